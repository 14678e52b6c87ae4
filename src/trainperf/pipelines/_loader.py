"""`image_loader`: pick a backend, check the arguments, build the loader."""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch

from trainperf._utils.imports import is_available, require
from trainperf._utils.stack import user_stacklevel
from trainperf._utils.validate import choice, non_negative_int, positive_int
from trainperf.device import resolve_device
from trainperf.pipelines._base import ImageBackend, ImageLoader, LastBatch, LoaderConfig
from trainperf.pipelines._header import MAX_IMAGE_PIXELS
from trainperf.pipelines._source import (
    ImageSource,
    Shard,
    load_source,
    resolve_shard,
    shard_plan,
    shown,
)

__all__ = ["IMAGENET_MEAN", "IMAGENET_STD", "MAX_IMAGE_PIXELS", "image_loader"]

IMAGENET_MEAN: tuple[float, float, float] = (0.485, 0.456, 0.406)
IMAGENET_STD: tuple[float, float, float] = (0.229, 0.224, 0.225)

_BACKENDS = ("auto", "dali", "nvjpeg", "torchvision")
_LAST_BATCH = ("drop", "keep", None)
_ON_ERROR = ("raise", "skip")
_log = logging.getLogger(__name__)


# The oldest DALI the backend runs on: its CPU graph uses the dynamic executor (1.44).
DALI_MIN_VERSION = (1, 44)


def _dali_import_error() -> ImportError | OSError | None:
    """None if NVIDIA DALI imports and is new enough, else the error that says why not."""
    try:
        import nvidia.dali
    except (ImportError, OSError) as e:  # e.g. a wheel built for another CUDA
        return e
    version = getattr(nvidia.dali, "__version__", None)
    found = re.match(r"(\d+)\.(\d+)", str(version))
    need = ".".join(map(str, DALI_MIN_VERSION))
    if found is None:
        return ImportError(
            f"cannot tell which NVIDIA DALI this is (__version__ = {version!r}); trainperf "
            f"needs {need} or later"
        )
    if (int(found[1]), int(found[2])) < DALI_MIN_VERSION:
        return ImportError(f"NVIDIA DALI {version} is older than {need}")
    return None


def _dali_importable() -> bool:
    if not is_available("nvidia.dali"):
        return False
    error = _dali_import_error()
    if error is not None:
        _log.info("NVIDIA DALI is installed but cannot be used (%s); not using it", error)
        return False
    return True


def _choose_backend(
    backend: Literal["auto", "dali", "nvjpeg", "torchvision"], device: torch.device
) -> tuple[ImageBackend, str]:
    if backend == "dali":
        if not is_available("nvidia.dali"):
            from trainperf.pipelines._dali import dali_missing_error

            raise dali_missing_error()
        error = _dali_import_error()
        if error is not None:
            from trainperf.pipelines._dali import dali_broken_error

            raise dali_broken_error(error) from error
        if device.type not in ("cpu", "cuda"):
            raise ValueError(
                f"backend='dali' runs on 'cpu' or a CUDA device, got device='{device}'; "
                "use backend='torchvision'"
            )
        return "dali", "asked for"
    if backend == "nvjpeg":
        require("torchvision", "image_loader(backend='nvjpeg')")
        if device.type != "cuda":
            raise ValueError(
                f"backend='nvjpeg' decodes on a CUDA GPU, but device is '{device}'; use "
                "backend='dali' or backend='torchvision' there"
            )
        return "nvjpeg", "asked for"
    if backend == "torchvision":
        require("torchvision", "image_loader(backend='torchvision')")
        return "torchvision", "asked for"
    if device.type in ("cpu", "cuda") and _dali_importable():
        where = "nvJPEG on the GPU" if device.type == "cuda" else "DALI's CPU mode"
        return "dali", f"auto: NVIDIA DALI is installed ({where})"
    if not is_available("nvidia.dali"):
        no_dali = "DALI is not installed"
    elif device.type in ("cpu", "cuda"):
        no_dali = "DALI is installed but cannot be used (see the INFO log)"
    else:
        no_dali = f"DALI does not run on '{device.type}'"
    if device.type == "cuda" and is_available("torchvision"):
        return "nvjpeg", f"auto: {no_dali}; CUDA device, so torchvision's GPU decode"
    if is_available("torchvision"):
        return "torchvision", (
            f"auto: {no_dali} and device '{device}' has no nvJPEG, so the autotuned DataLoader"
        )
    raise ModuleNotFoundError(
        "image_loader() needs NVIDIA DALI or torchvision: pip install 'trainperf[dali]' "
        "or pip install 'trainperf[vision]'",
        name="torchvision",
    )


def _channel_triple(
    name: str, value: Sequence[float], *, positive: bool
) -> tuple[float, float, float]:
    if isinstance(value, (set, frozenset, dict, str, bytes)):  # no channel order, or text
        raise ValueError(
            f"{name} must be 3 numbers in R, G, B order (a list or tuple), got {value!r}"
        )
    try:
        triple = tuple(float(v) for v in value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name} must be 3 numbers (R, G, B), got {value!r}") from e
    if not all(math.isfinite(v) for v in triple):  # NaN passes every comparison below
        raise ValueError(f"{name} must be finite, got {value!r}")
    if len(triple) != 3 or (positive and min(triple) <= 0):
        need = "3 positive numbers" if positive else "3 numbers"
        raise ValueError(f"{name} must be {need} (R, G, B, in 0..1 units), got {value!r}")
    if max(triple) > 1:
        # No channel of a 0..1 image has a mean or a spread above 1, so these are 0..255
        # units (DALI's convention); taken as given, every image would come out ~constant.
        divided = tuple(round(v / 255, 4) for v in triple)
        raise ValueError(
            f"{name} must be in 0..1 units (images are scaled to 0..1 before normalising), "
            f"got {value!r}, which looks like 0..255 units; pass {name}={divided!r}"
        )
    return triple[0], triple[1], triple[2]


def _seed(seed: object) -> int:
    """``seed`` checked: an int in ``0 <= seed < 2**64``, what ``torch.Generator.manual_seed``
    takes (each epoch's ``seed + epoch`` is taken modulo ``2**64``)."""
    seed = non_negative_int("seed", seed)
    if seed >= 2**64:
        raise ValueError(
            f"seed must be < 2**64 (it seeds torch.Generator, which takes 64 bits), got "
            f"{seed}; pass a smaller one, e.g. seed % 2**64 = {seed % 2**64}"
        )
    return seed


def _check_choices(*, train: object, backend: object, last_batch: object, on_error: object) -> None:
    if not isinstance(train, bool):
        raise ValueError(f"train must be True or False, got {train!r}")
    choice("backend", backend, _BACKENDS)
    choice("last_batch", last_batch, _LAST_BATCH)
    choice("on_error", on_error, _ON_ERROR)


def _threads(num_threads: int | Literal["auto"]) -> int:
    """``num_threads`` checked, or this process's share of the usable CPUs for ``"auto"``."""
    if num_threads == "auto":
        from trainperf.limits import local_world_size, usable_cpus

        return usable_cpus(local_world_size())
    return positive_int("num_threads", num_threads)


def _check_loader_kwargs(
    loader_kwargs: Mapping[str, Any] | None, chosen: ImageBackend, backend: str
) -> None:
    """``loader_kwargs`` are for the torchvision backend: an error if another was asked for."""
    if loader_kwargs is None or chosen == "torchvision":
        return
    if backend != "auto":
        raise ValueError(
            f"loader_kwargs configure the torchvision backend's DataLoader; "
            f"backend={backend!r} takes none"
        )
    _log.info("backend %r chosen: loader_kwargs (torchvision only) are not used", chosen)


def _warn_skipped(source: ImageSource) -> None:
    if not source.skipped:
        return
    import warnings

    listed = ", ".join(f"{shown(b.path)} ({b.reason})" for b in source.skipped[:5])
    more = len(source.skipped) - 5
    # A folder that cannot be listed is skipped too, with every image in it.
    kind = (
        "file(s) or folder(s)" if any(os.path.isdir(b.path) for b in source.skipped) else "file(s)"
    )
    warnings.warn(
        f"image_loader skipped {len(source.skipped)} unreadable {kind}: {listed}"
        + (f" and {more} more" if more > 0 else "")
        + "; see loader.skipped",
        stacklevel=user_stacklevel(),  # the line that called image_loader
    )


def _build_loader(
    chosen: ImageBackend,
    source: ImageSource,
    plan: Shard,
    config: LoaderConfig,
    reason: str,
    loader_kwargs: Mapping[str, Any] | None,
) -> ImageLoader:
    """The loader of the chosen backend; each backend's module is imported only here."""
    if chosen == "dali":
        from trainperf.pipelines._dali import DaliLoader

        return DaliLoader(source, plan, config, reason)
    if chosen == "nvjpeg":
        from trainperf.pipelines._nvjpeg import NvjpegLoader

        return NvjpegLoader(source, plan, config, reason)
    from trainperf.pipelines._torchvision import TorchvisionLoader

    return TorchvisionLoader(source, plan, config, reason, loader_kwargs)


def image_loader(
    source: str | os.PathLike[str] | Sequence[tuple[str | os.PathLike[str], int]],
    batch_size: int,
    *,
    train: bool = True,
    size: int = 224,
    backend: Literal["auto", "dali", "nvjpeg", "torchvision"] = "auto",
    device: str | torch.device | None = "auto",
    num_threads: int | Literal["auto"] = "auto",
    shard: Literal["auto"] | tuple[int, int] | None = "auto",
    seed: int = 0,
    last_batch: Literal["drop", "keep"] | None = None,
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
    on_error: Literal["raise", "skip"] = "raise",
    loader_kwargs: Mapping[str, Any] | None = None,
    max_pixels: int | None = MAX_IMAGE_PIXELS,
) -> ImageLoader:
    """Batches of normalised images and their labels, decoded off the Python workers.

    Yields ``(images, labels)``: float32 ``[N, 3, size, size]`` normalised with ``mean`` and
    ``std``, and int64 ``[N]``, both on ``device``. ``len()`` is the number of batches per
    epoch; each new iteration is a new epoch, reshuffled when ``train``. An epoch abandoned
    part-way (a ``break``) costs at most the few batches already read ahead.

    With the torchvision backend and no ``num_workers`` in ``loader_kwargs``, building the
    loader *runs the DataLoader autotuner* (:func:`trainperf.loader.autotune_loader`): it
    measures worker counts for up to ``budget_s`` seconds (30 by default), stores the choice
    in the tuner's cache (``~/.cache/trainperf/loader.json``; a later call with the same
    data returns at once) and shows no progress bar unless ``loader_kwargs`` asks for one
    (``"progress": True``). Pass ``{"num_workers": n}`` to skip tuning, or
    ``{"budget_s": ..., "cache": False}`` to bound or not store it.

    Train: random resized crop (area 8-100 %, aspect 3/4-4/3), horizontal flip, normalise.
    Eval: resize the shorter side to ``int(size / 0.875)``, centre crop, normalise: the
    output of torchvision's ``Resize`` + ``CenterCrop`` + ``Normalize`` (exact for the
    torchvision backend; DALI within one grey level, see ``docs/pipelines.md``).
    Grayscale, CMYK and PNG images are converted to RGB. The EXIF orientation of JPEG, PNG
    and WebP files is ignored and a TIFF's Orientation tag applied, as torchvision's
    ImageFolder (PIL) does.

    Args:
        source: an ImageFolder directory (``root/<class>/<image>``, classes sorted by
            name) or a list of ``(path, label)`` pairs.
        batch_size: images per batch, per rank.
        train: training augmentation and reshuffling, or the eval transform in file order.
        size: output height and width.
        backend: ``"auto"`` (DALI if installed, else nvjpeg on a CUDA device, else
            torchvision), or one of them by name. The choice is in ``loader.backend`` and
            ``loader.backend_reason``, and logged.
        device: where batches are delivered; ``"auto"`` (the default) or None is the best
            available device, :func:`trainperf.best_device`, as everywhere in trainperf
            (parsed by :func:`trainperf.device.resolve_device`).
        num_threads: decode threads (DALI), reader threads (nvjpeg) or the most DataLoader
            workers (torchvision); ``"auto"``: this process's share of the usable CPUs
            (divided by :func:`trainperf.limits.local_world_size`).
        shard: ``"auto"`` reads this rank's shard under ``torch.distributed`` (or torchrun's
            ``RANK``/``WORLD_SIZE``); ``(rank, world_size)`` sets it; None reads everything.
            Every rank gets the same number of batches per epoch.
        seed: seeds shuffling and augmentation (use the same on every rank); an int in
            ``0 <= seed < 2**64``.
        last_batch: ``"drop"`` the partial last batch (each rank's shard is trimmed to
            ``floor(N / world_size)``), or ``"keep"`` it (shards padded to
            ``ceil(N / world_size)`` by repeating images). None (the default): ``"drop"``
            when ``train``, ``"keep"`` otherwise, so that evaluation sees every image.
        mean: per-channel mean, 0..1 units (not DALI's 0..255: a value over 1 is refused).
        std: per-channel standard deviation, 0..1 units (a value over 1 is refused).
        on_error: ``"raise"``: a missing, empty or non-image file, one over
            ``max_pixels``, one that is not a regular file (a FIFO, a device: never
            opened to read, so it cannot block), or a folder that cannot be listed, raises
            up front, naming it, and a file that fails to decode raises when it is reached;
            ``"skip"``: every file is decoded once up front and bad ones (those over
            ``max_pixels`` without decoding them) and unlistable folders are left out with
            a warning (listed in ``loader.skipped``). A file that goes bad after the loader is
            built raises, naming it, whichever is chosen.
        loader_kwargs: torchvision backend only: keyword arguments for
            :func:`trainperf.loader.autotune_loader` (e.g. ``budget_s``, ``cache``,
            ``progress``, which defaults to False here), or for a plain ``DataLoader`` when
            they include ``num_workers`` (no tuning).
        max_pixels: the most pixels (width x height) an image may have: every backend reads
            the size from the file's header, before decoding it, and treats an image over
            the limit as a bad file (see ``on_error``), so a decompression bomb (a small
            file that claims 30000 x 30000 pixels) never reaches a decoder. The default is
            Pillow's ``MAX_IMAGE_PIXELS``, 89,478,485 (:data:`MAX_IMAGE_PIXELS`); None: no
            limit.

    Returns:
        An :class:`ImageLoader`.

    Raises:
        ValueError: a bad argument (a NaN or infinite ``mean``/``std`` among them); no
            images; a bad file (an image over ``max_pixels`` among them) or a folder that
            cannot be listed under ``on_error="raise"``; a list's largest label far beyond
            the labels used;
            ``batch_size`` larger than a rank's share with ``last_batch="drop"`` (the
            default when training); with
            ``num_threads="auto"``, a ``LOCAL_WORLD_SIZE``/``SLURM_NTASKS_PER_NODE`` that
            is not a whole number >= 1.
        FileNotFoundError: ``source`` does not exist, or is ``""``.
        ModuleNotFoundError: the backend's package is not installed (the message names the
            ``pip install`` command).
        ImportError: ``backend="dali"`` and DALI is installed but does not import (e.g. a
            wheel for another CUDA version) or is older than 1.44; the message says why and
            how to reinstall it.
        TypeError: ``source`` is neither a folder path nor a list of ``(path, label)``
            pairs (a ``bytes`` path among them); ``device`` is not a str, int or
            torch.device.
        DeviceError: CUDA (or MPS) asked for but not available, or a CUDA index beyond the
            visible GPUs.

    Example:
        >>> import os, tempfile
        >>> import numpy as np
        >>> from PIL import Image
        >>> root = tempfile.mkdtemp()
        >>> for cls, colour in (("red", (220, 20, 20)), ("blue", (20, 20, 220))):
        ...     os.makedirs(f"{root}/{cls}")
        ...     for i in range(3):
        ...         Image.new("RGB", (64 + 8 * i, 48), colour).save(f"{root}/{cls}/{i}.jpg")
        >>> loader = image_loader(root, batch_size=4, size=32, backend="torchvision",
        ...                       device="cpu", loader_kwargs={"num_workers": 0})
        >>> len(loader), loader.classes
        (1, ('blue', 'red'))
        >>> images, labels = next(iter(loader))
        >>> images.shape, images.dtype, labels.dtype
        (torch.Size([4, 3, 32, 32]), torch.float32, torch.int64)
    """
    batch_size = positive_int("batch_size", batch_size)
    size = positive_int("size", size)
    _check_choices(train=train, backend=backend, last_batch=last_batch, on_error=on_error)
    seed = _seed(seed)
    max_pixels = positive_int("max_pixels", max_pixels, none_ok=True)
    mean3 = _channel_triple("mean", mean, positive=False)
    std3 = _channel_triple("std", std, positive=True)
    rank, world_size = resolve_shard(shard)
    threads = _threads(num_threads)
    dev = resolve_device(device)
    chosen, reason = _choose_backend(backend, dev)
    _check_loader_kwargs(loader_kwargs, chosen, backend)
    source_files = load_source(source, on_error=on_error, max_pixels=max_pixels)
    _warn_skipped(source_files)
    # Training drops the ragged batch; evaluation keeps it, or the same images go unseen.
    batch_rule: LastBatch = last_batch or ("drop" if train else "keep")
    plan = shard_plan(len(source_files.files), batch_size, rank, world_size, batch_rule)
    config = LoaderConfig(
        batch_size=batch_size,
        train=train,
        size=size,
        device=dev,
        num_threads=threads,
        seed=seed,
        last_batch=batch_rule,
        mean=mean3,
        std=std3,
        max_pixels=max_pixels,
    )
    loader = _build_loader(chosen, source_files, plan, config, reason, loader_kwargs)
    _log.info("%r", loader)
    return loader
