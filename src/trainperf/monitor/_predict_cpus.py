"""What the host's CPUs are predicted to gain: fewer torch threads, or the CPUs back.

Pure functions of the measured :class:`Figures` (see ``_predict``), on the mean step ``T``
(wall time over steps), its data wait ``w`` and the rest ``c = T - w``:

- **Fewer threads** (:func:`threads_fix`): with torch's threads cut to the cores the
  workers and other processes leave, the workers keep up and the step's own time shrinks
  by what the crowding probe measured (``_crowding``), ``s``:
  ``T / max(c / s + h, Lw / (n (1 - t)), (m + Lw) / (N - o))`` (``h``: the loop's own
  time getting its batches, which fewer threads do not shorten: receiving them from
  workers, or without workers the whole wait; ``Lw``: the workers' CPU per step, ``n``
  workers (unknown behind an iterable that is not a DataLoader: no such term), ``t`` the
  share of the time the hypervisor steals, ``m`` the loop's CPU with ``k`` threads,
  ``(1 - t) (k c / s + h')`` but no more than the loop's process uses now nor less than
  ``(1 - t) (c / s + h')``, ``h'`` the CPU of ``h``: ``h`` with workers, without them
  what the loop's thread demanded while it waited; ``N`` the usable CPUs' worth of time
  the hypervisor leaves, ``o`` the cores other processes keep busy: the CPUs must hold
  the step's threads and the workers); without the probe (a GPU step) ``s = 1``, a lower
  bound.
- **The host's CPUs back** (:func:`free_cpus_fix`): the step minus the time the loop's
  thread waited for a CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainperf._utils.format import plural
from trainperf.monitor._figures import (
    Figures,
    capacity,
    compute_s,
    main_cores,
    mean_step_s,
    others_cores,
    oversubscribed,
    threads_that_fit,
    wait_s,
    worker_cores,
)
from trainperf.monitor._predict import _cores, _ms, _speedup, hidden_workers
from trainperf.monitor._verdict import NOT_PREDICTED, Fix

__all__ = ["free_cpus_fix", "threads_fix"]

FREE_CPUS_CALL = "stop or move the other jobs (`trainperf doctor` shows the host's load)"


def threads_fix(f: Figures) -> Fix | None:
    """``torch.set_num_threads(k)``: the step's threads cut to the cores left to them.

    The workers get the cores the surplus threads took, so the data wait goes where they
    can keep up, but for the loop's own time getting its batches (:func:`kept_loading_s`,
    ``h``): the loop runs at ``max(c' + h, what each worker delivers on its core)``, and as
    far as the CPUs other processes leave hold the loop's thread and the workers' CPU
    together. The step's own time ``c`` becomes ``c' = c / s``, ``s`` what the crowding
    probe measured (``_crowding``: a parallel torch workload with ``k`` threads against the
    loop's count, beside processes as busy as the workers); without that figure (a GPU
    step, or not measured) ``c`` is kept, and the prediction is a lower bound.
    """
    threads = f.setup.torch_threads
    if not oversubscribed(f) or threads is None:
        return None
    k = threads_that_fit(f)
    step, work = mean_step_s(f), compute_s(f)
    probed = f.setup.fewer_threads_speedup if f.setup.fewer_threads == k else None
    fewer = work if probed is None else work / max(probed, 1.0)  # never slower than now
    bounds = _thread_bounds(f, k, fewer)
    after = min(step, max(bounds.loop, bounds.worker, bounds.cpus))
    lead = (
        f"torch runs {threads} threads on {f.cpus} usable CPUs, {_cores(k)} left once the "
        f"workers ({worker_cores(f):.1f} cores) and other processes ({others_cores(f):.1f}) "
        f"have theirs; with {k} {_wait_words(f, bounds)}"
    )
    if probed is None:
        step_s = (
            f"the step's own {_ms(work)} kept (fewer threads stop crowding it too, not predicted)"
        )
    else:
        gain = (
            f"runs {probed:.2f}x faster, as a parallel torch workload did"
            if probed > 1.0
            else f"is kept, as a parallel torch workload ran no faster ({probed:.2f}x)"
        )
        step_s = (
            f"the step's own {_ms(work)} {gain} with {plural(k, 'thread')} instead of "
            f"{threads} beside processes as busy as the workers ({_ms(fewer)})"
        )
    at_least = "at least: " if probed is None else ""
    basis = (
        f"{at_least}{lead}, {step_s}{_binding_words(bounds, step)}: "
        f"{_ms(step)} -> {_ms(after)} per step"
    )
    return Fix("host-bound", f"torch.set_num_threads({k})", _speedup(step, after), basis)


@dataclass(frozen=True)
class _ThreadBounds:
    """What bounds a step with fewer threads, in seconds: ``loop``, the loop's own thread
    (its step and ``taking``, getting its batches); ``worker``, each worker delivering its
    share on a core; ``cpus``, the CPUs holding the loop's CPU (``own``) and the workers'
    (``fed``) together."""

    loop: float
    worker: float
    cpus: float
    taking: float
    own: float
    fed: float


def _thread_bounds(f: Figures, k: int, fewer: float) -> _ThreadBounds:
    """The three bounds of :func:`threads_fix` for ``k`` threads and a step of ``fewer``.

    The step's times are wall time, of which a thread runs the share the hypervisor leaves
    (``left``); the workers' figures are CPU time, which takes a worker ``1 / left`` as long
    on its core. The loop's CPU is its ``k`` threads' (no more than its process uses now,
    nor less than one thread's) and the CPU it spends getting its batches.
    """
    step = mean_step_s(f)
    left = capacity(f) / f.cpus
    taking = kept_loading_s(f)
    # Without workers the loop loads in its own thread, for as much CPU as it demanded
    # while it waited (reads that sleep demand little), or the whole wait when unmeasured.
    demand = f.wait_cpu_s
    loading_cpu = taking if has_workers(f) or demand is None else min(demand, taking)
    own = left * (k * fewer + loading_cpu)
    now = main_cores(f)
    if now is not None:
        own = min(own, max(left * (fewer + loading_cpu), now * step))
    fed = worker_cores(f) * step  # the workers' CPU per step
    # Workers behind an iterable that is not a DataLoader: their count, so each one's
    # share, is unknown, and only the CPUs bound them.
    count = f.setup.num_workers
    worker = fed / count / left if count else 0.0
    cpus = (own + fed) / max(left, capacity(f) - others_cores(f))
    return _ThreadBounds(fewer + taking, worker, cpus, taking, own, fed)


def _binding_words(b: _ThreadBounds, step: float) -> str:
    """The clause naming the bound that is not the loop's own thread, if one binds."""
    if b.worker > max(b.loop, b.cpus):
        return f", but each worker takes {_ms(b.worker)} a step to deliver its share"
    if b.cpus <= max(b.loop, b.worker):
        return ""
    held = f"the CPUs hold its {_ms(b.own)} of CPU and the workers' {_ms(b.fed)}"
    if b.cpus < step:
        return f", and {held} in {_ms(b.cpus)}"
    return f", but {held} in no less than the step takes now"


def _wait_words(f: Figures, b: _ThreadBounds) -> str:
    """What becomes of the data wait with fewer threads: the workers get their cores back
    (and keep up, unless one worker's share is the bound), and the loop keeps its own
    ``taking`` of the wait."""
    wait, taking = wait_s(f), b.taking
    if not has_workers(f):
        if wait <= 0:
            return "the loop, loading in its own thread, waits for no data"
        return f"the {_ms(taking)} the loop spends loading in its own thread stays"
    workers = (
        "the workers keep up" if b.worker <= max(b.loop, b.cpus) else "the workers get cores back"
    )
    if wait <= 0:
        return workers
    if taking <= 0:
        return f"{workers} and the {_ms(wait)} data wait goes"
    if _ms(taking) == _ms(wait):
        return f"{workers}; the {_ms(wait)} data wait, the loop receiving its batches, stays"
    return (
        f"{workers} and the {_ms(wait)} data wait goes but for the {_ms(taking)} the loop "
        "takes to receive its batches"
    )


def has_workers(f: Figures) -> bool:
    """The loop takes its batches from worker processes: a DataLoader with workers, or
    hidden ones (:func:`hidden_workers`)."""
    return bool(f.setup.num_workers) or hidden_workers(f)


def kept_loading_s(f: Figures) -> float:
    """Seconds per step the loop's thread spends getting its batches whatever its torch
    threads: receiving them from workers (its CPU demand while it waited, at most the
    wait), or, without workers, the whole wait (it loads them itself)."""
    if not has_workers(f):
        return wait_s(f)
    return min(f.wait_cpu_s or 0.0, wait_s(f))


def free_cpus_fix(f: Figures) -> Fix:
    """The host's CPUs back: the step minus the time its thread waited for a CPU."""
    step = mean_step_s(f)
    if f.cpu_delay_s is None:
        basis = f"{NOT_PREDICTED}: the time the loop's thread waited for a CPU was not measured"
        return Fix("host-bound", FREE_CPUS_CALL, 1.0, basis)
    delay = f.cpu_delay_s
    if delay >= step:  # a thread cannot wait longer than the step it waits in
        basis = f"{NOT_PREDICTED}: the measured wait for a CPU is not shorter than the step"
        return Fix("host-bound", FREE_CPUS_CALL, 1.0, basis)
    after = step - delay
    basis = (
        f"the loop's thread waited {_ms(delay)} per step for a CPU other processes held: "
        f"{_ms(step)} -> {_ms(after)} per step without them"
    )
    return Fix("host-bound", FREE_CPUS_CALL, _speedup(step, after), basis)
