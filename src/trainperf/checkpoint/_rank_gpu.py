"""The GPU a rank's collectives in this package run on under NCCL (:func:`on_rank_gpu`):
the restore's agreements, ``save_checkpoint(..., distributed=True)``'s broadcast and
``Checkpointer.preemption()``'s flag comparison; and, under any process group, the GPU
``device="cuda"`` (no index) or ``"auto"`` loads a checkpoint onto (:func:`own_gpu`, applied
by :func:`load_device` for ``load_checkpoint`` and ``Checkpointer.restore`` alike), as DDP's
convention has each rank on its own GPU (``torch.load(map_location="cuda")`` would use the
current device, ``cuda:0`` on every rank for the reason below).

NCCL's object collectives (``all_gather_object``, ``broadcast_object_list``) move the
pickled object to ``torch.cuda.current_device()``, which is ``cuda:0`` on every rank of a
script that never calls ``torch.cuda.set_device`` (one that writes
``model.to(f"cuda:{local_rank}")`` instead): the ranks of a host then share one GPU, and
NCCL hangs or fails ("Duplicate GPU detected"). The rank's GPU is, in order:

- the group's bound device (``init_process_group(..., device_id=...)``);
- the current device, when the script chose one other than ``cuda:0``;
- the local rank's GPU (``LOCAL_RANK``, or ``SLURM_LOCALID`` inside an ``srun`` step, as
  :func:`trainperf.ddp.local_rank` reads it), when that is a whole number below the visible
  GPUs' count (a rank that sees one GPU only, under ``CUDA_VISIBLE_DEVICES`` per rank, keeps
  ``cuda:0``);
- the current device.

A current device of ``cuda:0`` cannot be told from one never chosen: a rank whose local
rank is not 0 but that pinned itself to ``cuda:0`` on purpose (``set_device(0)``, a topology
map) gathers on its local rank's GPU instead; bind the group to the device
(``init_process_group(..., device_id=...)``), which comes first, for such a layout.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from trainperf._utils import launch_env
from trainperf.device import resolve_device

__all__ = ["load_device", "on_rank_gpu", "own_gpu", "rank_gpu"]


def load_device(device: str | int | torch.device | None) -> torch.device:
    """The device a checkpoint's tensors are loaded onto for ``device``, the caller's
    argument as given (:func:`trainperf.device.resolve_device`'s choices): under a process
    group, a GPU without an index or one picked for ``"auto"``/None is the rank's own
    (:func:`own_gpu`). It takes the argument, not a resolved device, because ``"auto"``
    resolves to an indexed GPU (the emptiest: the same one on every rank of a host) that
    cannot be told from an explicit ``"cuda:N"`` afterwards.

    Raises:
        ValueError: ``device`` is none of the choices.
        DeviceError: it asks for a device this machine lacks.
    """
    # resolve_device gives the CPU as plain "cpu", never "cpu:0": torch.load maps onto
    # exactly "cpu", and "cpu:0" failed inside the unpickler, which read as a damaged file
    # (and made restore skip every step).
    dev = resolve_device(device, allowed=("cpu", "cuda", "mps"))
    if dev.type == "cuda" and (dev.index is None or device is None or device == "auto"):
        # Under a process group, "cuda" is the rank's own GPU (DDP's convention), not the
        # current device (cuda:0 on every rank of a script that never calls set_device),
        # nor the GPU with most free memory (the same one on every rank of a host).
        return own_gpu() or dev
    return dev


def rank_gpu() -> torch.device | None:
    """This rank's GPU (the rule is in the module docstring) under an NCCL process group;
    None under another backend, without a group or without CUDA."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or not torch.cuda.is_available():
        return None
    if dist.get_backend() != dist.Backend.NCCL:
        return None
    return own_gpu()


def own_gpu() -> torch.device | None:
    """This rank's GPU by the rule in the module docstring, under a process group of any
    backend; None without a group or without CUDA."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or not torch.cuda.is_available():
        return None
    bound = getattr(dist.group.WORLD, "bound_device_id", None)
    if bound is not None and bound.index is not None:
        return torch.device("cuda", bound.index)
    current = torch.cuda.current_device()
    local = _local_rank()
    if current == 0 and local is not None and local < torch.cuda.device_count():
        return torch.device("cuda", local)
    return torch.device("cuda", current)


def _local_rank() -> int | None:
    """``LOCAL_RANK`` (``SLURM_LOCALID`` inside an ``srun`` step), or None when unset or not a
    whole number: raising here, inside a collective, would leave the other ranks waiting for
    this one."""
    try:
        return launch_env.read_int_or_srun("LOCAL_RANK", "SLURM_LOCALID")
    except ValueError:
        return None


@contextlib.contextmanager
def on_rank_gpu() -> Iterator[torch.device | None]:
    """Make :func:`rank_gpu` the current CUDA device for the block (the caller's current
    device is back after it); nothing changes where it is None. Yields it."""
    gpu = rank_gpu()
    if gpu is None:
        yield None
        return
    with torch.cuda.device(gpu):
        yield gpu
