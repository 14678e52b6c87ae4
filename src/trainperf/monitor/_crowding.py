"""What fewer torch threads would gain a CPU step on a crowded host: measured.

When torch runs more intra-op threads than the CPUs hold beside the DataLoader workers, the
threads wait for each other at every parallel region: the last one to get a CPU decides.
How much a step loses that way depends on the host, the BLAS and the OpenMP runtime's
spinning, none of which the watch's CPU figures can tell from work. So the prediction for
``torch.set_num_threads(k)`` measures it: :func:`measure_crowding` runs a small parallel
torch workload (a 256 x 256 matrix product and an element-wise pass over 256 K floats)
with the loop's thread count and with ``k``, in alternating windows, while spinning
processes stand in for the workers (the workers' 0.6 cores: the figures beside none and
beside one spinner, weighted 0.4 and 0.6), once, when the report is made (under a second
for each count of spinners), and remembers it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from trainperf._utils.fds import readable
from trainperf.limits import usable_cpus
from trainperf.monitor._figures import Figures, oversubscribed, threads_that_fit, worker_cores
from trainperf.monitor._setup import LoopSetup

__all__ = ["Crowding", "crowding_beside", "measure_crowding", "with_crowding"]

_ROUNDS = 4  # alternating rounds, the order reversed every other one
_WINDOW_S = 0.05  # each window runs the workload at least this long
_MAX_S = 1.0  # the whole probe stops after this long with two rounds
_NEGLIGIBLE = 0.1  # a share of a core too small to measure beside
_SPIN_START_S = 2.0  # the most the probe waits for its spinners to say they spin
# A spinner says it started (a byte on stdout), burns a CPU and ends itself after 5 s,
# whatever its parent does.
_SPIN = (
    "import sys, time\nsys.stdout.write('.')\nsys.stdout.flush()\n"
    "end = time.monotonic() + 5.0\nwhile time.monotonic() < end:\n    pass\n"
)
_CACHE: dict[tuple[int, int, int, int], Crowding | None] = {}


@dataclass(frozen=True)
class Crowding:
    """The workload's speed with ``fit`` torch threads over its speed with ``threads``.

    Attributes:
        threads: the loop's torch threads.
        fit: the threads the CPUs hold beside the workers.
        busy: spinning processes standing in for the workers.
        speedup: the median over the rounds of the ``fit`` windows' rate over the
            ``threads`` windows' rate.
        rounds: rounds measured.
    """

    threads: int
    fit: int
    busy: int
    speedup: float
    rounds: int


def _workload() -> Callable[[], None]:
    gen = torch.Generator().manual_seed(0)  # the loop's random state untouched
    a = torch.randn(256, 256, generator=gen)
    v = torch.randn(256 * 1024, generator=gen)

    def run() -> None:
        a @ a
        torch.tanh(v)

    return run


def _window(run: Callable[[], None], threads: int) -> float:
    """Runs of the workload per second with ``threads`` torch threads."""
    torch.set_num_threads(threads)
    run()  # the thread pool resized: not timed
    n, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < _WINDOW_S or n < 2:
        run()
        n += 1
    return n / elapsed


def _spinners(count: int, procs: list[subprocess.Popen[bytes]]) -> None:
    """Start ``count`` spinners, each appended to ``procs`` as soon as it exists (a start
    that fails part-way leaves the ones before it in ``procs``, to be stopped). Fresh
    interpreters, not forks: a forked child would share this process's signal handlers
    and stack (a Ctrl-C would run the loop's own ``except`` blocks in it)."""
    for _ in range(count):
        procs.append(
            subprocess.Popen(
                [sys.executable, "-S", "-E", "-c", _SPIN],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
            )
        )
    deadline = time.monotonic() + _SPIN_START_S
    for p in procs:  # each says it spins (a loaded host starts an interpreter slowly)
        if p.stdout is None:  # pragma: no cover - started with stdout=PIPE
            continue
        if readable([p.stdout.fileno()], max(0.0, deadline - time.monotonic())):
            p.stdout.read(1)


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        with contextlib.suppress(OSError):
            p.kill()
    for p in procs:
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            p.wait(timeout=5)
        if p.stdout is not None:
            p.stdout.close()


def _probe(threads: int, fit: int, busy: int) -> Crowding:
    run = _workload()
    before = torch.get_num_threads()
    procs: list[subprocess.Popen[bytes]] = []
    ratios: list[float] = []
    try:
        _spinners(busy, procs)
        start = time.perf_counter()
        for r in range(_ROUNDS):
            order = (threads, fit) if r % 2 == 0 else (fit, threads)
            rates = {n: _window(run, n) for n in order}
            ratios.append(rates[fit] / rates[threads])
            if r >= 1 and time.perf_counter() - start > _MAX_S:
                break
    finally:
        _stop(procs)
        torch.set_num_threads(before)
    return Crowding(threads, fit, busy, statistics.median(ratios), len(ratios))


def measure_crowding(threads: int, fit: int, busy: int, *, probe: bool = True) -> Crowding | None:
    """How much faster a parallel torch workload runs with ``fit`` threads than with
    ``threads`` beside ``busy`` processes that each keep a CPU busy.

    Measured once per process for each ``(threads, fit, busy)`` and usable CPU count, in
    well under a second, then remembered.

    Args:
        threads: the loop's torch threads.
        fit: the threads the usable CPUs hold beside the workers (fewer than ``threads``).
        busy: spinning processes to stand in for the workers (0 or more).
        probe: False only looks up an earlier measurement.

    Returns:
        The :class:`Crowding`, or None where it cannot be measured (``fit >= threads``, no
        interpreter to start, a process limit that refuses one).

    Example:
        >>> c = measure_crowding(4, 1, 0)
        >>> c is None or (c.speedup > 0 and c.rounds >= 2)
        True
    """
    if fit >= threads or fit < 1 or busy < 0 or not sys.executable:
        return None
    key = (threads, fit, busy, usable_cpus())
    if key not in _CACHE and not probe:
        return None
    if key not in _CACHE:
        try:
            _CACHE[key] = _probe(threads, fit, busy)
        except OSError:  # a spinner refused (a process limit): not measured
            _CACHE[key] = None
    return _CACHE[key]


def with_crowding(f: Figures, *, probe: bool = True) -> LoopSetup | None:
    """``f``'s setup with :func:`measure_crowding`'s figure for a loop whose torch threads
    crowd the CPUs on the CPU (:func:`~trainperf.monitor._figures.oversubscribed`, no
    CUDA: a GPU step's host threads mostly launch kernels), the workers' cores standing
    in as spinning processes; None where that does not apply or was not measured."""
    threads = f.setup.torch_threads
    if f.cuda_used or threads is None or not oversubscribed(f):
        return None
    fit = threads_that_fit(f)
    speedup = crowding_beside(threads, fit, worker_cores(f), probe=probe)
    if speedup is None:
        return None
    return dataclasses.replace(f.setup, fewer_threads=fit, fewer_threads_speedup=round(speedup, 4))


def crowding_beside(threads: int, fit: int, cores: float, *, probe: bool = True) -> float | None:
    """:func:`measure_crowding`'s speed-up beside processes that keep ``cores`` busy: a
    whole number of spinners stands in for a fraction of a core by the figures beside the
    whole counts on either side, weighted by how near each is (0.3 cores: 0.7 of the
    figure beside none and 0.3 of the one beside one spinner; a share under
    ``_NEGLIGIBLE`` is not measured). None where a figure was not measured."""
    low = math.floor(max(0.0, cores))
    share = max(0.0, cores) - low
    figures = []
    for busy, weight in ((low, 1.0 - share), (low + 1, share)):
        if weight < _NEGLIGIBLE:
            continue
        crowding = measure_crowding(threads, fit, busy, probe=probe)
        if crowding is None:
            return None
        figures.append((crowding.speedup, weight))
    return sum(s * w for s, w in figures) / sum(w for _, w in figures)
