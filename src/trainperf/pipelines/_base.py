"""The loader every backend returns: an iterable of ``(images, labels)``, one pass per epoch."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from trainperf._utils.validate import non_negative_int
from trainperf.pipelines._header import MAX_IMAGE_PIXELS
from trainperf.pipelines._source import BadFile, ImageSource, Shard

__all__ = ["ImageBackend", "ImageLoader", "LoaderConfig"]

# Not "Backend": in trainperf.ddp (as in torch.distributed) that word means nccl or gloo.
ImageBackend = Literal["dali", "nvjpeg", "torchvision"]
"""The libraries an :class:`ImageLoader` can decode and augment with."""
LastBatch = Literal["drop", "keep"]
# Reading an epoch and counting it on is one step: held for that alone (every loader's).
_EPOCH_BUMP = threading.Lock()


@dataclass(frozen=True)
class LoaderConfig:
    """What :func:`trainperf.pipelines.image_loader` was asked for, resolved.

    Attributes:
        batch_size: images per batch.
        train: random resized crop + flip (True) or resize + centre crop (False).
        size: output height and width.
        device: where batches are delivered.
        num_threads: decode threads (DALI), reader threads (nvjpeg), or the worker cap
            (torchvision).
        seed: seeds shuffling and augmentation.
        last_batch: ``"drop"`` or ``"keep"`` the partial last batch.
        mean: per-channel mean, in 0..1 units.
        std: per-channel standard deviation, in 0..1 units.
        max_pixels: the most pixels an image may have (read from its header before it is
            decoded); None: no limit.
    """

    batch_size: int
    train: bool
    size: int
    device: torch.device
    num_threads: int
    seed: int
    last_batch: LastBatch
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    max_pixels: int | None = MAX_IMAGE_PIXELS


class ImageLoader:
    """Batches of ``(images, labels)``: float ``[N, 3, size, size]`` and int64 ``[N]``.

    ``len(loader)`` is the number of batches per epoch, the same on every rank. Each
    ``iter(loader)`` (each ``for`` loop) is a new epoch, reshuffled when training.
    Subclasses implement :meth:`_epoch`.

    Attributes:
        backend: ``"dali"``, ``"nvjpeg"`` or ``"torchvision"``.
        backend_reason: why that backend was chosen.
        config: the resolved settings.
        source: the files, labels and classes read.
        shard: this rank's share: rank, world size, samples and batches per epoch.
    """

    backend: ImageBackend
    # The epoch the next pass reads (a backend may keep it elsewhere: then it overrides
    # ``epoch``, which is all that reads or writes this).
    _epoch_next = 0

    def __init__(
        self, source: ImageSource, shard: Shard, config: LoaderConfig, backend_reason: str
    ) -> None:
        self.source = source
        self.shard = shard
        self.config = config
        self.backend_reason = backend_reason

    # ----------------------------------------------------------------- the contract

    @property
    def epoch(self) -> int:
        """The epoch the next pass reads: epochs started so far, unless set (an int >= 0;
        assigning it is :meth:`set_epoch`)."""
        return self._epoch_next

    @epoch.setter
    def epoch(self, epoch: int) -> None:
        self._epoch_next = non_negative_int("epoch", epoch)

    def set_epoch(self, epoch: int) -> None:
        """Make the next pass read ``epoch``: its files, in its order (``seed + epoch``), as
        ``DistributedSampler.set_epoch`` does, so a loop written for one runs unchanged.

        Passes go on from there (``epoch + 1``, ...). Setting the epoch a pass would read
        anyway changes nothing; setting another one (to resume, or to run an epoch again)
        works in every backend.

        Args:
            epoch: the epoch to read next, an int >= 0 (NumPy's integers too).

        Raises:
            ValueError: ``epoch`` is not an int >= 0.

        Example:
            >>> import os, tempfile
            >>> from PIL import Image
            >>> from trainperf.pipelines import image_loader
            >>> root = tempfile.mkdtemp()
            >>> os.makedirs(f"{root}/cat")
            >>> for i in range(4):
            ...     Image.new("RGB", (40, 30)).save(f"{root}/cat/{i}.jpg")
            >>> loader = image_loader(root, 4, size=16, backend="torchvision", device="cpu",
            ...                       shard=None, loader_kwargs={"num_workers": 0})
            >>> def order():
            ...     return [i for _, _, indices in loader.iter_with_indices()
            ...             for i in indices.tolist()]
            >>> loader.set_epoch(5)
            >>> fifth = order()
            >>> loader.epoch
            6
            >>> loader.set_epoch(5)  # the same epoch again: the same order
            >>> order() == fifth
            True
            >>> loader.set_epoch(-1)
            Traceback (most recent call last):
            ...
            ValueError: epoch must be an int >= 0, got -1
        """
        self.epoch = epoch

    @property
    def device(self) -> torch.device:
        """Where the batches are delivered."""
        return self.config.device

    @property
    def batch_size(self) -> int:
        """Images per batch (the last one may hold fewer with ``last_batch="keep"``)."""
        return self.config.batch_size

    @property
    def classes(self) -> tuple[str, ...]:
        """Class names; a label is an index into this tuple."""
        return self.source.classes

    @property
    def files(self) -> tuple[str, ...]:
        """The image files read (after skipping bad ones); indices point into this tuple."""
        return self.source.files

    @property
    def skipped(self) -> tuple[BadFile, ...]:
        """Files left out by ``on_error="skip"``, with the reason."""
        return self.source.skipped

    def __len__(self) -> int:
        return self.shard.batches

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for images, labels, _ in self.iter_with_indices():
            yield images, labels

    def iter_with_indices(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """One epoch of ``(images, labels, indices)``; ``indices`` (int64, on the CPU) point
        into :attr:`files`, to tell which file each image came from.

        Example:
            >>> import os, tempfile
            >>> from PIL import Image
            >>> from trainperf.pipelines import image_loader
            >>> root = tempfile.mkdtemp()
            >>> for cls in ("cat", "dog"):
            ...     os.makedirs(f"{root}/{cls}")
            ...     Image.new("RGB", (40, 30)).save(f"{root}/{cls}/0.jpg")
            >>> loader = image_loader(root, 2, size=16, train=False, backend="torchvision",
            ...                       device="cpu", shard=None, loader_kwargs={"num_workers": 0})
            >>> for images, labels, indices in loader.iter_with_indices():
            ...     names = [os.path.relpath(loader.files[i], root) for i in indices]
            ...     print(names, labels.tolist())
            ['cat/0.jpg', 'dog/0.jpg'] [0, 1]
        """
        with _EPOCH_BUMP:  # two threads starting passes at once must not read one epoch
            epoch = self.epoch
            self.epoch = epoch + 1
        return self._epoch(epoch)

    def _epoch(self, epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        raise NotImplementedError

    def close(self) -> None:
        """Release threads, worker processes and pipelines. Iterating again is an error.

        The loader is also a context manager that closes itself at the end of the block.

        Example:
            >>> import os, tempfile
            >>> from PIL import Image
            >>> from trainperf.pipelines import image_loader
            >>> root = tempfile.mkdtemp()
            >>> os.makedirs(f"{root}/cat")
            >>> Image.new("RGB", (40, 30)).save(f"{root}/cat/0.jpg")
            >>> loader = image_loader(root, 1, size=16, backend="torchvision", device="cpu",
            ...                       shard=None, loader_kwargs={"num_workers": 0})
            >>> [labels.tolist() for _, labels in loader]
            [[0]]
            >>> loader.close()
            >>> next(iter(loader))
            Traceback (most recent call last):
            ...
            RuntimeError: this image loader was closed
        """

    def __enter__(self) -> ImageLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        c, s = self.config, self.shard
        return (
            f"ImageLoader(backend={self.backend!r}, device='{c.device}', "
            f"batch_size={c.batch_size}, batches={s.batches}, images={len(self.files)}, "
            f"classes={len(self.classes)}, shard={s.rank}/{s.world_size}, train={c.train}, "
            f"size={c.size}; why: {self.backend_reason})"
        )


def labels_tensor(labels: Sequence[int]) -> torch.Tensor:
    """File index -> label, for turning a batch of indices into its labels."""
    return torch.tensor(list(labels), dtype=torch.int64)
