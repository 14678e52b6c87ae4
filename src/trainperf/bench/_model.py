"""``bench_model``: a GPU throughput benchmark, ResNet-50 and ViT-B/16 on synthetic data.

The method is the one behind the reference table (a GPU cloud provider's published figures,
PyTorch 1.9): a torchvision model with random weights (nothing is downloaded),
synthetic input already in device memory (no CPU preprocessing, no I/O), weights *cast* to
the precision (pure fp16/bf16, not autocast), and a few timed iterations of several
batches each, each printed as ``Iteration i, X images/s in Y s.``. Warm-up batches run
first and are not timed; CUDA is synchronised before and after each timed iteration. The
second warm-up batch is timed on its own (synchronised), to refuse a run that would take
longer than ``max_seconds`` before it does.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable

import torch

from trainperf._utils.imports import require
from trainperf._utils.validate import choice, flag, positive_int
from trainperf.bench._common import (
    DEFAULT_MAX_SECONDS,
    check_max_seconds,
    check_tensor_bytes,
    gpu_name,
    resolve_device,
)
from trainperf.bench._host_notes import cpu_emulation_notes, host_notes_now
from trainperf.bench._model_run import (
    MIN_COMPARABLE_BATCH,
    RunTimeLimit,
    Settings,
    Timing,
    measure,
)
from trainperf.bench._reference import (
    BenchPrecision,
    ModelName,
    ReferenceComparison,
    compare_to_reference,
)
from trainperf.bench._result import BenchResult
from trainperf.errors import DeviceError

__all__ = ["BenchPrecision", "ModelName", "bench_model", "format_iteration"]


MODELS: tuple[str, ...] = ("resnet50", "vit_b_16")
PRECISIONS: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
}

# The reference's iteration is 1,920 images: 15 batches of 128 on a GPU. A CPU gets a token run
# so that the command (and its tests) finish in seconds.
CUDA_DEFAULTS = {"batch_size": 128, "image_size": 224, "batches_per_iteration": 15, "iterations": 5}
CPU_DEFAULTS = {"batch_size": 2, "image_size": 64, "batches_per_iteration": 1, "iterations": 2}
REFERENCE_IMAGE_SIZE = 224
# The smallest image each model takes (ResNet-50's five halvings; one ViT-B/16 patch): a
# refusal suggests no smaller one.
MIN_IMAGE_SIZE = {"resnet50": 32, "vit_b_16": 16}


def format_iteration(index: int, images_per_s: float, seconds: float) -> str:
    """The reference benchmark's per-iteration line.

    Example:
        >>> format_iteration(0, 7258.31, 0.26453)
        'Iteration 0, 7258.3 images/s in 0.265 s.'
    """
    return f"Iteration {index}, {images_per_s:.1f} images/s in {seconds:.3f} s."


def _build(model: str, image_size: int) -> torch.nn.Module:
    require("torchvision", f"bench_model(model={model!r})")
    import torchvision

    if model == "resnet50":
        net: torch.nn.Module = torchvision.models.resnet50(weights=None)
    else:
        net = torchvision.models.vit_b_16(weights=None, image_size=image_size)
    return net


def _unsupported(precision: str, device: torch.device) -> str | None:
    # The device asked for, not the current one: is_bf16_supported() looks at the latter.
    if device.type == "cuda" and precision == "bf16":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 0):
            return (
                f"bf16 needs a GPU with compute capability 8.0 or newer (Ampere+); "
                f"{device} has {major}.{minor}"
            )
    return None


def _settings(
    device: torch.device,
    *,
    batch_size: int | None,
    image_size: int | None,
    iterations: int | None,
    batches_per_iteration: int | None,
    warmup_batches: int | None,
) -> Settings:
    defaults = CUDA_DEFAULTS if device.type == "cuda" else CPU_DEFAULTS
    batch_size = defaults["batch_size"] if batch_size is None else batch_size
    image_size = defaults["image_size"] if image_size is None else image_size
    iterations = defaults["iterations"] if iterations is None else iterations
    if batches_per_iteration is None:
        batches_per_iteration = defaults["batches_per_iteration"]
    if warmup_batches is None:
        warmup_batches = max(2, batches_per_iteration)
    return Settings(
        batch_size=positive_int("batch_size", batch_size),
        image_size=positive_int("image_size", image_size),
        iterations=positive_int("iterations", iterations),
        batches_per_iteration=positive_int("batches_per_iteration", batches_per_iteration),
        warmup_batches=positive_int("warmup_batches", warmup_batches),
    )


def _check_supported(precision: str, dev: torch.device) -> None:
    reason = _unsupported(precision, dev)
    if reason is not None:
        raise DeviceError(f"bench_model(precision={precision!r}) on {dev}: {reason}")


def _tf32_notes(tf32: bool | None, dev: torch.device) -> tuple[str, ...]:
    """A note where ``tf32=True`` changes nothing (``bench_matmul`` skips its tf32 there)."""
    if not tf32:
        return ()
    if dev.type != "cuda":
        return (
            f"tf32=True has no effect on {dev}: TF32 is a tensor-core mode of CUDA GPUs "
            "(compute capability 8.0, Ampere, and newer)",
        )
    major, minor = torch.cuda.get_device_capability(dev)
    if (major, minor) >= (8, 0):
        return ()
    return (
        f"tf32=True has no effect on {dev}: TF32 needs compute capability 8.0 (Ampere) or "
        f"newer, and it has {major}.{minor}",
    )


def _notes_before(precision: str, tf32: bool | None, dev: torch.device) -> tuple[str, ...]:
    """The notes known before the run: a busy host (its load read now, as the run's own
    threads would count in it later), ``tf32=True`` with no effect, a precision the CPU
    only emulates."""
    emulated = cpu_emulation_notes(precision) if dev.type == "cpu" else ()
    return host_notes_now() + _tf32_notes(tf32, dev) + emulated


def _check_arguments(model: str, precision: str, on_iteration: object, **flags: object) -> None:
    choice("model", model, MODELS)
    choice("precision", precision, tuple(PRECISIONS))
    for name, value in flags.items():
        flag(name, value, none_ok=name == "tf32")
    if on_iteration is not None and not callable(on_iteration):
        raise TypeError(
            f"on_iteration must be None or a callable taking (index, images_per_s, seconds), "
            f"got {on_iteration!r}: pass a function, e.g. on_iteration=lambda i, rate, s: "
            f"print(format_iteration(i, rate, s))"
        )


def _check_model_input(model: str, precision: str, settings: Settings, *, train: bool) -> None:
    image_size, batch_size = settings.image_size, settings.batch_size
    _check_input_bytes(precision, settings)
    if model == "vit_b_16" and image_size % 16:
        raise ValueError(
            f"vit_b_16 takes 16-pixel patches, so image_size must be a multiple of 16, "
            f"got {image_size!r} (the reference uses 224)"
        )
    if model == "resnet50" and image_size < MIN_IMAGE_SIZE[model]:
        raise ValueError(f"resnet50 needs image_size >= 32, got {image_size!r}")
    if train and batch_size < 2:
        raise ValueError(
            f"training needs batch_size >= 2 (BatchNorm cannot normalise one image), "
            f"got {batch_size!r}"
        )


def _check_input_bytes(precision: str, settings: Settings) -> None:
    """Refuse a batch past what a tensor can address, before the model is built."""
    batch, size = settings.batch_size, settings.image_size
    check_tensor_bytes(
        f"bench_model(batch_size={batch}, image_size={size})",
        f"its input batch ({batch} x 3 x {size} x {size} {precision})",
        batch * 3 * size * size,
        PRECISIONS[precision],
        f"use a smaller batch_size or image_size (the reference uses "
        f"{CUDA_DEFAULTS['batch_size']} at {REFERENCE_IMAGE_SIZE} px)",
    )


def _batch_runner(
    model: str,
    precision: str,
    settings: Settings,
    device: torch.device,
    *,
    train: bool,
    channels_last: bool,
) -> Callable[[], None]:
    """One batch of the benchmark (inference, or a training step), ready to call."""
    dtype = PRECISIONS[precision]
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    size, batch = settings.image_size, settings.batch_size
    net = _build(model, size).to(device, dtype).to(memory_format=memory_format)
    images = torch.randn(batch, 3, size, size, device=device, dtype=dtype)
    images = images.contiguous(memory_format=memory_format)
    labels = torch.randint(0, 1000, (batch,), device=device)

    def infer() -> None:
        net(images)

    if not train:
        net.eval()
        return infer
    net.train()
    optimizer = torch.optim.SGD(net.parameters(), lr=1e-3)

    def train_step() -> None:
        loss = torch.nn.functional.cross_entropy(net(images), labels)
        torch.autograd.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return train_step


def _comparison(
    device: torch.device,
    device_name: str,
    model: ModelName,
    precision: BenchPrecision,
    images_per_s: float,
    settings: Settings,
    timing: Timing,
    *,
    train: bool,
    channels_last: bool,
) -> tuple[ReferenceComparison | None, tuple[str, ...]]:
    """The reference comparison of a GPU inference run at 224 px, and notes on why not."""
    if train:
        return None, ("no reference comparison: the reference table is inference",)
    if settings.image_size != REFERENCE_IMAGE_SIZE:
        return None, (
            f"no reference comparison: the reference table is at {REFERENCE_IMAGE_SIZE}px",
        )
    notes: list[str] = []
    comparison = compare_to_reference(
        device_name,
        model,
        precision,
        images_per_s,
        compute_capability=torch.cuda.get_device_capability(device),
        tf32_matmul=timing.tf32_matmul,
        tf32_cudnn=timing.tf32_cudnn,
    )
    if comparison.warning is not None and settings.batch_size < MIN_COMPARABLE_BATCH:
        notes.append(
            f"batch {settings.batch_size} is small; the reference ran 1,920 images per "
            f"iteration, so the {comparison.ratio:.2f}x ratio may reflect the batch"
        )
        comparison = dataclasses.replace(comparison, warning=None)
    if channels_last:
        notes.append("channels_last is faster than the reference's default layout")
    return comparison, tuple(notes)


def bench_model(
    model: ModelName = "resnet50",
    precision: BenchPrecision = "fp32",
    *,
    batch_size: int | None = None,
    image_size: int | None = None,
    iterations: int | None = None,
    batches_per_iteration: int | None = None,
    warmup_batches: int | None = None,
    train: bool = False,
    channels_last: bool = False,
    tf32: bool | None = None,
    device: str | torch.device | None = None,
    compare: bool = True,
    on_iteration: Callable[[int, float, float], None] | None = None,
    max_seconds: float | None = DEFAULT_MAX_SECONDS,
) -> BenchResult:
    """Measure a torchvision model's throughput the way the reference table was measured.

    Defaults depend on the device: on a GPU, batch 128 at 224 px and 15 batches (1,920
    images) per iteration, as the reference; on the CPU, batch 2 at 64 px and one batch per
    iteration, so that a CPU run is a quick smoke test. ``vit_b_16`` is built for the
    image size asked for (its patch size is 16, so the size must be a multiple of 16).

    Args:
        model: ``"resnet50"`` (memory-bandwidth sensitive) or ``"vit_b_16"`` (compute-bound).
        precision: ``"fp32"``, ``"fp16"`` or ``"bf16"``; weights and input are cast to it.
        batch_size: images per batch (device default when None).
        image_size: input height and width (device default when None).
        iterations: timed iterations (5 on a GPU, as the reference; 2 on the CPU when None).
        batches_per_iteration: batches per timed iteration (device default when None).
        warmup_batches: untimed batches first (default: one iteration's worth, at least 2).
        train: time forward + backward + an SGD step instead of inference.
        channels_last: use the NHWC memory format (faster convolutions on tensor cores).
        tf32: allow TF32 for fp32 matmuls and convolutions during the run; None keeps
            PyTorch's current settings. The previous settings are restored afterwards. On
            the CPU or a GPU older than Ampere True changes nothing, and a note says so.
        device: ``"cpu"``, ``"cuda"`` or ``"cuda:<i>"``; None or ``"auto"`` is the best
            available device (:func:`trainperf.best_device`: the GPU with the most free
            memory), except that where that is MPS the CPU is used: the benchmarks run on
            CPU and CUDA only.
        compare: compare a GPU's inference result with the reference table.
        on_iteration: called after each timed iteration with ``(index, images_per_s,
            seconds)``, e.g. to print :func:`format_iteration` lines as they come.
        max_seconds: refuse a run that would take longer than this (warm-up and timed
            batches, estimated from the second warm-up batch, timed on its own; where there
            is one warm-up batch, from the first timed batch, timed on its own where the
            warm-up batch leaves the run's fit in doubt, and the first timed iteration; from
            the first batch where that alone took longer); None for no limit. The refusal
            comes after the batches it is measured on, so it cannot spare those.

    Returns:
        A :class:`BenchResult`.

    Raises:
        TypeError: ``train``, ``channels_last``, ``compare`` or ``tf32`` is not a bool (``tf32``
            may be None), or ``on_iteration`` is neither None nor a callable.
        ValueError: an unknown model or precision, a count below 1, an image size the
            model cannot take, ``train`` with a batch of one, an input batch of more
            bytes than a tensor can address, a ``max_seconds`` that is not a positive number
            or None, or a run estimated to take longer than ``max_seconds`` (the message
            names the estimate and the fix).
        DeviceError: a CUDA device was asked for but is not available, or the GPU lacks
            what ``precision`` needs (bf16 on a GPU older than Ampere).
        NotImplementedError: this PyTorch build has no kernel for the model in
            ``precision`` on this device (e.g. fp16 convolutions on some CPU builds).
        ModuleNotFoundError: torchvision is missing (``pip install 'trainperf[vision]'``).

    Example:
        >>> r = bench_model("resnet50", "fp32", device="cpu", batch_size=1, image_size=32,
        ...                 iterations=1, warmup_batches=1)
        >>> r.model, r.precision, len(r.iteration_seconds), r.images_per_s > 0
        ('resnet50', 'fp32', 1, True)
    """
    flags = {"train": train, "channels_last": channels_last, "compare": compare, "tf32": tf32}
    _check_arguments(model, precision, on_iteration, **flags)
    max_seconds = check_max_seconds(max_seconds)
    dev = resolve_device(device)
    settings = _settings(
        dev,
        batch_size=batch_size,
        image_size=image_size,
        iterations=iterations,
        batches_per_iteration=batches_per_iteration,
        warmup_batches=warmup_batches,
    )
    _check_model_input(model, precision, settings, train=train)
    _check_supported(precision, dev)
    run_batch = _batch_runner(
        model, precision, settings, dev, train=train, channels_last=channels_last
    )
    what = f"{model} in {precision} is not supported on {dev}"
    notes = _notes_before(precision, tf32, dev)
    limit = RunTimeLimit(
        f"{model} {precision}", settings, dev, max_seconds, train, MIN_IMAGE_SIZE[model]
    )
    timing = measure(run_batch, limit, what=what, tf32=tf32, on_iteration=on_iteration)
    median = statistics.median(timing.rates)
    device_name = gpu_name(dev)
    comparison: ReferenceComparison | None = None
    if compare and device_name is not None:
        comparison, why = _comparison(
            dev,
            device_name,
            model,
            precision,
            median,
            settings,
            timing,
            train=train,
            channels_last=channels_last,
        )
        notes += why
    return BenchResult(
        model=model,
        precision=precision,
        device=str(dev),
        gpu_name=device_name,
        batch_size=settings.batch_size,
        image_size=settings.image_size,
        batches_per_iteration=settings.batches_per_iteration,
        warmup_batches=settings.warmup_batches,
        train=train,
        channels_last=channels_last,
        tf32_matmul=timing.tf32_matmul,
        tf32_cudnn=timing.tf32_cudnn,
        cudnn_benchmark=bool(torch.backends.cudnn.benchmark),
        torch_version=torch.__version__,
        iteration_seconds=timing.seconds,
        iteration_images_per_s=timing.rates,
        images_per_s=median,
        comparison=comparison,
        notes=notes,
    )
