"""What bf16 autocast would gain a CPU training step: measured.

On a GPU the reference table gives the fp16/fp32 ratio of whole training steps. For a CPU
there is no table, and a matrix product's ratio says little of a step's: on an AVX-512
BF16 host ``trainperf bench matmul`` measured bf16 3-7x faster than fp32, while a whole
MLP training step ran 1.5x faster, since autocast keeps the loss, the backward's
element-wise work and the optimizer in fp32. So the prediction for
:class:`trainperf.MixedPrecision` on a CPU with native bf16 measures a small training
step (a 3-layer MLP, 512-1024-1024-10, batch 64: forward, backward, SGD) in fp32 and
under bf16 autocast, alternating step by step with the loop's torch threads, once, when the
report is made (about a second), and remembers it.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from trainperf.monitor._figures import INPUT_BOUND_WAIT, Figures
from trainperf.monitor._setup import LoopSetup

__all__ = ["measure_cpu_bf16", "with_cpu_bf16"]

_PROBE_S = 0.8  # the probe alternates steps this long
_MIN_PAIRS = 8  # ... and at least this many of each precision
_MAX_S = 2.0  # ... unless that takes longer than this (two pairs at least)
_CACHE: dict[int, float | None] = {}


def _step() -> Callable[[bool], None]:
    """A seeded MLP training step; ``step(bf16)`` runs one, under bf16 autocast or not."""
    gen = torch.Generator().manual_seed(0)
    model = nn.Sequential(
        nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)
    )
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(64, 512, generator=gen)
    y = torch.randint(0, 10, (64,), generator=gen)

    def step(bf16: bool) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _timed(step: Callable[[bool], None], bf16: bool) -> float:
    start = time.perf_counter()
    step(bf16)
    return time.perf_counter() - start


def _probe() -> float:
    """The fp32 step's median time over the bf16 step's, the two alternating step by step
    (a host's drift and a neighbour's bursts hit both alike; windows of each in turn
    measured 0.9-1.9x on one quiet host, alternate steps 1.5-1.6x)."""
    step = _step()
    step(False)  # the first of each: allocations and kernel choice, not timed
    step(True)
    fp32: list[float] = []
    bf16: list[float] = []
    start = time.perf_counter()
    while len(fp32) < _MIN_PAIRS or time.perf_counter() - start < _PROBE_S:
        fp32.append(_timed(step, False))
        bf16.append(_timed(step, True))
        if len(fp32) >= 2 and time.perf_counter() - start > _MAX_S:
            break  # slow steps: fewer of them
    return statistics.median(fp32) / statistics.median(bf16)


def measure_cpu_bf16(*, probe: bool = True) -> float | None:
    """How much faster a small MLP training step runs under bf16 autocast than in fp32 on
    this CPU, with the current torch threads; None where it could not be measured.
    Measured once per thread count, in about a second, then remembered; ``probe=False``
    only looks it up.

    Example:
        >>> gain = measure_cpu_bf16()
        >>> gain is None or gain > 0
        True
    """
    key = torch.get_num_threads()
    if key not in _CACHE and not probe:
        return None
    if key not in _CACHE:
        try:
            with torch.random.fork_rng(devices=[]):  # the loop's random state untouched
                _CACHE[key] = _probe()
        except RuntimeError:  # bf16 autocast not supported by this build: not measured
            _CACHE[key] = None
    return _CACHE[key]


def with_cpu_bf16(f: Figures, *, probe: bool = True) -> LoopSetup | None:
    """``f``'s setup with :func:`measure_cpu_bf16`'s figure, for a CPU loop (no CUDA, no
    :class:`~trainperf.amp.MixedPrecision` in use) on a CPU with native bf16 that spends
    less than :data:`~trainperf.monitor._figures.INPUT_BOUND_WAIT` of its steps waiting for
    data (where the step's own speed can matter); None otherwise."""
    if f.cuda_used or f.precision is not None or not f.setup.cpu_native_bf16:
        return None
    if f.wait_measured and f.wait_fraction >= INPUT_BOUND_WAIT:
        return None
    gain = measure_cpu_bf16(probe=probe)
    if gain is None:
        return None
    return dataclasses.replace(f.setup, cpu_bf16_speedup=round(gain, 4))
