"""Under DDP every rank tunes in lockstep: the same sizes, the same number of steps.

A DDP-wrapped model all-reduces its gradients inside every ``backward()``, so a rank that
ran one step more or one size fewer than the others would leave them waiting forever. The
tuner therefore takes every decision from figures all ranks agree on: after each warm-up
step, each timed window and each probe, the ranks combine what they measured
(:meth:`Agreement.combine`: the slowest rank's throughput, the largest peak memory, the
smallest memory limit, "out of time" if any rank is), and the decision rules, being pure
functions of those figures, decide the same everywhere. Without a process group (or with
one rank) nothing is exchanged.

The world size is ``torch.distributed.get_world_size()`` when a process group is
initialised, else 1.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["Agreement", "world_size"]


def world_size() -> int:
    """Ranks in the default process group, or 1 without one.

    Example:
        >>> world_size()
        1
    """
    if dist.is_available() and dist.is_initialized():
        return int(dist.get_world_size())
    return 1


class Agreement:
    """Combines per-rank figures so that every rank decides alike.

    Example:
        >>> Agreement().combine(maxima=[1.0, 2.0], minima=[5.0])
        ([1.0, 2.0], [5.0])
    """

    def __init__(self) -> None:
        self.world_size = world_size()
        self._device: torch.device | None = None
        if self.world_size > 1 and dist.get_backend() == "nccl":
            self._device = torch.device("cuda", torch.cuda.current_device())

    @property
    def active(self) -> bool:
        """True when there are other ranks to agree with."""
        return self.world_size > 1

    def combine(
        self, maxima: Sequence[float] = (), minima: Sequence[float] = ()
    ) -> tuple[list[float], list[float]]:
        """The largest of each ``maxima`` value and the smallest of each ``minima`` value
        over all ranks (one all-reduce)."""
        if not self.active:
            return list(maxima), list(minima)
        values = [float(v) for v in maxima] + [-float(v) for v in minima]
        t = torch.tensor(values, dtype=torch.float64, device=self._device or "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out = t.tolist()
        n = len(maxima)
        return out[:n], [-v for v in out[n:]]

    def any(self, flag: bool) -> bool:
        """True when ``flag`` is True on any rank."""
        return bool(self.combine(maxima=[1.0 if flag else 0.0])[0][0])
