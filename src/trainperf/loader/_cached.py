"""The cache path of :func:`trainperf.loader.tune_loader`: a report from a stored entry, and
the entry stored for a fresh choice.

An entry holds the four tuned settings (``"best"``), the report's figures, notes and
candidates as :meth:`~trainperf.loader.TuningReport.to_dict` writes them, and the memory and
``/dev/shm`` the choice needs. Nothing in it is trusted: before a hit is used,
:func:`cache_misfit` checks the settings' types and ranges, ``num_workers`` against this
call's ``max_workers`` (the caller's, or the default from the usable CPUs), and the memory
and ``/dev/shm`` against what is free now; an entry that fails (hand-edited, corrupted, or
from a roomier host) is tuned again, with a note saying why. The
file itself (its place, keys, atomic writes) is :mod:`trainperf.loader._cache`. Under DDP
local rank 0 sends the other local ranks the same entry, less the memory figures
(:func:`share_entry`, :func:`report_from_share`; the hand-over is
:mod:`trainperf.loader._share`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeGuard

from trainperf._utils.format import format_bytes
from trainperf.limits import HostLimits
from trainperf.loader import _cache
from trainperf.loader._choice import final_kwargs
from trainperf.loader._faults import budget_cut
from trainperf.loader._report import CandidateResult, TuningReport, UserSetting
from trainperf.loader._search import safety_margin
from trainperf.loader._step import cores_for_workers, main_process_cores

__all__ = [
    "REPORT_KEYS",
    "cache_entry",
    "cache_misfit",
    "cached_report",
    "entry_key",
    "report_from_cache",
    "report_from_share",
    "share_entry",
    "store",
]

REPORT_KEYS = (
    "samples_per_s",
    "baseline_samples_per_s",
    "step_samples_per_s",
    "worker_cpus",
    "main_cores",
    "candidates",
    "notes",
    "user_setting",
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
        # An IterableDataset's workers were chosen after the check that it shards.
        "sharding_checked": True,
        # A search the budget cut short answers no call with a larger one (_budget_misfit).
        "budget_s": report.budget_s,
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
            report,
            notes=(
                *report.notes,
                f"the choice could not be cached: {e}; point XDG_CACHE_HOME at a writable "
                "directory, or pass cache=False",
            ),
        )
    return report


def _user_setting(data: Any) -> UserSetting | None:
    return None if data is None else _typed(UserSetting(**data))


_KINDS: dict[str, tuple[type, ...]] = {
    "int": (int, float),  # figures: a float passes too (the settings are checked apart)
    "float": (int, float),
    "bool": (bool,),
    "str": (str,),
    "Status": (str,),
    "FaultKind": (str,),
    "dict[str, Any]": (dict,),
}


def _typed(record: Any) -> Any:
    """``record`` (a :class:`CandidateResult` or :class:`UserSetting` read back), when each
    field has its declared type; a figure of another type (a hand-edited ``"fast"``) would
    reach the report's table and raise there, in the caller's ``print(report)``.

    Raises:
        TypeError: a field of another type than declared.

    Example:
        >>> _typed(CandidateResult(0, None, False, "ok", samples_per_s="fast"))
        Traceback (most recent call last):
        ...
        TypeError: samples_per_s='fast' is not float | None
    """
    for field in dataclasses.fields(record):
        value, declared = getattr(record, field.name), str(field.type)
        parts = declared.split(" | ")
        if value is None and "None" in parts:
            continue
        kinds = tuple(k for part in parts if part != "None" for k in _KINDS.get(part, (object,)))
        wrong_bool = isinstance(value, bool) and bool not in kinds
        if wrong_bool or not isinstance(value, kinds):
            raise TypeError(f"{field.name}={value!r} is not {declared}")
        if isinstance(value, float) and not _finite(value):
            raise TypeError(f"{field.name}={value!r} is not a finite number")
    return record


def _finite(value: object) -> TypeGuard[float]:
    """Whether ``value`` is a number (not a bool) other than JSON's Infinity and NaN, which
    would leave the report's ``to_dict()`` no longer JSON.

    Example:
        >>> _finite(1.5), _finite(float("inf")), _finite(True), _finite("1.5")
        (True, False, False, False)
    """
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _figure(value: Any) -> float | None:
    """A report figure read back: None or a finite number (not a bool)."""
    if value is None or _finite(value):
        return value
    raise TypeError(f"{value!r} is not a finite number")


def _parsed(entry: Mapping[str, Any], cpus: int) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The tuned settings and the report fields an entry holds; None when it is malformed
    (a field missing, or a figure of another type than the report's: :func:`_typed`).

    The main process's share is the entry's (measured with ``step_fn``); an entry without
    one kept the default core.
    """
    try:
        best = dict(entry["best"])
        int(best["num_workers"])
        cores = entry.get("main_cores", main_process_cores(cpus))
        if not _finite(cores):
            return None
        main_cores = float(cores)
        fields = {
            "samples_per_s": _figure(entry.get("samples_per_s")),
            "baseline_samples_per_s": _figure(entry.get("baseline_samples_per_s")),
            "step_samples_per_s": _figure(entry.get("step_samples_per_s")),
            "candidates": tuple(_typed(CandidateResult(**c)) for c in entry["candidates"]),
            "notes": [str(n) for n in entry.get("notes", [])],
            "main_cores": main_cores,
            "worker_cpus": int(entry.get("worker_cpus", cores_for_workers(cpus, main_cores))),
            "user_setting": _user_setting(entry.get("user_setting")),
        }
    except (KeyError, TypeError, ValueError, OverflowError):  # OverflowError: int(Infinity)
        return None
    return best, fields


def _report(
    best: Mapping[str, Any],
    fields: dict[str, Any],
    loader_kwargs: Mapping[str, Any],
    common: Mapping[str, Any],
    elapsed_s: float,
    **extra: Any,
) -> TuningReport:
    return TuningReport(
        best_kwargs=final_kwargs(loader_kwargs, common["batch_size"], best, []),
        elapsed_s=elapsed_s,
        **{**fields, "notes": tuple(fields["notes"])},
        **extra,
        **common,
    )


def entry_key(
    dataset: Any,
    batch_size: int,
    *,
    cpus: int,
    device_type: str,
    max_workers: int,
    epochs_hint: int | None,
    step_fn: Callable[[Any], Any] | None,
    loader_kwargs: Mapping[str, Any],
) -> str:
    """The key of a call's entry: a hash of :func:`trainperf.loader._cache.key_fields`.

    Raises:
        RuntimeError: reading the first sample fails.
    """
    fields = _cache.key_fields(
        dataset,
        batch_size,
        cpus=cpus,
        device_type=device_type,
        max_workers=max_workers,
        epochs_hint=epochs_hint,
        step_fn=step_fn,
        loader_kwargs=loader_kwargs,
    )
    return _cache.make_key(fields)


def cached_report(
    key: str,
    limits: HostLimits,
    loader_kwargs: Mapping[str, Any],
    common: Mapping[str, Any],
    *,
    iterable: bool = False,
) -> tuple[TuningReport | None, str | None]:
    """The report of the entry stored under ``key`` and None; or None and, when there was
    an entry that is malformed or no longer fits (:func:`cache_misfit`; ``iterable``: the
    dataset is an ``IterableDataset``), the note for the report of the tuning that replaces
    it."""
    entry = _cache.read_entry(key)
    if entry is None:
        return None, None
    why = cache_misfit(entry, limits, common, iterable=iterable)
    if why is not None:
        return None, f"the cached settings were not used ({why}): tuned again"
    return report_from_cache(entry, limits, loader_kwargs, common), None


def _is_int(value: object, minimum: int) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _settings_misfit(best: Any, max_workers: int) -> str | None:
    """Why the tuned settings ``best`` are not ones this call could have chosen, or None."""
    if not isinstance(best, Mapping):
        return f"best={best!r} is not a mapping of settings"
    n, pf = best.get("num_workers"), best.get("prefetch_factor")
    if not _is_int(n, 0):
        return f"num_workers={n!r} is not an int >= 0"
    if n > max_workers:
        return (
            f"num_workers={n} is above max_workers={max_workers}, the most this call tries "
            f"(the caller's max_workers, or the default from the usable CPUs)"
        )
    if pf is not None and not _is_int(pf, 1):
        return f"prefetch_factor={pf!r} is not None or an int >= 1"
    for name in ("pin_memory", "persistent_workers"):
        if not isinstance(best.get(name), bool):
            return f"{name}={best.get(name)!r} is not a bool"
    return None


def _limits_misfit(entry: Mapping[str, Any], limits: HostLimits) -> str | None:
    """Why the memory and ``/dev/shm`` the entry's choice needs are not free now, or None."""
    need, shm = entry.get("memory_needed"), entry.get("shm_needed")
    if not _is_int(need, 0):
        return f"memory_needed={need!r} is not an int >= 0"
    if not _is_int(shm, 0):
        return f"shm_needed={shm!r} is not an int >= 0"
    room = limits.memory_available - safety_margin(limits.memory_available)
    if need > room:
        return (
            f"they need {format_bytes(need)} of memory, {format_bytes(max(room, 0))} is "
            f"available now after the safety margin"
        )
    if limits.shm_free is not None and shm > 0.9 * limits.shm_free:
        return (
            f"they need {format_bytes(shm)} of /dev/shm, {format_bytes(limits.shm_free)} is "
            f"free now (90 % of it is used at most)"
        )
    return None


def _cut_short(candidates: Any) -> bool:
    """Whether the budget ran out before the search of these stored candidates ended: one
    was skipped or stopped for want of time, or a pool's hang timeout was cut to what was
    left (:func:`~trainperf.loader._faults.budget_cut`)."""
    return any(
        isinstance(c, Mapping)
        and (c.get("fault") == "budget" or budget_cut(c.get("fault"), c.get("reason")))
        for c in candidates
    )


def _budget_misfit(entry: Mapping[str, Any], budget_s: float) -> str | None:
    """Why an entry from a search its budget cut short does not answer a call with a larger
    ``budget_s`` (which would measure what that search never reached), or None."""
    if not _cut_short(entry.get("candidates", ())):
        return None
    stored = entry.get("budget_s")
    if not _finite(stored):
        return "the budget ran out before the search ended, and the entry does not say what it was"
    if budget_s <= stored:
        return None
    return (
        f"its budget_s={stored:g} ran out before the search ended, and this call's "
        f"budget_s={budget_s:g} is larger"
    )


def cache_misfit(
    entry: Mapping[str, Any],
    limits: HostLimits,
    common: Mapping[str, Any],
    *,
    iterable: bool = False,
) -> str | None:
    """Why a cache entry cannot be used on this host for this call, or None when it can.

    A hit is checked as strictly as a choice the tuner makes: the settings' types and ranges
    (``num_workers`` an int >= 0, ``prefetch_factor`` None or an int >= 1, ``pin_memory`` and
    ``persistent_workers`` bools), ``num_workers`` at most this call's ``max_workers``, and
    the memory and ``/dev/shm`` the choice needs within what is free now. An entry from a
    search its budget cut short answers only calls whose ``budget_s`` is not larger (one
    that ran to its end answers any). For an
    ``IterableDataset``, workers stored before the tuner checked that it shards its stream
    (:mod:`trainperf.loader._iterable`) are not trusted either.

    Args:
        entry: what :func:`cache_entry` stored, or a hand-edited version of it.
        limits: this host's limits now.
        common: the report fields known before measuring (``cpus``, ``max_workers``,
            ``budget_s``, ...).
        iterable: the dataset is an ``IterableDataset``.

    Example:
        >>> from trainperf.limits import HostLimits
        >>> limits = HostLimits(4, 4, None, 4, 2**33, None, 2**32, None, None)
        >>> best = {"num_workers": 100000, "prefetch_factor": 2, "pin_memory": False,
        ...         "persistent_workers": False}
        >>> cache_misfit({"best": best}, limits, {"max_workers": 16, "cpus": 4})[:42]
        'num_workers=100000 is above max_workers=16'
    """
    why = _settings_misfit(entry.get("best"), int(common["max_workers"]))
    unchecked = iterable and not entry.get("sharding_checked")
    if why is None and unchecked and entry["best"]["num_workers"] > 0:
        why = (
            "stored before tune_loader checked that an IterableDataset shards its stream "
            "across workers"
        )
    if why is None:
        why = _limits_misfit(entry, limits)
    if why is None and _parsed(entry, common["cpus"]) is None:
        why = "the entry is malformed: its figures or candidates do not parse"
    if why is None and "budget_s" in common:
        why = _budget_misfit(entry, float(common["budget_s"]))
    return why


def report_from_cache(
    entry: Mapping[str, Any],
    limits: HostLimits,
    loader_kwargs: Mapping[str, Any],
    common: Mapping[str, Any],
) -> TuningReport | None:
    """A report built from a cache entry, or None when it is malformed or no longer fits
    (:func:`cache_misfit` says why). Its ``elapsed_s`` is 0: the caller sets the call's
    time once it has checked the hit (:func:`~trainperf.loader._tune_stale._changed_since`
    loads batches).

    Args:
        entry: what :func:`cache_entry` stored (older entries may lack the shares).
        limits: this host's limits now.
        loader_kwargs: the caller's DataLoader arguments.
        common: the report fields known before measuring (``cpus``, ``batch_size``, ...).
    """
    parsed = _parsed(entry, common["cpus"])
    if parsed is None or cache_misfit(entry, limits, common) is not None:
        return None
    best, fields = parsed
    fields["notes"].append(f"settings from the cache ({_cache.cache_file()}); cache=False re-tunes")
    return _report(best, fields, loader_kwargs, common, 0.0, from_cache=True)


def share_entry(report: TuningReport) -> dict[str, Any]:
    """What local rank 0 sends the other local ranks: the tuned settings of ``report``
    (their own arguments complete them) and its figures, as a cache entry holds them.

    Example:
        >>> from trainperf.limits import HostLimits
        >>> zero = CandidateResult(0, None, False, "ok", samples_per_s=100.0)
        >>> report = TuningReport(
        ...     {"num_workers": 0, "pin_memory": False, "persistent_workers": False}, 100.0,
        ...     100.0, None, (zero,), 1.0, 5.0,
        ...     HostLimits(4, 4, None, 4, 2**33, None, 2**32, None, None), 4, 3, 8, "cpu", 32)
        >>> share_entry(report)["best"]  # doctest: +NORMALIZE_WHITESPACE
        {'num_workers': 0, 'prefetch_factor': None, 'pin_memory': False,
         'persistent_workers': False}
    """
    data = report.to_dict()
    kw = report.best_kwargs
    best = {
        "num_workers": report.num_workers,
        "prefetch_factor": kw.get("prefetch_factor"),
        "pin_memory": bool(kw.get("pin_memory", False)),
        "persistent_workers": bool(kw.get("persistent_workers", False)),
    }
    return {"best": best, **{k: data[k] for k in REPORT_KEYS}, "from_cache": report.from_cache}


def report_from_share(
    entry: Mapping[str, Any],
    loader_kwargs: Mapping[str, Any],
    common: Mapping[str, Any],
    started: float,
    sender: int,
) -> TuningReport | None:
    """This rank's report from what local rank 0 (global rank ``sender``) sent, with this
    rank's own arguments; None when the entry is malformed. Nothing is re-checked against
    the limits: local rank 0 checked them on this same host."""
    parsed = _parsed(entry, common["cpus"])
    if parsed is None:
        return None
    best, fields = parsed
    fields["notes"].append(
        f"tuned on local rank 0 (rank {sender}) of this host and shared with this rank"
    )
    from_cache = bool(entry.get("from_cache", False))
    elapsed_s = time.perf_counter() - started
    return _report(
        best, fields, loader_kwargs, common, elapsed_s, from_cache=from_cache, shared_from=sender
    )
