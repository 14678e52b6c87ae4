"""The search: predict the worker count from the single-process cost, then climb.

Not a grid. ``num_workers=0`` is measured first; its throughput and CPU use say how much a
worker delivers and how much of a core it burns. The first worker count tried is the one
that fills the cores left for workers (usable CPUs minus the main process's: one core, or
what ``step_fn`` was measured to use) — more when the loading mostly
waits (sleeps, I/O) rather than computes — capped by ``max_workers``, by memory and
``/dev/shm``, and by ``step_fn`` (no point loading faster than the training step eats).
Before a pool of more than one worker is started, one worker is measured (``probe_first``),
so that the memory check of the first pool uses a measured worker, not a guess: a dataset
whose workers each hold gigabytes would otherwise start a pool the memory limit cannot
hold. A count the limits refuse is listed as skipped, with the figures (the workers, the
memory each needs, and what is available), never dropped silently. From there it climbs in
steps of a quarter of the count while each step pays at least 3 %, or, when the first step
up does not pay, steps down while throughput holds within 2 %.
Among the configurations within 2 % of the best, the one with fewest workers wins, so
``num_workers=0`` is kept unless workers really are faster.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

from trainperf._utils.stack import user_stacklevel
from trainperf.loader._report import CandidateResult, FaultKind, format_bytes
from trainperf.loader._report_table import main_process_share, shares_main_core

__all__ = ["GAIN", "TIE", "Search", "default_max_workers", "safety_margin"]

MiB = 1 << 20
GAIN = 0.03
"""A step up must raise throughput by this fraction to keep climbing."""
TIE = 0.02
"""Configurations within this fraction of the best count as equal; fewest workers wins."""
_FATAL: tuple[FaultKind, ...] = ("crash", "hang", "pickle", "error")
_TIMES = "\N{MULTIPLICATION SIGN}"

MeasureFn = Callable[[int, "int | None", bool], CandidateResult]
"""``measure(num_workers, prefetch_factor, pin_memory) -> CandidateResult``."""


def default_max_workers(cpus: int) -> int:
    """The largest ``num_workers`` tried when the caller gives no ``max_workers``.

    Four per usable CPU, because I/O-bound loading keeps paying past the core count (the
    CPU check stops compute-bound loading at the cores), at least 2 and at most 64.

    Example:
        >>> default_max_workers(2), default_max_workers(16), default_max_workers(64)
        (8, 64, 64)
    """
    return max(2, min(64, 4 * cpus))


def adaptive_max_workers(cpus: int) -> int:
    """The most workers an :class:`~trainperf.loader.AdaptiveDataLoader` uses when the
    caller gives no ``max_workers``: eight per usable CPU, at least 2 and at most 64.

    Twice the one-off tuner's bound (:func:`default_max_workers`): the tuner pays for every
    count it tries out of its time budget, the adaptive loader tries one while training
    and goes back when it does not pay. Its CPU rule stops loading that computes at the
    cores; only loading that waits (I/O latency, a remote store) gets this far, and there
    workers at a few percent of a core each keep paying past four per CPU.

    Example:
        >>> adaptive_max_workers(1), adaptive_max_workers(2), adaptive_max_workers(16)
        (8, 16, 64)
    """
    return max(2, min(64, 8 * cpus))


def safety_margin(memory_available: int) -> int:
    """Memory never planned for: 10 % of what is available, at least 512 MiB.

    Example:
        >>> safety_margin(2**30) // 2**20, safety_margin(64 * 2**30) // 2**20
        (512, 6553)
    """
    return max(512 * MiB, memory_available // 10)


def worker_memory_prior(start_method: str) -> int:
    """Private memory assumed per worker before one has been measured.

    A forked worker shares the parent's pages (tens of MiB private); a spawned one imports
    torch again and unpickles its own copy of the dataset.
    """
    return 128 * MiB if start_method == "fork" else 768 * MiB


@dataclass
class Search:
    """One tuning run over ``(num_workers, prefetch_factor, pin_memory)``.

    ``measure`` does the timing (and owns the deadline); ``out_of_time`` says whether the
    budget is spent; ``user`` is the caller's own ``(num_workers, prefetch_factor,
    pin_memory)``, measured first when given. ``probe_first``: measure one worker before
    the first pool of several, unless a worker's memory is known already (the tuner sets
    it; tests of the search's other rules leave it off). ``refused``: a failed worker
    configuration that rules out every other (an ``IterableDataset`` that does not shard,
    :mod:`trainperf.loader._iterable`): no worker configuration is measured. Tests drive
    the search with synthetic measurements.
    """

    measure: MeasureFn
    out_of_time: Callable[[], bool]
    worker_cpus: int
    max_workers: int
    memory_available: int
    shm_free: int | None
    start_method: str
    pin_options: tuple[bool, ...] = (False,)
    step_samples_per_s: float | None = None
    main_rss: int = 0
    main_cores: float = 1.0
    cpus: int | None = None  # the usable CPUs, for the words of a CPU skip; None: not known
    user: tuple[int, int | None, bool] | None = None
    probe_first: bool = False
    refused: CandidateResult | None = None
    results: list[CandidateResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    broken: CandidateResult | None = None

    # ----------------------------------------------------------------- model

    def objective(self, c: CandidateResult) -> float:
        """Training throughput the candidate allows: with ``step_fn``, loading in the main
        process adds to the step, while workers overlap with it."""
        r = c.samples_per_s or 0.0
        s = self.step_samples_per_s
        if s is None or r <= 0:
            return r
        if c.num_workers == 0:
            return 1.0 / (1.0 / r + 1.0 / s)
        return min(r, s)

    def _baseline(self) -> CandidateResult:
        return self.results[0]

    def cores_per_worker(self) -> float:
        """CPU cores one worker demands: measured on the latest worker pool when there is
        one (demand counts time waiting for a CPU, so a crowded pool does not look idle),
        else the main process's demand while loading alone."""
        for c in reversed(self.results):
            if c.ok and c.num_workers > 0 and c.worker_cpu is not None:
                return max(0.01, c.worker_cpu / c.num_workers)
        main = self._baseline().main_cpu
        return 1.0 if main is None else min(1.0, max(0.01, main))

    def worker_bytes(self) -> int:
        """Private memory per worker: the largest measured plus 25 %, else the worst case:
        a worker may end up copying every page of the main process it was forked from
        (``main_rss``). A measured figure already includes the growth projected over the
        dataset (a forked worker copies the pages of the Python objects it touches, see
        :func:`trainperf.loader._memory.project_worker_uss`); the 25 % covers what the
        projection cannot see."""
        seen = [c.worker_uss for c in self.results if c.worker_uss]
        if seen:
            return int(max(seen) * 1.25)
        return max(worker_memory_prior(self.start_method), self.main_rss)

    def _batch_bytes(self) -> int:
        return next((c.batch_bytes for c in self.results if c.batch_bytes), 0) or 0

    def memory_needed(self, n: int, pf: int | None, pin: bool) -> int:
        """Bytes ``n`` workers need: their private memory plus every batch in flight (in
        ``/dev/shm``, which is memory too, and a pinned copy when pinning)."""
        inflight = (n * (pf or 0) + 2) * self._batch_bytes() * (2 if pin else 1)
        return n * self.worker_bytes() + inflight

    def shm_needed(self, n: int, pf: int | None) -> int:
        """Bytes of ``/dev/shm`` the batches in flight occupy."""
        return (n * (pf or 0) + 2) * self._batch_bytes() if n > 0 else 0

    def why_not(self, n: int, pf: int | None, pin: bool) -> tuple[FaultKind, str] | None:
        """Why this candidate must not be tried (CPU, memory, /dev/shm), or None."""
        if n == 0:
            return None
        if self.refused is not None and self.refused.fault is not None:
            return self.refused.fault, self.refused.reason or ""
        cores = n * self.cores_per_worker()
        if cores > self.worker_cpus + 0.5:
            return "cpu", (
                f"{n} workers would keep about {cores:.1f} cores busy but only "
                f"{_cores(self.worker_cpus)} left for workers "
                f"({self._main_share()})"
            )
        return self.memory_problem(n, pf, pin)

    def _main_share(self) -> str:
        """The main process's share of the CPUs, as a CPU skip words it."""
        shared = self.cpus is not None and shares_main_core(
            self.cpus, self.worker_cpus, self.main_cores
        )
        return main_process_share(self.main_cores, self.step_samples_per_s is not None, shared)

    def _worker_measured(self) -> bool:
        return any(c.worker_uss for c in self.results)

    def memory_problem(self, n: int, pf: int | None, pin: bool) -> tuple[FaultKind, str] | None:
        """Why ``n`` workers would not fit in memory or ``/dev/shm``, or None."""
        if n == 0:
            return None
        need = self.memory_needed(n, pf, pin)
        margin = safety_margin(self.memory_available)
        room = self.memory_available - margin
        if need > room:
            per = self.worker_bytes()
            inflight = need - n * per
            how = (
                "measured private memory projected over the dataset, +25 %"
                if self._worker_measured()
                else "assumed: no worker measured yet"
            )
            return "memory", (
                f"{n} workers {_TIMES} {per / 2**30:.2f} GiB + {format_bytes(inflight)} of batches "
                f"in flight > {max(room, 0) / 2**30:.2f} GiB available (per worker: {how}; "
                f"available: {format_bytes(self.memory_available)} less a safety margin of "
                f"{format_bytes(margin)}); fix: more memory, fewer workers, or a smaller "
                f"prefetch_factor"
            )
        shm = self.shm_needed(n, pf)
        if self.shm_free is not None and shm > 0.9 * self.shm_free:
            return "shm", (
                f"batches in flight would take about {shm / 2**20:,.0f} MiB of /dev/shm but "
                f"only {self.shm_free / 2**20:,.0f} MiB is free; fix: docker run "
                f"--shm-size=16g (or a memory-backed emptyDir on Kubernetes), fewer workers "
                f"or a smaller prefetch_factor"
            )
        return None

    def wanted(self) -> int:
        """The worker count the CPUs, ``max_workers`` and ``step_fn`` ask for, before the
        memory and ``/dev/shm`` limits."""
        base = self._baseline()
        n = math.floor((self.worker_cpus + 0.5) / self.cores_per_worker())
        n = max(1, min(self.max_workers, n))
        if self.step_samples_per_s is not None and base.samples_per_s:
            # Workers beyond what keeps up with the step only burn CPU (10 % headroom).
            needed = math.ceil(1.1 * self.step_samples_per_s / base.samples_per_s)
            n = min(n, max(1, needed))
        return n

    def predict(self) -> int:
        """The first worker count to try (see the module docstring): :meth:`wanted`,
        lowered until the limits allow it."""
        n = self.wanted()
        pin = self.pin_options[0]
        while n > 1 and self.why_not(n, 2, pin) is not None:
            n = max(1, n * 3 // 4) if n > 4 else n - 1
        return n

    def _first_count(self, pin: bool) -> int:
        """:meth:`predict`; the count it lowered for the limits is listed as skipped, with
        the figures, so that no candidate vanishes without a note."""
        wanted, n = self.wanted(), self.predict()
        why = self.why_not(wanted, 2, pin) if n < wanted else None
        if why is not None and self.find(wanted, 2, pin) is None:
            self.results.append(
                CandidateResult(wanted, 2, pin, "skipped", fault=why[0], reason=why[1])
            )
        return n

    def _probe_one_worker(self, pin: bool) -> CandidateResult | None:
        """One worker measured before a pool of several (see ``probe_first``); None when
        not needed: a worker was measured already, or the first pool has one worker."""
        if not self.probe_first or self._worker_measured() or self.predict() <= 1:
            return None
        return self.attempt(1, 2, pin)

    # ----------------------------------------------------------------- steps

    def find(self, n: int, pf: int | None, pin: bool) -> CandidateResult | None:
        """The candidate already considered with these settings, or None."""
        for c in self.results:
            if (c.num_workers, c.prefetch_factor, c.pin_memory) == (n, pf, pin):
                return c
        return None

    def attempt(self, n: int, pf: int | None, pin: bool) -> CandidateResult:
        """Measure a candidate unless already done, unsafe, or out of time."""
        seen = self.find(n, pf, pin)
        if seen is not None:
            return seen
        why = self.why_not(n, pf, pin)
        if why is None and self.out_of_time():
            why = ("budget", "the time budget ran out before it could be measured")
        if why is not None:
            r = CandidateResult(n, pf, pin, "skipped", fault=why[0], reason=why[1])
        else:
            r = self.measure(n, pf, pin)
        self.results.append(r)
        if r.status == "failed" and r.fault in _FATAL:
            self.broken = r
        return r

    def _pays(self, new: CandidateResult, old: CandidateResult) -> bool:
        return new.ok and self.objective(new) >= self.objective(old) * (1 + GAIN)

    def _outruns_step(self, c: CandidateResult) -> bool:
        s = self.step_samples_per_s
        return s is not None and (c.samples_per_s or 0.0) >= 1.05 * s

    def run(self, baseline: CandidateResult) -> CandidateResult:
        """Search from a measured ``num_workers=0`` baseline; returns the choice."""
        self.results = [baseline]
        if not baseline.ok:
            self.notes.append("num_workers=0 could not be measured within the budget")
            return baseline
        if self.refused is not None:
            self.results.append(self.refused)
        if self.user is not None and self.user[0] <= self.max_workers:
            # The caller's own setting first: the budget cannot run out before it, and the
            # prediction starts from its measured cost (see trainperf.loader._user).
            self.attempt(*self.user)
        if self.max_workers == 0 or self.refused is not None:
            return self.choose()
        pin = self.pin_options[0]
        probe = self._probe_one_worker(pin)
        if probe is None or probe.ok:
            self._pool(pin)
        choice = self.choose()
        if choice.num_workers > 0:
            choice = self._refine(choice)
        self._explain_fallback(choice)
        self._explain_memory_refusals(choice)
        return choice

    def _pool(self, pin: bool) -> None:
        """The predicted pool, smaller ones while it does not fit, then the climb."""
        n = self._first_count(pin)
        cur = self.attempt(n, 2, pin)
        # A smaller pool may still fit: /dev/shm ran out, or a worker was SIGKILLed (the
        # out-of-memory killer, most likely).
        while n > 1 and (cur.fault == "shm" or (cur.fault == "memory" and cur.status == "failed")):
            n = n // 2
            cur = self.attempt(n, 2, pin)
        if cur.ok:
            self._climb(cur, pin)

    def _explain_memory_refusals(self, choice: CandidateResult) -> None:
        """A note for each faster configuration that ran but that the memory measured on
        the way says would not last the run."""
        for c in self.results:
            if not c.ok or self.objective(c) <= self.objective(choice) * (1 + TIE):
                continue
            problem = self.memory_problem(c.num_workers, c.prefetch_factor, c.pin_memory)
            if problem is not None:
                self.notes.append(f"{c.label()} ran, but is not chosen: {problem[1]}")

    def _climb(self, first: CandidateResult, pin: bool) -> None:
        base = self._baseline()
        step = max(1, round(first.num_workers / 4))
        if self.objective(first) <= self.objective(base) * (1 + TIE):
            # Workers do not pay at the predicted count; contention may be why.
            if first.num_workers >= 4 and self.broken is None:
                self.attempt(first.num_workers // 2, 2, pin)
            return
        cur, went_up = first, False
        while self.broken is None and not self._outruns_step(cur):
            nxt = cur.num_workers + step
            if nxt > self.max_workers:
                break
            r = self.attempt(nxt, 2, pin)
            if not self._pays(r, cur):
                break
            cur, went_up = r, True
        if went_up or first.num_workers <= 1:
            return
        best = self.objective(first)
        lo = first.num_workers - step
        while lo >= 1 and self.broken is None:
            r = self.attempt(lo, 2, pin)
            if not r.ok or self.objective(r) < best * (1 - TIE):
                break
            lo -= step

    def _refine(self, choice: CandidateResult) -> CandidateResult:
        """Deeper prefetch when the pool underdelivers; the other pin setting on CUDA."""
        n, pin = choice.num_workers, choice.pin_memory
        base_rate = self._baseline().samples_per_s or 0.0
        ideal = min(n, self.worker_cpus / self.cores_per_worker()) * base_rate
        if self.broken is None and (choice.samples_per_s or 0.0) < 0.8 * ideal:
            # Workers idle while the main process waits for one slow batch in order;
            # more batches in flight per worker can hide that.
            self.attempt(n, 4, pin)
            choice = self.choose()
        for other in self.pin_options[1:]:
            if self.broken is None and choice.num_workers > 0:
                self.attempt(choice.num_workers, choice.prefetch_factor, other)
        return self.choose()

    def choose(self) -> CandidateResult:
        """Fewest workers (then smallest prefetch) within ``TIE`` of the best objective."""
        # A configuration that ran may still be refused: memory measured on the way may
        # show that it would not last an epoch inside the margin.
        ok = [
            c
            for c in self.results
            if c.ok and self.memory_problem(c.num_workers, c.prefetch_factor, c.pin_memory) is None
        ]
        if not ok:
            return self._baseline()
        best = max(self.objective(c) for c in ok)
        preferred_pin = self.pin_options[0]
        near = [c for c in ok if self.objective(c) >= best * (1 - TIE)]
        return min(
            near,
            key=lambda c: (c.num_workers, c.prefetch_factor or 0, c.pin_memory != preferred_pin),
        )

    def _explain_fallback(self, choice: CandidateResult) -> None:
        if choice.num_workers > 0 or any(c.ok and c.num_workers > 0 for c in self.results):
            return
        failed = [
            c
            for c in self.results
            if c.num_workers > 0
            and (c.status == "failed" or c.fault in ("memory", "shm"))
            and c.fault != "budget"
        ]
        if not failed:
            if any(c.num_workers > 0 and c.fault == "budget" for c in self.results):
                self.notes.append(
                    "num_workers=0 by default, not by measurement: the time budget ran out "
                    "before any worker configuration was measured; fix: a larger budget_s"
                )
            return
        why = "; ".join(f"{c.label()}: {c.reason}" for c in failed)
        warnings.warn(
            f"tune_loader falls back to num_workers=0 because workers fail: {why}",
            RuntimeWarning,
            stacklevel=user_stacklevel(),
        )
        # The table's rows give each reason in full; the note only points at them.
        labels = ", ".join(c.label() for c in failed)
        self.notes.append(
            f"tune_loader falls back to num_workers=0 because workers fail ({labels}: the "
            "reasons are in the table above)"
        )


def _cores(n: int) -> str:
    """``1`` -> ``"1 is"``, ``3`` -> ``"3 are"``: the count of cores as a sentence's subject.

    Example:
        >>> _cores(1), _cores(3)
        ('1 is', '3 are')
    """
    return f"{n} {'is' if n == 1 else 'are'}"
