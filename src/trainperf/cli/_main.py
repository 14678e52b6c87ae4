"""``main``: parse, run one handler, turn what goes wrong into one line and an exit status."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import TextIO, cast

from trainperf.cli._commands import _HANDLERS
from trainperf.cli._output import (
    _asks_json,
    _discard_stdout,
    _fail,
    _Output,
    _OutputError,
    _report,
    _stderr,
    _unexpected,
    _usage_error,
    _write_failed,
)
from trainperf.cli._parser import _as_typed, _parse, _UsageError

# 128 + the signal: the status a shell gives a command stopped by SIGINT (Ctrl-C) or SIGPIPE.
_INTERRUPTED = 130
_BROKEN_PIPE = 141
_INTERRUPTED_MESSAGE = "interrupted (Ctrl-C) before the command finished"


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``trainperf`` with ``argv`` (default: the command line) and return the exit status.

    Returns 0 on success, 1 when a command fails (or ``doctor`` finds a failing check), 130
    when Ctrl-C stops it (at any point, the imports a command starts with included), 141
    when stdout's reader goes away first (``trainperf doctor | head -1``: what a shell
    reports for a command stopped by SIGPIPE, with nothing on stderr), and exits with 2 on a
    usage error (argparse's convention). An error is one line on stderr, ``trainperf:
    error: ...``, never a traceback, naming the options as typed (``--batch-size``, not the
    library's ``batch_size``), as do the reports and skipped settings it prints; with
    ``--json`` stdout also gets ``{"command": ..., "error": {"type": ..., "message": ...}}``
    (a usage error's type is ``"UsageError"``; its command is None where the command itself
    is missing or unknown). Output that stdout's encoding cannot hold is written escaped.

    Example:
        >>> main(["bench", "matmul", "--size", "32", "--dtype", "fp32", "--device", "cpu",
        ...       "--iterations", "1", "--json"])  # doctest: +ELLIPSIS
        {...}
        0
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        return _main(argv)
    except KeyboardInterrupt:
        # Ctrl-C before a command ran (while parsing, or starting): the same one line as
        # during one, where Python would print a traceback.
        _report(_INTERRUPTED_MESSAGE, None, "KeyboardInterrupt", _asks_json(argv))
        return _INTERRUPTED


def _main(argv: list[str]) -> int:
    """:func:`main` but for a Ctrl-C outside the command's own run."""
    try:
        args = _parse(argv)
    except _UsageError as e:
        raise SystemExit(_usage_error(argv, e)) from None
    if sys.stdout is None:  # started with stdout closed (`>&-`)
        print(
            "trainperf: error: stdout is closed, so the output has nowhere to go: redirect "
            "it instead (> file, or > /dev/null)",
            file=_stderr(),
        )
        return 1
    handler = _HANDLERS[args.bench if args.command == "bench" else args.command]
    stdout = sys.stdout
    sys.stdout = cast("TextIO", _Output(stdout))
    try:
        return _run(handler, args)
    finally:
        sys.stdout = stdout


def _run(handler: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Run a command's ``handler``, its errors reported as :func:`main` says."""
    from trainperf.errors import TrainperfError

    try:
        status = handler(args)
        sys.stdout.flush()  # a full disk shows here, not at exit as an ignored exception
    except _OutputError as e:
        return _fail(args, _write_failed(e.error), e.error)
    except BrokenPipeError:
        # The reader (`| head`) went away: stop quietly, with the status of a Unix tool that
        # SIGPIPE stopped (so `set -o pipefail` still sees the output was cut short).
        _discard_stdout()
        return _BROKEN_PIPE
    except KeyboardInterrupt as e:
        # Ctrl-C: one line (and the --json error document), not a traceback through torch.
        _fail(args, _INTERRUPTED_MESSAGE, e)
        return _INTERRUPTED
    except (ValueError, TrainperfError) as e:
        # The library's messages name its parameters (batch_size=, device='cpu'): say the
        # options the user typed instead.
        return _fail(args, _as_typed(str(e), args), e)
    except (OSError, ModuleNotFoundError) as e:
        return _fail(args, str(e), e)
    except Exception as e:  # the last resort: a message, never a raw traceback
        return _fail(args, _unexpected(e), e)
    return status
