"""``BenchResult``: what one ``bench_model`` run measured, with the settings it ran with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainperf._utils.format import plural
from trainperf.bench._common import result_dict
from trainperf.bench._reference import ReferenceComparison

__all__ = ["BenchResult"]


@dataclass(frozen=True)
class BenchResult:
    """One model benchmark: the settings it ran with and what it measured.

    Attributes:
        model: ``"resnet50"`` or ``"vit_b_16"``.
        precision: ``"fp32"``, ``"fp16"`` or ``"bf16"`` (weights and input cast to it).
        device: e.g. ``"cuda:0"`` or ``"cpu"``.
        gpu_name: the GPU's name, None on the CPU.
        batch_size: images per batch.
        image_size: input height and width in pixels.
        batches_per_iteration: batches in one timed iteration.
        warmup_batches: untimed batches run first.
        train: forward + backward + SGD step when True, inference otherwise.
        channels_last: model and input in NHWC memory format.
        tf32_matmul: fp32 matmuls were allowed to use TF32 during the run.
        tf32_cudnn: cuDNN convolutions were allowed to use TF32 during the run.
        cudnn_benchmark: ``torch.backends.cudnn.benchmark`` during the run.
        torch_version: ``torch.__version__``.
        iteration_seconds: wall time of each timed iteration.
        iteration_images_per_s: throughput of each timed iteration.
        images_per_s: the median of ``iteration_images_per_s``.
        comparison: the comparison with the reference GPUs, None when there is none.
        notes: why there is no comparison, or other caveats.
    """

    model: str
    precision: str
    device: str
    gpu_name: str | None
    batch_size: int
    image_size: int
    batches_per_iteration: int
    warmup_batches: int
    train: bool
    channels_last: bool
    tf32_matmul: bool
    tf32_cudnn: bool
    cudnn_benchmark: bool
    torch_version: str
    iteration_seconds: tuple[float, ...]
    iteration_images_per_s: tuple[float, ...]
    images_per_s: float
    comparison: ReferenceComparison | None
    notes: tuple[str, ...]

    @property
    def images_per_iteration(self) -> int:
        """Images processed in one timed iteration."""
        return self.batch_size * self.batches_per_iteration

    def summary(self) -> str:
        """One line: model, precision, device, settings and the median throughput.

        Example:
            >>> from trainperf.bench import bench_model
            >>> r = bench_model("resnet50", device="cpu", batch_size=1, image_size=32,
            ...                 iterations=1, warmup_batches=1)
            >>> r.summary().startswith("resnet50 fp32 inference on cpu: ")
            True
        """
        mode = "training" if self.train else "inference"
        layout = ", channels_last" if self.channels_last else ""
        where = self.gpu_name or self.device
        iterations = plural(len(self.iteration_seconds), "iteration")
        return (
            f"{self.model} {self.precision} {mode} on {where}: {self.images_per_s:.1f} images/s "
            f"(median of {iterations}, batch {self.batch_size}, "
            f"{self.image_size}px{layout})"
        )

    def __str__(self) -> str:
        """The summary line, then the reference comparison and the notes, one per line."""
        lines = [self.summary()]
        if self.comparison is not None:
            lines.append(str(self.comparison))
        lines.extend(f"Note: {note}" for note in self.notes)
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """Every field, JSON-safe (tuples as lists, the comparison as a dict or None).

        Example:
            >>> import json
            >>> from trainperf.bench import bench_model
            >>> r = bench_model("resnet50", device="cpu", batch_size=1, image_size=32,
            ...                 iterations=1, warmup_batches=1)
            >>> json.loads(json.dumps(r.to_dict())) == r.to_dict()
            True
            >>> str(r).splitlines()[0] == r.summary()
            True
        """
        return result_dict(self)
