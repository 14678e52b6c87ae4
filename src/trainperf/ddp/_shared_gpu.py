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

from trainperf.errors import DeviceError

__all__ = ["refuse_shared_gpu", "sharing_ranks"]


def sharing_ranks(uuids: list[str]) -> list[int]:
    """The local ranks whose GPU another local rank uses too (``uuids[r]``: rank r's card).

    Example:
        >>> sharing_ranks(["GPU-a", "GPU-b"]), sharing_ranks(["GPU-a", "GPU-b", "GPU-a"])
        ([], [0, 2])
    """
    return [r for r, uuid in enumerate(uuids) if uuids.count(uuid) > 1]


_WAIT = timedelta(seconds=30)
"""How long a rank waits for the other local ranks' cards: they all joined the group just
before, so they post at once, except a rank that sees several GPUs (``CUDA_VISIBLE_DEVICES``
differs on the node), which posts nothing; without a bound this rank would wait for it until
the store's timeout while it waits in NCCL's eager start for this one."""


def refuse_shared_gpu(
    store: Any,
    local_rank: int,
    local_world_size: int,
    uuid: str,
    host: str | None = None,
    wait: timedelta = _WAIT,
) -> None:
    """Post this rank's GPU (``uuid``) on ``store``, read every local rank's, and raise if
    this rank shares its card with another; no check where a local rank posts nothing
    within ``wait`` (one that sees several GPUs).

    Raises:
        DeviceError: another rank on this node uses the same GPU.
    """
    host = socket.gethostname() if host is None else host
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    prefix = f"trainperf/gpu/{restart}/{host}/"
    store.set(f"{prefix}{local_rank}", uuid)
    keys = [f"{prefix}{r}" for r in range(local_world_size)]
    try:
        store.wait(keys, wait)
    except RuntimeError:  # DistStoreError: a rank that sees several GPUs posts no card
        return
    shared = sharing_ranks([store.get(key).decode() for key in keys])
    if local_rank in shared:
        raise DeviceError(_message(shared, local_world_size, host))


def _message(shared: list[int], local_world_size: int, host: str) -> str:
    shown = os.environ.get("CUDA_VISIBLE_DEVICES")
    return (
        f"local ranks {', '.join(map(str, shared))} on {host} share one GPU: "
        f"{local_world_size} ranks run on this node and each sees 1 GPU "
        f"(CUDA_VISIBLE_DEVICES={shown!r}), the same card; backend='nccl' needs a GPU of "
        "its own for every rank (NCCL fails with 'Duplicate GPU detected'). Start at most as "
        "many ranks per node as it has GPUs (torchrun --nproc-per-node, srun "
        "--ntasks-per-node), give each task its own card (srun --gpus-per-task=1), or use "
        "backend='gloo' to test on CPU"
    )
