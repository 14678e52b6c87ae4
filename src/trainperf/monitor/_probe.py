"""What :class:`~trainperf.monitor.Watch` reads besides the clock: cheap per-step CPU
figures (:class:`CpuClock`), the batch size, the settings the loop ran with
(:func:`loader_facts`, :func:`loop_setup`), and the :class:`trainperf.amp.MixedPrecision`
in use.

None of this initialises CUDA: the GPU is only looked at once the loop uses it.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from trainperf._utils.batches import batch_length
from trainperf._utils.validate import as_real_number
from trainperf.limits import local_world_size, usable_cpus
from trainperf.monitor._setup import LoopSetup

__all__ = [
    "CpuClock",
    "background_saves",
    "batch_size",
    "loader_batch_size",
    "loader_facts",
    "loop_setup",
    "precision_in_use",
    "rank_cpus",
    "shared_leading",
]

_PRECISION_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


class CpuClock:
    """The calling thread's CPU demand and run-queue delay so far, one ``pread`` a reading.

    Linux's ``/proc/thread-self/schedstat`` gives the nanoseconds a thread ran and the
    nanoseconds it was runnable but waited for a CPU. Their sum is what the thread
    *demanded* (loading that computes demands a whole core even on a crowded host, while
    loading that sleeps on I/O demands none), the second alone is what other threads kept
    it from. Elsewhere the demand is ``time.thread_time()`` and the delay is unknown (NaN).
    The file is opened once per thread (a reading from another thread reopens it, and
    :attr:`generation` counts the reopenings so that differences across threads are not
    taken). The kernel adds a running thread's time at scheduler ticks, so one reading can
    lag by a tick (1-10 ms): a single step's figure is rough, a mean over steps is not.
    """

    def __init__(self) -> None:
        self._tid: int | None = None
        self._fd: int | None = None
        self.generation = 0

    def _open(self, tid: int) -> None:
        self.close()
        self._tid = tid
        self.generation += 1
        try:
            self._fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        except OSError:  # not Linux, or no schedstat: CPU time alone
            self._fd = None

    def read(self) -> tuple[float, float]:
        """``(demand, delay)`` in seconds since the thread started (delay NaN if unknown)."""
        tid = threading.get_native_id()
        if tid != self._tid:
            self._open(tid)
        if self._fd is not None:
            try:
                run, wait, _ = os.pread(self._fd, 96, 0).split()
                return (int(run) + int(wait)) / 1e9, int(wait) / 1e9
            except (OSError, ValueError):
                self.close()
        return time.thread_time(), math.nan

    def close(self) -> None:
        """Close the file (readings go on, from CPU time, until the next reopening)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)


def batch_size(
    batch: object, loader_batch_size: int | None = None, sample_leading: int | None = None
) -> int | None:
    """Samples in a batch, None when unknown: :func:`~trainperf._utils.batches.batch_length`'s
    count (a list of per-sample items, as ``collate_fn=list`` gives, counts its items),
    except that a list of tensors (or arrays) that all share a leading size counts that
    size: ``default_collate`` returns tuple samples as such a list (``[x, y]``). Only from a
    DataLoader whose ``loader_batch_size`` that list's length matches (and the tensors'
    size does not) are they per-sample tensors, counted by their number; a shorter list
    (an epoch's last batch) is too when its tensors share ``sample_leading``, the leading
    size of the per-sample tensors of a full batch of the same loader before it
    (:func:`shared_leading`; without one, it reads as that size). A batch larger than the
    loader's ``batch_size`` (a dataset of ready-made batches) counts what it holds.

    Example:
        >>> batch_size({"x": np.zeros((5, 2)), "y": np.zeros(5)}), batch_size(np.zeros(()))
        (5, None)
        >>> batch_size([(np.zeros((224, 224, 3)), 1) for _ in range(8)])  # collate_fn=list
        8
        >>> batch_size([np.zeros((224, 224, 3))] * 8, 8)  # collate_fn=list, batch_size=8
        8
        >>> batch_size([np.zeros((224, 224, 3))] * 5, 8, sample_leading=224)  # the last 5
        5
    """
    size = shared_leading(batch)
    if isinstance(batch, list) and size is not None:
        if loader_batch_size is not None and (
            len(batch) == loader_batch_size != size
            or (len(batch) < loader_batch_size and size == sample_leading)
        ):
            return len(batch)
        return size
    return batch_length(batch)


def shared_leading(batch: object) -> int | None:
    """The leading size all items of a non-empty list of tensors (or arrays) share, None
    for anything else: a list :func:`batch_size` reads as the batch's fields or as
    per-sample tensors.

    Example:
        >>> shared_leading([np.zeros((3, 4)), np.zeros((3, 2))]), shared_leading([np.zeros(2)])
        (3, 2)
        >>> shared_leading([np.zeros(3), np.zeros(4)]) is None
        True
    """
    if not isinstance(batch, list) or not batch:
        return None
    leading = {_leading(v) for v in batch}
    return leading.pop() if len(leading) == 1 and None not in leading else None


def loader_batch_size(iterable: object) -> int | None:
    """The ``batch_size`` of a DataLoader (None for anything else, or a loader built from a
    ``batch_sampler``, whose batches have no set size)."""
    from torch.utils.data import DataLoader

    if not isinstance(iterable, DataLoader):
        return None
    size = _int_or_none(iterable.batch_size)
    return size if size is not None and size >= 1 else None


def _leading(value: object) -> int | None:
    """The leading size of a tensor or array with a dimension, else None."""
    if isinstance(value, (torch.Tensor, np.ndarray)) and value.ndim:
        return int(value.shape[0])
    return None


def background_saves() -> int:
    """Background checkpoint writes this process has started
    (``Checkpointer.save(..., blocking=False)``); 0 where trainperf.checkpoint was never
    imported (read from ``sys.modules``, as :func:`precision_in_use` reads amp's registry).
    """
    writer = sys.modules.get("trainperf.checkpoint._writer")
    count = getattr(writer, "background_saves", None)
    return int(count()) if callable(count) else 0


def precision_in_use() -> tuple[str, str] | None:
    """What a live :class:`trainperf.amp.MixedPrecision` chose: ``(name, reason)``, or None.

    amp keeps its live objects in ``trainperf.amp._mixed.LIVE`` (a ``WeakSet``); without
    that registry, or with nothing in it, none is in use. With several, a lower precision
    is reported first (the loop already uses it). Read from ``sys.modules``: where amp was
    never imported, no MixedPrecision exists.
    """
    live = getattr(sys.modules.get("trainperf.amp._mixed"), "LIVE", None)
    if live is None:
        return None
    found = []
    for mp in list(live):
        name = _PRECISION_NAMES.get(getattr(mp, "dtype", None))  # type: ignore[arg-type]
        reason = getattr(mp, "reason", None)
        if name is not None and isinstance(reason, str):
            found.append((name != "fp32", name, reason))
    if not found:
        return None
    _, name, reason = max(found)
    return name, reason


def rank_cpus() -> int:
    """This process's share of the usable CPUs: under DDP the host's ranks split them, so a
    host busy with this job's own ranks is not "other processes"."""
    try:
        return usable_cpus(local_world_size())
    except ValueError:  # a malformed launcher variable: the limits' own error elsewhere
        return usable_cpus()


def _int_or_none(value: object) -> int | None:
    """``value`` as a Python int if it is a whole number (NumPy's integers too: a setting
    read from a NumPy config), else None; a bool is not a setting's number."""
    number = as_real_number(value)
    return number if isinstance(number, int) else None


def _float_or_none(value: object) -> float | None:
    number = as_real_number(value)
    return None if number is None else float(number)


def loader_facts(iterable: object) -> dict[str, Any]:
    """The DataLoader settings of what ``w.iter()`` was given ({} for anything else).

    A loader from :func:`trainperf.autotune_loader` also brings what its tuner measured
    (its ``tuning_report``).
    """
    from torch.utils.data import DataLoader

    if not isinstance(iterable, DataLoader):
        return {}
    workers = _int_or_none(iterable.num_workers)
    facts: dict[str, Any] = {
        "num_workers": workers,
        "prefetch_factor": _int_or_none(iterable.prefetch_factor) if workers else None,
        "batch_size": _int_or_none(iterable.batch_size),
    }
    report = getattr(iterable, "tuning_report", None)
    if report is not None:
        facts["tuned_num_workers"] = _int_or_none(getattr(report, "num_workers", None))
        facts["tuned_worker_cpus"] = _int_or_none(getattr(report, "worker_cpus", None))
        facts["tuned_max_workers"] = _int_or_none(getattr(report, "max_workers", None))
        facts["tuned_samples_per_s"] = _float_or_none(getattr(report, "samples_per_s", None))
    return facts


def loop_setup(facts: Mapping[str, Any], cuda_index: int | None, **measured: Any) -> LoopSetup:
    """The :class:`LoopSetup` now: ``facts`` from :func:`loader_facts`, torch's threads, the
    host's CPUs, the GPU the loop uses (``cuda_index``: None when it uses none), and the
    ``measured`` fields the watch itself found (batches per step, the hand-over probe)."""
    from trainperf.amp._precision import cpu_has_bf16_kernels

    name: str | None = None
    capability: tuple[int, int] | None = None
    if cuda_index is not None:  # CUDA is initialised already: the loop did it
        name = torch.cuda.get_device_name(cuda_index)
        major, minor = torch.cuda.get_device_capability(cuda_index)
        capability = (int(major), int(minor))
    return LoopSetup(
        **facts,
        torch_threads=torch.get_num_threads(),
        host_cpus=os.cpu_count(),
        gpu_name=name,
        gpu_capability=capability,
        cpu_native_bf16=cpu_has_bf16_kernels() if cuda_index is None else None,
        **measured,
    )
