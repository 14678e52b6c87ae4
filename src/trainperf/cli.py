"""The ``trainperf`` command: ``bench model|matmul|h2d``, ``doctor`` and ``gpus``.

A thin layer: :func:`build_parser` defines the arguments, each handler calls the library
(:mod:`trainperf.bench`, :mod:`trainperf.doctor`, :func:`trainperf.device.gpus`) and prints
either each result's ``str()`` (the report a person reads) on stdout or, with ``--json``, one
JSON document on stdout holding each result's ``to_dict()``.
Progress (warm-up, per-iteration lines in JSON mode) goes to stderr, so ``--json`` output
can be piped as it is.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import io
import json
import os
import sys
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn, TextIO, cast

from trainperf._utils.validate import positive_int

__all__ = ["build_parser", "main"]

_MiB = 2**20
_DEVICE_HELP = "cpu, cuda or cuda:<i> (default: the best available)"


def _positive(text: str) -> int:
    # argparse's type=int accepts 0 and negatives; a count below 1 is an argument error, by
    # the library's own rule (trainperf._utils.validate.positive_int).
    try:
        return positive_int("count", int(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from e


def _add_json(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json", action="store_true", help="print one JSON document on stdout instead"
    )


def _add_model_parser(benches: Any) -> None:
    model = benches.add_parser(
        "model",
        help="ResNet-50 / ViT-B/16 throughput on synthetic data, vs the reference GPUs",
        description="The reference table's benchmark (a GPU cloud provider's published "
        "figures, PyTorch 1.9): a torchvision model with random weights, "
        "synthetic input on the device, weights cast to the precision. Defaults: batch 128 at "
        "224 px and 15 batches per iteration on a GPU; batch 2 at 64 px on the CPU.",
    )
    model.add_argument("--model", choices=["resnet50", "vit_b_16"], default="resnet50")
    model.add_argument(
        "--precision", choices=["fp32", "fp16", "bf16", "all"], default="fp32", help="or all"
    )
    model.add_argument("--batch-size", type=_positive)
    model.add_argument("--image-size", type=_positive)
    model.add_argument("--iterations", type=_positive, help="timed iterations (GPU 5, CPU 2)")
    model.add_argument("--batches-per-iteration", type=_positive)
    model.add_argument("--warmup-batches", type=_positive, help="untimed batches first")
    model.add_argument("--train", action="store_true", help="time forward+backward+SGD step")
    model.add_argument("--channels-last", action="store_true")
    model.add_argument(
        "--tf32",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="allow TF32 for fp32 (default: PyTorch's current setting)",
    )
    model.add_argument("--device", help=_DEVICE_HELP)
    _add_json(model)


def _add_matmul_parser(benches: Any) -> None:
    matmul = benches.add_parser(
        "matmul",
        help="matrix-product TFLOP/s per dtype, vs the datasheet",
        description="Square matrix products on random data: fp32 (TF32 off), tf32, bf16, fp16.",
    )
    matmul.add_argument("--size", type=_positive, help="matrix side (8192 on a GPU, 256 on CPU)")
    matmul.add_argument(
        "--dtype",
        nargs="+",
        choices=["fp32", "tf32", "bf16", "fp16", "all"],
        default=["all"],
    )
    matmul.add_argument("--iterations", type=_positive)
    matmul.add_argument("--device", help=_DEVICE_HELP)
    _add_json(matmul)


def _add_h2d_parser(benches: Any) -> None:
    h2d = benches.add_parser(
        "h2d", help="host-to-device GB/s, pageable vs pinned memory (needs CUDA)"
    )
    h2d.add_argument("--size-mb", type=_positive, default=512, help="MiB per copy (512)")
    h2d.add_argument("--iterations", type=_positive, default=5)
    h2d.add_argument("--device", help="cuda or cuda:<i> (default: the best available)")
    _add_json(h2d)


class _UsageError(Exception):
    """A command line that does not parse: ``prog`` is the (sub)command that refused it."""

    def __init__(self, prog: str, message: str) -> None:
        super().__init__(message)
        self.prog = prog
        self.message = message


class _Parser(argparse.ArgumentParser):
    """The parser :func:`main` uses: a usage error is raised as :class:`_UsageError`, for
    main to report in one line (and as JSON with ``--json``), where argparse would print the
    usage text, to stdout when stderr is closed, and exit."""

    def error(self, message: str) -> NoReturn:
        raise _UsageError(self.prog, message)


def build_parser() -> argparse.ArgumentParser:
    """The ``trainperf`` argument parser.

    Example:
        >>> args = build_parser().parse_args(["bench", "matmul", "--size", "64", "--json"])
        >>> args.command, args.bench, args.size, args.json
        ('bench', 'matmul', 64, True)
    """
    return _build_parser(argparse.ArgumentParser)


def _build_parser(parser_class: type[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    # Subparsers are made of the same class (argparse's default parser_class).
    parser = parser_class(
        prog="trainperf",
        description="Say why PyTorch training is slow: benchmark the GPU, check the "
        "environment, list GPUs.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    bench = commands.add_parser("bench", help="benchmark the GPU (model, matmul, h2d)")
    benches = bench.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    _add_model_parser(benches)
    _add_matmul_parser(benches)
    _add_h2d_parser(benches)
    doctor = commands.add_parser(
        "doctor",
        help="check GPUs, drivers, CPUs, memory, /dev/shm, BLAS, threads; exit 1 on a fail",
    )
    doctor.add_argument(
        "--dist",
        action="store_true",
        help="also the multi-process pre-flight (5-30 s): start one rank per GPU (2 CPU "
        "ranks with gloo without 2 GPUs), time an all_reduce sweep against the link, check "
        "/dev/shm for NCCL, NCCL_*/GLOO_* variables, interfaces, IOMMU/ACS, P2P on vs off",
    )
    _add_json(doctor)
    gpus = commands.add_parser("gpus", help="list the GPUs this process can see (NVML)")
    _add_json(gpus)
    return parser


def _jsonable(obj: Any) -> Any:
    # Every result type has to_dict(); a plain dataclass (GpuInfo) is written field by field.
    to_dict = getattr(obj, "to_dict", None)
    if callable(to_dict):
        return to_dict()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    return obj


def _emit_json(document: dict[str, Any], out: TextIO) -> None:
    json.dump(document, out, indent=2, default=_jsonable)
    out.write("\n")


def _emit_results(command: str, results: Sequence[Any], out: TextIO) -> None:
    """The ``--json`` document of a benchmark: its name and each result's ``to_dict()``."""
    _emit_json({"command": command, "results": [r.to_dict() for r in results]}, out)


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


def _stderr() -> TextIO:
    """``sys.stderr``, or a sink that drops what is written where the process was started
    with stderr closed (``2>&-``): ``print(file=None)`` would write it to stdout, into the
    ``--json`` document."""
    return sys.stderr if sys.stderr is not None else _Discard()


def _progress(message: str) -> None:
    print(message, file=_stderr(), flush=True)


def _check_device(device: str | None, allowed: tuple[str, ...] = ("cpu", "cuda")) -> None:
    """Refuse a device that is not there, or of a type not ``allowed``, before any benchmark
    runs (exit status 1).

    A :class:`~trainperf.errors.DeviceError` raised by a benchmark after this check means
    the device lacks what one setting needs (bf16 before Ampere, TF32 on the CPU): that
    setting is reported as skipped and the others still run.
    """
    from trainperf.device import resolve_device

    resolve_device(device, allowed=allowed)


def _one_device(device: str | None) -> str:
    """``device`` checked (as :func:`_check_device`), and None resolved once to the emptiest
    GPU (or the CPU): every setting of a command then runs on that one device, where each
    would otherwise pick the emptiest GPU anew, which the settings before it just filled."""
    from trainperf.bench._common import resolve_device

    return str(resolve_device(device))


_OOM = "out of memory"


def _status(results: Sequence[Any]) -> int:
    """The exit status of a benchmark command: 1 when a setting ran out of memory (its
    options were too large), else 0 (a setting the device cannot run is only skipped)."""
    from trainperf.bench import Skipped

    return int(any(isinstance(r, Skipped) and r.reason.startswith(_OOM) for r in results))


def _skipped(bench: str, setting: str, e: Exception, smaller: str) -> Any:
    """The Skipped record of a setting that could not run: the device lacks what it needs
    (a ``DeviceError``, ``NotImplementedError``) or it ran out of memory (the cache emptied for
    the next setting; ``smaller`` names the options that shrink it); None for any other
    error, which the caller raises again."""
    import torch

    from trainperf._utils.oom import oom_kind
    from trainperf.bench import Skipped
    from trainperf.errors import DeviceError

    if oom_kind(e) is not None:
        # The traceback's frames hold the failed setting's tensors: free them first.
        traceback.clear_frames(e.__traceback__)
        e.__traceback__ = None
        if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            torch.cuda.empty_cache()
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        return Skipped(bench, setting, f"{_OOM} ({first}): try a smaller {smaller}")
    if isinstance(e, (DeviceError, NotImplementedError)):
        return Skipped(bench, setting, str(e))
    return None


def _bench_one_model(args: argparse.Namespace, precision: str, lines: TextIO) -> Any:
    """One ``bench model`` run: its result, or a Skipped record of why it could not run."""
    from trainperf.bench import BenchPrecision, bench_model, format_iteration
    from trainperf.errors import DeviceError

    def on_iteration(i: int, rate: float, seconds: float) -> None:
        print(format_iteration(i, rate, seconds), file=lines, flush=True)

    try:
        return bench_model(
            args.model,
            cast("BenchPrecision", precision),
            batch_size=args.batch_size,
            image_size=args.image_size,
            iterations=args.iterations,
            batches_per_iteration=args.batches_per_iteration,
            warmup_batches=args.warmup_batches,
            train=args.train,
            channels_last=args.channels_last,
            tf32=args.tf32,
            device=args.device,
            on_iteration=on_iteration,
        )
    except (DeviceError, RuntimeError, MemoryError) as e:
        skipped = _skipped("model", precision, e, "--batch-size or --image-size")
        if skipped is None:
            raise
        print(f"Skipped {precision}: {skipped.reason}", file=lines)
        return skipped


def _run_bench_model(args: argparse.Namespace) -> int:
    from trainperf.bench import Skipped

    args.device = _one_device(args.device)
    precisions = ["fp32", "fp16", "bf16"] if args.precision == "all" else [args.precision]
    out = sys.stdout
    # In JSON mode stdout carries only the document, so the iteration lines go to stderr.
    lines: TextIO = _stderr() if args.json else out
    results: list[Any] = []
    for precision in precisions:
        _progress(f"trainperf bench model: {args.model} {precision}: building and warming up...")
        result = _bench_one_model(args, precision, lines)
        results.append(result)
        if not args.json and not isinstance(result, Skipped):
            print(result, file=out)
    if args.json:
        _emit_results("bench model", results, out)
    return _status(results)


def _run_bench_matmul(args: argparse.Namespace) -> int:
    from trainperf.bench import MATMUL_DTYPES, MatmulDtype, bench_matmul
    from trainperf.errors import DeviceError

    device = _one_device(args.device)
    dtypes = list(MATMUL_DTYPES) if "all" in args.dtype else list(dict.fromkeys(args.dtype))
    results: list[Any] = []
    for dtype in dtypes:
        _progress(f"trainperf bench matmul: {dtype}...")
        try:
            result = bench_matmul(
                cast("MatmulDtype", dtype),
                size=args.size,
                iterations=args.iterations,
                device=device,
            )
        except (DeviceError, RuntimeError, MemoryError) as e:
            skipped = _skipped("matmul", dtype, e, "--size")
            if skipped is None:
                raise
            results.append(skipped)
            if not args.json:
                print(f"{dtype:>4}: skipped: {skipped.reason}")
            continue
        results.append(result)
        if not args.json:
            print(result)
    if args.json:
        _emit_results("bench matmul", results, sys.stdout)
    return _status(results)


def _run_bench_h2d(args: argparse.Namespace) -> int:
    from trainperf.bench import bench_h2d
    from trainperf.errors import DeviceError

    # A device named on the command line must exist (cuda:3 on a 1-GPU host is an error, as
    # for matmul); with none named, a host without CUDA is a skipped record (bench_h2d's
    # "needs CUDA"), so None is not checked here.
    if args.device is not None:
        _check_device(args.device, allowed=("cuda",))
    size = args.size_mb * _MiB
    _progress(f"trainperf bench h2d: {args.size_mb} MiB copies, pageable then pinned...")
    try:
        result: Any = bench_h2d(size_bytes=size, iterations=args.iterations, device=args.device)
    except (DeviceError, RuntimeError, MemoryError) as e:
        result = _skipped("h2d", "pageable+pinned", e, "--size-mb")
        if result is None:
            raise
        if not args.json:
            print(f"bench h2d skipped: {result.reason}")
    else:
        if not args.json:
            print(result)
    if args.json:
        _emit_results("bench h2d", [result], sys.stdout)
    return _status([result])


def _run_doctor(args: argparse.Namespace) -> int:
    from trainperf.doctor import diagnose

    if args.dist:
        _progress("trainperf doctor --dist: starting ranks for an all_reduce sweep...")
        report = diagnose(dist=True)
    else:
        report = diagnose()
    if args.json:
        _emit_json({"command": "doctor", **report.to_dict()}, sys.stdout)
    else:
        print(report)
    return 1 if report.worst == "fail" else 0


def _run_gpus(args: argparse.Namespace) -> int:
    from trainperf._utils.format import format_bytes
    from trainperf.device import gpus

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "no NVML": an empty list says it
        found = gpus()
    if args.json:
        _emit_json({"command": "gpus", "gpus": found}, sys.stdout)
        return 0
    if not found:
        print("No NVIDIA GPU visible (no driver, or CUDA_VISIBLE_DEVICES hides them).")
        return 0
    print(f"{'cuda':>4}  {'smi':>3}  {'name':<28}  {'memory used/total':>20}  {'util':>4}  cc")
    for g in found:
        if g.memory_total is not None and g.memory_used is not None:
            memory = f"{format_bytes(g.memory_used)}/{format_bytes(g.memory_total)}"
        else:
            memory = "?"
        util = "?" if g.utilization is None else f"{g.utilization}%"
        cc = "?" if g.compute_capability is None else "{}.{}".format(*g.compute_capability)
        print(f"{g.index:>4}  {g.nvml_index:>3}  {g.name:<28}  {memory:>20}  {util:>4}  {cc}")
    return 0


_INTERRUPTED = 130

_HANDLERS: dict[str, Callable[[argparse.Namespace], int]] = {
    "model": _run_bench_model,
    "matmul": _run_bench_matmul,
    "h2d": _run_bench_h2d,
    "doctor": _run_doctor,
    "gpus": _run_gpus,
}


def _command_name(args: argparse.Namespace) -> str:
    return f"bench {args.bench}" if args.command == "bench" else str(args.command)


def _discard_stdout() -> None:
    """Point stdout at devnull, so that the flush at exit does not fail again on what is
    left in its buffer (Python's docs' recipe for a reader that went away)."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


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


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``trainperf`` with ``argv`` (default: the command line) and return the exit status.

    Returns 0 on success, 1 when a command fails (or ``doctor`` finds a failing check), 130
    when Ctrl-C stops it, and exits with 2 on a usage error (argparse's convention). An error
    is one line on stderr, ``trainperf: error: ...``, never a traceback; with ``--json``
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
        args = _build_parser(_Parser).parse_args(argv)
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
    except (OSError, ValueError, TrainperfError, ModuleNotFoundError) as e:
        return _fail(args, str(e), e)
    except Exception as e:  # the last resort: a message, never a raw traceback
        return _fail(args, _unexpected(e), e)
    return status
