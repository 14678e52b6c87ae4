"""Ranks of one node on one GPU under NCCL, refused before NCCL's own "Duplicate GPU
detected" error (which names neither the ranks nor the fix).

Used by :mod:`~trainperf.ddp._injob` (torchrun, SLURM): ``launch``'s own ranks are refused
earlier, in the launcher (``nprocs`` > visible GPUs). A rank that sees one GPU cannot tell
alone whether the scheduler bound one card to each task (intended) or every task of the
node sees the same card; the local ranks compare the cards' UUIDs on the rendezvous store.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any

from trainperf.errors import DeviceError, LaunchError

__all__ = ["refuse_shared_gpu", "sharing_ranks"]


def sharing_ranks(uuids: list[str]) -> list[int]:
    """The local ranks whose GPU another local rank uses too (``uuids[r]``: rank r's card).

    Example:
        >>> sharing_ranks(["GPU-a", "GPU-b"]), sharing_ranks(["GPU-a", "GPU-b", "GPU-a"])
        ([], [0, 2])
    """
    return [r for r, uuid in enumerate(uuids) if uuids.count(uuid) > 1]


def refuse_shared_gpu(
    store: Any,
    local_rank: int,
    local_world_size: int,
    uuid: str,
    wait: timedelta,
    host: str | None = None,
) -> None:
    """Post this rank's GPU (``uuid``) on ``store``, read every local rank's (waiting up to
    ``wait``, the group's timeout: nothing lines the ranks up before this), and raise if
    this rank shares its card with another.

    Raises:
        DeviceError: another rank on this node uses the same GPU.
        LaunchError: a local rank posted no card within ``wait``.
    """
    host = socket.gethostname() if host is None else host
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    prefix = f"trainperf/gpu/{restart}/{host}/"
    store.set(f"{prefix}{local_rank}", uuid)
    keys = [f"{prefix}{r}" for r in range(local_world_size)]
    try:
        store.wait(keys, wait)
    except RuntimeError as e:  # DistStoreError: a rank failed or never got this far
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
        raise LaunchError(
            f"local ranks {missing} on {host} did not reach the GPU check within {wait} "
            f"(this is local rank {local_rank}): they failed or are still starting; their "
            "own errors name the cause"
        ) from e
    shared = sharing_ranks([store.get(key).decode() for key in keys])
    if local_rank in shared:
        raise DeviceError(_message(shared, local_world_size, host, _visible_count()))


def _visible_count() -> int:
    import torch

    return int(torch.cuda.device_count())


def _message(shared: list[int], local_world_size: int, host: str, visible: int) -> str:
    shown = os.environ.get("CUDA_VISIBLE_DEVICES")
    return (
        f"local ranks {', '.join(map(str, shared))} on {host} share one GPU: "
        f"{local_world_size} ranks run on this node and use the same card (this rank sees "
        f"{visible} GPU{'s' if visible != 1 else ''}, CUDA_VISIBLE_DEVICES={shown!r}); "
        "backend='nccl' needs a GPU of its own for every rank (NCCL fails with 'Duplicate "
        "GPU detected'). Start at most as many ranks per node as it has GPUs (torchrun "
        "--nproc-per-node, srun --ntasks-per-node), give each task its own card (srun "
        "--gpus-per-task=1), or use backend='gloo' to test on CPU"
    )
