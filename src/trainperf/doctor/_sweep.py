"""The all_reduce bandwidth sweep behind ``trainperf doctor --dist``.

:func:`all_reduce_sweep` starts one rank per GPU with NCCL (or 2 CPU ranks with gloo) through
:func:`trainperf.ddp.launch`, and times ``all_reduce`` at a few sizes the way nccl-tests
does: warm-up calls first, then a loop of calls timed as a whole (CUDA synchronised around
it), the slowest rank's time counting. Algorithm bandwidth is bytes / time; bus bandwidth
is algbw x 2(n-1)/n, the traffic each rank's link carries in a ring all_reduce, so it is
comparable with the link's own figure whatever the rank count (nccl-tests'
``doc/PERFORMANCE.md``). :class:`AllReduceSweep` holds the result.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from trainperf._utils.imports import require
from trainperf._utils.plotting import checked_path, save_figure
from trainperf._utils.serialize import result_dict
from trainperf._utils.validate import choice, non_negative_number, positive_int, positive_number

__all__ = ["AllReduceSweep", "SweepRow", "all_reduce_sweep", "bus_bandwidth"]

_MiB = 2**20
# The names trainperf.ddp uses, spelt here so importing doctor does not import ddp.
Backend = Literal["nccl", "gloo"]
StartMethod = Literal["fork", "spawn"]
GLOO_SIZES = (1 * _MiB, 4 * _MiB, 16 * _MiB, 64 * _MiB)
# NVLink needs larger messages than 64 MiB to approach its peak.
NCCL_SIZES = (*GLOO_SIZES, 256 * _MiB)
WARMUP_CALLS = 2
MIN_ITERATIONS = 3
MAX_ITERATIONS = 200
# Each size is timed for about this long, so the whole sweep stays within seconds.
TARGET_SECONDS = 0.25
DEFAULT_TIMEOUT = 20.0


def bus_bandwidth(algbw: float, ranks: int) -> float:
    """Bus bandwidth of a ring all_reduce: ``algbw x 2(n-1)/n`` (nccl-tests' definition).

    Args:
        algbw: algorithm bandwidth (bytes / time), in any unit; the result is in the same.
        ranks: ranks taking part (``n``, at least 1; one rank moves nothing over a link).

    Raises:
        ValueError: ``algbw`` is not a finite number >= 0 (a string, NaN), or ``ranks`` is
            not an int >= 1.

    Example:
        >>> bus_bandwidth(100.0, 8), bus_bandwidth(1.0, 2)
        (175.0, 1.0)
    """
    algbw = non_negative_number("algbw", algbw)
    ranks = positive_int("ranks", ranks)
    return algbw * 2 * (ranks - 1) / ranks


@dataclass(frozen=True)
class SweepRow:
    """One message size of the sweep.

    Attributes:
        size_bytes: bytes all-reduced per call (float32 elements x 4).
        iterations: timed calls.
        seconds_per_call: the slowest rank's time per call.
        algbw_gb_per_s: ``size_bytes / seconds_per_call`` in GB/s (10**9 bytes).
        busbw_gb_per_s: :func:`bus_bandwidth` of it.
    """

    size_bytes: int
    iterations: int
    seconds_per_call: float
    algbw_gb_per_s: float
    busbw_gb_per_s: float

    @classmethod
    def from_timing(cls, size: int, iterations: int, seconds: float, ranks: int) -> SweepRow:
        """A row from the slowest rank's time per call.

        Raises:
            ValueError: ``size`` or ``iterations`` is not an int >= 1, ``seconds`` not a
                finite number > 0, or ``ranks`` not an int >= 1 (:func:`bus_bandwidth`).

        Example:
            >>> SweepRow.from_timing(2**26, 10, 0.1, ranks=2).busbw_gb_per_s
            0.671
        """
        size = positive_int("size", size)
        iterations = positive_int("iterations", iterations)
        seconds = positive_number("seconds", seconds, unit="seconds per call")
        algbw = size / seconds / 1e9
        busbw = bus_bandwidth(algbw, ranks)
        return cls(size, iterations, seconds, round(algbw, 3), round(busbw, 3))


@dataclass(frozen=True)
class AllReduceSweep:
    """An all_reduce bandwidth sweep across the ranks of this host.

    Attributes:
        backend: ``"nccl"`` or ``"gloo"``.
        world_size: ranks that took part.
        device: ``"cuda"`` or ``"cpu"``, where the tensors lived.
        rows: one :class:`SweepRow` per message size, smallest first.
        setting: the environment it ran under (``"as configured"``, ``"NCCL_P2P_DISABLE=1"``).
        start_method: how the ranks were started (``"fork"`` or ``"spawn"``).
        seconds: wall time of the whole run, start-up of the ranks included.
    """

    backend: str
    world_size: int
    device: str
    rows: tuple[SweepRow, ...]
    setting: str = "as configured"
    start_method: str = "spawn"
    seconds: float = 0.0

    @property
    def peak(self) -> SweepRow | None:
        """The row with the highest bus bandwidth (None for an empty sweep)."""
        return max(self.rows, key=lambda r: r.busbw_gb_per_s, default=None)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict: the fields, each row's, and ``peak_busbw_gb_per_s``.

        Example:
            >>> sweep = AllReduceSweep("gloo", 2, "cpu", (SweepRow(2**20, 3, 0.01, 0.1, 0.1),))
            >>> sweep.to_dict()["peak_busbw_gb_per_s"]
            0.1
        """
        data = result_dict(self)
        peak = self.peak
        data["peak_busbw_gb_per_s"] = None if peak is None else peak.busbw_gb_per_s
        return data

    def __str__(self) -> str:
        head = (
            f"all_reduce sweep: {self.backend}, {self.world_size} ranks on {self.device} "
            f"({self.setting}; {self.start_method}, {self.seconds:.1f} s in all)"
        )
        lines = [
            head,
            f"{'size':>8}  {'calls':>5}  {'time/call':>10}  {'algbw GB/s':>10}  {'busbw GB/s':>10}",
        ]
        for r in self.rows:
            size = f"{r.size_bytes / _MiB:g} MiB"
            lines.append(
                f"{size:>8}  {r.iterations:>5}  {r.seconds_per_call * 1e3:>7.2f} ms  "
                f"{r.algbw_gb_per_s:>10.2f}  {r.busbw_gb_per_s:>10.2f}"
            )
        return "\n".join(lines)

    def plot(self, path: str | os.PathLike[str]) -> Path:
        """Save bus and algorithm bandwidth against message size to ``path`` (PNG, SVG...).

        Args:
            path: the image file to write; its suffix picks the format (none: a PNG at
                ``path`` as given).

        Returns:
            ``path`` as a :class:`~pathlib.Path`.

        Raises:
            FileNotFoundError: the folder ``path`` is in does not exist.
            IsADirectoryError: ``path`` is a folder.
            ModuleNotFoundError: matplotlib is not installed (``pip install 'trainperf[plot]'``).

        Example:
            >>> import tempfile, pathlib
            >>> sweep = AllReduceSweep("gloo", 2, "cpu", (SweepRow(2**20, 3, 0.01, 0.1, 0.1),))
            >>> out = pathlib.Path(tempfile.mkdtemp()) / "sweep.png"
            >>> try:
            ...     print(sweep.plot(out).exists())
            ... except ModuleNotFoundError as e:
            ...     print("pip install" in str(e))
            True
        """
        out = checked_path(path, "AllReduceSweep.plot", "all_reduce.png")
        require("matplotlib", "AllReduceSweep.plot()")
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        fig = Figure(figsize=(7, 4.5))
        FigureCanvasAgg(fig)  # a canvas of our own: pyplot's global state is left alone
        ax = fig.add_subplot()
        sizes = [r.size_bytes / _MiB for r in self.rows]
        ax.plot(sizes, [r.busbw_gb_per_s for r in self.rows], marker="o", label="bus bandwidth")
        ax.plot(sizes, [r.algbw_gb_per_s for r in self.rows], marker=".", label="algorithm bw")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size (MiB)")
        ax.set_ylabel("GB/s")
        ax.set_title(f"all_reduce, {self.backend}, {self.world_size} ranks ({self.setting})")
        ax.legend()
        save_figure(fig, out, dpi=100)
        return out


# --------------------------------------------------------------------------- in each rank


def _slowest(seconds: float, device: torch.device) -> float:
    import torch.distributed as dist

    value = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


def sweep_rank(sizes: Sequence[int], target_seconds: float) -> list[tuple[int, int, float]]:
    """Run in every rank: ``(bytes, calls, slowest rank's seconds per call)`` per size.

    Every rank makes the same calls in the same order: the number of timed calls is agreed
    from the slowest rank's pilot call, so no rank waits in a collective the others skip.
    """
    import torch.distributed as dist

    cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    rows = []
    for size in sizes:
        # Zeros stay zeros however often they are summed: no overflow to inf along the way.
        x = torch.zeros(max(1, size // 4), dtype=torch.float32, device=device)
        for _ in range(WARMUP_CALLS):
            dist.all_reduce(x)
        sync()
        start = time.perf_counter()
        dist.all_reduce(x)
        sync()
        pilot = _slowest(time.perf_counter() - start, device)
        calls = int(min(MAX_ITERATIONS, max(MIN_ITERATIONS, target_seconds / max(pilot, 1e-6))))
        sync()
        start = time.perf_counter()
        for _ in range(calls):
            dist.all_reduce(x)
        sync()
        elapsed = _slowest(time.perf_counter() - start, device)
        rows.append((x.numel() * 4, calls, elapsed / calls))
        del x
    return rows


# --------------------------------------------------------------------------- the launcher side


@contextlib.contextmanager
def environment(overrides: Mapping[str, str | None]) -> Iterator[None]:
    """Set (or, with None, remove) variables for the block; the ranks inherit them.

    Example:
        >>> with environment({"NCCL_P2P_DISABLE": "1"}):
        ...     os.environ["NCCL_P2P_DISABLE"]
        '1'
    """
    saved = {key: os.environ.get(key) for key in overrides}
    try:
        for key, value in overrides.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def start_method_for(backend: str, maps: Path = Path("/proc/self/maps")) -> StartMethod:
    """``"fork"`` where it is safe and quick (gloo, Linux, one thread, no CUDA driver loaded).

    Forking a process that runs other threads, or has CUDA's driver loaded, can leave a
    child holding a lock no thread will release; NCCL ranks need CUDA, so they are spawned.

    Example:
        >>> start_method_for("nccl")
        'spawn'
    """
    from trainperf.ddp._launch_checks import cuda_driver_loaded

    if backend != "gloo" or sys.platform != "linux" or threading.active_count() > 1:
        return "spawn"
    # cuda_driver_loaded says False for maps it cannot read; here that is a reason to spawn.
    if not os.access(maps, os.R_OK) or cuda_driver_loaded(maps):
        return "spawn"
    return "fork"


def _visible_gpus() -> int:
    from trainperf.device import gpus

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # no NVML: no GPU, said elsewhere
        return len(gpus())


def _check_sizes(sizes: Sequence[int]) -> tuple[int, ...]:
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Iterable):
        raise ValueError(
            f"sizes must be a sequence of message sizes in bytes, got {sizes!r}: pass a list, "
            "e.g. sizes=[2**20, 2**26]"
        )
    checked = tuple(positive_int(f"sizes[{i}]", s) for i, s in enumerate(sizes))
    if not checked:
        raise ValueError("sizes must name at least one message size in bytes, got ()")
    return checked


def _check_env(env: object) -> dict[str, str | None]:
    """``env`` checked as :func:`all_reduce_sweep` takes it: variable names to a str (set)
    or None (removed), refused before any variable is changed."""
    if env is None:
        return {}
    if not isinstance(env, Mapping):
        raise ValueError(
            f"env must be a mapping of variable names to str or None, got {env!r}: e.g. "
            "env={'NCCL_P2P_DISABLE': '1'}"
        )
    checked: dict[str, str | None] = {}
    for key, value in env.items():
        if not isinstance(key, str) or not key or "=" in key or "\0" in key:
            raise ValueError(
                f"env key must be a variable name (a non-empty str, no '=' or NUL), got {key!r}"
            )
        if value is not None and not isinstance(value, str):
            raise ValueError(
                f"env[{key!r}] must be a str or None (None removes the variable), got "
                f"{value!r}: pass str({value!r}) to set it"
            )
        checked[key] = value
    return checked


def all_reduce_sweep(
    *,
    backend: Backend | None = None,
    nprocs: int | None = None,
    sizes: Sequence[int] | None = None,
    env: Mapping[str, str | None] | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    target_seconds: float = TARGET_SECONDS,
) -> AllReduceSweep:
    """Time ``all_reduce`` across ranks of this host at a few message sizes.

    Args:
        backend: ``"nccl"`` (one rank per GPU) or ``"gloo"`` (CPU ranks); None picks NCCL
            with 2+ visible GPUs, else gloo.
        nprocs: ranks to start (>= 2); default one per visible GPU (NCCL) or 2 (gloo).
        sizes: message sizes in bytes; default 1, 4, 16, 64 MiB (and 256 MiB with NCCL).
        env: variables to set (or, with None, remove) for the ranks, e.g.
            ``{"NCCL_P2P_DISABLE": "1"}``; this process's environment is restored after.
        timeout: seconds a collective (and the rendezvous) may wait before the run fails;
            half of it with no rank making progress is reported as a hang naming its cause.
        target_seconds: about how long each size is timed.

    Returns:
        An :class:`AllReduceSweep`.

    Raises:
        ValueError: ``nprocs`` below 2, ``backend="nccl"`` without ``nprocs`` on fewer than
            2 visible GPUs, a size below 1 byte, no sizes (or ``sizes`` not a sequence), an
            ``env`` that is not names to str or None, an unknown backend, a timeout that is
            not a finite number of at least 2 s.
        LaunchError: a rank failed (from :func:`trainperf.ddp.launch`).

    Example:
        >>> sweep = all_reduce_sweep(backend="gloo", sizes=[2**16], target_seconds=0.01)
        >>> sweep.world_size, len(sweep.rows), sweep.rows[0].busbw_gb_per_s > 0
        (2, 1, True)
    """
    import trainperf.ddp as ddp
    from trainperf.ddp._launch_checks import MIN_HANG_TIMEOUT_S

    choice("backend", backend, ("nccl", "gloo", None))
    overrides = _check_env(env)
    if backend is None or (backend == "nccl" and nprocs is None):
        visible = _visible_gpus()
        if backend == "nccl" and nprocs is None and visible < 2:
            raise ValueError(
                f"backend='nccl' runs one rank per GPU and needs 2+ visible GPUs, found "
                f"{visible}: use backend='gloo' (or None, which picks it) on this host"
            )
        backend = backend or ("nccl" if visible >= 2 else "gloo")
        default_ranks = visible if backend == "nccl" else 2
    else:
        default_ranks = 2
    nprocs = positive_int("nprocs", default_ranks if nprocs is None else nprocs)
    if nprocs < 2:
        raise ValueError(f"all_reduce_sweep needs nprocs >= 2 ranks to all-reduce, got {nprocs}")
    timeout = positive_number("timeout", timeout, unit="s")
    if timeout < 2 * MIN_HANG_TIMEOUT_S:
        raise ValueError(
            f"all_reduce_sweep(timeout={timeout:g}) is under {2 * MIN_HANG_TIMEOUT_S:g} s: half "
            f"of it bounds a hang, and a hang timeout is at least {MIN_HANG_TIMEOUT_S:g} s; "
            f"pass timeout={2 * MIN_HANG_TIMEOUT_S:g} or more (the default is "
            f"{DEFAULT_TIMEOUT:g})"
        )
    target_seconds = positive_number("target_seconds", target_seconds, unit="s")
    default_sizes = NCCL_SIZES if backend == "nccl" else GLOO_SIZES
    chosen = _check_sizes(default_sizes if sizes is None else sizes)
    method = start_method_for(backend)
    start = time.perf_counter()
    with environment(overrides):
        raw = ddp.launch(
            sweep_rank,
            chosen,
            target_seconds,
            nprocs=nprocs,
            backend=backend,
            start_method=method,
            timeout=timeout,
            # Below the collective timeout, so a hang names the rank that causes it (and
            # the launcher does not warn that it cannot).
            hang_timeout=timeout / 2,
        )
    rows = tuple(SweepRow.from_timing(s, n, t, nprocs) for s, n, t in raw)
    setting = ", ".join(f"{k}={v}" if v is not None else f"{k} unset" for k, v in overrides.items())
    return AllReduceSweep(
        backend=backend,
        world_size=nprocs,
        device="cuda" if backend == "nccl" else "cpu",
        rows=rows,
        setting=setting or "as configured",
        start_method=method,
        seconds=round(time.perf_counter() - start, 2),
    )
