"""What a non-blocking save still costs the step on the CPU: measured.

``Checkpointer.save(..., blocking=False)`` of a CPU state takes its snapshot by forking the
training process (copy-on-write; the child writes the file), so the step that saves still
waits for the ``fork()`` (the kernel copies the process's page tables: the more memory the
process maps, the longer) and for the save's own bookkeeping (the host's free memory, the
state's tensors, the random states). On the 2-core CI host that was 16-18 ms for states of
a few bytes to 32 MB, against the 37 ms a synchronous ``torch.save`` of 32 MB took there.
So the prediction for that fix measures it instead of leaving it out:
:func:`measure_save_block_s` makes three non-blocking saves of a tiny state into a
temporary directory (after one untimed), each waited for, when the report is made, and
remembers the figure for as long as the process's memory stays about the same size.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import tempfile
import time
import warnings

import psutil
import torch

from trainperf.monitor._figures import Figures
from trainperf.monitor._setup import LoopSetup

__all__ = ["measure_save_block_s", "with_save_cost"]

_SAVES = 3
_RSS_BUCKET = 256 << 20  # a remembered figure holds while the memory stays in its bucket
_CACHE: dict[int, float | None] = {}


def _probe() -> float:
    """The median seconds ``save(..., blocking=False)`` of a tiny CPU state blocked for."""
    from trainperf.checkpoint import Checkpointer  # the monitor imports it only here

    state = {"probe": torch.zeros(4)}
    spent: list[float] = []
    with tempfile.TemporaryDirectory(prefix="trainperf-save-probe-") as folder:
        ckpt = Checkpointer(folder, keep=1)
        with warnings.catch_warnings():  # Python 3.12+ warns of forking a threaded process
            warnings.simplefilter("ignore", DeprecationWarning)
            for step in range(_SAVES + 1):
                start = time.perf_counter()
                ckpt.save(state, step=step + 1, blocking=False)
                spent.append(time.perf_counter() - start)
                ckpt.wait()
    return statistics.median(spent[1:])  # the first: the directory and imports, not timed


def measure_save_block_s(*, probe: bool = True) -> float | None:
    """The seconds a non-blocking save of a CPU state blocks this process for (its fork and
    bookkeeping; the writing happens in the forked child); None where saves do not fork
    (not Linux) or it could not be measured. Measured once per size of the process's
    memory (256 MiB buckets), then remembered; ``probe=False`` only looks it up.

    Example:
        >>> spent = measure_save_block_s()
        >>> spent is None or 0 < spent < 5
        True
    """
    if not (sys.platform.startswith("linux") and hasattr(os, "fork")):
        return None
    key = psutil.Process().memory_info().rss // _RSS_BUCKET
    if key not in _CACHE and not probe:
        return None
    if key not in _CACHE:
        try:
            _CACHE[key] = _probe()
        except Exception:  # no memory, no disk, no process slot: not measured
            _CACHE[key] = None
    return _CACHE[key]


def with_save_cost(f: Figures, *, probe: bool = True) -> LoopSetup | None:
    """``f``'s setup with :func:`measure_save_block_s`'s figure, for a CPU loop (no CUDA: a
    GPU state is copied to pinned host buffers instead of forked) with periodic stalls;
    None otherwise."""
    if f.cuda_used or f.stall_period is None or f.stall_fraction <= 0 or not f.stall_steps:
        return None
    spent = measure_save_block_s(probe=probe)
    if spent is None:
        return None
    return dataclasses.replace(f.setup, save_block_s=round(spent, 6))
