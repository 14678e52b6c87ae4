"""The handlers of ``bench model|matmul|h2d``, ``doctor`` and ``gpus``: each calls the library
and prints its results.
"""

from __future__ import annotations

import argparse
import functools
import sys
import traceback
import warnings
from collections.abc import Callable, Sequence
from typing import Any, TextIO, cast

from trainperf.cli._output import _emit_json, _emit_results, _progress, _stderr
from trainperf.cli._parser import _as_typed, _MiB


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


def _skipped(args: argparse.Namespace, setting: str, e: Exception, smaller: str) -> Any:
    """The Skipped record of a setting of the benchmark ``args`` ran that could not run: the
    device lacks what it needs (a ``DeviceError``, ``NotImplementedError``: the reason in the
    words of the command line, ``--dtype tf32`` where the library says ``dtype='tf32'``) or it
    ran out of memory (the cache emptied for the next setting; ``smaller`` names the options
    that shrink it); None for any other error, which the caller raises again."""
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
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        if isinstance(e, MemoryError) and str(e):
            # The library's host-memory check: whole, since its fix comes last.
            return Skipped(args.bench, setting, f"{_OOM}: {_as_typed(first, args)}")
        return Skipped(args.bench, setting, f"{_OOM} ({first[:200]}): try a smaller {smaller}")
    if isinstance(e, (DeviceError, NotImplementedError)):
        return Skipped(args.bench, setting, _as_typed(str(e), args))
    return None


def _refusal_as_value_error(
    handler: Callable[[argparse.Namespace], int],
) -> Callable[[argparse.Namespace], int]:
    """``handler`` with a benchmark's run-time refusal (the private ``RunTimeLimitExceeded``)
    raised as the ``ValueError`` it is to the library's callers, so that the error's type in
    the ``--json`` document is the public one."""

    @functools.wraps(handler)
    def run(args: argparse.Namespace) -> int:
        from trainperf.bench._common import RunTimeLimitExceeded

        try:
            return handler(args)
        except RunTimeLimitExceeded as e:
            raise ValueError(str(e)) from e

    return run


def _bench_one_model(args: argparse.Namespace, precision: str, lines: TextIO) -> Any:
    """One ``bench model`` run: its result, or a Skipped record of why it could not run (a
    run-time refusal is raised)."""
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
            max_seconds=args.max_seconds,
        )
    except (DeviceError, RuntimeError, MemoryError) as e:
        skipped = _skipped(args, precision, e, "--batch-size or --image-size")
        if skipped is None:
            raise
        return skipped


def _run_bench_model(args: argparse.Namespace) -> int:
    from trainperf.bench import Skipped
    from trainperf.bench._common import RunTimeLimitExceeded

    args.device = _one_device(args.device)
    precisions = ["fp32", "fp16", "bf16"] if args.precision == "all" else [args.precision]
    out = sys.stdout
    # In JSON mode stdout carries only the document, so the iteration lines go to stderr.
    lines: TextIO = _stderr() if args.json else out
    results: list[Any] = []
    refused = False
    for precision in precisions:
        _progress(f"trainperf bench model: {args.model} {precision}: building and warming up...")
        try:
            result = _bench_one_model(args, precision, lines)
        except RunTimeLimitExceeded as e:
            # One precision of several past --max-seconds (fp16 emulated on a CPU): a
            # skipped record, so the results before it are kept and those after it still run;
            # alone, it is the command's error, as is a bad argument.
            if len(precisions) == 1:
                raise
            refused = True
            result = Skipped(args.bench, precision, _as_typed(str(e), args))
        results.append(result)
        if isinstance(result, Skipped):
            print(f"Skipped {precision}: {result.reason}", file=lines)
        elif not args.json:
            print(_as_typed(str(result), args), file=out)
    if args.json:
        _emit_results(args, results, out)
    return max(_status(results), int(refused))  # 1 where a precision was refused


def _check_matmul_run_times(args: argparse.Namespace, device: str, dtypes: list[str]) -> None:
    """Refuse the command before any dtype runs where one would run past ``--max-seconds``
    (a ValueError), rather than after the dtypes before it took minutes; a dtype that cannot
    run at all is left for its run to report as skipped."""
    from trainperf.bench._matmul import matmul_plan
    from trainperf.errors import DeviceError

    for dtype in dtypes:
        _progress(f"trainperf bench matmul: {dtype}: estimating the run time...")
        try:
            matmul_plan(
                dtype,
                size=args.size,
                iterations=args.iterations,
                device=device,
                max_seconds=args.max_seconds,
            )
        except (DeviceError, RuntimeError, MemoryError):
            continue


def _run_bench_matmul(args: argparse.Namespace) -> int:
    from trainperf.bench import MATMUL_DTYPES, MatmulDtype, bench_matmul
    from trainperf.errors import DeviceError

    device = _one_device(args.device)
    every = args.dtype is None or "all" in args.dtype
    dtypes = list(MATMUL_DTYPES) if every else list(dict.fromkeys(args.dtype))
    _check_matmul_run_times(args, device, dtypes)
    results: list[Any] = []
    for dtype in dtypes:
        _progress(f"trainperf bench matmul: {dtype}...")
        try:
            result = bench_matmul(
                cast("MatmulDtype", dtype),
                size=args.size,
                iterations=args.iterations,
                device=device,
                max_seconds=None,  # checked above, for every dtype
            )
        except (DeviceError, RuntimeError, MemoryError) as e:
            skipped = _skipped(args, dtype, e, "--size")
            if skipped is None:
                raise
            results.append(skipped)
            if not args.json:
                print(f"{dtype:>4}: skipped: {skipped.reason}")
            continue
        results.append(result)
        if not args.json:
            print(_as_typed(str(result), args))
    if args.json:
        _emit_results(args, results, sys.stdout)
    return _status(results)


def _check_h2d_device(device: str) -> None:
    """:func:`_check_device` for ``bench h2d``, whose error for a device other than CUDA
    says why it takes only CUDA: it copies host memory to a GPU."""
    try:
        _check_device(device, allowed=("cuda",))
    except ValueError as e:
        raise ValueError(
            "bench h2d measures host-to-GPU copies, so it needs a CUDA device (--device cuda "
            f"or --device cuda:<i>, or no --device for the best one), got --device {device}"
        ) from e


def _run_bench_h2d(args: argparse.Namespace) -> int:
    import torch

    from trainperf.bench import bench_h2d
    from trainperf.bench._common import check_host_memory, check_tensor_bytes
    from trainperf.errors import DeviceError

    # A device named on the command line must exist (cuda:3 on a 1-GPU host is an error, as
    # for matmul); with none named (or "auto", which bench_h2d reads as none), a host without
    # CUDA is a skipped record (bench_h2d's "needs CUDA"), so those are not checked here.
    if args.device not in (None, "auto"):
        _check_h2d_device(args.device)
    size = args.size_mb * _MiB
    # Checked here too, so that the error names the option and the value as typed, where
    # bench_h2d's names its size_bytes.
    typed, fix = f"--size-mb {args.size_mb}", "use a smaller --size-mb"
    check_tensor_bytes(typed, "one copy", size, torch.uint8, fix)
    _progress(f"trainperf bench h2d: {args.size_mb} MiB copies, pageable then pinned...")
    try:
        if torch.cuda.is_available():  # else bench_h2d's "needs CUDA" says more
            check_host_memory(typed, "a pageable and a pinned copy", 2 * size, fix)
        result: Any = bench_h2d(
            size_bytes=size,
            iterations=args.iterations,
            device=args.device,
            max_seconds=args.max_seconds,
        )
    except (DeviceError, RuntimeError, MemoryError) as e:
        result = _skipped(args, "pageable+pinned", e, "--size-mb")
        if result is None:
            raise
        if not args.json:
            print(f"bench h2d skipped: {result.reason}")
    else:
        if not args.json:
            print(_as_typed(str(result), args))
    if args.json:
        _emit_results(args, [result], sys.stdout)
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
        print(_as_typed(str(report), args))
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


_HANDLERS: dict[str, Callable[[argparse.Namespace], int]] = {
    "model": _refusal_as_value_error(_run_bench_model),
    "matmul": _refusal_as_value_error(_run_bench_matmul),
    "h2d": _refusal_as_value_error(_run_bench_h2d),
    "doctor": _run_doctor,
    "gpus": _run_gpus,
}
