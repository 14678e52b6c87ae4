"""The per-step log of a :class:`Watch`: each ``w.step()`` appended to compact arrays,
the CPU figures settled from the loop thread's ``schedstat``, the oldest steps trimmed past
``max_records``, the CUDA events' spans read back, and the kept steps as
:class:`StepRecord` s for the report.

The arrays live on the watch (``Watch.__init__`` makes them); these functions are the
only ones that write them after that.
"""

from __future__ import annotations

import math
import threading
import time
from typing import TYPE_CHECKING

import torch

from trainperf.monitor._records import StepRecord
from trainperf.monitor._watch_iter import wait_elsewhere

if TYPE_CHECKING:
    from trainperf.monitor._watch import Watch

__all__ = [
    "claim_steps", "cpu_reading", "record_step", "resolve", "settle", "step_records",
    "wait_for_logged",
]  # fmt: skip

_RESOLVE_EVERY = 32  # steps between non-blocking reads of finished CUDA events
_SETTLE_EVERY = 16  # steps between reads of the loop thread's schedstat (see settle)


def record_step(w: Watch, now: float, samples: int | None) -> None:
    """Append the step that ended at ``now`` (``time.perf_counter()``), with ``samples``
    samples if given, else those ``w.iter`` counted (see :meth:`Watch.step`): unknown
    (None in the report) without ``w.iter``. Under the watch's (re-entrant) lock, so that a
    report from another thread reads the log between two steps; a signal handler's report
    in this thread sees ``_writing`` and reads only the whole steps (:func:`step_records`).

    Raises:
        RuntimeError: another thread, still alive, stepped this watch first (see
            :func:`claim_steps`).
    """
    if threading.current_thread() is not w._loop_thread or w._stepper is None:
        claim_steps(w)
    with w._lock:
        w._writing = True
        try:
            _append(w, now, samples)
        finally:
            w._writing = False


def claim_steps(w: Watch) -> None:
    """Make the calling thread the one that steps ``w``: the first to call ``w.step()``,
    or one taking over from a stepping thread that has ended (a thread per epoch).

    One watch times one loop: steps from two threads would merge into one timeline of
    interleaved steps, each the time since the other thread's last one.

    The first to claim also judges the thread that took ``w.iter()``'s batches before it
    (see :func:`wait_elsewhere`).

    Raises:
        RuntimeError: another thread, still alive, stepped this watch first.
    """
    me = threading.current_thread()
    with w._lock:  # two threads' first steps at once: one of them claims the watch
        owner = w._stepper
        if owner is not None and owner is not me and owner.is_alive():
            raise RuntimeError(
                f"w.step() from thread {me.name!r}, but thread {owner.name!r} steps this "
                "watch: a watch times one loop, and steps from two threads would interleave "
                "into one wrong timeline; call w.step() from the training loop's thread "
                "only, or give each thread its own trainperf.watch()"
            )
        w._stepper = me
        w._loop_thread = me
        fetcher, w._fetcher = w._fetcher, None
    if owner is None and fetcher is not None and fetcher is not me:
        # Batches w.iter() timed before this first step were taken in another thread.
        wait_elsewhere(w, fetcher, me)


def _append(w: Watch, now: float, samples: int | None) -> None:
    w._ends.append(now - w._t0)
    w._waits.append(w._pending_wait)
    w._wait_cpus.append(w._pending_wait_cpu)
    w._delays.append(math.nan)
    if samples is not None:
        w._counts.append(samples)
    else:
        w._counts.append(w._pending_count if w._count_known and w._iterated else -1)
    w._unsettled += 1
    if w._unsettled >= _SETTLE_EVERY:
        began = time.perf_counter()
        settle(w)
        exclude_from_next(w, time.perf_counter() - began)
    w._pending_wait = 0.0
    w._pending_wait_cpu = 0.0
    w._pending_count = 0
    w._count_known = True
    if len(w._ends) >= 2 * w._max:
        _trim(w)
    if not w._cuda:
        w._maybe_start_cuda()
        if not w._cuda:
            return
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end.record(w._stream)
    w._pending.append((w._first + len(w._ends) - 1, w._step_start, end))
    w._step_start = None
    if len(w._ends) % _RESOLVE_EVERY == 0:
        began = time.perf_counter()
        resolve(w, block=False)
        exclude_from_next(w, time.perf_counter() - began)


def exclude_from_next(w: Watch, spent: float) -> None:
    """Leave ``spent`` seconds of the watch's own bookkeeping out of the step under way (it
    runs after the step's end was read): done every N steps, it would look like the loop's
    own periodic stall, and in a loop of very short steps make one."""
    index = w._first + len(w._ends)
    w._excluded[index] = w._excluded.get(index, 0.0) + spent


def cpu_reading(w: Watch) -> tuple[float, float, int]:
    demand, delay = w._clock.read()
    return demand - delay, delay, w._clock.generation


def settle(w: Watch) -> None:
    """Give the steps since the last schedstat reading their CPU figures.

    One reading every ``_SETTLE_EVERY`` steps (a ``pread`` costs a few microseconds;
    ``time.thread_time()`` around each batch costs less): the time the loop's thread
    waited for a CPU in between is spread evenly over those steps, and the CPU time
    each spent waiting for data is scaled by the interval's wait-for-a-CPU per second
    run, into what it demanded (running, plus waiting for a CPU). A reading made after the
    last step (at the watch's end, or a report's) gives those steps only their share of the
    interval's delay, by time: the rest is the next step's (a report made mid-step), or the
    work after the loop's (at the watch's end). Without schedstat, or read from another
    thread, the delays stay unknown and the wait CPU is CPU time.
    """
    pending, w._unsettled = w._unsettled, 0
    if pending <= 0:
        return
    run, delay, generation = reading = cpu_reading(w)
    run0, delay0, generation0 = w._last_reading
    w._last_reading = reading
    # Read while a step is appended, the reading is at that step's end; read later (at the
    # watch's end, or by a report), the interval also holds the time since the last step:
    # the steps get their share of the interval's delay only, and the next interval starts
    # from the reading as it stood, by time, at the last step's end. The rest is then the
    # next step's (a report made mid-step), or no step's (the work after the loop).
    now = w._ends[-1] if w._writing else time.perf_counter() - w._t0
    since, w._reading_at = w._reading_at, now
    if generation == generation0 and not math.isnan(delay + delay0):
        share = min(1.0, (w._ends[-1] - since) / (now - since)) if now > since else 1.0
        share = max(0.0, share)
        w._last_reading = (
            run0 + share * (run - run0),
            delay0 + share * (delay - delay0),
            generation,
        )
        w._reading_at = max(since, min(now, w._ends[-1]))
        per_step = max(0.0, delay - delay0) * share / pending
        queued = max(0.0, delay - delay0) / (run - run0) if run > run0 else 0.0
        # The interval's steps still held (a trim may have dropped its first ones).
        for i in range(max(0, len(w._ends) - pending), len(w._ends)):
            w._delays[i] = per_step
            w._wait_cpus[i] *= 1 + queued


def _trim(w: Watch) -> None:
    w._trimming = True  # the arrays lose their fronts one by one: no report reads them now
    try:
        _cut(w)
    finally:
        w._trimming = False


def _cut(w: Watch) -> None:
    cut = len(w._ends) - w._max
    w._dropped_end = w._ends[cut - 1]
    del w._ends[:cut], w._waits[:cut], w._counts[:cut]
    del w._wait_cpus[:cut], w._delays[:cut]
    w._first += cut
    busy = w._gpu_busy
    while busy and (oldest := next(iter(busy))) < w._first:  # keys come in step order
        del busy[oldest]
    for index in [i for i in w._excluded if i < w._first]:
        del w._excluded[index]


def wait_for_logged(w: Watch) -> int:
    """Wait until the GPU has run the steps logged so far, without holding the watch's lock:
    a report from another thread lets the loop go on stepping meanwhile (its next
    ``w.step()`` would otherwise wait for the whole GPU queue). Returns the number of the
    first step logged after the wait began: the report covers the steps before it, whose
    GPU time is known (a later one's may not be, which would void the GPU figures)."""
    with w._lock:
        newest = w._pending[-1][2] if w._pending else None
        logged = w._first + len(w._ends)
    if newest is not None:
        newest.synchronize()
    return logged


def resolve(w: Watch, *, block: bool) -> None:
    if block and w._pending:
        w._pending[-1][2].synchronize()
    while w._pending and w._pending[0][2].query():
        index, start, end = w._pending.popleft()
        if start is not None:
            w._gpu_busy[index] = start.elapsed_time(end) / 1e3


def step_records(w: Watch) -> tuple[int, list[StepRecord]]:
    """The number of the first step kept, and the kept steps as :class:`StepRecord` s (none
    while a trim is half done: a signal handler's report that interrupted it)."""
    if w._trimming:
        return w._first, []
    extra = max(0, len(w._ends) - w._max)  # held beyond max_records: not reported
    first = w._first + extra
    previous = w._ends[extra - 1] if extra else w._dropped_end
    timeline = []
    # Up to the shortest array: a report from a signal handler may come between two of a
    # step's appends.
    n = min(len(w._ends), len(w._waits), len(w._counts), len(w._wait_cpus), len(w._delays))
    steps = zip(
        w._ends[extra:n], w._waits[extra:n], w._counts[extra:n],
        w._wait_cpus[extra:n], w._delays[extra:n], strict=True,
    )  # fmt: skip
    for i, (end, wait_s, count, wait_cpu, delay) in enumerate(steps, start=first):
        # An in-loop w.report() is the watch's own time, not the step's.
        duration = max(0.0, end - previous - w._excluded.get(i, 0.0))
        timeline.append(
            StepRecord(
                index=i,
                start=previous,
                wait=min(wait_s, duration),
                compute=max(0.0, duration - wait_s),
                samples=None if count < 0 else count,
                gpu_busy=w._gpu_busy.get(i),
                wait_cpu=wait_cpu,
                cpu_delay=None if math.isnan(delay) else max(0.0, delay),
            )
        )
        previous = end
    return first, timeline
