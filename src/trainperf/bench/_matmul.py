"""``bench_matmul``: TFLOP/s of one square matrix product, per dtype, against the datasheet.

A quick sanity check for a slow card is a run of 8192x8192 fp32 matmuls. Four dtypes
are measured: ``fp32`` with TF32 off (the datasheet's fp32 figure), ``tf32`` (fp32 inputs
on TF32 tensor cores, Ampere and newer), ``bf16`` and ``fp16``. The TF32 setting is
restored after each run.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, Literal

import torch

from trainperf._utils.validate import choice, positive_int
from trainperf.amp._tf32 import tf32
from trainperf.bench._common import (
    DEFAULT_MAX_SECONDS,
    RunTimeLimitExceeded,
    check_host_memory,
    check_max_seconds,
    check_tensor_bytes,
    fewer_iterations,
    format_duration,
    gpu_name,
    iterations_within,
    limit_passed,
    power_of_two_at_most,
    resolve_device,
    result_dict,
    run_time_fix,
    seconds_to_fit,
    synchronize,
)
from trainperf.bench._host_notes import cpu_emulation_notes
from trainperf.bench._reference import GpuSpec, find_gpu_spec
from trainperf.errors import DeviceError

__all__ = [
    "MATMUL_DTYPES",
    "MatmulDtype",
    "MatmulPlan",
    "MatmulResult",
    "bench_matmul",
    "matmul_plan",
]

MatmulDtype = Literal["fp32", "tf32", "bf16", "fp16"]
MATMUL_DTYPES: tuple[str, ...] = ("fp32", "tf32", "bf16", "fp16")
_TORCH_DTYPES = {
    "fp32": torch.float32,
    "tf32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}
CUDA_DEFAULT_SIZE = 8192
CPU_DEFAULT_SIZE = 256
# Under this fraction of the datasheet figure the card is worth a look.
LOW_FRACTION = 0.5
# The probe that estimates a run grows its matrices until one product takes this long: long
# enough to time, and to leave small-matrix overheads behind.
_PROBE_SECONDS = 0.05
_PROBE_START_SIZE = 128
# Products timed at the probe's final size, the fastest kept: on a busy host one product's
# rate varies about 3x between calls, and a refusal near the limit flipped with it.
_PROBE_REPEATS = 3
_DEFAULT_WARMUP = 3


@dataclass(frozen=True)
class MatmulResult:
    """One matmul benchmark.

    Attributes:
        dtype: ``"fp32"`` (TF32 off), ``"tf32"``, ``"bf16"`` or ``"fp16"``.
        size: the matrices are ``size x size``.
        device: e.g. ``"cuda:0"``.
        gpu_name: the GPU's name, None on the CPU.
        iterations: timed products.
        seconds: mean wall time of one product over one synchronised block.
        tflops: ``2 * size**3 / seconds / 1e12``.
        datasheet_tflops: the reference datasheet figure for this card and dtype, None when
            unknown: fp32 and fp16, and for bf16 on Ampere and newer the fp16 figure (the
            table has no bf16 column; a note says so).
        datasheet_fraction: ``tflops / datasheet_tflops``, None when unknown.
        notes: caveats (no datasheet figure, TF32 on a pre-Ampere GPU, a low fraction).
    """

    dtype: str
    size: int
    device: str
    gpu_name: str | None
    iterations: int
    seconds: float
    tflops: float
    datasheet_tflops: float | None
    datasheet_fraction: float | None
    notes: tuple[str, ...]

    def summary(self) -> str:
        """One line: dtype, TFLOP/s and the datasheet fraction where known.

        Example:
            >>> bench_matmul("fp32", size=32, iterations=1, warmup=1, device="cpu").summary()[:5]
            'fp32:'
        """
        shape = f"{self.size}x{self.size}"
        line = f"{self.dtype:>4}: {self.tflops:9.3f} TFLOP/s ({shape}, {self.device})"
        if self.datasheet_tflops is not None and self.datasheet_fraction is not None:
            line += f", {self.datasheet_fraction:.0%} of the datasheet's {self.datasheet_tflops:g}"
        return line

    def __str__(self) -> str:
        """The summary line, then one indented line per note."""
        return "\n".join([self.summary(), *(f"      note: {note}" for note in self.notes)])

    def to_dict(self) -> dict[str, Any]:
        """Every field, JSON-safe (``notes`` as a list).

        Example:
            >>> r = bench_matmul("fp32", size=32, iterations=1, warmup=1, device="cpu")
            >>> r.to_dict()["dtype"], str(r) == r.summary()  # no notes on the CPU
            ('fp32', True)
        """
        return result_dict(self)


def _check_host_memory_for(dtype: str, size: int) -> None:
    """Refuse a CPU run whose three matrices (a, b and out) need more host memory than is
    available, naming a size that fits.

    Raises:
        MemoryError: they do not fit.
    """
    per_element = 3 * _TORCH_DTYPES[dtype].itemsize

    def fix(available: int) -> str:
        # size=<n> is what trainperf.cli rewrites as --size <n>.
        return f"use a smaller size (e.g. size={_size_that_fits(available, per_element)})"

    what = f"three {size}x{size} {dtype} matrices"
    check_host_memory(f"bench_matmul(size={size})", what, size * size * per_element, fix)


def _size_that_fits(available: int, per_element: int) -> int:
    """The largest power of two ``n`` whose ``n*n`` elements of ``per_element`` bytes fit in
    ``available`` bytes (1 where none does).

    Example:
        >>> _size_that_fits(8 * 2**20, 12)  # three fp32 matrices in 8 MiB: 836x836 at most
        512
    """
    return max(1, power_of_two_at_most(math.isqrt(available // per_element)))


def _estimated_seconds(size: int, products: int, flops_per_s: float) -> float:
    """Seconds that ``products`` ``size x size`` products take at ``flops_per_s``.

    Example:
        >>> _estimated_seconds(1000, 10, 1e9)  # 2e9 FLOP each at 1 GFLOP/s
        20.0
    """
    return products * 2 * size**3 / flops_per_s


def _size_within(max_seconds: float, products: int, flops_per_s: float) -> int:
    """The largest power of two whose ``products`` products take at most ``max_seconds`` at
    ``flops_per_s`` (1 where none does).

    Example:
        >>> _size_within(300.0, 13, 1e9)  # 2048: 223 s; 4096 would take 30 min
        2048
    """
    largest = math.floor(math.pow(max_seconds * flops_per_s / (2 * products), 1 / 3))
    while largest > 1 and _estimated_seconds(largest, products, flops_per_s) > max_seconds:
        largest -= 1  # the cube root's rounding
    return max(1, power_of_two_at_most(largest))


def _fixes(
    size: int, warmup: int, iterations: int, flops_per_s: float, limit: float
) -> dict[str, str]:
    """What to do instead of a run past ``limit``, by the argument each fix changes: a
    smaller size, fewer iterations, fewer warm-up products (where they alone do not fit),
    each only where one fits.

    Example:
        >>> list(_fixes(16, 3, 10**12, 1e9, 300.0))  # 1x1 products would not fit either
        ['iterations']
    """
    # size=<n>, iterations=<n> and warmup=<n> are what trainperf.cli rewrites as --size <n>
    # and --iterations <n> (it passes no warmup).
    products = warmup + iterations
    fitting = _size_within(seconds_to_fit(limit), products, flops_per_s)
    per_product = _estimated_seconds(size, 1, flops_per_s)
    fixes = {}
    if _estimated_seconds(fitting, products, flops_per_s) <= seconds_to_fit(limit):
        fixes["size"] = f"a smaller size (e.g. size={fitting})"
    for fix in fewer_iterations(limit, warmup * per_product, per_product):
        fixes["iterations"] = fix
    fewer_warmup = iterations_within(limit, iterations * per_product, per_product)
    if not fixes and 1 <= fewer_warmup < warmup:
        fixes["warmup"] = f"fewer warm-up products (e.g. warmup={fewer_warmup})"
    return fixes


def _too_long(
    size: int, warmup: int, iterations: int, flops_per_s: float, max_seconds: float | None
) -> tuple[float, str | None]:
    """The decision rule for a run of ``warmup + iterations`` ``size x size`` products at
    ``flops_per_s``: its estimated seconds, and None where they fit in ``max_seconds`` (or
    there is no limit), else what to do instead (:func:`_fixes`, or a larger limit).

    Example:
        >>> _too_long(256, 3, 10, 1e9, 300.0)[1] is None
        True
        >>> _too_long(8192, 3, 10, 1e9, 300.0)[1]
        'use a smaller size (e.g. size=2048) or a larger max_seconds (e.g. max_seconds=18000)'
    """
    estimate = _estimated_seconds(size, warmup + iterations, flops_per_s)
    limit = limit_passed(estimate, max_seconds)
    if limit is None:
        return estimate, None
    fixes = _fixes(size, warmup, iterations, flops_per_s, limit)
    return estimate, run_time_fix(estimate, list(fixes.values()))


def _call(size: int, iterations: int, warmup: int, at_fault: Collection[str]) -> str:
    """The call a refusal names: the arguments ``at_fault`` (those a fix changes), or every
    count that sets the run's length where none is, the warm-up only where it is not the
    default (the CLI passes none).

    Example:
        >>> _call(16, 10**9, 3, ["iterations"]), _call(16, 10, 3, [])
        ('bench_matmul(iterations=1000000000)', 'bench_matmul(size=16, iterations=10)')
    """
    counts = {"size": size, "iterations": iterations, "warmup": warmup}
    named = [name for name in counts if name in at_fault]
    if not named:
        named = ["size", "iterations"] + (["warmup"] if warmup != _DEFAULT_WARMUP else [])
    # size=<n> and iterations=<n> are what trainperf.cli rewrites as its options.
    return f"bench_matmul({', '.join(f'{name}={counts[name]}' for name in named)})"


def _format_rate(flops_per_s: float) -> str:
    """A FLOP rate in GFLOP/s, or TFLOP/s from 1 TFLOP/s up."""
    if flops_per_s >= 1e12:
        return f"{flops_per_s / 1e12:.3g} TFLOP/s"
    return f"{flops_per_s / 1e9:.3g} GFLOP/s"


def _probe(dtype: str, size: int, device: torch.device) -> tuple[int, float]:
    """``(n, FLOP/s)`` of ``n x n`` products, ``n`` doubled from a small one until a
    product takes :data:`_PROBE_SECONDS` or ``n`` reaches ``size``; the rate is that of the
    fastest of :data:`_PROBE_REPEATS` products at that ``n``, on the same matrices (the
    others were slowed by whatever else the host ran). Small products run slower per FLOP
    than large ones, so the rate is a conservative one for ``size``."""
    n = min(size, _PROBE_START_SIZE)
    while True:
        timer = _product_timer(dtype, n, device)
        seconds = timer(1, 1)
        if seconds >= _PROBE_SECONDS or n >= size:
            break
        n = min(size, 2 * n)
    for _ in range(_PROBE_REPEATS - 1):
        seconds = min(seconds, timer(1, 0))  # no warm-up: the first product had one
    return n, 2 * n**3 / max(seconds, 1e-9)


def _check_run_time(
    dtype: str,
    size: int,
    iterations: int,
    warmup: int,
    device: torch.device,
    max_seconds: float | None,
) -> None:
    """Refuse a run that a quick probe of this device says would take past ``max_seconds``,
    before it starts (a CPU run of 50000x50000 products would take hours, and a product
    underway does not stop at Ctrl-C).

    Raises:
        RunTimeLimitExceeded: the estimate is past ``max_seconds`` (a ValueError); the message
            names it, the size and the fix.
    """
    if max_seconds is None:
        return
    products = warmup + iterations
    probed, flops_per_s = _probe(dtype, size, device)
    estimate, fix = _too_long(size, warmup, iterations, flops_per_s, max_seconds)
    if fix is not None:
        call = _call(
            size, iterations, warmup, _fixes(size, warmup, iterations, flops_per_s, max_seconds)
        )
        raise RunTimeLimitExceeded(
            f"{call}: {products} {dtype} products ({warmup} warm-up, {iterations} timed) "
            f"would take about {format_duration(estimate)} on {device} "
            f"({_format_rate(flops_per_s)} measured on a {probed}x{probed} product), more "
            f"than max_seconds={max_seconds:g}: {fix}"
        )


def _check_dtype_on(dtype: str, device: torch.device) -> tuple[str, ...]:
    """Raise if ``device`` cannot run ``dtype``; else the notes on how it will run it."""
    if dtype == "tf32" and device.type != "cuda":
        raise DeviceError(
            "bench_matmul(dtype='tf32') needs a CUDA GPU: TF32 is a tensor-core mode of "
            "Ampere and newer GPUs; on the CPU fp32 matmuls ignore it"
        )
    if device.type != "cuda":
        return cpu_emulation_notes(dtype)
    capability = torch.cuda.get_device_capability(device)
    # The device asked for, not the current one (which is_bf16_supported() looks at).
    if dtype == "bf16" and capability < (8, 0):
        raise DeviceError(
            f"bench_matmul(dtype='bf16') needs compute capability 8.0+ (Ampere); {device} "
            f"has {capability[0]}.{capability[1]}"
        )
    if dtype == "tf32" and capability < (8, 0):
        return ("this GPU predates TF32 (Ampere): tf32 runs as plain fp32",)
    return ()


def _product_timer(dtype: str, size: int, device: torch.device) -> Callable[[int, int], float]:
    """Random ``size x size`` matrices of ``dtype`` on ``device``, made once, and a function
    ``(iterations, warmup)`` of them: the mean wall time of one product, over one
    synchronised block after ``warmup`` untimed ones."""
    torch_dtype = _TORCH_DTYPES[dtype]
    a = torch.randn(size, size, device=device, dtype=torch_dtype)
    b = torch.randn(size, size, device=device, dtype=torch_dtype)
    out = torch.empty(size, size, device=device, dtype=torch_dtype)

    def seconds_per_product(iterations: int, warmup: int) -> float:
        # The TF32 switch is restored afterwards, and never read through a legacy getter that
        # raises once torch's new fp32_precision API was used.
        with tf32(dtype == "tf32"):
            for _ in range(warmup):
                torch.matmul(a, b, out=out)
            synchronize(device)
            # One synchronised block: a sync per product would add its latency to each one.
            start = time.perf_counter()
            for _ in range(iterations):
                torch.matmul(a, b, out=out)
            synchronize(device)
            return (time.perf_counter() - start) / iterations

    return seconds_per_product


def _datasheet_tflops(
    spec: GpuSpec | None, dtype: str, device: torch.device
) -> tuple[float | None, tuple[str, ...]]:
    """The datasheet figure to compare ``dtype`` with, and a note where it is a stand-in."""
    if spec is not None and dtype in ("fp32", "fp16"):
        return (spec.fp32_tflops if dtype == "fp32" else spec.fp16_tflops), ()
    if spec is not None and dtype == "bf16" and torch.cuda.get_device_capability(device) >= (8, 0):
        # As bench model does: bf16 and fp16 share the tensor-core rate on Ampere and newer.
        return spec.fp16_tflops, (
            "the reference table has no bf16 figure; compared with its fp16 figure (the same "
            "tensor-core rate on Ampere and newer)",
        )
    return None, ()


def _datasheet_notes(
    name: str | None, spec: GpuSpec | None, dtype: str, fraction: float | None
) -> tuple[str, ...]:
    """Why there is no datasheet figure, or that the measured one is low."""
    notes: list[str] = []
    if name is not None and fraction is None:
        if spec is None:
            notes.append(f"no datasheet figure for {name} in the reference table")
        else:
            notes.append(f"the reference table lists no {dtype} figure for {name}")
    if fraction is not None and fraction < LOW_FRACTION:
        notes.append(
            f"{fraction:.0%} of the datasheet: check clocks and power "
            "(nvidia-smi -q -d CLOCK,POWER), other processes on the GPU, and try a larger size"
        )
    return tuple(notes)


@dataclass(frozen=True)
class MatmulPlan:
    """A ``bench_matmul`` run, its arguments checked and its defaults filled in."""

    device: torch.device
    size: int
    iterations: int
    warmup: int
    notes: tuple[str, ...]


def matmul_plan(
    dtype: str,
    *,
    size: int | None = None,
    iterations: int | None = None,
    warmup: int = _DEFAULT_WARMUP,
    device: str | torch.device | None = None,
    max_seconds: float | None = DEFAULT_MAX_SECONDS,
) -> MatmulPlan:
    """Everything :func:`bench_matmul` checks before it runs, the estimate of its run time
    included: ``trainperf bench matmul`` checks every dtype asked for this way before it
    runs the first. Same arguments and errors as :func:`bench_matmul`.

    Example:
        >>> matmul_plan("fp32", device="cpu").size
        256
    """
    choice("dtype", dtype, MATMUL_DTYPES)
    dev = resolve_device(device)
    size = (CUDA_DEFAULT_SIZE if dev.type == "cuda" else CPU_DEFAULT_SIZE) if size is None else size
    iterations = (20 if dev.type == "cuda" else 10) if iterations is None else iterations
    size = positive_int("size", size)
    iterations = positive_int("iterations", iterations)
    warmup = positive_int("warmup", warmup)
    max_seconds = check_max_seconds(max_seconds)
    check_tensor_bytes(
        f"bench_matmul(size={size})",
        f"a {size}x{size} {dtype} matrix",
        size * size,
        _TORCH_DTYPES[dtype],
        # size=<n> is what trainperf.cli rewrites as --size <n>.
        f"use a smaller size (e.g. size={CUDA_DEFAULT_SIZE}, the default on a GPU)",
    )
    notes = _check_dtype_on(dtype, dev)
    if dev.type == "cpu":
        _check_host_memory_for(dtype, size)
    _check_run_time(dtype, size, iterations, warmup, dev, max_seconds)
    return MatmulPlan(dev, size, iterations, warmup, notes)


def bench_matmul(
    dtype: MatmulDtype = "fp32",
    *,
    size: int | None = None,
    iterations: int | None = None,
    warmup: int = _DEFAULT_WARMUP,
    device: str | torch.device | None = None,
    max_seconds: float | None = DEFAULT_MAX_SECONDS,
) -> MatmulResult:
    """Time ``size x size`` matrix products on random data and report TFLOP/s.

    Args:
        dtype: ``"fp32"`` (TF32 off), ``"tf32"`` (fp32 with TF32 on), ``"bf16"`` or
            ``"fp16"``.
        size: the matrix side; 8192 on a GPU, 256 on the CPU when None.
        iterations: timed products (20 on a GPU, 10 on the CPU when None).
        warmup: untimed products first.
        device: ``"cpu"``, ``"cuda"`` or ``"cuda:<i>"``; None or ``"auto"`` is the best
            available device (:func:`trainperf.best_device`: the GPU with the most free
            memory), except that where that is MPS the CPU is used: the benchmarks run on
            CPU and CUDA only.
        max_seconds: refuse a run that would take longer than this (warm-up and timed
            products, estimated from a quick probe of this device, a second or two at
            most, from the fastest of its last three products); None for no limit.

    Returns:
        A :class:`MatmulResult`.

    Raises:
        ValueError: an unknown dtype, a count below 1, a ``max_seconds`` that is not a
            positive number or None, a size whose matrices are more bytes than a tensor can
            address, or a run estimated to take longer than ``max_seconds`` (the message
            names the estimate and a size that fits).
        DeviceError: a CUDA device was asked for but is not available, or the device lacks
            what ``dtype`` needs: ``"tf32"`` on the CPU (TF32 is a CUDA tensor-core mode),
            or bf16 on a GPU older than Ampere.
        MemoryError: on the CPU, the three matrices need more host memory than is available
            (checked before they are filled).

    Example:
        >>> r = bench_matmul("fp32", size=64, iterations=2, device="cpu")
        >>> r.dtype, r.size, r.tflops > 0
        ('fp32', 64, True)
    """
    plan = matmul_plan(
        dtype,
        size=size,
        iterations=iterations,
        warmup=warmup,
        device=device,
        max_seconds=max_seconds,
    )
    dev, size, iterations = plan.device, plan.size, plan.iterations
    seconds = _product_timer(dtype, size, dev)(iterations, plan.warmup)
    tflops = 2 * size**3 / seconds / 1e12
    name = gpu_name(dev)
    spec = None if name is None else find_gpu_spec(name)
    datasheet, stand_in = _datasheet_tflops(spec, dtype, dev)
    fraction = None if datasheet is None else tflops / datasheet
    return MatmulResult(
        dtype=dtype,
        size=size,
        device=str(dev),
        gpu_name=name,
        iterations=iterations,
        seconds=seconds,
        tflops=tflops,
        datasheet_tflops=datasheet,
        datasheet_fraction=fraction,
        notes=plan.notes + stand_in + _datasheet_notes(name, spec, dtype, fraction),
    )
