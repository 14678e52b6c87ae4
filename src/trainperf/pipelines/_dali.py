"""The DALI backend: a DALI pipeline decodes and augments in C++ threads (or on the GPU).

Input (:mod:`._dali_feed`): trainperf reads the files, checks each one's header on the bytes
it hands over, and feeds DALI through an ``external_source``, in the order of the other
backends (``DistributedSampler``'s), epoch after epoch. So trainperf knows which files are in
every batch: a DALI error is traced back to its file (:func:`describe_failure`), a file name
need not be UTF-8, and a decompression bomb never reaches DALI's decoder.

Graph (:mod:`._dali_graph`): ``decoders.image`` (``"mixed"``: nvJPEG on the GPU; ``"cpu"``:
libjpeg-turbo, when there is no GPU) -> random resized crop + ``resize`` (train) or an exact
torchvision-style resize + ``slice`` (eval) -> ``crop_mirror_normalize`` (random mirror when
training) -> DALI's PyTorch iterator. The crop boxes and flips come with the files, drawn as
in every backend from ``(seed, epoch, index)``: an epoch set again (``set_epoch``) or
resumed on a new loader gets the same ones, and they are the other backends'.

Training on the CPU ends differently. DALI decodes only the random crop's region
(``decoders.image_slice``) and hands the uint8 crops over without a copy (its dynamic
executor, DALI >= 1.44). torch then resizes each crop (bilinear, antialiased: the torchvision
backend's work), mirrors it and normalises it into a reused batch buffer
(:class:`CpuTrainFinish`). Measured on 500x375 JPEGs, DALI's own linear resize cost 0.8 ms per
image without antialiasing, torch's vectorised uint8 resize 0.25 ms with it, so the CPU path is
both cheaper and equal in quality to the other backends.

Each batch is exactly the shard plan's: full batches, and a partial last one with
``last_batch="keep"``. An epoch left part-way costs only the batches DALI had read ahead.
One pipeline feeds one pass at a time: a pass that a newer ``iter(loader)`` took the feed
from raises at its next batch, rather than dropping the newer pass's batches forever.
Passes in several threads take turns at DALI (its iterator is not thread-safe) under the
same rule: a pass taken over by one in another thread raises, naming the fix (one loader per
thread).
"""

from __future__ import annotations

import importlib
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from trainperf.pipelines._base import ImageLoader, LoaderConfig, labels_tensor
from trainperf.pipelines._dali_feed import DALI_REFUSES, FedBatch, FileFeed, find_culprits
from trainperf.pipelines._dali_graph import build_pipeline
from trainperf.pipelines._source import BadFile, ImageSource, Shard, epoch_batches, shown

__all__ = [
    "CpuTrainFinish",
    "DaliLoader",
    "build_pipeline",
    "dali_broken_error",
    "dali_missing_error",
    "describe_failure",
    "failure_fix",
]

_SKIP_FIX = (
    "Fix or remove the file, or pass on_error='skip', which decodes every file up front and "
    "leaves out the bad ones"
)
_PIL_READS_FIX = (
    "on_error='skip' would keep the file: it leaves out only files PIL cannot decode, and PIL "
    "decodes this one. Convert it to an image DALI decodes (e.g. an 8-bit RGB PNG or JPEG; "
    "1-bit TIFFs are one kind DALI refuses), or pass backend='torchvision', which decodes "
    "with PIL"
)
_UNKNOWN_FILE_FIX = (
    "If a file is damaged, pass on_error='skip', which decodes every file up front and "
    "leaves out the bad ones; if DALI refuses a file PIL reads, pass backend='torchvision', "
    "which decodes with PIL"
)


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


def _cause(message: str) -> str:
    """The part of a DALI error after its operator traceback ("encountered: ...")."""
    tail = message.split("encountered:", 1)[-1]
    lines = [
        line.strip()
        for line in tail.splitlines()
        if line.strip() and "pipeline object is no longer valid" not in line
    ]
    return " ".join(lines[:3]) or message.strip()[:300]


def describe_failure(message: str, culprits: Sequence[BadFile], suspects: Sequence[str]) -> str:
    """What went wrong, for a DALI decoder error: the culprit files and why, or the suspects
    (all of which PIL decodes), or, with neither (nothing was pending), DALI's words alone.

    Example:
        >>> print(describe_failure("...encountered: nvImageCodec failure: '#3'", [], ["a.jpg"]))
        DALI failed on one of 'a.jpg', which PIL decodes (DALI said: nvImageCodec failure: '#3')
    """
    if culprits:
        listed = "; ".join(f"'{shown(b.path)}': {b.reason}" for b in culprits[:5])
        more = f" and {len(culprits) - 5} more" if len(culprits) > 5 else ""
        return f"DALI could not decode {listed}{more}"
    if not suspects:
        return f"DALI failed on a file it did not name (DALI said: {_cause(message)})"
    names = ", ".join(f"'{shown(p)}'" for p in suspects[:10])
    more = f" and {len(suspects) - 10} more" if len(suspects) > 10 else ""
    return f"DALI failed on one of {names}{more}, which PIL decodes (DALI said: {_cause(message)})"


def failure_fix(culprits: Sequence[BadFile], suspects: Sequence[str]) -> str:
    """The fix to suggest for a DALI decoder error: ``on_error='skip'`` only if some culprit
    is a file PIL cannot decode, since skip checks files with PIL and keeps the others;
    converting the file if PIL decodes every suspect; both choices if no file is known.

    Example:
        >>> failure_fix([BadFile("a.jpg", "cannot be decoded (truncated)")], ["a.jpg"])[:25]
        'Fix or remove the file, o'
        >>> failure_fix([], ["a.jpg"])[:37]
        "on_error='skip' would keep the file: "
        >>> failure_fix([], [])[:38]
        "If a file is damaged, pass on_error='s"
    """
    if any(b.reason != DALI_REFUSES for b in culprits):
        return _SKIP_FIX
    if not suspects:  # nothing was pending, so no file was checked with PIL
        return _UNKNOWN_FILE_FIX
    return _PIL_READS_FIX


def _device_id(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    return device.index if device.index is not None else torch.cuda.current_device()


def _epoch_plan(num_files: int, shard: Shard, c: LoaderConfig) -> Callable[[int], list[list[int]]]:
    """Epoch -> this rank's batches. Not a method: the feed must not hold the loader, or the
    two would form a cycle that only the garbage collector frees, and it may do so in a forked
    DataLoader worker, where destroying a DALI pipeline (its threads are not there) crashes."""

    def plan(epoch: int) -> list[list[int]]:
        return epoch_batches(
            num_files,
            shard,
            c.batch_size,
            shuffle=c.train,
            seed=c.seed,
            epoch=epoch,
            last_batch=c.last_batch,
        )

    return plan


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
        device_id = _device_id(config.device)
        self._feed = FileFeed(
            source.files,
            _epoch_plan(len(source.files), shard, config),
            max_pixels=config.max_pixels,
            threads=config.num_threads,
            augment_seed=config.seed if config.train else None,
        )
        pipe = build_pipeline(
            self._feed,
            gpu=device_id is not None,
            device_id=device_id,
            batch_size=config.batch_size,
            num_threads=config.num_threads,
            train=config.train,
            size=config.size,
            mean=config.mean,
            std=config.std,
        )
        # The feed never ends (epoch after epoch), so DALI's iterators never reset.
        iterate = {"auto_reset": False, "prepare_first_batch": False}
        self._finish: CpuTrainFinish | None = None
        if config.train and device_id is None:  # crops of every size: the ragged iterator
            self._finish = CpuTrainFinish(config.size, mean=config.mean, std=config.std)
            ragged = plugin.DALIRaggedIterator
            tags = [ragged.SPARSE_LIST_TAG, ragged.DENSE_TAG, ragged.DENSE_TAG]
            self._iterator: Any = ragged(
                [pipe], ["crops", "flips", "indices"], output_types=tags, **iterate
            )
        else:
            self._iterator = plugin.DALIGenericIterator([pipe], ["images", "indices"], **iterate)
        self._failed: str | None = None
        self._labels = labels_tensor(source.labels)
        # Passes started so far, and the epoch and thread of the latest: one pass reads at a
        # time. The lock keeps threads out of DALI's iterator and the feed one at a time.
        self._passes, self._pass_epoch, self._pass_thread = 0, 0, threading.get_ident()
        self._lock = threading.Lock()

    def _next(self) -> tuple[dict[str, Any], FedBatch]:
        """DALI's next batch, as its iterator gives it, and which files it holds."""
        if self._failed is not None:
            raise RuntimeError(f"this loader's DALI pipeline failed earlier: {self._failed}")
        if self._iterator is None:
            raise RuntimeError("this image loader was closed")
        try:
            out = next(self._iterator)[0]
        except RuntimeError as e:
            pending = self._feed.pending
            problem = pending[0].problem if pending else None
            if problem is not None:
                raise self._fail(problem) from e
            raise self._decode_failure(str(e)) from e
        fed = self._feed.pending.popleft()
        if fed.problem is not None:  # DALI decoded the placeholder: never hand that out
            raise self._fail(fed.problem)
        return out, fed

    def _fail(self, what: str, fix: str = _SKIP_FIX) -> RuntimeError:
        self._failed = what
        # The pipeline cannot run again: let it go now, while this process owns its threads.
        self._iterator = None
        self._feed.close()
        return RuntimeError(
            f"{what} (rank {self.shard.rank}, epoch {self.epoch - 1}); a DALI pipeline cannot "
            f"continue after an error. {fix}"
        )

    def _decode_failure(self, message: str) -> RuntimeError:
        culprits, suspects = find_culprits(
            message, list(self._feed.pending), self.source.files, self.config.max_pixels
        )
        what = describe_failure(message, culprits, suspects)
        return self._fail(what, failure_fix(culprits, suspects))

    def _images(self, out: dict[str, Any]) -> torch.Tensor:
        if "images" in out:  # no crops to finish (eval), whatever close() did since
            return out["images"]  # type: ignore[no-any-return]
        finish = self._finish
        if finish is None:
            raise RuntimeError("this image loader was closed")
        return finish(out["crops"], out["flips"].reshape(-1).tolist())

    def _interrupted(self, epoch: int) -> RuntimeError:
        if self._pass_thread != threading.get_ident():
            return RuntimeError(
                f"this pass over epoch {epoch} was interrupted by a newer pass over the same "
                f"DALI loader (epoch {self._pass_epoch}) from another thread: a DALI loader "
                "feeds one pass at a time, so the older one cannot go on. Build one loader "
                "per thread"
            )
        return RuntimeError(
            f"this pass over epoch {epoch} was interrupted by a newer pass over the same DALI "
            f"loader (epoch {self._pass_epoch}): a DALI loader feeds one pass at a time, so "
            "the older one cannot go on. Finish or break out of one loop over the loader "
            "before starting another (no interleaved or nested loops), or build a second loader"
        )

    def _step(self, epoch: int, mine: int) -> tuple[dict[str, Any], FedBatch]:
        """The next batch for pass number ``mine``, one thread at a time."""
        with self._lock:
            # A newer pass took the feed over: every batch from here on is its own, and this
            # pass would drop them all, waiting forever for one of its epoch.
            if self._passes != mine:
                raise self._interrupted(epoch)
            return self._next()

    def _epoch(self, epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        with self._lock:
            generation = self._feed.start(epoch)
            self._passes += 1
            mine, self._pass_epoch = self._passes, epoch
            self._pass_thread = threading.get_ident()
        device, last = self.config.device, self.shard.batches - 1
        while True:
            out, fed = self._step(epoch, mine)
            if (fed.generation, fed.epoch) != (generation, epoch):
                continue  # read ahead for an epoch left part-way, or before a restart: dropped
            images = self._images(out)
            indices = out["indices"].reshape(-1).to("cpu", torch.int64)
            labels = self._labels[indices].to(device, non_blocking=True)
            yield images.to(device), labels, indices
            if fed.batch == last:
                return

    def close(self) -> None:
        with self._lock:  # not under a pass in another thread's step: it reads these
            self._iterator = None
            self._finish = None  # its batch buffers go once the caller's batches do
            self._feed.close()
