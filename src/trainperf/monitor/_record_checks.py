"""The checks :func:`trainperf.monitor.analyse` makes of a timeline and its samples before
judging them (``_analysis``): each figure a Python number, finite, non-negative where it
must be, counts ints, totals and rates within float range; a record that fails is named
with the fix.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from trainperf._utils.validate import as_real_number, int_like
from trainperf.monitor._records import Sample, StepRecord

__all__ = ["check_rates", "check_records"]


_STEP_TOTALS = ("samples", "gpu_busy", "wait_cpu", "cpu_delay")  # summed or averaged
_STEP_FIGURES = ("start", "wait", "compute", *_STEP_TOTALS)
_SAMPLE_MEANS = ("gpu_utilization", "process_cpu", "host_cpu", "workers_cpu", "host_steal")
_SAMPLE_FIGURES = ("time", *_SAMPLE_MEANS, "gpu_memory_used")
_COUNTS = ("samples", "gpu_memory_used")  # samples and bytes: ints


def _fits(value: float) -> bool:
    """Whether ``value`` is finite as a float (an int past float range is not)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _total_fits(values: Sequence[float]) -> bool:
    """Whether ``values`` (each finite, >= 0) add up within float range, as the means need."""
    try:
        return math.isfinite(math.fsum(values))
    except OverflowError:
        return False


def check_records(timeline: Sequence[StepRecord], samples: Sequence[Sample]) -> None:
    """Refuse figures that are no measurements: one that is no Python number, a NaN or
    infinite figure (it would make a verdict of NaN, and a ``to_dict()`` strict JSON
    refuses), a negative one other than a clock reading, or figures whose total is past
    float range (an infinite wall time)."""
    for i, step in enumerate(timeline):
        _check_figures(step, _STEP_FIGURES, f"timeline[{i}] (step {step.index})")
    durations = [x for step in timeline for x in (step.wait, step.compute)]
    if not _total_fits(durations):
        i = max(range(len(timeline)), key=lambda k: timeline[k].wait + timeline[k].compute)
        step = timeline[i]
        raise ValueError(
            "analyse() needs step times whose total fits a float, but the steps' wait + "
            f"compute add up past float range (the longest: timeline[{i}] (step {step.index}) "
            f"has wait={step.wait!r}, compute={step.compute!r}); drop or repair that step"
        )
    for name in _STEP_TOTALS:
        _check_total(name, timeline)
    for i, sample in enumerate(samples):
        _check_figures(sample, _SAMPLE_FIGURES, f"samples[{i}]")
    for name in _SAMPLE_MEANS:
        _check_total(name, samples)


def _check_figures(record: StepRecord | Sample, names: Sequence[str], where: str) -> None:
    """Refuse a figure of ``record`` (at ``where``) that no watch records: one that is no
    Python number (a NumPy scalar or a tensor ``to_dict()`` hands on to ``json.dumps``,
    which refuses it; a bool), a count that is no int, or one that is NaN, infinite, or
    negative (but a clock reading: a step's ``start``, a sample's ``time``)."""
    what, clock = ("step", "start") if isinstance(record, StepRecord) else ("sample", "time")
    for name in names:
        value = getattr(record, name)
        if value is None:
            continue
        count, signed = name in _COUNTS, name == clock
        if isinstance(value, bool) or not isinstance(value, int if count else (int, float)):
            raise ValueError(
                f"analyse() needs {what} figures that are Python numbers ({name} "
                f"{'an int' if count else 'an int or a float'}), but {where} has "
                f"{name}={value!r}; {_repair(name, value, what, count=count, signed=signed)}"
            )
        if (value < 0 and not signed) or not _fits(value):
            raise ValueError(
                f"analyse() needs finite {what} figures, each but {clock} >= 0, but {where} "
                f"has {name}={value!r}; drop or repair that {what}"
            )


def _repair(name: str, value: object, what: str, *, count: bool, signed: bool) -> str:
    """The fix for a figure of the wrong type: ``int(...)`` for a count where that makes it
    right, by the rule ``w.step(samples=...)`` hints by (a whole float, a NumPy integer, a
    one-element tensor; never a bool), or ``float(...)`` for a NumPy scalar in range; else
    to repair the record."""
    if count:  # counts are never signed
        return f"make it int({name})" if int_like(value, 0) else f"drop or repair that {what}"
    number = as_real_number(value)
    if number is None or not _fits(number) or (number < 0 and not signed):
        return f"drop or repair that {what}"
    return f"make it float({name})"


def _check_total(name: str, records: Sequence[StepRecord] | Sequence[Sample]) -> None:
    """Refuse a figure whose total (where known) is past float range: the means need it."""
    known = [(getattr(r, name), i) for i, r in enumerate(records) if getattr(r, name) is not None]
    if _total_fits([v for v, _ in known]):
        return
    value, i = max(known, key=lambda known_value: known_value[0])  # the first largest
    record = records[i]
    where = (
        f"timeline[{i}] (step {record.index})"
        if isinstance(record, StepRecord)
        else f"samples[{i}]"
    )
    what = "step" if isinstance(record, StepRecord) else "sample"
    raise ValueError(
        f"analyse() needs figures whose total fits a float, but the {what}s' {name} add up "
        f"past float range (the largest: {where} has {name}={value!r}); drop or repair "
        f"that {what}"
    )


def check_rates(steps: Sequence[StepRecord]) -> None:
    """Refuse steps so short that their steps/s or samples/s is past float range (no
    clock measures 5e-324 s)."""
    wall = sum(s.duration for s in steps)
    if wall <= 0:
        return  # no time to judge: the inconclusive verdict says so
    counts = [s.samples for s in steps]
    rates = [(len(steps) / wall, "steps")]
    if None not in counts:
        rates.append((math.fsum(n for n in counts if n is not None) / wall, "samples"))
    for rate, unit in rates:
        if not math.isfinite(rate):
            raise ValueError(
                f"analyse() needs step times a clock can measure, but steps "
                f"{steps[0].index} to {steps[-1].index} took {wall!r} s in all, which makes "
                f"{rate!r} {unit}/s (past float range); drop or repair those steps"
            )
