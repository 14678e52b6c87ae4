"""What moving the loading into DataLoader workers costs besides the loading: measured.

A loop that loads in its own thread (``num_workers=0``) shows what loading costs, but not
what handing each batch over from a worker process will: the worker collates into shared
memory and pickles, the loop's thread unpickles and maps the storage. Against a step of a
few milliseconds that is a large part of the step (about a millisecond of the loop
thread's CPU a batch on a busy 2-core host), so the prediction for
:func:`trainperf.autotune_loader` measures it instead of leaving it out:
:func:`measure_handover` runs one worker over batches of the loop's own layout (the same
tensors, the same bytes) once, when the report is made, and a loop with workers already
shows its own cost.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Handover", "batch_layout", "measure_handover"]

_MAX_TENSORS = 64  # a batch layout keeps at most this many tensors
_MAX_BATCHES = 32
_MIN_BATCHES = 8
_PROBE_S = 0.6  # the probe stops after this long once it has _MIN_BATCHES
_MAX_PROBE_S = 1.0  # ... and after this long with any two
_SHM_SHARE = 0.25  # the probe's batches in flight take at most this share of /dev/shm
_MAX_PAUSE_S = 0.02  # the longest pause between two receives
_CACHE: dict[tuple[int, int, int, int], Handover | None] = {}


@dataclass(frozen=True)
class Handover:
    """Per batch, what a worker hand-over costs beyond loading it in the loop's thread.

    Attributes:
        receive_s: CPU seconds the loop's thread spends taking a batch from a worker.
        produce_s: extra CPU seconds a worker spends on a batch (collating into shared
            memory, pickling) over what fetching it costs the loop's thread.
        batches: batches the probe measured.
    """

    receive_s: float
    produce_s: float
    batches: int


def batch_layout(batch: object, depth: int = 0) -> tuple[int, ...]:
    """The byte sizes of a batch's tensors, in order (nested lists, tuples and mappings
    walked three levels deep, at most 64 tensors)."""
    if isinstance(batch, torch.Tensor):
        return (batch.numel() * batch.element_size(),)
    if depth >= 3:
        return ()
    items: Sequence[Any] | None = None
    if isinstance(batch, Mapping):
        items = list(batch.values())
    elif isinstance(batch, (list, tuple)):
        items = batch
    out: tuple[int, ...] = ()
    for item in items or ():
        out += batch_layout(item, depth + 1)
        if len(out) >= _MAX_TENSORS:
            return out[:_MAX_TENSORS]
    return out


class _Samples(torch.utils.data.Dataset[tuple[torch.Tensor, ...]]):
    """Samples whose default collation gives a batch of the given layout."""

    def __init__(self, sample_bytes: tuple[int, ...], length: int) -> None:
        self._sample = tuple(torch.ones(max(1, n), dtype=torch.uint8) for n in sample_bytes)
        self._length = length

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        return self._sample


def _cpu_of(pid: int) -> float | None:
    """CPU seconds all threads of process ``pid`` have run (nanosecond ``schedstat`` of
    each task: a worker pickles in its queue's feeder thread, not its main one)."""
    total = 0.0
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/schedstat", "rb") as f:
                    total += int(f.read().split()[0]) / 1e9
            except FileNotFoundError:  # a thread that ended since the listing
                continue
    except (OSError, ValueError, IndexError):
        return None
    return total


def _local_cost(data: _Samples, batch: int, count: int, until: float) -> float:
    """CPU seconds per batch the loop's thread spends fetching a batch itself, with one
    torch thread as a worker has (more threads spin on a busy host and count as work)."""
    loader = torch.utils.data.DataLoader(data, batch_size=batch, num_workers=0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        it = iter(loader)
        next(it)
        start, done = time.thread_time(), 0
        while done < count and (done < 2 or time.perf_counter() < until):
            next(it)
            done += 1
        return (time.thread_time() - start) / done
    finally:
        torch.set_num_threads(threads)


def _probe(layout: tuple[int, ...], batch: int, pause_s: float = 0.0) -> Handover | None:
    sample = tuple(-(-n // batch) for n in layout)
    data = _Samples(sample, batch * (_MAX_BATCHES + 2))
    loader = torch.utils.data.DataLoader(
        data,
        batch_size=batch,
        num_workers=1,
        prefetch_factor=2,
        timeout=10,  # a worker that stalls: not measured (the report says so)
        multiprocessing_context="fork",
    )
    it = iter(loader)
    try:
        next(it)  # the worker has started
        pid = it._workers[0].pid  # type: ignore[attr-defined]
        worker_start, start, count = _cpu_of(pid), time.perf_counter(), 0
        receive = 0.0
        while count < _MAX_BATCHES and (
            count < _MIN_BATCHES or time.perf_counter() - start < _PROBE_S
        ):
            if pause_s > 0:
                time.sleep(pause_s)  # the loop's step between two receives
            t = time.thread_time()
            next(it)
            receive += time.thread_time() - t
            count += 1
            if count >= 2 and time.perf_counter() - start > _MAX_PROBE_S:
                break  # large batches: fewer of them
        worker_end = _cpu_of(pid)
    finally:
        it._shutdown_workers()  # type: ignore[attr-defined]
    if worker_start is None or worker_end is None:
        return None
    local = _local_cost(data, batch, min(count, 16), time.perf_counter() + _PROBE_S / 2)
    produce = max(0.0, (worker_end - worker_start) / count - local)
    return Handover(receive / count, produce, count)


def measure_handover(
    layout: tuple[int, ...], batch: int, *, pause_s: float = 0.0, probe: bool = True
) -> Handover | None:
    """What a one-worker DataLoader's hand-over costs per batch of this ``layout`` (the
    tensors' byte sizes, :func:`batch_layout`) and ``batch`` samples; None where it cannot
    be measured (no ``/proc``, a worker that will not start, no room in ``/dev/shm``).
    Measured once per process for layouts and pauses alike (:func:`_key`), in about a
    second (up to 1.5 s for large batches or long pauses), then remembered;
    ``probe=False`` only looks it up.

    ``pause_s`` is the loop's own time between two receives (its step), at most 20 ms:
    the probe waits that long before each. A receive after a pause costs more than one in
    a tight loop, the caches and the scheduler's state gone cold: 1.1-1.4 ms of CPU against
    0.6 ms for a 128-byte batch on a 2-core host, after a 3-10 ms pause.

    Example:
        >>> h = measure_handover((8 * 4096,), 8)
        >>> h is None or (h.receive_s >= 0 and h.produce_s >= 0)
        True
    """
    if not layout or batch < 1 or not _can_fork_a_worker() or not _shm_holds(sum(layout)):
        return None
    pause = min(_MAX_PAUSE_S, max(0.0, pause_s))
    key = _key(layout, batch, pause)
    if key not in _CACHE and not probe:
        return None  # only what was measured before
    if key not in _CACHE:
        try:
            _CACHE[key] = _probe(layout, batch, pause)
        except Exception:  # a worker that could not start, died or timed out: not measured
            _CACHE[key] = None
    return _CACHE[key]


def _key(layout: tuple[int, ...], batch: int, pause_s: float) -> tuple[int, int, int, int]:
    """Layouts alike enough to share a measurement: the tensor count, the batch size, the
    total bytes to within a factor of sqrt(2) (padding to each batch's longest sequence
    changes the bytes, not the cost's size) and the pause to within a factor of sqrt(2)
    (any under 0.1 ms counts as none)."""
    pause = round(2 * math.log2(pause_s / 1e-4)) if pause_s >= 1e-4 else -1
    return len(layout), batch, round(2 * math.log2(max(1, sum(layout)))), pause


def _shm_holds(batch_bytes: int) -> bool:
    """``/dev/shm`` has room for the probe's batches in flight (three) within a quarter of
    what is free there (under DDP every rank of the host may probe at once, next to
    NCCL's segments); True where there is no ``/dev/shm`` to fill."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return True
    return 3 * batch_bytes <= _SHM_SHARE * st.f_bavail * st.f_frsize


def _can_fork_a_worker() -> bool:
    """A worker can be started cheaply here: Linux ``/proc``, the fork start method (the
    probe forks its worker whatever the default: a spawned one takes seconds to start, and
    the worker touches no CUDA), and not a daemonic process (which may not have children:
    a DataLoader worker, a ``multiprocessing`` pool worker)."""
    import multiprocessing

    if not os.path.exists("/proc/self/schedstat") or multiprocessing.current_process().daemon:
        return False
    return "fork" in multiprocessing.get_all_start_methods()
