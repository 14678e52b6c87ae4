"""How :meth:`Watch.report` makes its report: the step log read under the watch's lock
(the CUDA spans resolved, the CPU figures settled where the loop's thread asks), the
background samples, and :func:`analyse` of them with what ``_watch_inputs`` gathers.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from typing import TYPE_CHECKING

from trainperf.monitor._analysis import analyse
from trainperf.monitor._probe import loop_setup
from trainperf.monitor._probe import precision_in_use as _precision_in_use
from trainperf.monitor._report import WatchReport
from trainperf.monitor._watch_inputs import (
    loader_changes,
    loader_now,
    measured,
    probed,
    shared_cpu_noted,
    wait_elsewhere_noted,
)
from trainperf.monitor._watch_steps import resolve, settle, step_records, wait_for_logged

if TYPE_CHECKING:
    from trainperf.monitor._watch import Watch

__all__ = ["build_report"]


def build_report(w: Watch) -> WatchReport:
    """The report on the steps ``w`` logged so far (see :meth:`Watch.report`)."""
    running_here = threading.current_thread() is w._loop_thread
    elsewhere = w._state == "running" and not running_here
    # Outside the lock: the loop steps on meanwhile; the report ends where the wait began.
    limit = wait_for_logged(w) if w._cuda and elsewhere else None
    with w._lock:  # another thread reads the log between two steps
        # Re-entered by a signal handler while this thread appends a step: the steps
        # before it are whole; the rest is left for the next report.
        whole = not w._writing
        if w._cuda and whole:
            resolve(w, block=not elsewhere)
        if w._state == "running" and running_here and whole:
            settle(w)  # schedstat is read in the loop's own thread only
        first, timeline = step_records(w)
    if limit is not None:
        timeline = [s for s in timeline if s.index < limit]
    sampler = w._sampler
    samples, dropped_samples = sampler.snapshot() if sampler else ([], 0)
    cuda_index = sampler.device_index if w._cuda and sampler else None
    report = analyse(
        timeline,
        samples,
        device=_device_name(w),
        gpu_present=bool(sampler and sampler.gpu_present),
        cuda_used=w._cuda,
        cpus=w._cpus,
        warmup_steps=w._warmup,
        dropped_steps=first,
        dropped_samples=dropped_samples,
        wait_measured=w._iterated and w._wait_elsewhere is None,
        precision=_precision_in_use(),
        setup=loop_setup(loader_now(w), cuda_index, **measured(w, timeline, samples)),
        measure=functools.partial(probed, probe=w._state != "running"),
    )
    report = dataclasses.replace(report, loader_changes=loader_changes(w))
    if w._wait_elsewhere is not None:
        report = wait_elsewhere_noted(report, *w._wait_elsewhere)
    return shared_cpu_noted(report) if sampler is not None and sampler.shared else report


def _device_name(w: Watch) -> str:
    """The device ``w`` was given, else the GPU the loop was seen to use, else "auto"."""
    if w._device is not None:
        return str(w._device)
    sampler = w._sampler
    if sampler and sampler.device_index is not None:
        return f"cuda:{sampler.device_index}"
    return "auto"
