"""A :class:`~trainperf.checkpoint.Checkpointer` under a process group: this process's rank
and the world size (:func:`_group`), and, on restore, the small file of a rank other than 0
(its generators and loader positions: :func:`own_part`), refused when it holds another step
or rank than its name says, or is complete but unloadable here (a newer PyTorch's), and the
ranks' agreement on what they restore (:func:`agree`): one ``all_gather_object``, reached
by every rank even after a failure of its own, so that a rank that fails before it (cannot
list the directory or read a file), refuses its file, or finds another step, makes every
rank raise instead of leaving the others waiting for the group's timeout or in their next
collective; and a second one once each rank has loaded that step into its objects, or
failed to (:func:`agree_loaded`), so that a rank whose objects do not match the file makes
every rank raise too.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from trainperf._utils.stack import user_stacklevel
from trainperf.checkpoint._checkpointer_warn import stop_at
from trainperf.checkpoint._files import load_checkpoint
from trainperf.checkpoint._payload import RESERVED, saved_step
from trainperf.checkpoint._rank_gpu import on_rank_gpu
from trainperf.checkpoint._skim import skim
from trainperf.checkpoint._steps import main_file, rank_file, refuse_misnamed
from trainperf.errors import CheckpointError

if TYPE_CHECKING:
    from trainperf.checkpoint._checkpointer import Checkpointer

__all__ = ["agree", "agree_loaded", "agreed_own_part", "own_part"]


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
            renamed from another step's or rank's file), or it was saved by a newer
            PyTorch, as for the main file.
        UnsafeCheckpointError: it holds values ``weights_only=True`` refuses, as for the
            main file.
    """
    if rank == 0:
        return None
    path = rank_file(ckpt.directory, step, rank)
    _refuse_misnamed_unloaded(path, step, rank)
    try:
        own: Mapping[str, Any] = load_checkpoint(path)  # saved_step checks it is one
        held = saved_step(own, str(path))
    except (CheckpointError, ValueError) as e:
        stop = stop_at(e, step, path, instead="rank 0's random states")
        if stop is not None:
            raise stop from e
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


def _refuse_misnamed_unloaded(path: Path, step: int, rank: int) -> None:
    """Refuse rank ``rank``'s file ``path`` of step ``step`` when its pickle alone shows it
    holds another step or rank, before the full load reads its tensors (as the main file is
    refused). A file it cannot tell about (cut short, unreadable, foreign) is left to the
    full load, which warns or raises as it should."""
    try:
        skimmed = skim(path)
        held = saved_step(skimmed, str(path))
    except Exception:
        return
    held_rank = _saved_rank(skimmed, rank)
    refuse_misnamed("restore", path, step, held, named_rank=rank, held_rank=held_rank)


def _saved_rank(own: Mapping[str, Any], named: int) -> int:
    """The rank a rank file says it was written by (``named``, its name's, if it says
    none)."""
    said = own[RESERVED].get("rank")
    return said if type(said) is int else named


def agreed_own_part(ckpt: Checkpointer, step: int, rank: int) -> Mapping[str, Any] | None:
    """:func:`own_part`, then :func:`agree` on step ``step`` with the other ranks (its
    failure, if any, is shared with them first, then raised here).

    Raises:
        CheckpointError: as :func:`own_part`, or as :func:`agree`.
    """
    try:
        own = own_part(ckpt, step, rank)
    except Exception as e:
        agree(ckpt.directory, step, failure=e)
        raise
    agree(ckpt.directory, step)
    return own


def agree(directory: Path, step: int | None, failure: Exception | None = None) -> None:
    """Under a process group of two or more ranks, tell every rank which step this rank
    restores (0: none; None: it failed before it found one) and whether it failed
    (``failure``: its own part, or anything before), and raise unless all of them restore
    the same step without a failure; without one, do nothing. With a ``failure`` of its
    own, this rank returns (its caller raises that) whatever the others said.

    Raises:
        CheckpointError: another rank failed before the agreement or to read its own part
            (the message names the rank(s) and why), the ranks found different newest steps
            (the directory is not the same for every rank), or the other ranks never came
            (``restore`` was not called on every rank: the group's timeout passed).
    """
    if not _in_group():
        return
    rank, _ = _group()
    try:
        said = _gathered((step, _said(failure)))
    except Exception as e:
        if failure is not None:
            return  # this rank's own failure is the news
        raise CheckpointError(
            "Checkpointer.restore is a collective under a process group, but rank "
            f"{rank} waited for the other ranks in vain ({type(e).__name__}: {e}): call "
            "restore on every rank (before the training loop)",
            directory,
        ) from e
    if failure is None:
        _refuse_disagreement(directory, step, rank, said)


def _refuse_disagreement(directory: Path, step: int | None, rank: int, said: list[Any]) -> None:
    """Raise when another rank failed before the agreement or to read its own part of a
    step, or restores another step than ``step`` (what this rank, ``rank``, restores);
    ``said[r]`` is rank ``r``'s ``(step or None, failure or None)``."""
    early = [(r, why) for r, (s, why) in enumerate(said) if s is None and why is not None]
    if early:
        whose = "; ".join(
            f"rank {r} failed before the ranks agreed on a step ({why})" for r, why in early
        )
        raise CheckpointError(
            f"Checkpointer.restore stops on rank {rank}: {whose}; nothing was loaded on this "
            "rank: see that rank's error for the fix",
            directory,
        )
    failed = [(r, s, why) for r, (s, why) in enumerate(said) if why is not None]
    if failed:
        whose = ", ".join(f"rank {r} ({why})" for r, _, why in failed)
        raise CheckpointError(
            f"Checkpointer.restore stops at step {step} on rank {rank}: another rank could "
            f"not restore its own part: {whose}; nothing was loaded on this rank",
            rank_file(directory, failed[0][1], failed[0][0]),
        )
    steps = [s for s, _ in said]
    if len(set(steps)) > 1:
        found = ", ".join(f"rank {r}: {s or 'none'}" for r, s in enumerate(steps))
        raise CheckpointError(
            f"Checkpointer.restore: the ranks found different newest steps in {directory} "
            f"({found}), so they would resume from different states; put the directory "
            "on a filesystem every rank sees, with the same files for each",
            main_file(directory, max(steps)),
        )


def agree_loaded(directory: Path, step: int, failure: Exception | None = None) -> None:
    """Under a process group of two or more ranks, once every rank has put step ``step`` into
    its live objects, tell every rank whether this rank failed to (``failure``), and raise on
    the ranks that did not fail when another did, so that none goes on to its next collective
    and waits there for the failed one until the group's timeout; without one, do nothing.
    With a ``failure`` of its own, this rank returns (its caller raises that).

    Raises:
        CheckpointError: another rank could not load its state (the message names the
            rank(s) and their errors), or the other ranks never came (one died or is stuck
            loading: the group's timeout passed); this rank's state was loaded either way.
    """
    if not _in_group():
        return
    rank, _ = _group()
    try:
        said = _gathered(_said(failure))
    except Exception as e:
        if failure is not None:
            return  # this rank's own failure is the news
        raise CheckpointError(
            f"Checkpointer.restore loaded step {step} on rank {rank}, then waited in vain for "
            f"the other ranks to say they had loaded it too ({type(e).__name__}: {e}): one "
            "may have died or be stuck loading; do not go on training with ranks out of step",
            main_file(directory, step),
        ) from e
    failed = [(r, why) for r, why in enumerate(said) if why is not None]
    if failure is None and failed:
        whose = "; ".join(f"rank {r} ({why})" for r, why in failed)
        raise CheckpointError(
            f"Checkpointer.restore stops on rank {rank}: another rank could not load step "
            f"{step} into its objects: {whose}; this rank's state was loaded, but training "
            "must not go on with the ranks out of step: fix that rank's error (its objects "
            "must match the ones the checkpoint was saved from) and restore again",
            main_file(directory, step),
        )


def _in_group() -> bool:
    """Whether a default process group of two or more ranks is up."""
    dist = torch.distributed
    return bool(dist.is_available() and dist.is_initialized() and dist.get_world_size() >= 2)


def _gathered(mine: Any) -> list[Any]:
    """Every rank's ``mine``, in rank order (one ``all_gather_object``, under NCCL on this
    rank's GPU: :func:`~._rank_gpu.on_rank_gpu`); raises what it raises (the group's timeout
    passed)."""
    said: list[Any] = [None] * _group()[1]
    with on_rank_gpu():
        torch.distributed.all_gather_object(said, mine)
    return said


def _said(failure: Exception | None) -> str | None:
    """What the other ranks are told of this rank's ``failure``: its type and message."""
    return None if failure is None else f"{type(failure).__name__}: {failure}"
