"""What the batch-size tuner measured and chose: :class:`BatchSizeCandidate`,
:class:`BatchSizeReport` and :class:`PipelineMemory`."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from trainperf._utils.format import format_bytes
from trainperf._utils.serialize import result_dict

__all__ = ["BatchSizeCandidate", "BatchSizeReport", "CandidateStatus", "PipelineMemory"]

CandidateStatus = Literal["ok", "oom", "over-headroom", "skipped"]
"""``ok``: measured, within the headroom; ``oom``: ran out of memory (the error was caught);
``over-headroom``: measured, but its peak memory is past ``(1 - headroom)`` of the limit;
``skipped``: not run (predicted past the headroom, or no time left in the budget)."""

MEMORY_KINDS = {
    "cuda": "peak = CUDA caching allocator's max reserved; limit = free + reserved at the start",
    "rss": "peak = growth of this process's resident memory; limit = host memory available",
    "unmeasured": "peak memory not measured on this device",
}


@dataclass(frozen=True)
class BatchSizeCandidate:
    """One batch size the tuner considered.

    Attributes:
        batch_size: samples per step (the micro-batch).
        status: ``"ok"``, ``"oom"``, ``"over-headroom"`` or ``"skipped"``
            (see :data:`CandidateStatus`).
        samples_per_s: steady-state throughput (median of the last timed windows); None when
            nothing was timed.
        spread: (max - min) / median of those windows; small means trustworthy.
        peak_memory: peak bytes over the whole probe, warm-up included (see
            :class:`BatchSizeReport` for what is counted); None when not measured.
        peak_allocated: on CUDA, the peak of live tensors (``max_memory_allocated``); the
            rest of ``peak_memory`` is the allocator's cache and fragmentation.
        warmup_steps: steps run before timing (allocator growth, cuDNN autotuning,
            ``torch.compile`` recompiles).
        steps: steps inside the timed windows.
        windows: timed windows.
        accumulation_steps: steps per optimizer update that keep ``global_batch`` (1
            without it).
        elapsed_s: wall time spent on this size, building the batch included.
        reason: why it is not ``ok`` (or what limited its measurement), else None.
    """

    batch_size: int
    status: CandidateStatus
    samples_per_s: float | None = None
    spread: float | None = None
    peak_memory: int | None = None
    peak_allocated: int | None = None
    warmup_steps: int = 0
    steps: int = 0
    windows: int = 0
    accumulation_steps: int = 1
    elapsed_s: float = 0.0
    reason: str | None = None

    @property
    def ok(self) -> bool:
        """True when it was measured within the headroom."""
        return self.status == "ok" and self.samples_per_s is not None

    @property
    def probed(self) -> bool:
        """True when it was run (ok, out of memory or over the headroom), not skipped."""
        return self.status != "skipped"

    def __str__(self) -> str:
        """One line: the size, its rate and peak memory, and its status.

        Example:
            >>> print(BatchSizeCandidate(64, "ok", samples_per_s=900.0, peak_memory=2**30))
            batch 64: 900.0 samples/s, peak 1.0 GiB, ok
        """
        rate = "-" if self.samples_per_s is None else f"{self.samples_per_s:,.1f} samples/s"
        peak = "" if self.peak_memory is None else f", peak {format_bytes(self.peak_memory)}"
        why = f" ({self.reason})" if self.reason else ""
        return f"batch {self.batch_size}: {rate}{peak}, {self.status}{why}"

    def to_dict(self) -> dict[str, Any]:
        """Every field by name, JSON-safe; ``BatchSizeCandidate(**c.to_dict())`` is ``c``.

        Example:
            >>> c = BatchSizeCandidate(64, "ok", samples_per_s=900.0, peak_memory=2**30)
            >>> BatchSizeCandidate(**c.to_dict()) == c, c.to_dict()["status"]
            (True, 'ok')
        """
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class PipelineMemory:
    """The input pipeline's memory at the chosen batch size: the batches in flight.

    A DataLoader with workers keeps ``num_workers * prefetch_factor`` batches in flight in
    shared memory (``/dev/shm``), and the main process holds one more; without workers it
    holds one.

    Attributes:
        batch_bytes: bytes of tensor data in one batch as ``sample(n)`` built it.
        num_workers: the DataLoader's workers the figure is for.
        prefetch_factor: batches each worker keeps in flight (None without workers).
        batches_in_flight: ``num_workers * prefetch_factor + 1``.
        total_bytes: ``batch_bytes * batches_in_flight``.
        memory_available: host memory available when tuning began.
        shm_free: free bytes in ``/dev/shm`` (None where there is none).
        fits: whether the batches fit in available memory (and ``/dev/shm`` with workers).
    """

    batch_bytes: int
    num_workers: int
    prefetch_factor: int | None
    batches_in_flight: int
    total_bytes: int
    memory_available: int
    shm_free: int | None
    fits: bool

    @classmethod
    def of(
        cls,
        batch_bytes: int,
        num_workers: int,
        prefetch_factor: int | None,
        memory_available: int,
        shm_free: int | None,
    ) -> PipelineMemory:
        """The figure for ``num_workers`` workers (``prefetch_factor`` None: DataLoader's 2).

        Example:
            >>> p = PipelineMemory.of(2**20, 4, None, 2**33, 2**30)
            >>> p.batches_in_flight, p.total_bytes // 2**20, p.fits
            (9, 9, True)
        """
        pf = (prefetch_factor or 2) if num_workers else None
        in_flight = num_workers * (pf or 0) + 1
        total = batch_bytes * in_flight
        shm_ok = num_workers == 0 or shm_free is None or total <= shm_free
        return cls(
            batch_bytes,
            num_workers,
            pf,
            in_flight,
            total,
            memory_available,
            shm_free,
            total <= memory_available and shm_ok,
        )

    def __str__(self) -> str:
        """One line: the batches in flight against memory and ``/dev/shm``.

        Example:
            >>> print(PipelineMemory.of(2**20, 0, None, 2**33, None))
            ... # doctest: +NORMALIZE_WHITESPACE
            input pipeline: one batch is 1 MiB; num_workers=0 holds 1 batch: 1 MiB of
            8.0 GiB memory available: fits
        """
        workers = (
            f"num_workers={self.num_workers} x prefetch_factor={self.prefetch_factor} + 1"
            if self.num_workers
            else "num_workers=0"
        )
        plural = "batch" if self.batches_in_flight == 1 else "batches"
        shm = ""
        if self.num_workers and self.shm_free is not None:
            shm = f", /dev/shm {format_bytes(self.shm_free)} free"
        verdict = (
            "fits" if self.fits else "does NOT fit: fewer workers or a smaller prefetch_factor"
        )
        return (
            f"input pipeline: one batch is {format_bytes(self.batch_bytes)}; {workers} holds "
            f"{self.batches_in_flight} {plural}: {format_bytes(self.total_bytes)} of "
            f"{format_bytes(self.memory_available)} memory available{shm}: {verdict}"
        )

    def to_dict(self) -> dict[str, Any]:
        """Every field by name, JSON-safe."""
        return result_dict(self)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _rate(x: float | None) -> str:
    return "-" if x is None else f"{x:,.1f}"


@dataclass(frozen=True)
class BatchSizeReport:
    """The result of :func:`trainperf.tune_batch_size`.

    Attributes:
        batch_size: the chosen micro-batch: samples per ``step(batch)``.
        accumulation_steps: steps per optimizer update; ``batch_size * accumulation_steps *
            world_size == global_batch`` when ``global_batch`` was given, else 1.
        samples_per_s: the chosen size's measured steady-state throughput (this rank's).
        peak_memory: the chosen size's peak memory in bytes (None when not measured):
            on CUDA the caching allocator's peak reserved memory (fragmentation included),
            on the CPU the growth of this process's resident memory.
        memory_limit: what the peak is held to before the headroom: on CUDA the free plus
            reserved memory of this process's GPU when tuning began (lowered when memory
            outside the allocator grew), on the CPU the host memory available
            (:func:`trainperf.host_limits`); None when not measured.
        candidates: every size considered, in the order tried.
        elapsed_s: wall time of the whole call.
        budget_s: the time budget it ran under.
        headroom: the fraction of ``memory_limit`` kept free.
        device: where the steps ran (``"cuda:0"``, ``"cpu"``).
        world_size: ranks sharing ``global_batch`` (torch.distributed's world size, else 1).
        global_batch: the effective batch kept, or None.
        memory_kind: ``"cuda"``, ``"rss"`` or ``"unmeasured"``: how the peak was read.
        pipeline: the input pipeline's memory at the chosen size (batches in flight).
        from_cache: True when the choice came from the cache without measuring.
        notes: remarks on the decisions (why the growth stopped, the budget, the cache).
    """

    batch_size: int
    accumulation_steps: int
    samples_per_s: float | None
    peak_memory: int | None
    memory_limit: int | None
    candidates: tuple[BatchSizeCandidate, ...]
    elapsed_s: float
    budget_s: float
    headroom: float
    device: str
    world_size: int = 1
    global_batch: int | None = None
    memory_kind: str = "unmeasured"
    pipeline: PipelineMemory | None = None
    from_cache: bool = False
    notes: tuple[str, ...] = field(default=())

    @property
    def effective_batch(self) -> int:
        """Samples per optimizer update over all ranks: ``batch_size * accumulation_steps *
        world_size``."""
        return self.batch_size * self.accumulation_steps * self.world_size

    @property
    def usable_memory(self) -> int | None:
        """``(1 - headroom) * memory_limit``: the most a chosen size may peak at."""
        if self.memory_limit is None:
            return None
        return int((1.0 - self.headroom) * self.memory_limit)

    def chosen(self) -> BatchSizeCandidate | None:
        """The measured candidate of the chosen size.

        Example:
            >>> c = BatchSizeCandidate(8, "ok", samples_per_s=10.0)
            >>> r = BatchSizeReport(8, 1, 10.0, None, None, (c,), 1.0, 5.0, 0.1, "cpu")
            >>> r.chosen() is c
            True
        """
        for c in self.candidates:
            if c.ok and c.batch_size == self.batch_size:
                return c
        return None

    def input_pipeline(
        self,
        num_workers: int,
        prefetch_factor: int | None = None,
        *,
        memory_available: int | None = None,
        shm_free: int | None = None,
    ) -> PipelineMemory | None:
        """The input pipeline's memory at the chosen size with another DataLoader setting
        (the one :func:`trainperf.autotune_loader` chose, say).

        Limits default to those of :attr:`pipeline` (read when tuning began). None when the
        batch's size is unknown (a report from an old cache entry).

        Example:
            >>> p = PipelineMemory.of(2**20, 0, None, 2**33, 2**30)
            >>> r = BatchSizeReport(8, 1, 10.0, None, None, (), 1.0, 5.0, 0.1, "cpu",
            ...                     pipeline=p)
            >>> r.input_pipeline(4, 2).batches_in_flight
            9
        """
        if self.pipeline is None:
            return None
        return PipelineMemory.of(
            self.pipeline.batch_bytes,
            num_workers,
            prefetch_factor,
            self.pipeline.memory_available if memory_available is None else memory_available,
            self.pipeline.shm_free if shm_free is None else shm_free,
        )

    def to_dict(self) -> dict[str, Any]:
        """The report as plain dicts, lists, strings and numbers (``json.dumps`` takes it):
        every field, plus ``effective_batch`` and ``usable_memory``.

        Example:
            >>> import json
            >>> c = BatchSizeCandidate(8, "ok", samples_per_s=10.0)
            >>> r = BatchSizeReport(8, 4, 10.0, None, None, (c,), 1.0, 5.0, 0.1, "cpu",
            ...                     global_batch=32)
            >>> d = json.loads(json.dumps(r.to_dict()))
            >>> d["effective_batch"], d["candidates"][0]["batch_size"]
            (32, 8)
        """
        data = result_dict(self)
        data["effective_batch"] = self.effective_batch
        data["usable_memory"] = self.usable_memory
        return data

    def _head(self) -> list[str]:
        source = (
            "from cache" if self.from_cache else f"{self.elapsed_s:.1f} s of {self.budget_s:g} s"
        )
        ranks = f"{self.world_size} rank{'s' if self.world_size != 1 else ''}"
        keep = "" if self.global_batch is None else f", global batch {self.global_batch}"
        lines = [f"Batch size tuning: device {self.device}, {ranks}{keep}, {source}"]
        if self.memory_limit is not None:
            lines.append(
                f"memory: limit {format_bytes(self.memory_limit)}, headroom "
                f"{100 * self.headroom:g} % -> {format_bytes(self.usable_memory)} usable "
                f"({MEMORY_KINDS.get(self.memory_kind, self.memory_kind)})"
            )
        else:
            lines.append(f"memory: {MEMORY_KINDS['unmeasured']}")
        return lines

    def _rows(self) -> list[str]:
        if not self.candidates:
            return []
        rows = [f"{'batch':>7} {'accum':>5} {'samples/s':>11} {'spread':>6} {'peak':>9}  status"]
        for c in self.candidates:
            mark = " <- chosen" if c.ok and c.batch_size == self.batch_size else ""
            status = c.status if c.reason is None else f"{c.status}: {c.reason}"
            rows.append(
                f"{c.batch_size:>7} {c.accumulation_steps:>5} {_rate(c.samples_per_s):>11} "
                f"{_pct(c.spread):>6} {format_bytes(c.peak_memory):>9}  {status}{mark}"
            )
        return rows

    def __str__(self) -> str:
        """The table a person reads: every size tried, the choice, the input pipeline."""
        lines = self._head() + self._rows()
        speed = (
            "samples/s not measured"
            if self.samples_per_s is None
            else f"{self.samples_per_s:,.1f} samples/s"
        )
        peak = ""
        if self.peak_memory is not None:
            peak = f", peak {format_bytes(self.peak_memory)}"
            if self.usable_memory is not None:
                peak += f" of {format_bytes(self.usable_memory)} usable"
        lines.append(
            f"chosen: batch_size={self.batch_size}, accumulation_steps={self.accumulation_steps} "
            f"({self.batch_size} x {self.accumulation_steps} x {self.world_size} = "
            f"{self.effective_batch} samples per update): {speed}{peak}"
        )
        if self.pipeline is not None:
            lines.append(str(self.pipeline))
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)

    def plot(self, path: str | os.PathLike[str]) -> Path:
        """Save a chart of samples/s and peak memory against batch size (PNG, SVG, PDF...).

        Throughput on the left axis, peak memory on the right with the usable limit as a
        dashed line; out-of-memory sizes are crossed and the chosen size is starred.

        Args:
            path: the image file to write; its suffix picks the format (none: a PNG at
                exactly ``path``).

        Returns:
            ``path`` as a :class:`~pathlib.Path`.

        Raises:
            FileNotFoundError: the folder ``path`` is in does not exist (before drawing).
            IsADirectoryError: ``path`` is a folder.
            ModuleNotFoundError: matplotlib is not installed.

        Example:
            >>> c = BatchSizeCandidate(8, "ok", samples_per_s=10.0, peak_memory=2**20)
            >>> r = BatchSizeReport(8, 1, 10.0, 2**20, 2**30, (c,), 1.0, 5.0, 0.1, "cpu")
            >>> try:
            ...     _ = r.plot("/tmp/trainperf-doctest-batchsize.png")
            ... except ModuleNotFoundError as e:
            ...     print("pip install" in str(e))
            ... else:
            ...     print(True)
            True
        """
        from trainperf.batchsize._plot import plot_report

        return plot_report(self, Path(path))
