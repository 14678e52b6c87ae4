"""A :class:`~trainperf.checkpoint.Checkpointer` under a process group: this process's rank
and the world size (:func:`_group`), and, on restore, the small file of a rank other than 0
(its generators and loader positions: :func:`own_part`).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from trainperf._utils.stack import user_stacklevel
from trainperf.checkpoint._files import load_checkpoint
from trainperf.checkpoint._steps import rank_file
from trainperf.errors import CheckpointError

if TYPE_CHECKING:
    from trainperf.checkpoint._checkpointer import Checkpointer

__all__ = ["own_part"]


def _group() -> tuple[int, int]:
    """``(rank, world size)`` of the default process group; ``(0, 1)`` without one."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return int(dist.get_rank()), int(dist.get_world_size())
    return 0, 1


def own_part(ckpt: Checkpointer, step: int, rank: int) -> Mapping[str, Any] | None:
    if rank == 0:
        return None
    path = rank_file(ckpt.directory, step, rank)
    try:
        own = load_checkpoint(path)
    except CheckpointError as e:
        warnings.warn(
            f"rank {rank} has no readable file of its own for step {step} ({e}): its "
            "random states and loader positions come from rank 0's file, so its random "
            "numbers may differ from the interrupted run's",
            UserWarning,
            stacklevel=user_stacklevel(),
        )
        return None
    return own if isinstance(own, Mapping) else None
