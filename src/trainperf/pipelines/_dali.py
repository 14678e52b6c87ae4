"""The DALI backend: a DALI pipeline decodes and augments in C++ threads (or on the GPU).

Graph: ``readers.file`` (sharded, padded, reshuffled every epoch) -> ``decoders.image``
(``"mixed"``: nvJPEG on the GPU; ``"cpu"``: libjpeg-turbo, when there is no GPU) -> random
resized crop + ``resize`` (train) or an exact torchvision-style resize + ``slice`` (eval) ->
``crop_mirror_normalize`` (random mirror when training) -> DALI's PyTorch iterator.

Training on the CPU ends differently. DALI decodes only the random crop's region
(``decoders.image_random_crop``) and hands the uint8 crops over without a copy (its dynamic
executor, DALI >= 1.44). torch then resizes each crop (bilinear, antialiased: the torchvision
backend's work), mirrors it and normalises it into a reused batch buffer
(:class:`CpuTrainFinish`). Measured on 500x375 JPEGs, DALI's own linear resize cost 0.8 ms per
image without antialiasing, torch's vectorised uint8 resize 0.25 ms with it, so the CPU path is
both cheaper and equal in quality to the other backends.

The reader is given file *indices* as its labels: the loader maps them to class labels and
knows which file every image came from. It always runs with ``pad_last_batch=True`` and
``LastBatchPolicy.FILL``, so every rank reads the same number of batches and each epoch
starts at a batch boundary; the loader then trims the final batch to the shard plan
(``"keep"``) or discards the batches past it (``"drop"``). DALI's own ``DROP`` policy is not
used: with a padded reader it lets the padding spill into the next epoch.

EXIF orientation is ignored (``adjust_orientation=False``), as torchvision's ImageFolder
ignores it, so every backend sees the same pixels.
"""

from __future__ import annotations

import importlib
import re
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from trainperf.pipelines._augment import CROP_RATIO
from trainperf.pipelines._base import ImageLoader, LoaderConfig, labels_tensor
from trainperf.pipelines._source import ImageSource, Shard

__all__ = [
    "CpuTrainFinish",
    "DaliLoader",
    "build_pipeline",
    "dali_broken_error",
    "dali_missing_error",
]

# The reader's output name, which the iterator uses to read the shard sizes.
READER = "Reader"
# Different augmentation streams per rank; the *shuffle* seed stays the same on every rank.
_RANK_SEED_STRIDE = 7919


def dali_missing_error() -> ModuleNotFoundError:
    """The error for ``backend="dali"`` without DALI installed."""
    return ModuleNotFoundError(
        "image_loader(backend='dali') needs NVIDIA DALI: pip install 'trainperf[dali]'",
        name="nvidia.dali",
    )


def dali_broken_error(error: BaseException) -> ImportError:
    """The error for ``backend="dali"`` when DALI is installed but does not import or is
    too old."""
    return ImportError(
        f"image_loader(backend='dali'): NVIDIA DALI is installed but cannot be used "
        f"({type(error).__name__}: {error}). Reinstall it: pip install --force-reinstall "
        "'trainperf[dali]' (its wheel, nvidia-dali-cuda120, needs a CUDA 12 runtime and "
        "driver), or pass backend='torchvision'",
        name="nvidia.dali",
    )


def _dali_ops() -> tuple[Any, Any]:
    """DALI's ``fn`` and ``types`` modules, as Any: its partial stubs disagree with its runtime
    (``fn`` is generated)."""
    return importlib.import_module("nvidia.dali.fn"), importlib.import_module("nvidia.dali.types")


def _read(
    files: Sequence[str],
    indices: Sequence[int],
    *,
    rank: int,
    world_size: int,
    train: bool,
    seed: int,
) -> tuple[Any, Any]:
    """The reader's ``(encoded, index)``: sharded, padded, reshuffled each epoch when training."""
    fn, _ = _dali_ops()
    # A global reshuffle each epoch; every rank must use the same seed for the shards to stay
    # disjoint. Eval keeps each rank on its own shard, in file order.
    shuffle = (
        {"shuffle_after_epoch": True, "shuffle_after_epoch_seed": seed % (2**31)} if train else {}
    )
    return fn.readers.file(  # type: ignore[no-any-return]
        files=list(files),
        labels=list(indices),
        name=READER,
        shard_id=rank,
        num_shards=world_size,
        pad_last_batch=True,
        stick_to_shard=not train,
        **shuffle,
    )


def _random_crops(encoded: Any, decoder: str) -> Any:
    """Decode only each image's random resized crop box (area 8-100 %, aspect 3/4-4/3)."""
    fn, types = _dali_ops()
    return fn.decoders.image_random_crop(
        encoded,
        device=decoder,
        output_type=types.RGB,
        random_area=[0.08, 1.0],
        random_aspect_ratio=[3 / 4, 4 / 3],
        num_attempts=10,
        adjust_orientation=False,
    )


def _eval_resize_crop(encoded: Any, decoder: str, size: int) -> Any:
    """Decode, resize the shorter side to ``size / CROP_RATIO``, cut the centre square."""
    fn, types = _dali_ops()
    short = int(size / CROP_RATIO)
    images = fn.decoders.image(
        encoded, device=decoder, output_type=types.RGB, adjust_orientation=False
    )
    # torchvision's Resize(short): the shorter side becomes `short`, the longer is
    # truncated, and CenterCrop rounds its offset half to even. DALI's resize_shorter
    # and crop_pos round differently (one pixel off, a visible shift), so the sizes and
    # offsets are computed here in integers.
    shape = fn.peek_image_shape(encoded, adjust_orientation=False, dtype=types.INT32)
    h, w = shape[0], shape[1]
    tall = fn.cast(h > w, dtype=types.INT32)
    new_h = tall * ((short * h) // w) + (1 - tall) * short
    new_w = tall * short + (1 - tall) * ((short * w) // h)
    images = fn.resize(
        images,
        resize_x=fn.cast(new_w, dtype=types.FLOAT),
        resize_y=fn.cast(new_h, dtype=types.FLOAT),
        interp_type=types.INTERP_LINEAR,
        antialias=True,
    )
    dy, dx = new_h - size, new_w - size
    half_y, half_x = dy // 2, dx // 2
    top = half_y + (dy % 2) * (half_y % 2)
    left = half_x + (dx % 2) * (half_x % 2)
    return fn.slice(
        images,
        fn.cast(fn.stack(top, left), dtype=types.FLOAT),
        fn.constant(fdata=[float(size), float(size)]),
        axis_names="HW",
        normalized_anchor=False,
        normalized_shape=False,
    )


def _normalize(images: Any, mean: Sequence[float], std: Sequence[float], mirror: Any) -> Any:
    """Float ``CHW`` output, normalised (``mean``/``std`` in 0..1 units), mirrored by flag."""
    fn, types = _dali_ops()
    return fn.crop_mirror_normalize(
        images,
        dtype=types.FLOAT,
        output_layout="CHW",
        mean=[m * 255 for m in mean],
        std=[s * 255 for s in std],
        mirror=mirror,
    )


def build_pipeline(
    files: Sequence[str],
    indices: Sequence[int],
    *,
    gpu: bool,
    device_id: int | None,
    batch_size: int,
    num_threads: int,
    seed: int,
    rank: int,
    world_size: int,
    train: bool,
    size: int,
    mean: Sequence[float],
    std: Sequence[float],
) -> Any:
    """Define (not build) the DALI pipeline.

    Args:
        files: image paths, in the order the reader should take them.
        indices: the label the reader attaches to each file (the loader passes file indices).
        gpu: decode with ``"mixed"`` and augment on the GPU; else everything on the CPU.
        device_id: the CUDA device, or None for DALI's CPU-only mode.
        batch_size: samples per batch.
        num_threads: DALI CPU threads.
        seed: shuffle seed (same on every rank) and base of the augmentation seed.
        rank: this shard.
        world_size: number of shards.
        train: random resized crop + mirror, reshuffled each epoch; else eval resize + crop.
        size: output height and width.
        mean: per-channel mean in 0..1 units.
        std: per-channel std in 0..1 units.

    Returns:
        An unbuilt ``nvidia.dali.Pipeline``. Its outputs are ``(images, indices)``, except
        when training on the CPU: ``(crops, flips, indices)``, uint8 ``HWC`` crops of any
        size and a 0/1 mirror flag per image, for :class:`CpuTrainFinish`.
    """
    pipeline_def: Any = importlib.import_module("nvidia.dali").pipeline_def
    fn, types = _dali_ops()
    decoder = "mixed" if gpu else "cpu"

    # The helpers create the operators in a fixed order (reader, decoder, resize, coin flip,
    # normalise); random operators are seeded from the pipeline seed as they are added.
    @pipeline_def(  # type: ignore[untyped-decorator]
        batch_size=batch_size,
        num_threads=num_threads,
        device_id=device_id,
        seed=(seed + _RANK_SEED_STRIDE * rank) % (2**31),
        prefetch_queue_depth=2,
        # On the CPU, DALI's dynamic executor (DALI >= 1.44) hands its output buffers to
        # torch without a copy: copying the eval graph's float batches was 12-15 % of the CPU
        # cost per image. An output a caller keeps stays valid: DALI does not reuse a buffer
        # torch still holds. The GPU graph keeps the default executor: its copy stays on the
        # device, and no GPU run has timed the dynamic one yet.
        exec_dynamic=not gpu,
    )
    def graph() -> tuple[Any, ...]:
        encoded, index = _read(
            files, indices, rank=rank, world_size=world_size, train=train, seed=seed
        )
        if not train:
            images = _eval_resize_crop(encoded, decoder, size)
            return _normalize(images, mean, std, mirror=None), index
        crops = _random_crops(encoded, decoder)
        if not gpu:  # torch resizes, mirrors and normalises (CpuTrainFinish)
            return crops, fn.random.coin_flip(probability=0.5, dtype=types.UINT8), index
        images = fn.resize(
            crops,
            resize_x=float(size),
            resize_y=float(size),
            interp_type=types.INTERP_LINEAR,
            antialias=True,
        )
        return _normalize(images, mean, std, mirror=fn.random.coin_flip(probability=0.5)), index

    return graph()


# ATen splits an elementwise op over its intra-op threads above this many elements
# (at::internal::GRAIN_SIZE). CpuTrainFinish works in row bands below it: split, its ops cost
# 1.6x the CPU time on a 2-core machine, where the extra thread waited for cores DALI's threads
# held. (Changing torch's thread count instead would be process-wide state.)
_ATEN_GRAIN = 32768


class CpuTrainFinish:
    """Training on the CPU: resize DALI's uint8 crops, mirror and normalise them into a batch.

    Each ``HWC`` crop is resized to ``size x size`` with ``F.interpolate`` (bilinear,
    antialiased, on uint8: torch's vectorised path, the arithmetic of torchvision's ``Resize``
    on a tensor), mirrored when its flag is set, and written as ``x * scale + bias``
    (``scale = 1 / (255 std)``, ``bias = -mean / std``) into the batch while it is still in
    the CPU cache, in row bands small enough that torch does not split them over threads.
    The batch is ``[N, 3, size, size]`` float32, contiguous, like every backend's.

    The float batch (38 MB for 64 images at 224 px) lives in a numpy buffer that is reused
    once no tensor uses it: each batch is handed out through a view of its own, and the buffer
    is free again only when that view is gone, i.e. when the batch, every view of it and
    everything made from them without a copy are gone. Fresh memory for every batch cost 0.19
    ms per image in page faults.

    Args:
        size: output height and width.
        mean: per-channel mean in 0..1 units.
        std: per-channel std in 0..1 units.
        keep: buffers held for reuse.

    Example:
        >>> finish = CpuTrainFinish(2, mean=[0.5] * 3, std=[0.5] * 3)
        >>> white = torch.full((4, 6, 3), 255, dtype=torch.uint8)
        >>> batch = finish([white, white], [False, True])
        >>> tuple(batch.shape), batch.unique().tolist()
        ((2, 3, 2, 2), [1.0])
    """

    def __init__(
        self, size: int, *, mean: Sequence[float], std: Sequence[float], keep: int = 3
    ) -> None:
        self.size = size
        m = torch.tensor(list(mean), dtype=torch.float32)
        s = torch.tensor(list(std), dtype=torch.float32)
        # Full-size operands, so that each op is one contiguous, vectorised loop.
        scale = (1 / (255 * s)).view(3, 1, 1).expand(3, size, size).contiguous()
        bias = (-m / s).view(3, 1, 1).expand(3, size, size).contiguous()
        step = max(1, _ATEN_GRAIN // (3 * size))
        bands = [slice(top, top + step) for top in range(0, size, step)]
        # (rows, scale, bias) of each row band
        self._bands = [(rows, scale[:, rows], bias[:, rows]) for rows in bands]
        self._keep = keep
        # (buffer, weak reference to the view the last batch from it was made of)
        self._slots: list[tuple[np.ndarray, weakref.ref[np.ndarray]]] = []

    def _batch_memory(self, shape: tuple[int, ...]) -> torch.Tensor:
        slot = next(
            (i for i, (buf, out) in enumerate(self._slots) if buf.shape == shape and out() is None),
            None,
        )
        if slot is None and len(self._slots) == self._keep:
            # every kept buffer is in use: a fresh one, not kept
            return torch.from_numpy(np.empty(shape, dtype=np.float32))
        buf = np.empty(shape, dtype=np.float32) if slot is None else self._slots[slot][0]
        view = buf.view()  # torch holds this view; it dies with the last tensor using it
        if slot is None:
            self._slots.append((buf, weakref.ref(view)))
        else:
            self._slots[slot] = (buf, weakref.ref(view))
        return torch.from_numpy(view)

    def __call__(self, crops: Sequence[torch.Tensor], flips: Sequence[bool]) -> torch.Tensor:
        """The normalised batch of ``crops`` (uint8 ``[h, w, 3]`` each), mirrored by ``flips``."""
        size = self.size
        out = self._batch_memory((len(crops), 3, size, size))
        for i, (crop, flip) in enumerate(zip(crops, flips, strict=True)):
            # [1, 3, h, w] in channels_last strides: torch's fast uint8 resize takes that
            # layout and returns a contiguous [1, 3, size, size].
            img = crop.permute(2, 0, 1).unsqueeze(0)
            if img.shape[-2:] != (size, size):
                img = F.interpolate(img, size=(size, size), mode="bilinear", antialias=True)
            for rows, scale, bias in self._bands:
                band = img[0, :, rows]
                dst = out[i, :, rows]
                dst.copy_(band.flip(-1) if flip else band)
                dst.mul_(scale).add_(bias)
        return out


_FAILED_SAMPLE = re.compile(r"Failed to decode sample #\d+ : (.+)")


def _cause(message: str) -> str:
    """The part of a DALI error after its operator traceback ("encountered: ...")."""
    tail = message.split("encountered:", 1)[-1]
    lines = [
        line.strip()
        for line in tail.splitlines()
        if line.strip() and "pipeline object is no longer valid" not in line
    ]
    return " ".join(lines[:3]) or message.strip()[:300]


class DaliLoader(ImageLoader):
    """``image_loader`` batches from a DALI pipeline; see the module docstring.

    Args:
        source, shard, config, backend_reason: as for every :class:`ImageLoader`.
    """

    backend = "dali"

    def __init__(
        self,
        source: ImageSource,
        shard: Shard,
        config: LoaderConfig,
        backend_reason: str,
    ) -> None:
        super().__init__(source, shard, config, backend_reason)
        plugin: Any = importlib.import_module("nvidia.dali.plugin.pytorch")

        gpu = config.device.type == "cuda"
        device_id: int | None = None
        if gpu:
            device_id = (
                config.device.index
                if config.device.index is not None
                else torch.cuda.current_device()
            )
        # The reader reshuffles after every epoch; pre-permuting the list makes the first
        # epoch's order depend on `seed` too, whatever the reader does before its first shuffle.
        order = list(range(len(source.files)))
        if config.train:
            g = torch.Generator()
            g.manual_seed(config.seed)
            order = torch.randperm(len(order), generator=g).tolist()
        pipe = build_pipeline(
            [source.files[i] for i in order],
            order,
            gpu=gpu,
            device_id=device_id,
            batch_size=config.batch_size,
            num_threads=config.num_threads,
            seed=config.seed,
            rank=shard.rank,
            world_size=shard.world_size,
            train=config.train,
            size=config.size,
            mean=config.mean,
            std=config.std,
        )
        iterate = {
            "reader_name": READER,
            "last_batch_policy": plugin.LastBatchPolicy.FILL,
            "auto_reset": False,
            "prepare_first_batch": False,
        }
        self._finish: CpuTrainFinish | None = None
        if config.train and not gpu:  # crops of every size: the ragged iterator
            self._finish = CpuTrainFinish(config.size, mean=config.mean, std=config.std)
            ragged = plugin.DALIRaggedIterator
            tags = [ragged.SPARSE_LIST_TAG, ragged.DENSE_TAG, ragged.DENSE_TAG]
            self._iterator: Any = ragged(
                [pipe], ["crops", "flips", "indices"], output_types=tags, **iterate
            )
        else:
            self._iterator = plugin.DALIGenericIterator([pipe], ["images", "indices"], **iterate)
        self._reader_batches = len(self._iterator)
        if self._reader_batches < shard.batches:  # the shard plan and DALI's must agree
            raise RuntimeError(
                f"internal error: DALI reads {self._reader_batches} batches per epoch, "
                f"fewer than the {shard.batches} planned"
            )
        self._consumed = 0
        self._failed: str | None = None
        self._labels = labels_tensor(source.labels)

    def _next(self) -> dict[str, Any]:
        """DALI's next batch, as its iterator gives it (resetting it at the epoch's end)."""
        if self._iterator is None:
            raise RuntimeError("this image loader was closed")
        if self._failed is not None:
            raise RuntimeError(f"this loader's DALI pipeline failed earlier: {self._failed}")
        try:
            out = next(self._iterator)[0]
        except RuntimeError as e:
            found = _FAILED_SAMPLE.search(str(e))
            what = f"could not decode {found.group(1).strip()}" if found else "failed"
            self._failed = f"DALI {what}"
            said = "" if found else f" DALI said: {_cause(str(e))}"
            raise RuntimeError(
                f"DALI {what} (rank {self.shard.rank}, epoch {self.epoch - 1}); a DALI pipeline "
                "cannot continue after an error. Fix or remove the file, or pass "
                "on_error='skip', which decodes every file up front and leaves out the bad "
                f"ones.{said}"
            ) from e
        self._consumed += 1
        if self._consumed == self._reader_batches:
            self._iterator.reset()
            self._consumed = 0
        return out  # type: ignore[no-any-return]

    def _images(self, out: dict[str, Any]) -> torch.Tensor:
        if self._finish is None:
            return out["images"]  # type: ignore[no-any-return]
        return self._finish(out["crops"], out["flips"].reshape(-1).tolist())

    def _finish_abandoned_epoch(self) -> None:
        # DALI's reader cannot rewind: an epoch left part-way is read to its end first.
        while self._consumed:
            self._next()

    def _epoch(self, epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        self._finish_abandoned_epoch()
        device, plan = self.config.device, self.shard
        for b in range(self._reader_batches):
            out = self._next()
            if b >= plan.batches:
                continue  # past the plan ("drop"): read only to keep the reader aligned
            images = self._images(out)
            indices = out["indices"].reshape(-1).to("cpu", torch.int64)
            if b == plan.batches - 1 and plan.last_batch_size < len(indices):
                images, indices = images[: plan.last_batch_size], indices[: plan.last_batch_size]
            labels = self._labels[indices].to(device, non_blocking=True)
            yield images.to(device), labels, indices

    def close(self) -> None:
        self._iterator = None
        self._finish = None  # its batch buffers go once the caller's batches do
