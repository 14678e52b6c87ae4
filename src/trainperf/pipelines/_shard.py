"""Each rank's share of the files: the sharding plan and every epoch's order.

Every rank yields the same number of batches per epoch (so no rank waits forever in a
collective), in exactly ``DistributedSampler``'s order.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from trainperf._utils import launch_env

__all__ = ["Shard", "epoch_batches", "epoch_indices", "resolve_shard", "shard_plan"]


@dataclass(frozen=True)
class Shard:
    """One rank's share of an epoch, the same length on every rank.

    Attributes:
        rank: this process's index among ``world_size``.
        world_size: number of processes reading disjoint shards.
        samples: images this rank yields per epoch.
        batches: batches this rank yields per epoch.
        last_batch_size: size of the final batch (``batch_size`` unless it is partial).
    """

    rank: int
    world_size: int
    samples: int
    batches: int
    last_batch_size: int


def resolve_shard(shard: Literal["auto"] | tuple[int, int] | None) -> tuple[int, int]:
    """``(rank, world_size)`` for ``shard``.

    ``"auto"``: :func:`trainperf.ddp.rank` and :func:`trainperf.ddp.world_size` (the
    process group's when one is initialised, else torchrun's ``RANK``/``WORLD_SIZE``
    variables, or in a task of an ``srun`` step of several SLURM's ``SLURM_PROCID`` and
    ``SLURM_NTASKS``, so the process group may come later) when a process group exists or
    the variables say which rank this is; else ``(0, 1)``. ``None`` means ``(0, 1)``: this
    process reads everything. A tuple's integers may be NumPy's (or one-element torch
    integers); they come back as Python ints. A bool is refused.

    Raises:
        ValueError: a malformed tuple, or ``rank`` outside ``[0, world_size)`` (given, or
            from the process group or the environment).

    Example:
        >>> import numpy as np
        >>> resolve_shard((1, 4)), resolve_shard(None), resolve_shard((np.int64(0), 2))
        ((1, 4), (0, 1), (0, 2))
    """
    if shard is None:
        return 0, 1
    if isinstance(shard, str):
        if shard != "auto":
            raise ValueError(
                f"shard must be 'auto', None or a (rank, world_size) tuple, got {shard!r}"
            )
        import torch.distributed as dist

        import trainperf.ddp as ddp

        grouped = dist.is_available() and dist.is_initialized()
        # A lone RANK or WORLD_SIZE is not a launch (ddp.rank() would default the other one
        # and give a shard that no other process reads alongside): read everything then.
        launched = launch_env.is_set("RANK") and launch_env.is_set("WORLD_SIZE")
        if not grouped and not launched and not launch_env.in_srun_step():
            return 0, 1
        return resolve_shard((ddp.rank(), ddp.world_size()))
    pair = _int_pair(shard)
    if pair is None:
        raise ValueError(
            f"shard must be 'auto', None or a (rank, world_size) tuple of ints, got {shard!r}"
        )
    rank, world = pair
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"shard needs 0 <= rank < world_size, got rank={rank}, world_size={world}")
    return rank, world


def _int_pair(shard: object) -> tuple[int, int] | None:
    """``shard`` as two Python ints if it is a 2-tuple of integers (NumPy's and one-element
    torch integers too, as in a config read from an array), else None. A bool is not a rank."""
    if not isinstance(shard, tuple) or len(shard) != 2:
        return None
    pair = []
    for value in shard:
        if isinstance(value, (bool, np.bool_)) or getattr(value, "dtype", None) == torch.bool:
            return None
        try:
            pair.append(operator.index(value))
        except TypeError:  # a float, a string, a float tensor...
            return None
    return pair[0], pair[1]


def shard_plan(
    num_files: int,
    batch_size: int,
    rank: int,
    world_size: int,
    last_batch: Literal["drop", "keep"],
) -> Shard:
    """How many samples and batches every rank yields per epoch.

    ``"keep"`` pads each rank to ``ceil(N / world_size)`` samples by repeating some (as
    ``DistributedSampler`` does) and keeps a partial last batch; ``"drop"`` trims each rank to
    ``floor(N / world_size)`` samples and drops the partial batch. Either way every rank
    yields the same number of batches, so no rank waits forever in a collective.

    Raises:
        ValueError: a rank would get no batch at all (more ranks than images, or
            ``batch_size`` larger than a rank's share, with ``"drop"``).

    Example:
        >>> shard_plan(25, 4, 0, 2, "keep")
        Shard(rank=0, world_size=2, samples=13, batches=4, last_batch_size=1)
        >>> shard_plan(25, 4, 1, 2, "drop").batches
        3
    """
    if last_batch == "drop":
        per_rank = num_files // world_size
        batches = per_rank // batch_size
        samples, last = batches * batch_size, batch_size
    else:
        per_rank = math.ceil(num_files / world_size)
        batches = math.ceil(per_rank / batch_size)
        samples, last = per_rank, per_rank - (batches - 1) * batch_size
    if per_rank == 0:  # only with "drop": no batch_size gives a rank an image
        raise ValueError(
            f"{world_size} ranks but only {num_files} images, so with last_batch='drop' every "
            "rank gets none; pass last_batch='keep' (ranks repeat images to fill their "
            f"shards), use at most {num_files} ranks, or add images"
        )
    if batches == 0:
        raise ValueError(
            f"batch_size={batch_size} is larger than the {per_rank} images each of "
            f"{world_size} rank(s) gets from {num_files} images, so an epoch would be empty; "
            "lower batch_size or pass last_batch='keep'"
        )
    return Shard(rank, world_size, samples, batches, last)


def epoch_indices(
    num_files: int,
    rank: int,
    world_size: int,
    *,
    shuffle: bool,
    seed: int,
    epoch: int,
    last_batch: Literal["drop", "keep"],
) -> list[int]:
    """This rank's file indices for one epoch, exactly as ``DistributedSampler`` orders them.

    A permutation from a generator seeded with ``seed + epoch`` (identity without shuffle),
    padded by wrapping round (``"keep"``) or trimmed (``"drop"``) to a multiple of
    ``world_size``, then every ``world_size``-th index from ``rank``.

    Example:
        >>> epoch_indices(5, 1, 2, shuffle=False, seed=0, epoch=0, last_batch="keep")
        [1, 3, 0]
    """
    if shuffle:
        g = torch.Generator()
        g.manual_seed((seed + epoch) % 2**64)  # what DistributedSampler seeds, within 64 bits
        order: list[int] = torch.randperm(num_files, generator=g).tolist()
    else:
        order = list(range(num_files))
    if last_batch == "drop":
        order = order[: (num_files // world_size) * world_size]
    else:
        total = math.ceil(num_files / world_size) * world_size
        pad = total - num_files
        order += (order * math.ceil(pad / num_files))[:pad] if pad else []
    return order[rank::world_size]


def epoch_batches(
    num_files: int,
    shard: Shard,
    batch_size: int,
    *,
    shuffle: bool,
    seed: int,
    epoch: int,
    last_batch: Literal["drop", "keep"],
) -> list[list[int]]:
    """This rank's batches of file indices for one epoch: :func:`epoch_indices` cut into
    ``shard.batches`` batches of ``batch_size`` (the last one partial with ``"keep"``).

    Example:
        >>> epoch_batches(5, shard_plan(5, 2, 0, 1, "keep"), 2, shuffle=False, seed=0, epoch=0,
        ...               last_batch="keep")
        [[0, 1], [2, 3], [4]]
    """
    order = epoch_indices(
        num_files,
        shard.rank,
        shard.world_size,
        shuffle=shuffle,
        seed=seed,
        epoch=epoch,
        last_batch=last_batch,
    )
    starts = range(0, len(order), batch_size)
    return [order[i : i + batch_size] for i in starts][: shard.batches]
