"""The DALI backend's graph: input -> decode -> crop / resize -> normalise.

``external_source`` (the files trainperf reads, :mod:`._dali_feed`) -> ``decoders.image``
(``"mixed"``: nvJPEG on the GPU; ``"cpu"``: libjpeg-turbo, when there is no GPU) -> random
resized crop + ``resize`` (train) or an exact torchvision-style resize + ``slice`` (eval) ->
``crop_mirror_normalize`` (random mirror when training). Training on the CPU stops after the
crop: torch finishes it (:class:`._dali.CpuTrainFinish`).

The graph draws nothing at random: the feed hands it each image's crop box and flip
(:func:`._dali_feed.crop_inputs`), drawn as every backend draws them, from ``(seed, epoch,
index)``. DALI's random operators are seeded once per pipeline and never reset, so with them
an epoch run again (``loader.set_epoch``) or resumed on a new loader got other crops.

EXIF orientation is ignored (``adjust_orientation=False``), as torchvision's ImageFolder
ignores it in JPEG, PNG and WebP files, so every backend sees the same pixels. PIL, and so
ImageFolder, does apply a TIFF's Orientation tag: such TIFFs reach DALI already decoded by PIL,
as PNGs (:func:`._dali_feed.read_for_dali`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any

from trainperf.pipelines._augment import CROP_RATIO

__all__ = ["build_pipeline"]


def _dali_ops() -> tuple[Any, Any]:
    """DALI's ``fn`` and ``types`` modules, as Any: its partial stubs disagree with its runtime
    (``fn`` is generated)."""
    return importlib.import_module("nvidia.dali.fn"), importlib.import_module("nvidia.dali.types")


def _inputs(source: Callable[[], tuple[Any, ...]], train: bool) -> tuple[Any, ...]:
    """The pipeline's inputs from ``source``, per sample: ``(encoded file, file index)``, and
    when training the crop's ``(top, left)``, its ``(height, width)`` and the flip (0/1)."""
    fn, types = _dali_ops()
    crops = [types.INT32] * 3 if train else []
    return fn.external_source(  # type: ignore[no-any-return]
        source=source,
        num_outputs=2 + len(crops),
        batch=True,
        dtype=[types.UINT8, types.INT64, *crops],
    )


def _crops(encoded: Any, anchor: Any, shape: Any, decoder: str) -> Any:
    """Decode only each image's crop box: ``anchor`` ``(top, left)``, ``shape`` ``(h, w)``."""
    fn, types = _dali_ops()
    return fn.decoders.image_slice(
        encoded,
        anchor,
        shape,
        device=decoder,
        output_type=types.RGB,
        axis_names="HW",
        normalized_anchor=False,
        normalized_shape=False,
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
    source: Callable[[], tuple[Any, ...]],
    *,
    gpu: bool,
    device_id: int | None,
    batch_size: int,
    num_threads: int,
    train: bool,
    size: int,
    mean: Sequence[float],
    std: Sequence[float],
) -> Any:
    """Define (not build) the DALI pipeline.

    Args:
        source: the external source's callback: each call returns the next batch, a list of
            encoded files (uint8 arrays) and their file indices, and when training their crop
            anchors, shapes and flips (:class:`._dali_feed.FileFeed`).
        gpu: decode with ``"mixed"`` and augment on the GPU; else everything on the CPU.
        device_id: the CUDA device, or None for DALI's CPU-only mode.
        batch_size: the most samples per batch.
        num_threads: DALI CPU threads.
        train: the fed crop + mirror; else eval resize + crop.
        size: output height and width.
        mean: per-channel mean in 0..1 units.
        std: per-channel std in 0..1 units.

    Returns:
        An unbuilt ``nvidia.dali.Pipeline``. Its outputs are ``(images, indices)``, except
        when training on the CPU: ``(crops, flips, indices)``, uint8 ``HWC`` crops of any
        size and a 0/1 mirror flag per image, for :class:`._dali.CpuTrainFinish`.
    """
    pipeline_def: Any = importlib.import_module("nvidia.dali").pipeline_def
    fn, types = _dali_ops()
    decoder = "mixed" if gpu else "cpu"

    @pipeline_def(  # type: ignore[untyped-decorator]
        batch_size=batch_size,
        num_threads=num_threads,
        device_id=device_id,
        prefetch_queue_depth=2,
        # On the CPU, DALI's dynamic executor (DALI >= 1.44) hands its output buffers to
        # torch without a copy: copying the eval graph's float batches was 12-15 % of the CPU
        # cost per image. An output a caller keeps stays valid: DALI does not reuse a buffer
        # torch still holds. The GPU graph keeps the default executor: its copy stays on the
        # device, and no GPU run has timed the dynamic one yet.
        exec_dynamic=not gpu,
    )
    def graph() -> tuple[Any, ...]:
        if not train:
            encoded, index = _inputs(source, train)
            images = _eval_resize_crop(encoded, decoder, size)
            return _normalize(images, mean, std, mirror=None), index
        encoded, index, anchor, shape, flip = _inputs(source, train)
        crops = _crops(encoded, anchor, shape, decoder)
        if not gpu:  # torch resizes, mirrors and normalises (CpuTrainFinish)
            return crops, flip, index
        images = fn.resize(
            crops,
            resize_x=float(size),
            resize_y=float(size),
            interp_type=types.INTERP_LINEAR,
            antialias=True,
        )
        return _normalize(images, mean, std, mirror=flip), index

    return graph()
