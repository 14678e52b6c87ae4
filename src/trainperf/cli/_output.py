"""What the ``trainperf`` command writes: results (text or one JSON document), progress on
stderr, and every error as one line (with ``--json``, an error document on stdout).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import io
import json
import math
import os
import sys
import traceback
from collections.abc import Iterator, Sequence
from typing import Any, TextIO, cast

from trainperf.cli._parser import _as_typed, _UsageError


def _jsonable(obj: Any) -> Any:
    """``obj`` as plain JSON values: a result by its ``to_dict()``, a plain dataclass
    (GpuInfo) field by field, and a NaN or infinite float as None (``null``), which strict
    JSON readers (jq, JavaScript's ``JSON.parse``) take where they refuse ``NaN``."""
    to_dict = getattr(obj, "to_dict", None)
    if callable(to_dict):
        return _jsonable(to_dict())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return _jsonable(dataclasses.asdict(obj))
    if isinstance(obj, dict):
        return {key: _jsonable(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(value) for value in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def _emit_json(document: dict[str, Any], out: TextIO) -> None:
    """Write ``document`` to ``out`` as strict JSON, encoded whole before the first write:
    an error while encoding it (a failing ``to_dict()``) leaves nothing half-written, so
    the error document that follows is all stdout holds."""
    text = json.dumps(_jsonable(document), indent=2, allow_nan=False)
    out.write(text + "\n")


def _emit_results(args: argparse.Namespace, results: Sequence[Any], out: TextIO) -> None:
    """The ``--json`` document of the benchmark ``args`` ran: its name and each result's
    ``to_dict()``, whose notes, warning and skip reason name the options typed, as its
    ``str()`` printed in text mode does (``--tf32`` where the library says ``tf32=True``)."""
    document = _jsonable({"command": _command_name(args), "results": list(results)})
    _emit_json(_typed_prose(document, args), out)


# The keys of a result's to_dict() whose values are sentences for a person to read.
_PROSE_KEYS = frozenset({"notes", "warning", "reason"})


def _typed_prose(value: Any, args: argparse.Namespace, prose: bool = False) -> Any:
    """``value``, plain JSON values, with the strings under :data:`_PROSE_KEYS` rewritten by
    :func:`~trainperf.cli._parser._as_typed`; names, columns and other values as they are."""
    if isinstance(value, dict):
        return {key: _typed_prose(item, args, key in _PROSE_KEYS) for key, item in value.items()}
    if isinstance(value, list):
        return [_typed_prose(item, args, prose) for item in value]
    return _as_typed(value, args) if prose and isinstance(value, str) else value


class _OutputError(Exception):
    """Writing the output to stdout failed (a full disk): ``error`` is the OSError."""

    def __init__(self, error: OSError) -> None:
        super().__init__(error)
        self.error = error


class _Output:
    """``sys.stdout`` while a command runs: a failed write raises :class:`_OutputError`, so
    the error can say that writing the output failed (BrokenPipeError stays itself: a reader
    that went away is no error), and text the stream cannot encode (``PYTHONIOENCODING=ascii``
    and a value such as ``OMP_NUM_THREADS='4\u00e9'`` in the doctor table) is written with
    ``\\xNN`` escapes instead of losing the whole report."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    @contextlib.contextmanager
    def _blamed(self) -> Iterator[None]:
        try:
            yield
        except BrokenPipeError:
            raise
        except OSError as e:
            raise _OutputError(e) from e

    def write(self, text: str) -> int:
        with self._blamed():
            try:
                return self._stream.write(text)
            except UnicodeEncodeError:
                encoding = getattr(self._stream, "encoding", None) or "utf-8"
                self._stream.write(text.encode(encoding, "backslashreplace").decode(encoding))
                return len(text)

    def flush(self) -> None:
        with self._blamed():
            self._stream.flush()

    def __getattr__(self, name: str) -> Any:  # fileno, encoding, isatty, ...
        return getattr(self._stream, name)


class _Discard(io.StringIO):
    """Where stderr output goes when there is no stderr: nowhere."""

    def write(self, text: str) -> int:
        return len(text)


class _Stderr:
    """``sys.stderr`` for progress and error lines, whose failed write (the reader of
    ``2>&1 | head -1`` went away, a full disk) is dropped and points stderr at devnull: losing
    the side channel must lose neither the results on stdout nor the exit status (Python
    exits 120 where flushing what is left in stderr's buffer fails at exit)."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError:
            self._discard()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError:
            self._discard()

    def _discard(self) -> None:
        with contextlib.suppress(OSError, ValueError):  # ValueError: no file descriptor
            _to_devnull(self._stream.fileno())


def _to_devnull(fd: int) -> None:
    """Point file descriptor ``fd`` at devnull."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


def _stderr() -> TextIO:
    """``sys.stderr`` as :class:`_Stderr`, or a sink that drops what is written where the
    process was started with stderr closed (``2>&-``): ``print(file=None)`` would write it to
    stdout, into the ``--json`` document."""
    return cast("TextIO", _Stderr(sys.stderr)) if sys.stderr is not None else _Discard()


def _progress(message: str) -> None:
    print(message, file=_stderr(), flush=True)


def _command_name(args: argparse.Namespace) -> str:
    return f"bench {args.bench}" if args.command == "bench" else str(args.command)


def _discard_stdout() -> None:
    """Point stdout at devnull, so that the flush at exit does not fail again on what is
    left in its buffer (Python's docs' recipe for a reader that went away); a stdout without
    a file descriptor (``main`` called with an ``io.StringIO`` in place) is left as it is."""
    with contextlib.suppress(OSError, ValueError):  # io.UnsupportedOperation: no descriptor
        _to_devnull(sys.stdout.fileno())


def _report(message: str, command: str | None, error_type: str, as_json: bool) -> None:
    """Report an error as ``trainperf: error: ...`` on stderr and, with ``--json``, as a
    JSON document on stdout too, so a pipeline reading it parses something. Where stdout
    itself failed (a full disk), what is left for it is dropped."""
    print(f"trainperf: error: {message}", file=_stderr())
    if sys.stdout is None:  # closed (`>&-`): the line on stderr is all there is
        return
    try:
        if as_json:
            error_info = {"type": error_type, "message": message}
            _emit_json({"command": command, "error": error_info}, sys.stdout)
        sys.stdout.flush()
    except (OSError, _OutputError):
        _discard_stdout()


def _fail(args: argparse.Namespace, message: str, error: BaseException) -> int:
    """:func:`_report` the error of a command that parsed; exit status 1."""
    _report(message, _command_name(args), type(error).__name__, getattr(args, "json", False))
    return 1


_USAGE = 2  # argparse's exit status for a command line that does not parse


def _asks_json(argv: Sequence[str]) -> bool:
    """Whether ``argv``, which did not parse, asks for ``--json`` (or an abbreviation of it,
    as argparse takes them) before any ``--``."""
    for arg in argv:
        if arg == "--":
            return False
        if len(arg) > 2 and "--json".startswith(arg):
            return True
    return False


def _usage_error(argv: Sequence[str], error: _UsageError) -> int:
    """:func:`_report` a command line that does not parse, pointing at the ``--help`` of the
    (sub)command that refused it; the JSON document's ``command`` is that (sub)command
    (``"bench matmul"``), or None where the command itself is missing or unknown."""
    message = f"{error.message}; see {error.prog} --help"
    command = error.prog.removeprefix("trainperf").strip() or None
    _report(message, command, "UsageError", _asks_json(argv))
    return _USAGE


def _write_failed(error: OSError) -> str:
    reason = error.strerror or str(error)
    fix = "free space there, or redirect" if error.errno == errno.ENOSPC else "redirect"
    return f"could not write the output to stdout: {reason}; {fix} stdout elsewhere"


def _unexpected(error: Exception) -> str:
    """An error no command expects (a bug here or in PyTorch): its type, the first line of
    its message, and where it was raised, in place of the traceback."""
    first = (str(error).strip().splitlines() or [""])[0]
    frames = traceback.extract_tb(error.__traceback__)
    where = f" (raised at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"unexpected {type(error).__name__}: {first}{where}"
