"""A :class:`~trainperf.checkpoint.Checkpointer` under a process group: this process's rank
and the world size (:func:`_group`), and, on restore, the small file of a rank other than 0
(its generators and loader positions: :func:`own_part`), refused when it holds another step
or rank than its name says.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from trainperf._utils.stack import user_stacklevel
from trainperf.checkpoint._files import load_checkpoint
from trainperf.checkpoint._payload import RESERVED, saved_step
from trainperf.checkpoint._steps import rank_file, refuse_misnamed
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
    """Rank ``rank``'s own file of step ``step`` (its generators and loader positions), or
    None: on rank 0 (whose are in the main file), or with a warning when the file is missing,
    damaged or not one ``Checkpointer.save`` wrote (rank 0's file stands in).

    Raises:
        CheckpointError: the file holds another step or rank than its name says (copied or
            renamed from another step's or rank's file), as for the main file.
    """
    if rank == 0:
        return None
    path = rank_file(ckpt.directory, step, rank)
    try:
        own: Mapping[str, Any] = load_checkpoint(path)  # saved_step checks it is one
        held = saved_step(own, str(path))
    except (CheckpointError, ValueError) as e:
        warnings.warn(
            f"rank {rank} has no readable file of its own for step {step} ({e}): its "
            "random states and loader positions come from rank 0's file, so its random "
            "numbers may differ from the interrupted run's",
            UserWarning,
            stacklevel=user_stacklevel(),
        )
        return None
    refuse_misnamed("restore", path, step, held, named_rank=rank, held_rank=_saved_rank(own, rank))
    return own


def _saved_rank(own: Mapping[str, Any], named: int) -> int:
    """The rank a rank file says it was written by (``named``, its name's, if it says
    none)."""
    said = own[RESERVED].get("rank")
    return said if type(said) is int else named
