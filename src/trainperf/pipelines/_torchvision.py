"""The torchvision backend: PIL decode and torchvision transforms in DataLoader workers.

The fallback everywhere. The DataLoader comes from :func:`trainperf.loader.autotune_loader`
(the worker count is measured, not guessed) unless ``loader_kwargs`` names ``num_workers``.
Workers return uint8 ``HWC`` images (PIL's layout, so batching them is a plain copy). For a
CUDA (or MPS) device the batch is converted and normalised on the device: a quarter of the
bytes go through shared and pinned memory. For the CPU the collate function normalises the
whole batch in the worker, in parallel with the others. Either way the arithmetic is that
of ``ToTensor`` + ``Normalize``, so results are bit-identical to torchvision's.

Randomness is per sample: each image's crop and flip come from a generator seeded with
``(seed, epoch, index)``, so a run is reproducible whatever number of workers the autotuner
picks. The crop follows ``RandomResizedCrop`` exactly (:func:`._augment.train_params`).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, BinaryIO

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from trainperf._utils.lifetime import DieWithParent
from trainperf._utils.validate import non_negative_int
from trainperf.pipelines._augment import CROP_RATIO, normalize, train_params
from trainperf.pipelines._base import ImageLoader, LoaderConfig, labels_tensor
from trainperf.pipelines._decode import pil_failure, pil_to_rgb
from trainperf.pipelines._header import (
    MAX_IMAGE_PIXELS,
    file_problem,
    open_regular,
    pixel_problem,
)
from trainperf.pipelines._source import (
    ImageSource,
    Shard,
    changed_file_error,
    epoch_indices,
    shown,
)

__all__ = [
    "EpochSampler",
    "FileDataset",
    "NormalizingCollate",
    "TorchvisionLoader",
]

_RESERVED = ("sampler", "batch_sampler", "shuffle", "drop_last", "batch_size", "collate_fn")


_CLOSED = "this image loader was closed"


class FileDataset(Dataset[tuple[torch.Tensor, int]]):
    """Decodes ``files[index]`` with PIL (to RGB) and applies the train or eval transform.

    Keys are ``(index, epoch)`` pairs, as :class:`EpochSampler` yields them (a plain index
    means epoch 0); items are a uint8 ``[size, size, 3]`` image and the index. Each file
    passes trainperf's header check (image size within ``max_pixels``) on the open file
    before Pillow reads it, as the file may have changed since the up-front check.

    Args:
        files: image paths.
        train: random resized crop + flip, or resize + centre crop.
        size: output height and width.
        seed: base of the per-sample seeds.
        max_pixels: the most pixels an image may have; None: no limit.
    """

    def __init__(
        self,
        files: Sequence[str],
        *,
        train: bool,
        size: int,
        seed: int,
        max_pixels: int | None = MAX_IMAGE_PIXELS,
    ) -> None:
        self.files = tuple(files)
        self.train = train
        self.size = size
        self.seed = seed
        self.max_pixels = max_pixels

    def _open_checked(self, path: str) -> BinaryIO:
        """``path`` opened, after trainperf's header check on it: Pillow's ``Image.open``
        refuses an image over twice its own limit itself, with advice to raise that limit,
        so a file replaced by a bomb must be refused before Pillow reads it."""
        try:
            f = open_regular(path)  # the caller closes it
        except OSError as e:
            unreadable = f"cannot be read ({e.strerror or e})"
            raise changed_file_error(path, unreadable, self.max_pixels) from e
        if isinstance(f, str):  # a FIFO or a device now: reading it could block forever
            raise changed_file_error(path, f, self.max_pixels)
        _, problem = file_problem(f, self.max_pixels)
        if problem is not None:
            f.close()
            raise changed_file_error(path, problem, self.max_pixels)
        f.seek(0)
        return f

    def _decode(self, path: str) -> Any:
        from PIL import Image

        with self._open_checked(path) as f:
            try:
                with Image.open(f) as im:  # reads the header only
                    too_big = pixel_problem(im.width, im.height, self.max_pixels)
                    # Grayscale, CMYK, palette and RGBA images all become 3-channel RGB;
                    # 16-bit greyscale is scaled to 8 bits (PIL's convert would clip it).
                    img = None if too_big else pil_to_rgb(im)
            except Exception as e:  # PIL raises OSError, SyntaxError, ValueError...
                raise RuntimeError(
                    f"could not decode image '{shown(path)}' ({pil_failure(e)}); fix or remove "
                    "the file, or pass on_error='skip', which decodes every file up front and "
                    "leaves out the bad ones"
                ) from e
        if too_big is not None:
            raise changed_file_error(path, too_big, self.max_pixels)
        return img

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, key: tuple[int, int] | int) -> tuple[torch.Tensor, int]:
        import torchvision.transforms.functional as TF
        from torchvision.transforms import InterpolationMode

        index, epoch = (key, 0) if isinstance(key, int) else key
        img = self._decode(self.files[index])
        size = self.size
        if self.train:
            (top, left, h, w), flip = train_params(self.seed, epoch, index, img.height, img.width)
            img = TF.resized_crop(
                img, top, left, h, w, [size, size], InterpolationMode.BILINEAR, antialias=True
            )
            if flip:
                img = TF.hflip(img)
        else:
            img = TF.resize(img, int(size / CROP_RATIO), InterpolationMode.BILINEAR, antialias=True)
            img = TF.center_crop(img, [size, size])
        return torch.from_numpy(np.array(img, dtype=np.uint8)), index


class NormalizingCollate:
    """Stack ``(HWC uint8 image, index)`` samples into a normalised float NCHW batch.

    Runs in the DataLoader worker (single-threaded there), so the float conversion of each
    batch happens in parallel across workers rather than in the training process.
    """

    def __init__(self, mean: Sequence[float], std: Sequence[float]) -> None:
        self.mean = tuple(mean)
        self.std = tuple(std)

    def __call__(
        self, samples: Sequence[tuple[torch.Tensor, int]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        images = torch.stack([image for image, _ in samples]).permute(0, 3, 1, 2).contiguous()
        indices = torch.tensor([index for _, index in samples], dtype=torch.int64)
        return normalize(images, self.mean, self.std), indices


class EpochSampler(Sampler[tuple[int, int]]):
    """This rank's ``(index, epoch)`` keys for the epoch in :attr:`epoch`.

    The order is :func:`trainperf.pipelines._source.epoch_indices`, i.e. exactly
    ``DistributedSampler``'s.

    Attributes:
        epoch: the epoch the next iteration draws, set by :meth:`set_epoch` as in
            ``DistributedSampler``. On a loader's sampler it is the loader's
            :attr:`~trainperf.pipelines.ImageLoader.epoch`, the epoch of its next pass (each
            pass draws its own epoch's order), so ``loader.sampler.set_epoch(e)``, which
            Lightning calls, sets the loader's next pass, and iterating ``loader.dataloader``
            itself draws ``e``'s order.
    """

    def __init__(self, num_files: int, shard: Shard, *, shuffle: bool, seed: int, drop: bool):
        self.num_files = num_files
        self.shard = shard
        self.shuffle = shuffle
        self.seed = seed
        self.drop = drop
        self._next_epoch = 0
        # The epoch a pass draws, by the thread drawing it (see drawing()): other threads,
        # another pass's among them, still see the next pass's epoch meanwhile.
        self._drawn: dict[int, int] = {}

    @property
    def epoch(self) -> int:
        """The epoch the next iteration draws (in a thread inside :meth:`drawing`: the one
        it draws)."""
        return self._drawn.get(threading.get_ident(), self._next_epoch)

    @epoch.setter
    def epoch(self, epoch: int) -> None:
        me = threading.get_ident()
        if me in self._drawn:
            self._drawn[me] = epoch
        else:
            self._next_epoch = epoch

    def set_epoch(self, epoch: int) -> None:
        """Draw ``epoch``'s order next (an int >= 0; NumPy's integers too).

        Raises:
            ValueError: ``epoch`` is not an int >= 0.
        """
        self.epoch = non_negative_int("epoch", epoch)

    @contextlib.contextmanager
    def drawing(self, epoch: int) -> Iterator[None]:
        """Draw ``epoch``'s order within the block, in this thread only; :attr:`epoch` stays
        the next pass's everywhere else, so a pass begun in another thread meanwhile, or a
        ``set_epoch`` from one, is not mistaken for or overwritten by this pass's epoch."""
        me = threading.get_ident()
        self._drawn[me] = epoch
        try:
            yield
        finally:
            del self._drawn[me]

    def __len__(self) -> int:
        return self.shard.samples if not self.drop else self.num_files // self.shard.world_size

    def __iter__(self) -> Iterator[tuple[int, int]]:
        order = epoch_indices(
            self.num_files,
            self.shard.rank,
            self.shard.world_size,
            shuffle=self.shuffle,
            seed=self.seed,
            epoch=self.epoch,
            last_batch="drop" if self.drop else "keep",
        )
        return iter([(i, self.epoch) for i in order])


class TorchvisionLoader(ImageLoader):
    """``image_loader`` batches from a DataLoader over :class:`FileDataset`."""

    backend = "torchvision"

    def __init__(
        self,
        source: ImageSource,
        shard: Shard,
        config: LoaderConfig,
        backend_reason: str,
        loader_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(source, shard, config, backend_reason)
        drop = config.last_batch == "drop"
        self.dataset = FileDataset(
            source.files,
            train=config.train,
            size=config.size,
            seed=config.seed,
            max_pixels=config.max_pixels,
        )
        self.sampler = EpochSampler(
            len(source.files),
            shard,
            shuffle=config.train,
            seed=config.seed,
            drop=drop,
        )
        kwargs: dict[str, Any] = dict(loader_kwargs or {})
        for reserved in _RESERVED:
            if reserved in kwargs:
                raise ValueError(
                    f"loader_kwargs may not set {reserved!r}: image_loader sets it (from "
                    f"batch_size, shard, train and last_batch); the others are {_RESERVED}"
                )
        kwargs.setdefault("pin_memory", config.device.type == "cuda")
        # On the CPU, the workers normalise; on an accelerator, uint8 batches cross to it and
        # are normalised there.
        self._normalise_in_workers = config.device.type == "cpu"
        if self._normalise_in_workers:
            kwargs["collate_fn"] = NormalizingCollate(config.mean, config.std)
        if "num_workers" in kwargs:
            # Workers die with this process, even when it is SIGKILLed (autotune_loader's
            # DataLoader does this itself).
            kwargs["worker_init_fn"] = DieWithParent(kwargs.get("worker_init_fn"))
            self.dataloader: DataLoader[Any] = DataLoader(
                self.dataset,
                batch_size=config.batch_size,
                sampler=self.sampler,
                drop_last=drop,
                **kwargs,
            )
        else:
            from trainperf.loader import autotune_loader

            kwargs.setdefault("max_workers", config.num_threads)
            # A bar nobody asked for, from inside a constructor, is noise in training logs.
            kwargs.setdefault("progress", False)
            self.dataloader = autotune_loader(
                self.dataset,
                config.batch_size,
                device=config.device,
                sampler=self.sampler,
                drop_last=drop,
                **kwargs,
            )
        self._labels = labels_tensor(source.labels)
        self._closed = False
        self._active: Iterator[Any] | None = None  # the running epoch's DataLoader iterator
        self._pool_pass: object | None = None  # the pass using the persistent pool, if one is

    @property
    def epoch(self) -> int:
        """The epoch the next pass reads: epochs started so far, unless set (an int >= 0;
        assigning it is :meth:`set_epoch`). Kept in :attr:`sampler`, so that
        ``loader.sampler.set_epoch(e)`` sets it too."""
        return self.sampler.epoch

    @epoch.setter
    def epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def _epoch(self, epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        if self._closed:
            raise RuntimeError(_CLOSED)
        device, c = self.config.device, self.config
        batches: Iterator[Any] = iter(())
        handed, me = batches, object()
        try:
            # The sampler draws this pass's order by its first batch (workers get their first
            # indices as the iterator starts, a single process as it fetches the batch), and
            # keeps the next pass's epoch.
            with self.sampler.drawing(epoch):
                batches = self._pass_iterator(me)
                self._active = batches
                handed = itertools.chain(list(itertools.islice(batches, 1)), batches)
            for images, indices in handed:
                if not self._normalise_in_workers:
                    nchw = images.to(device, non_blocking=True).permute(0, 3, 1, 2)
                    images = normalize(nchw, c.mean, c.std).contiguous()
                labels = self._labels[indices].to(device, non_blocking=True)
                yield images, labels, indices
                if self._closed:  # close() while the loop held this batch
                    raise RuntimeError(_CLOSED)
        finally:
            if self._active is batches:
                self._active = None
            if self._pool_pass is me:
                self._pool_pass = None
            self._end_workers(batches)
            del batches, handed  # a traceback keeps this frame, and with it the iterator, alive

    def _pass_iterator(self, me: object) -> Iterator[Any]:
        """Pass ``me``'s DataLoader iterator. Persistent workers (``loader_kwargs``, or the
        autotuner's choice) are one iterator, which each ``iter()`` resets: while a pass
        still reads from it, resetting it would restart that pass's epoch under its loop
        (batches repeated), so this pass gets workers of its own, ended with it."""
        # No local holds the pool's iterator across iter(): a tuned loader counts the
        # iterator's holders to tell a pass in progress (it would start a new pool each pass).
        if getattr(self.dataloader, "_iterator", None) is not None and self._pool_pass is not None:
            return self.dataloader._get_iterator()
        batches = iter(self.dataloader)
        if batches is getattr(self.dataloader, "_iterator", None):
            self._pool_pass = me
        return batches

    def _end_workers(self, batches: Iterator[Any]) -> None:
        """End the workers of an epoch's iterator, however the epoch ended: an error's
        traceback would keep the iterator, and so its workers, alive. Persistent workers
        (the DataLoader's kept iterator) live on until :meth:`close`."""
        if batches is getattr(self.dataloader, "_iterator", None):
            return
        shutdown = getattr(batches, "_shutdown_workers", None)
        if callable(shutdown):
            shutdown()

    def close(self) -> None:
        self._closed = True
        # The epoch's workers live in its DataLoader iterator (persistent ones in the
        # DataLoader's kept one); ending it ends them.
        for batches in (self._active, getattr(self.dataloader, "_iterator", None)):
            shutdown = getattr(batches, "_shutdown_workers", None)
            if callable(shutdown):
                shutdown()
        self._active = None
        self.dataloader._iterator = None
