"""Helpers for code that runs on every rank: who am I, reduce, print once, wrap, shard data.

Every helper also works in a plain single process (no process group): rank 0 of 1, the
main process, collectives that return their input. So a training function written for
``launch`` can be called directly while debugging.
"""

from __future__ import annotations

import math
import os
import sys
import warnings
from collections.abc import Iterator
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from trainperf._utils import launch_env
from trainperf._utils.format import plural
from trainperf._utils.lifetime import DieWithParent
from trainperf._utils.validate import non_negative_int, positive_int, worker_numbers

__all__ = [
    "DistributedLoader",
    "all_reduce_mean",
    "barrier",
    "distributed_loader",
    "is_main_process",
    "local_rank",
    "print0",
    "rank",
    "wrap_model",
    "world_size",
]

T = TypeVar("T")


def _initialised() -> bool:
    return dist.is_available() and dist.is_initialized()


def _env_or_slurm(name: str, slurm: str, default: int) -> int:
    """``name`` from the environment; else, in an srun task, ``slurm``; else ``default``."""
    value = launch_env.read_int_or_srun(name, slurm)
    return default if value is None else value


def rank() -> int:
    """This process's global rank: from the process group, else ``RANK``, else (one task
    of an ``srun`` step of several) ``SLURM_PROCID``, else 0.

    Raises:
        ValueError: ``RANK`` (or the SLURM variable read) is set but is not a whole number
            >= 0.

    Example:
        >>> rank()
        0
    """
    return dist.get_rank() if _initialised() else _env_or_slurm("RANK", "SLURM_PROCID", 0)


def local_rank() -> int:
    """This process's rank on its node (its GPU index): ``LOCAL_RANK``, else (one task of
    an ``srun`` step of several) ``SLURM_LOCALID``, else 0.

    Raises:
        ValueError: ``LOCAL_RANK`` (or ``SLURM_LOCALID``) is set but is not a whole number
            >= 0.

    Example:
        >>> local_rank()
        0
    """
    return _env_or_slurm("LOCAL_RANK", "SLURM_LOCALID", 0)


def world_size() -> int:
    """Number of ranks: from the process group, else ``WORLD_SIZE``, else (one task of an
    ``srun`` step of several) the step's tasks (``SLURM_STEP_NUM_TASKS``, else
    ``SLURM_NTASKS``, which ``srun --preserve-env`` leaves at the job's), else 1.

    Raises:
        ValueError: ``WORLD_SIZE`` (or the SLURM variable read) is set but is not a whole
            number >= 1.

    Example:
        >>> world_size()
        1
    """
    if _initialised():
        return dist.get_world_size()
    return _env_or_slurm("WORLD_SIZE", launch_env.step_tasks_variable(), 1)


def _checked_epoch(epoch: object) -> int:
    """``epoch`` as a Python int, the one check of every ``set_epoch`` here (a NumPy epoch
    kept as given would reach the shuffle's seed and a checkpoint as NumPy).

    Example:
        >>> import numpy as np
        >>> type(_checked_epoch(np.int64(2)))
        <class 'int'>
    """
    return non_negative_int("epoch", epoch)


def _layout() -> tuple[int, int]:
    """``(world_size(), rank())`` for a sampler; a rank the world size cannot hold (a stray
    ``RANK`` without ``WORLD_SIZE``) is refused with the variables that say so."""
    replicas, here = world_size(), rank()
    if here >= replicas:
        raise ValueError(
            f"rank {here} is not below the world size {replicas}: without a process group "
            f"both come from the environment (RANK={os.environ.get('RANK')!r}, WORLD_SIZE="
            f"{os.environ.get('WORLD_SIZE')!r}); set WORLD_SIZE to the number of ranks, or "
            "unset RANK in a single process"
        )
    return replicas, here


def is_main_process() -> bool:
    """True on global rank 0 (and in a plain single process).

    Example:
        >>> is_main_process()
        True
    """
    return rank() == 0


def barrier() -> None:
    """Wait until every rank gets here; does nothing without a process group.

    Example:
        >>> barrier()
    """
    if _initialised():
        dist.barrier()


def print0(*args: Any, **kwargs: Any) -> None:
    """``print`` on rank 0 only (flushed, so it is not lost if the job is killed).

    Example:
        >>> print0("loss", 0.25)
        loss 0.25
    """
    if is_main_process():
        kwargs.setdefault("flush", True)
        print(*args, **kwargs)


def _rank_device() -> torch.device:
    """Where this rank's model lives: its GPU under NCCL, the CPU under gloo."""
    if _initialised():
        if "nccl" in str(dist.get_backend()):
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_mean(tensor: torch.Tensor) -> torch.Tensor:
    """The element-wise mean of ``tensor`` over all ranks, as a new tensor (input untouched).

    Integer tensors are averaged in the default float dtype. Under NCCL a CPU tensor makes
    a round trip through this rank's GPU and comes back on the CPU.

    Args:
        tensor: the same shape on every rank.

    Returns:
        The mean, on ``tensor``'s device.

    Raises:
        TypeError: ``tensor`` is not a tensor.

    Example:
        >>> all_reduce_mean(torch.tensor([1.0, 3.0]))
        tensor([1., 3.])
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(
            f"all_reduce_mean needs a torch.Tensor, got {type(tensor).__name__}; "
            "wrap numbers with torch.tensor(value)"
        )
    out = tensor.detach().clone()
    if not (out.is_floating_point() or out.is_complex()):
        out = out.to(torch.get_default_dtype())
    if not _initialised():
        return out
    work = out
    if "nccl" in str(dist.get_backend()) and out.device.type != "cuda":
        work = out.to(_rank_device())
    dist.all_reduce(work, op=dist.ReduceOp.SUM)
    work /= dist.get_world_size()
    return work.to(out.device) if work is not out else work


def wrap_model(model: nn.Module, **ddp_kwargs: Any) -> nn.Module:
    """Move ``model`` to this rank's device and wrap it in ``DistributedDataParallel``.

    ``device_ids`` is passed only on a GPU (DDP refuses it for CPU modules). Without a
    process group the model is only moved and returned unwrapped, so the same training
    function runs in a single process.

    Args:
        model: a plain (unwrapped) module.
        **ddp_kwargs: passed to ``DistributedDataParallel`` (``find_unused_parameters``,
            ``gradient_as_bucket_view``, ...).

    Returns:
        The DDP-wrapped model (or the moved model without a process group).

    Raises:
        ValueError: ``model`` is already wrapped in DataParallel or DDP.

    Example:
        >>> net = wrap_model(torch.nn.Linear(2, 1))
        >>> type(net).__name__, next(net.parameters()).device.type
        ('Linear', 'cpu')
    """
    wrappers = (nn.DataParallel, nn.parallel.DistributedDataParallel)
    if isinstance(model, wrappers):
        raise ValueError(
            f"wrap_model got a model already wrapped in {type(model).__name__}; pass the "
            "plain module (trainperf.checkpoint.unwrap_model(model) peels wrappers)"
        )
    device = _rank_device()
    model.to(device)
    if not _initialised():
        return model
    if device.type == "cuda":
        ddp_kwargs.setdefault("device_ids", [device.index])
        ddp_kwargs.setdefault("output_device", device.index)
    return nn.parallel.DistributedDataParallel(model, **ddp_kwargs)


class _AutoEpochSampler(DistributedSampler[T]):
    """A DistributedSampler whose epoch moves on by itself after each pass, and whose rank
    and world size are the process's when it is iterated.

    ``set_epoch(e)`` still works (and sets the epoch of the next pass), so code written for
    a plain DistributedSampler behaves the same; code that forgets it no longer repeats
    the first epoch's order forever. A loader built before the ranks started (in a
    notebook cell, then handed to ``launch``) was built for rank 0 of 1: each rank would
    read the whole dataset; it takes its own rank's shard instead.
    """

    def _follow(self) -> None:
        """Take this process's rank and world size, if they changed since it was built."""
        replicas, here = _layout()
        if (replicas, here) == (self.num_replicas, self.rank):
            return
        self.num_replicas, self.rank = replicas, here
        n = len(self.dataset)  # type: ignore[arg-type]
        if self.drop_last and n % replicas != 0:
            self.num_samples = math.ceil((n - replicas) / replicas)
        else:
            self.num_samples = math.ceil(n / replicas)
        self.total_size = self.num_samples * replicas

    # The pass whose last batch's indices have not been drawn yet (None: none, or the epoch
    # was set since); a pass that starts while one is left open warns once (_warn_open).
    _open: object | None = None
    _warned_open = False
    # The loader's batch_size and drop_last (distributed_loader sets them): with drop_last
    # the indices past the last whole batch are drawn only by a request after it.
    batch_size = 1
    drop_last_batch = False

    @property
    def epoch(self) -> int:
        return self._epoch

    @epoch.setter
    def epoch(self, value: int) -> None:
        # Set by hand (set_epoch, a checkpoint's restore): no pass is left open any more.
        self._epoch = value
        self._open = None

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A sampler pickled before epoch became a property holds it as "epoch".
        if "epoch" in state:
            state["_epoch"] = state.pop("epoch")
        self.__dict__.update(state)

    def __iter__(self) -> Iterator[T]:
        self._follow()
        if self._open is not None:
            self._warn_open()
        indices = list(super().__iter__())
        self.epoch += 1
        last = len(indices)
        if self.drop_last_batch:
            last -= last % self.batch_size
        if last == 0:  # no batch: nothing to leave open
            return iter(indices)
        token = self._open = object()
        return self._pass(indices, last, token)

    def _pass(self, indices: list[T], last: int, token: object) -> Iterator[T]:
        """Yield ``indices``; the pass is no longer open once the ``last``-th is drawn (the
        last batch's last: before it is yielded, as a loop bounded by ``len(loader)`` never
        asks past it)."""
        for i, index in enumerate(indices, 1):
            if i == last and self._open is token:
                self._open = None
            yield index

    def _warn_open(self) -> None:
        """The previous pass stopped before its end (a peek such as
        ``next(iter(loader))``, or a ``break``) and no epoch was set since: it counted as
        an epoch. Harmless when every rank did the same; when only some ranks peeked their
        shuffles are now out of step and their shards overlap, silently."""
        self._open = None
        if self._warned_open:
            return
        self._warned_open = True
        warnings.warn(
            f"rank {self.rank}'s DistributedLoader starts a pass while its previous pass "
            f"stopped before its end (a peek such as next(iter(loader)), or a break); that "
            f"pass counted as epoch {self.epoch - 1}, so this one uses epoch {self.epoch}'s "
            "order. If the other ranks did not make the same pass, their shuffles are now "
            "out of step and the ranks' shards overlap: call loader.set_epoch(epoch) right "
            "before each epoch's loop (after any peek)",
            UserWarning,
            stacklevel=_outside_torch_data(),
        )

    def __len__(self) -> int:
        self._follow()
        return super().__len__()

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch``'s shuffle for the next pass, as ``DistributedSampler.set_epoch``,
        but checked: ``loader.sampler.set_epoch(e)`` is the usual call, and skips the
        loader's own.

        Raises:
            ValueError: ``epoch`` is not an integer >= 0.
        """
        super().set_epoch(_checked_epoch(epoch))


def _outside_torch_data() -> int:
    """The ``stacklevel`` of a warning in the function that calls this: the first frame
    outside trainperf and ``torch.utils.data`` (the loop that iterates the loader)."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and (
        "torch/utils/data/" in frame.f_code.co_filename.replace(os.sep, "/")
        or frame.f_code.co_filename == __file__
    ):
        frame, level = frame.f_back, level + 1
    return level


class DistributedLoader(DataLoader[T]):
    """A DataLoader over this rank's shard.

    Made by :func:`distributed_loader`, each pass over the loader uses the next epoch's
    order (0, 1, 2, ...) by itself; call :meth:`set_epoch` to choose it explicitly (e.g.
    when resuming). Built directly on a torch ``DistributedSampler``, the order changes as
    torch's does: only when :meth:`set_epoch` is called, so call ``loader.set_epoch(epoch)``
    at each epoch's start.
    """

    def __init__(
        self,
        dataset: Dataset[T],
        batch_size: int,
        sampler: DistributedSampler[T],
        **loader_kwargs: Any,
    ) -> None:
        super().__init__(dataset, batch_size=batch_size, sampler=sampler, **loader_kwargs)
        self.distributed_sampler = sampler
        self._warned_empty = False

    def __iter__(self) -> Any:
        if not self._warned_empty and self._length() == 0:
            self._warned_empty = True
            warnings.warn(self._empty_message(), UserWarning, stacklevel=2)
        return super().__iter__()

    def _length(self) -> int | None:
        """Batches per pass; None for a sampler without a length (DataLoader itself never
        asks one for it)."""
        try:
            return len(self)
        except TypeError:
            return None

    def _empty_message(self) -> str:
        sampler = self.distributed_sampler
        shard = int(sampler.num_samples)
        what = plural(shard, "sample")
        if shard:
            what += f", fewer than batch_size={self.batch_size} (drop_last=True)"
        return (
            f"this DistributedLoader yields no batch on rank {sampler.rank} of "
            f"{sampler.num_replicas}: its shard of the {len(sampler.dataset)} samples "  # type: ignore[arg-type]
            f"is {what}, so every epoch is empty; use drop_last=False, a smaller batch_size, "
            "or fewer ranks"
        )

    @property
    def epoch(self) -> int:
        """The epoch whose order the next pass uses."""
        return int(self.distributed_sampler.epoch)

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch``'s shuffle for the next pass (the usual ``sampler.set_epoch``).

        Raises:
            ValueError: ``epoch`` is not an integer >= 0.

        Example:
            >>> loader = distributed_loader(list(range(6)), batch_size=6, seed=1)
            >>> loader.set_epoch(3)
            >>> loader.epoch
            3
            >>> first = next(iter(loader)).tolist()
            >>> loader.set_epoch(3)  # the same epoch again: the same order
            >>> next(iter(loader)).tolist() == first
            True
        """
        # Checked here too: distributed_sampler may be a plain DistributedSampler.
        self.distributed_sampler.set_epoch(_checked_epoch(epoch))


def distributed_loader(
    dataset: Dataset[T],
    batch_size: int,
    *,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = False,
    **loader_kwargs: Any,
) -> DistributedLoader[T]:
    """A DataLoader that gives each rank its own 1/world_size of ``dataset`` every epoch.

    Built on ``DistributedSampler`` (with the rank and world size of the process that
    iterates it, so it also works in a single process, and a loader built before
    ``launch`` shards in each rank). The shuffle is seeded by ``seed + epoch`` and the
    epoch advances after each pass by itself (each ``iter(loader)``: every rank must make
    as many, or their shuffles drift apart and samples repeat; a peek such as ``next(iter(loader))``
    on one rank only counts as a pass, and the pass after one that stopped early warns once);
    ``loader.set_epoch(e)`` sets it explicitly, and calling it right before each epoch's loop
    (after any peek) keeps the ranks in step whatever else iterates. Without
    ``drop_last`` the sampler pads with repeated samples so every rank gets as many.
    DataLoader workers die with their rank.

    Args:
        dataset: a map-style dataset.
        batch_size: samples per batch *per rank*.
        shuffle: shuffle (the same permutation on every rank, split between them).
        seed: base seed of the shuffle; must be the same on every rank.
        drop_last: drop the samples that do not divide evenly among ranks, and each
            rank's last batch when it is short (``DataLoader(drop_last=True)``: a batch of
            one breaks BatchNorm); without it the sampler pads and the last batch may be short.
        **loader_kwargs: passed to ``DataLoader`` (``num_workers``, ``pin_memory``, ...),
            ``num_workers``, ``prefetch_factor`` and ``timeout`` as Python numbers (a NumPy
            one converted); not ``sampler`` or ``batch_sampler``.

    Returns:
        A :class:`DistributedLoader` (a ``DataLoader``).

    Raises:
        ValueError: ``batch_size`` < 1, ``seed`` or ``num_workers`` not an int >= 0,
            ``prefetch_factor`` not None or an int >= 1 (or given without workers: DataLoader
            refuses it), ``timeout`` not a finite number of seconds >= 0, ``loader_kwargs``
            has ``sampler`` or ``batch_sampler``, or, without a process group, ``RANK`` is
            not below ``WORLD_SIZE`` (or is set without it).
        TypeError: ``dataset`` is an ``IterableDataset``.

    Example:
        >>> loader = distributed_loader(list(range(6)), batch_size=3, shuffle=False)
        >>> [batch.tolist() for batch in loader]
        [[0, 1, 2], [3, 4, 5]]
    """
    # Kept as Python ints: BatchSampler refuses a NumPy batch_size the check accepts.
    batch_size = positive_int("batch_size", batch_size)
    seed = non_negative_int("seed", seed)
    loader_kwargs.update(worker_numbers(loader_kwargs))
    workers = loader_kwargs.get("num_workers", 0)
    if isinstance(dataset, torch.utils.data.IterableDataset):
        raise TypeError(
            f"distributed_loader needs a map-style dataset (__len__ and __getitem__), got "
            f"{type(dataset).__name__}, an IterableDataset: DistributedSampler shards "
            "indices. Shard the stream in its __iter__ by rank (trainperf.ddp.rank(), "
            "world_size()) and by worker (torch.utils.data.get_worker_info()), and use a "
            "plain DataLoader"
        )
    clashing = sorted({"sampler", "batch_sampler"} & loader_kwargs.keys())
    if clashing:
        raise ValueError(
            f"distributed_loader chooses the sampler itself; remove {', '.join(clashing)} "
            "(use its shuffle= argument)"
        )
    replicas, here = _layout()
    sampler: _AutoEpochSampler[T] = _AutoEpochSampler(
        dataset,
        num_replicas=replicas,
        rank=here,
        shuffle=shuffle,
        seed=seed,
        drop_last=drop_last,
    )
    sampler.batch_size, sampler.drop_last_batch = batch_size, drop_last
    if workers > 0 and sys.platform.startswith("linux"):
        loader_kwargs["worker_init_fn"] = DieWithParent(loader_kwargs.get("worker_init_fn"))
    return DistributedLoader(
        dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last, **loader_kwargs
    )
