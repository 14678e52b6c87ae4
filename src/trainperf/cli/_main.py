"""``main``: parse, run one handler, turn what goes wrong into one line and an exit status."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import TextIO, cast

from trainperf.cli._commands import _HANDLERS, _INTERRUPTED
from trainperf.cli._output import (
    _discard_stdout,
    _fail,
    _Output,
    _OutputError,
    _stderr,
    _unexpected,
    _usage_error,
    _write_failed,
)
from trainperf.cli._parser import _as_typed, _parse, _UsageError


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``trainperf`` with ``argv`` (default: the command line) and return the exit status.

    Returns 0 on success, 1 when a command fails (or ``doctor`` finds a failing check), 130
    when Ctrl-C stops it, and exits with 2 on a usage error (argparse's convention). An error
    is one line on stderr, ``trainperf: error: ...``, never a traceback, naming the options
    as typed (``--batch-size``, not the library's ``batch_size``); with ``--json``
    stdout also gets ``{"command": ..., "error": {"type": ..., "message": ...}}`` (a usage
    error's type is ``"UsageError"``; its command is None where the command itself is
    missing or unknown). Output that stdout's encoding cannot hold is written escaped.

    Example:
        >>> main(["bench", "matmul", "--size", "32", "--dtype", "fp32", "--device", "cpu",
        ...       "--iterations", "1", "--json"])  # doctest: +ELLIPSIS
        {...}
        0
    """
    argv = sys.argv[1:] if argv is None else list(argv)
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
        # The reader (`| head`) went away: stop quietly, as Unix tools do.
        _discard_stdout()
        return 1
    except KeyboardInterrupt as e:
        # Ctrl-C: one line (and the --json error document), not a traceback through torch;
        # 130 = 128 + SIGINT, the status a shell gives a command stopped by Ctrl-C.
        _fail(args, "interrupted (Ctrl-C) before the command finished", e)
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
