"""The nvjpeg backend: CPU threads read bytes, the GPU decodes batches and augments them.

A producer thread assembles each batch ahead of the training loop: a thread pool reads the
files, ``torchvision.io.decode_jpeg(list, device="cuda")`` decodes the JPEGs in one batched
nvJPEG call, and the crop / resize / flip / normalise of :mod:`._augment` run on the GPU, on
a side stream; the training loop's stream waits on an event, never on the host. Files that
nvJPEG does not take (PNG, BMP, TIFF, WebP, and CMYK/YCCK JPEGs) are decoded on the CPU in the
reader threads (``torchvision.io.decode_image``, PIL as the fallback) and copied over, and
so are JPEGs that do not end with the end-of-image marker (truncated ones among them: nvJPEG
may decode those without an error, the CPU decoder raises naming the file). Each file's bytes
pass the header check (format, image size within ``max_pixels``) before any decoder sees them.

Crops and flips are :func:`._augment.train_params`' for ``(seed, epoch, index)``, as in every
backend, so all cut the same boxes out of the same images. The device may also be the CPU,
which the CPU test suite uses to run this very code; :func:`trainperf.pipelines.image_loader`
offers this backend only for CUDA devices.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from trainperf.pipelines._augment import (
    center_resize_crop,
    normalize,
    random_flip,
    resized_crop,
    train_params,
)
from trainperf.pipelines._base import ImageLoader, LoaderConfig, labels_tensor
from trainperf.pipelines._decode import pil_failure, pil_to_rgb, to_uint8
from trainperf.pipelines._source import ImageSource, Shard, epoch_batches, read_checked, shown

__all__ = ["NvjpegLoader", "augment_batch", "jpeg_frame"]

# Queue poll interval: how soon a consumer notices a producer that died without a word.
_POLL_S = 1.0
_SOF_MARKERS = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
_GPU_FRAMES = ((0xC0, 3), (0xC1, 3))


def jpeg_frame(data: bytes | np.ndarray[Any, Any]) -> tuple[int, int] | None:
    """``(start-of-frame marker, colour components)`` of a JPEG, or None if there is none.

    The marker tells the coding (0xC0 baseline, 0xC1 extended, 0xC2 progressive, ...);
    components are 1 for grey, 3 for YCbCr/RGB, 4 for CMYK/YCCK. Walks the marker segments
    up to the first start-of-frame, jumping over each by its length, however far into the
    file it is (camera JPEGs carry EXIF thumbnails and ICC profiles of 64 KiB and more).

    Example:
        >>> jpeg_frame(b"\\xff\\xd8\\xff\\xc0\\x00\\x0b\\x08\\x00\\x10\\x00\\x10\\x03")
        (192, 3)
    """
    # A view, not a copy, whatever the size.
    buf = (data.data if isinstance(data, np.ndarray) else memoryview(data)).cast("B")
    pos = 2
    while pos + 4 <= len(buf):
        if buf[pos] != 0xFF:
            return None
        marker = buf[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker in _SOF_MARKERS:
            return (marker, buf[pos + 9]) if pos + 9 < len(buf) else None
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:
            pos += 2
            continue
        pos += 2 + ((buf[pos + 2] << 8) | buf[pos + 3])
    return None


def _gpu_decodable(data: np.ndarray[Any, Any]) -> bool:
    # Baseline or extended sequential colour JPEGs: what nvJPEG's batched decode surely takes.
    # Grey, CMYK and progressive files are rare enough to decode on the CPU. So is a file
    # that does not end with the end-of-image marker: truncated (nvJPEG may decode it
    # without a word, libjpeg-turbo refuses it and the error names the file) or carrying
    # data after the image (which the CPU decoder ignores).
    return (
        data[:3].tobytes() == b"\xff\xd8\xff"
        and data[-2:].tobytes() == b"\xff\xd9"
        and jpeg_frame(data) in _GPU_FRAMES
    )


def augment_batch(
    images: Sequence[torch.Tensor],
    indices: Sequence[int],
    *,
    train: bool,
    size: int,
    seed: int,
    epoch: int,
    mean: Sequence[float],
    std: Sequence[float],
) -> torch.Tensor:
    """Decoded ``[3, H, W]`` uint8 images (any sizes, any device) to a normalised batch.

    Train: the random resized crop and flip of ``(seed, epoch, index)``; eval: the
    torchvision resize + centre crop. Runs wherever the images are.

    Returns:
        float32 ``[N, 3, size, size]`` on the images' device.

    Example:
        >>> imgs = [torch.zeros(3, 40, 60, dtype=torch.uint8), torch.zeros(3, 90, 50).byte()]
        >>> augment_batch(imgs, [0, 1], train=True, size=16, seed=0, epoch=0,
        ...               mean=[0.0] * 3, std=[1.0] * 3).shape
        torch.Size([2, 3, 16, 16])
    """
    out: list[torch.Tensor] = []
    flips: list[bool] = []
    for img, index in zip(images, indices, strict=True):
        if train:
            box, flip = train_params(seed, epoch, index, img.shape[-2], img.shape[-1])
            out.append(resized_crop(img, box, size))
            flips.append(flip)
        else:
            out.append(center_resize_crop(img, size))
    batch = torch.stack(out)
    if train:
        batch = random_flip(batch, flips)
    return normalize(batch, mean, std)


def _decode_on_cpu(data: np.ndarray[Any, Any], path: str) -> torch.Tensor:
    from torchvision.io import ImageReadMode, decode_image

    try:
        decoded: torch.Tensor = decode_image(torch.from_numpy(data), mode=ImageReadMode.RGB)
        return to_uint8(decoded)  # 16-bit PNGs decode to uint16
    except RuntimeError:
        pass  # BMP and TIFF: torchvision.io does not read them; PIL does
    import io

    import torchvision.transforms.functional as TF
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data.tobytes())) as im:
            pixels: torch.Tensor = TF.pil_to_tensor(pil_to_rgb(im))
            return pixels
    except Exception as e:
        raise RuntimeError(
            f"could not decode image '{shown(path)}' ({pil_failure(e)}); fix or remove the "
            "file, or pass on_error='skip'"
        ) from e


class NvjpegLoader(ImageLoader):
    """``image_loader`` batches decoded by nvJPEG; see the module docstring.

    Args:
        source, shard, config, backend_reason: as for every :class:`ImageLoader`.
        prefetch: batches prepared ahead of the training loop.
    """

    backend = "nvjpeg"

    def __init__(
        self,
        source: ImageSource,
        shard: Shard,
        config: LoaderConfig,
        backend_reason: str,
        *,
        prefetch: int = 2,
    ) -> None:
        super().__init__(source, shard, config, backend_reason)
        self._labels = labels_tensor(source.labels)
        self._prefetch = prefetch
        self._pool: ThreadPoolExecutor | None = ThreadPoolExecutor(
            max_workers=config.num_threads, thread_name_prefix="trainperf-nvjpeg"
        )
        self._gpu = config.device.type == "cuda"

    # ----------------------------------------------------------------- producer side

    def _live_pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            raise RuntimeError("this image loader was closed")
        return self._pool

    def _decode(
        self, paths: Sequence[str], datas: list[np.ndarray[Any, Any]]
    ) -> list[torch.Tensor]:
        from torchvision.io import ImageReadMode, decode_jpeg

        pool = self._live_pool()
        device = self.config.device
        on_gpu = [i for i, data in enumerate(datas) if _gpu_decodable(data)]
        gpu_set = set(on_gpu)
        rest = [i for i in range(len(paths)) if i not in gpu_set]
        decoded: list[torch.Tensor | None] = [None] * len(paths)
        cpu_jobs = [pool.submit(_decode_on_cpu, datas[i], paths[i]) for i in rest]
        if on_gpu:
            encoded = [torch.from_numpy(datas[i]) for i in on_gpu]
            try:
                images = decode_jpeg(encoded, mode=ImageReadMode.RGB, device=device)
            except RuntimeError:
                # The batch call does not say which file failed: decode one by one, on the CPU
                # where nvJPEG refuses a file, so only a file nothing can read is an error.
                images = []
                for i, data in zip(on_gpu, encoded, strict=True):
                    try:
                        images.append(decode_jpeg(data, mode=ImageReadMode.RGB, device=device))
                    except RuntimeError:
                        images.append(_decode_on_cpu(datas[i], paths[i]).to(device))
            for i, img in zip(on_gpu, images, strict=True):
                decoded[i] = img
        for i, job in zip(rest, cpu_jobs, strict=True):
            decoded[i] = job.result().to(device, non_blocking=True)
        return [d for d in decoded if d is not None]

    def _make_batch(self, indices: list[int], epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
        paths = [self.source.files[i] for i in indices]
        limit = self.config.max_pixels
        datas = list(self._live_pool().map(lambda p: read_checked(p, limit), paths))
        images = self._decode(paths, datas)
        c = self.config
        batch = augment_batch(
            images,
            indices,
            train=c.train,
            size=c.size,
            seed=c.seed,
            epoch=epoch,
            mean=c.mean,
            std=c.std,
        )
        labels = self._labels[torch.tensor(indices)].to(c.device, non_blocking=True)
        return batch, labels

    def _produce(
        self, batches: list[list[int]], epoch: int, out: queue.Queue[Any], stop: threading.Event
    ) -> None:
        stream: Any = None
        if self._gpu:
            stream = torch.cuda.Stream(self.config.device)  # type: ignore[no-untyped-call]
        try:
            for indices in batches:
                if stop.is_set():
                    return
                if stream is not None:
                    with torch.cuda.stream(stream):
                        images, labels = self._make_batch(indices, epoch)
                        ready: Any = torch.cuda.Event()  # type: ignore[no-untyped-call]
                        ready.record(stream)
                else:
                    images, labels = self._make_batch(indices, epoch)
                    ready = None
                item = ("batch", images, labels, indices, ready)
                while not stop.is_set():
                    try:
                        out.put(item, timeout=_POLL_S)
                        break
                    except queue.Full:
                        continue
        except BaseException as e:  # handed to the consumer, which re-raises it
            out.put(("error", e))
        else:
            out.put(("done",))

    # ----------------------------------------------------------------- consumer side

    def _epoch(self, epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        if self._pool is None:
            raise RuntimeError("this image loader was closed")
        c = self.config
        batches = epoch_batches(
            len(self.source.files),
            self.shard,
            c.batch_size,
            shuffle=c.train,
            seed=c.seed,
            epoch=epoch,
            last_batch=c.last_batch,
        )
        out: queue.Queue[Any] = queue.Queue(maxsize=self._prefetch)
        stop = threading.Event()
        producer = threading.Thread(
            target=self._produce,
            args=(batches, epoch, out, stop),
            name="trainperf-nvjpeg-producer",
            daemon=True,
        )
        producer.start()
        try:
            while True:
                try:
                    item = out.get(timeout=_POLL_S)
                except queue.Empty:
                    if not producer.is_alive() and out.empty():
                        raise RuntimeError(
                            "the nvjpeg producer thread stopped without a result"
                        ) from None
                    continue
                if item[0] == "done":
                    return
                if item[0] == "error":
                    if self._pool is None:  # close() cancelled the producer's reads
                        raise RuntimeError("this image loader was closed") from item[1]
                    raise item[1]
                _, images, labels, indices, ready = item
                if ready is not None:
                    current = torch.cuda.current_stream(self.config.device)
                    current.wait_event(ready)
                    # The batch was allocated on the producer's stream; tell the allocator
                    # this stream uses it too, so it is not recycled under the training step.
                    images.record_stream(current)
                    labels.record_stream(current)
                yield images, labels, torch.tensor(indices, dtype=torch.int64)
                if self._pool is None:  # close() while the loop held this batch
                    raise RuntimeError("this image loader was closed")
        finally:
            stop.set()
            while producer.is_alive():
                with contextlib.suppress(queue.Empty):
                    out.get(timeout=0.05)
            producer.join()

    def close(self) -> None:
        # Marked closed before the shutdown, so a producer whose reads it cancels is seen to
        # have been stopped by close(), not by a failure.
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
