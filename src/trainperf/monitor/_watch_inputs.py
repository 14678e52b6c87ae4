"""What :meth:`Watch.report` passes :func:`analyse` besides the timeline and the
samples: the loader's settings and an adaptive loader's changes, what a worker hand-over
would cost, and the setup the predictions' probes measure; and what it adds to the report
afterwards (:func:`shared_cpu_noted`, :func:`wait_elsewhere_noted`).
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import TYPE_CHECKING, Any

from trainperf.monitor._cpu_bf16 import with_cpu_bf16
from trainperf.monitor._crowding import with_crowding
from trainperf.monitor._figures import SAWTOOTH_WAIT, Figures
from trainperf.monitor._handover import measure_handover
from trainperf.monitor._probe import background_saves, loader_facts
from trainperf.monitor._records import LoaderChange, Sample, StepRecord
from trainperf.monitor._rules import MIN_STEPS, UNMEASURED
from trainperf.monitor._save_cost import with_save_cost
from trainperf.monitor._setup import LoopSetup
from trainperf.monitor._verdict import Verdict
from trainperf.monitor._watch_iter import feeding_source

if TYPE_CHECKING:
    from trainperf.monitor._report import WatchReport
    from trainperf.monitor._watch import Watch

__all__ = [
    "loader_changes", "loader_now", "measured", "probed", "shared_cpu_noted",
    "wait_elsewhere_noted",
]  # fmt: skip

SHARED_CPU_REASON = (
    "another trainperf.watch() ran in this process meanwhile: the process CPU figures "
    "cover both loops, so the CPUs may be busy with the other loop's work, not this one's"
)


def shared_cpu_noted(report: WatchReport) -> WatchReport:
    """``report`` with its host-bound verdict and findings (judged on the process's CPU)
    saying that another watch's loop ran in this process meanwhile, and used that CPU."""

    def noted(v: Verdict) -> Verdict:
        if v.kind != "host-bound":
            return v
        return dataclasses.replace(v, reasons=(*v.reasons, SHARED_CPU_REASON))

    return dataclasses.replace(
        report, verdict=noted(report.verdict), findings=tuple(map(noted, report.findings))
    )


def wait_elsewhere_noted(report: WatchReport, fetcher: str, stepper: str) -> WatchReport:
    """``report`` with its verdict saying why the data wait was not measured although the
    loop used ``w.iter()``: thread ``fetcher`` iterated it while ``stepper`` stepped. A
    verdict whose reasons already say why (compute-bound, held CPUs: they name the prefetch
    thread from ``LoopSetup.prefetch_thread``) is left as it is: one explanation, not two."""
    v = report.verdict
    if any(r.startswith(UNMEASURED) for r in v.reasons):
        return report
    why = (
        f"w.iter() ran in thread {fetcher!r}, not in {stepper!r} that steps the watch (a "
        f"prefetch thread): its wait for each batch overlapped the steps, so the loop's own "
        f"wait was not measured; wrap what {stepper!r} iterates: for batch in w.iter(prefetcher)"
    )
    return dataclasses.replace(report, verdict=dataclasses.replace(v, reasons=(*v.reasons, why)))


def loader_changes(w: Watch) -> tuple[LoaderChange, ...]:
    """The adaptive loader's changes, placed on the watch's clock."""
    return tuple(
        LoaderChange(
            step=step,
            time=max(0.0, float(c.time) - w._wall0),
            old=(int(c.old[0]), c.old[1]),
            new=(int(c.new[0]), c.new[1]),
            reason=str(c.reason),
            why=str(c.why),
        )
        for step, c in w._retunes
    )


def measured(w: Watch, timeline: list[StepRecord], samples: list[Sample]) -> dict[str, Any]:
    """What the watch measures for the predictions beyond the timeline: batches per
    step, the steps of an epoch (a pass over the loader that fed the loop), the background
    checkpoint writes the loop started, the prefetch thread that took the batches (the
    reason the data wait went unmeasured), and (once) what a worker hand-over would cost a
    loop that loads in its own thread while it waits for data. The probe runs a worker for
    about a second, so only once the watch has stopped: a report made inside the loop would
    put that second into the loop's step (it uses a measurement made before, if any)."""
    steps = w._first + len(w._ends)
    out: dict[str, Any] = {"batches_per_step": w._items / steps if steps else None}
    after = w._saves_after if w._saves_after is not None else background_saves()
    out["background_saves"] = after - w._saves_before
    out["prefetch_thread"] = None if w._wait_elsewhere is None else w._wait_elsewhere[0]
    kept = timeline[max(0, w._warmup - w._first) :]
    total = sum(s.duration for s in kept)
    waits = total > 0 and sum(s.wait for s in kept) >= SAWTOOTH_WAIT * total
    source = feeding_source(w)
    out["steps_per_epoch"] = (source.epoch_steps or None) if source is not None else None
    layout, layout_batch = (None, None) if source is None else (source.layout, source.layout_batch)
    if waits and _loads_in_thread(w, samples) and layout and layout_batch:
        probe = w._state != "running"
        # The loop's own time between two batches: the probe pauses that long before
        # each receive (a receive after a step costs more than one in a tight loop).
        own = statistics.median(s.duration - s.wait for s in kept)
        pause = max(0.0, own) / max(1.0, out["batches_per_step"] or 1.0)
        handover = measure_handover(layout, layout_batch, pause_s=pause, probe=probe)
        if handover is not None:
            out["handover_receive_s"] = handover.receive_s
            out["handover_produce_s"] = handover.produce_s
    return out


def loader_now(w: Watch) -> dict[str, Any]:
    """The settings of the loader that fed the loop's steps (:func:`feeding_source`: not a
    validation loader ``w.iter()`` was given last), as they are now (an adaptive loader's
    change them while it runs), or as they were at its last ``w.iter()`` if it is gone."""
    source = feeding_source(w)
    if source is None:
        return {}
    loader = source.ref()
    return source.facts if loader is None else loader_facts(loader)


def _loads_in_thread(w: Watch, samples: list[Sample]) -> bool:
    """The loop loads in its own thread: a DataLoader with ``num_workers=0``, or an
    iterable of another kind while this process's children used under a tenth of a
    core (more would be workers behind it: a prefetcher around a DataLoader, say)."""
    facts = loader_now(w)
    if "num_workers" in facts:
        return not facts["num_workers"]
    workers = [x.workers_cpu for x in samples if x.workers_cpu is not None]
    return not workers or sum(workers) / len(workers) < 10.0


def probed(f: Figures, *, probe: bool) -> LoopSetup | None:
    """The judged figures' setup with what the predictions' probes measured (the crowding
    of torch's threads, bf16 on a CPU, a non-blocking save's), or None where none applies.
    ``probe=False`` (a report made inside the loop) only uses earlier measurements: a
    probe's second would land in the loop's step. Too few steps for a verdict: no probe
    (there is nothing to predict)."""
    if f.measured_steps < MIN_STEPS:
        return None
    setup = None
    for measure in (with_crowding, with_cpu_bf16, with_save_cost):
        found = measure(f, probe=probe)
        if found is not None:
            setup = found
            f = dataclasses.replace(f, setup=found)
    return setup
