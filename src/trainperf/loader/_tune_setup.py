"""What a ``tune_loader`` call settles before it measures anything: the device, the host's
limits and this rank's share of them (:func:`rank_share`), and the bounds of the search.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from trainperf.device import resolve_device
from trainperf.limits import HostLimits, host_limits, local_world_size, usable_cpus
from trainperf.loader._faults import start_method
from trainperf.loader._search import default_max_workers

__all__ = ["rank_share"]


def rank_share(limits: HostLimits, local_ranks: int) -> HostLimits:
    """The memory and ``/dev/shm`` one of ``local_ranks`` training processes may give its
    loader: each rank starts its own workers with the settings chosen (a host's ranks
    share one tuning), so the available memory and the free ``/dev/shm`` are divided
    between them. The CPUs are :func:`~trainperf.limits.usable_cpus`'s.

    Example:
        >>> limits = HostLimits(8, 8, None, 8, 2**35, None, 2**34, 2**33, 2**33)
        >>> share = rank_share(limits, 4)
        >>> share.memory_available == 2**32, share.shm_free == 2**31
        (True, True)
    """
    if local_ranks <= 1:
        return limits
    shm = None if limits.shm_free is None else limits.shm_free // local_ranks
    return dataclasses.replace(
        limits, memory_available=limits.memory_available // local_ranks, shm_free=shm
    )


@dataclass(frozen=True)
class _Setup:
    """What a call settles before measuring: the device, the limits, the search's bounds."""

    device: torch.device
    limits: HostLimits
    share: HostLimits  # the memory and /dev/shm this rank's loader may use
    local_ranks: int
    cpus: int
    max_workers: int
    start_method: str
    pin_options: tuple[bool, ...]
    budget_s: float
    batch_size: int

    def report_fields(self) -> dict[str, Any]:
        """The :class:`TuningReport` fields known before anything is measured."""
        return {
            "budget_s": self.budget_s,
            "limits": self.limits,
            "cpus": self.cpus,
            "max_workers": self.max_workers,
            "device": str(self.device),
            "batch_size": self.batch_size,
        }


def _set_up(
    batch_size: int,
    device: str | torch.device | None,
    max_workers: int | None,
    budget_s: float,
    loader_kwargs: Mapping[str, Any],
) -> _Setup:
    dev = resolve_device(device)
    limits = host_limits()
    ranks = local_world_size()
    cpus = usable_cpus(ranks, limits=limits)
    user_pin = loader_kwargs.get("pin_memory")
    if user_pin is not None:
        pin_options: tuple[bool, ...] = (bool(user_pin),)
    else:
        pin_options = (True, False) if dev.type == "cuda" else (False,)
    return _Setup(
        device=dev,
        limits=limits,
        share=rank_share(limits, ranks),
        local_ranks=ranks,
        cpus=cpus,
        max_workers=default_max_workers(cpus) if max_workers is None else max_workers,
        start_method=start_method(loader_kwargs),
        pin_options=pin_options,
        budget_s=float(budget_s),
        batch_size=batch_size,
    )
