"""The cache path of :func:`trainperf.loader.tune_loader`: a report from a stored entry, and
the entry stored for a fresh choice.

An entry holds the four tuned settings (``"best"``), the report's figures, notes and
candidates as :meth:`~trainperf.loader.TuningReport.to_dict` writes them, and the memory and
``/dev/shm`` the choice needs, so that a hit on a host with less of either tunes again. The
file itself (its place, keys, atomic writes) is :mod:`trainperf.loader._cache`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from typing import Any

from trainperf.limits import HostLimits
from trainperf.loader import _cache
from trainperf.loader._choice import final_kwargs
from trainperf.loader._report import CandidateResult, TuningReport
from trainperf.loader._search import safety_margin
from trainperf.loader._step import cores_for_workers, main_process_cores

__all__ = ["REPORT_KEYS", "cache_entry", "report_from_cache", "store"]

REPORT_KEYS = (
    "samples_per_s",
    "baseline_samples_per_s",
    "step_samples_per_s",
    "worker_cpus",
    "main_cores",
    "candidates",
    "notes",
)
"""The keys of :meth:`TuningReport.to_dict` an entry keeps, under the same names."""


def cache_entry(
    report: TuningReport, best: Mapping[str, Any], memory_needed: int, shm_needed: int
) -> dict[str, Any]:
    """The entry stored for ``report``, whose tuned settings are ``best``.

    Example:
        >>> from trainperf.limits import HostLimits
        >>> zero = CandidateResult(0, None, False, "ok", samples_per_s=100.0)
        >>> report = TuningReport(
        ...     {"num_workers": 0}, 100.0, 100.0, None, (zero,), 1.0, 5.0,
        ...     HostLimits(4, 4, None, 4, 2**33, None, 2**32, None, None), 4, 3, 8, "cpu", 32)
        >>> entry = cache_entry(report, {"num_workers": 0}, 0, 0)
        >>> entry["samples_per_s"], entry["candidates"] == [zero.to_dict()]
        (100.0, True)
    """
    data = report.to_dict()
    return {
        "best": dict(best),
        **{k: data[k] for k in REPORT_KEYS},
        "memory_needed": memory_needed,
        "shm_needed": shm_needed,
    }


def store(
    key: str,
    report: TuningReport,
    best: Mapping[str, Any],
    memory_needed: int,
    shm_needed: int,
) -> TuningReport:
    """Write the entry for ``report``; returns it, with a note when the write failed."""
    try:
        _cache.write_entry(key, cache_entry(report, best, memory_needed, shm_needed))
    except OSError as e:
        return dataclasses.replace(
            report, notes=(*report.notes, f"the choice could not be cached: {e}")
        )
    return report


def report_from_cache(
    entry: Mapping[str, Any],
    limits: HostLimits,
    loader_kwargs: Mapping[str, Any],
    batch_size: int,
    common: Mapping[str, Any],
    started: float,
) -> TuningReport | None:
    """A report built from a cache entry, or None when it is malformed or no longer fits.

    The main process's share is the entry's (measured with ``step_fn``); an entry without
    one kept the default core.

    Args:
        entry: what :func:`cache_entry` stored (older entries may lack the shares).
        limits: this host's limits now.
        loader_kwargs: the caller's DataLoader arguments.
        batch_size: the batch size.
        common: the report fields known before measuring (``cpus``, ``device``, ...).
        started: ``time.perf_counter()`` when the call began.
    """
    try:
        best = dict(entry["best"])
        candidates = tuple(CandidateResult(**c) for c in entry["candidates"])
        int(best["num_workers"])
        need, shm = int(entry["memory_needed"]), int(entry["shm_needed"])
        notes = [str(n) for n in entry.get("notes", [])]
        rate = entry.get("samples_per_s")
        base = entry.get("baseline_samples_per_s")
        step = entry.get("step_samples_per_s")
        main_cores = float(entry.get("main_cores", main_process_cores(common["cpus"])))
        worker_cpus = int(entry.get("worker_cpus", cores_for_workers(common["cpus"], main_cores)))
    except (KeyError, TypeError, ValueError):
        return None
    if need > limits.memory_available - safety_margin(limits.memory_available):
        return None
    if limits.shm_free is not None and shm > 0.9 * limits.shm_free:
        return None
    notes.append(f"settings from the cache ({_cache.cache_file()}); cache=False re-tunes")
    return TuningReport(
        best_kwargs=final_kwargs(loader_kwargs, batch_size, best, []),
        samples_per_s=rate,
        baseline_samples_per_s=base,
        step_samples_per_s=step,
        candidates=candidates,
        elapsed_s=time.perf_counter() - started,
        from_cache=True,
        notes=tuple(notes),
        worker_cpus=worker_cpus,
        main_cores=main_cores,
        **common,
    )
