"""The reference GPUs: measured throughput, datasheet figures, name matching.

The reference table is a GPU cloud provider's published figures (PyTorch 1.9).

Two tables ship as package data (``trainperf/bench/data``): ``seed_gpu_throughput.csv``
(ResNet-50 and ViT-B/16 inference, images/s, PyTorch 1.9) and ``seed_gpu_specs.csv``
(datasheet TFLOP/s). GPUs report themselves by long marketing names (``"NVIDIA GeForce
RTX 3090"``, ``"Tesla V100-SXM2-32GB"``) while the tables use short ones (``"3090"``,
``"V100"``); :func:`normalize_gpu_name` maps both onto one key by explicit rules, so a
lookup is exact: ``"RTX 3090 Ti"`` finds its own row, and a card without one (``"RTX 3060
Ti"``, ``"A10G"``, ``"L40S"``) never borrows another's.
"""

from __future__ import annotations

import csv
import io
import math
import re
from dataclasses import dataclass
from functools import lru_cache
from importlib.resources import files
from typing import Any, Literal

from trainperf._utils.validate import as_real_number, choice
from trainperf.bench._common import result_dict

__all__ = [
    "MODEL_COLUMNS",
    "BenchPrecision",
    "ModelName",
    "GpuSpec",
    "ReferenceComparison",
    "compare_to_reference",
    "find_gpu_spec",
    "find_reference_gpu",
    "gpu_specs",
    "normalize_gpu_name",
    "reference_throughput",
]

ModelName = Literal["resnet50", "vit_b_16"]
"""The models :func:`~trainperf.bench.bench_model` runs and the reference table lists."""
BenchPrecision = Literal["fp32", "fp16", "bf16"]
"""Benchmark precisions (weights and input cast to it); not :data:`trainperf.amp.Precision`."""

# torchvision model name -> the column prefix the reference table uses (timm's names).
MODEL_COLUMNS: dict[str, str] = {"resnet50": "resnet50", "vit_b_16": "vit_base_patch16_224"}

# A known GPU below this fraction of its reference is reported as sick or throttled.
SLOW_RATIO = 0.8

# Words that say who makes or sells the card, not which chip it is.
_VENDOR_WORDS = frozenset({"NVIDIA", "GEFORCE", "TESLA", "QUADRO", "RTX", "GTX"})
# Form factor and memory size of one chip: "V100-SXM2-32GB" and "V100-PCIE-16GB" are both V100.
# Not dropped on purpose: "LAPTOP", "SUPER", "TI", "S", "G", "FHHL" name slower or faster cards.
_VARIANT_WORD = re.compile(r"^(SXM\d*|PCIE|\d+GB|HBM\d*E?|DGXS)$")
# Names that the rules above do not reduce to a table row by themselves.
_ALIASES: dict[str, str] = {"TITAN XP COLLECTORS EDITION": "TITAN XP"}
# Compact spellings: a series glued to its number ("RTX3090", "RTXA4000") and Ti or SUPER
# glued to the number before it ("3090TI"); split apart, they reduce as the spaced ones do.
_GLUED_SERIES = re.compile(r"\b(RTX|GTX)(?=A?\d)")
_GLUED_SUFFIX = re.compile(r"(?<=\d)(TI|SUPER)\b")


def _check_name(call: str, name: object, argument: str = "name") -> str:
    """``name`` if it is a str, else a ``TypeError`` naming ``call`` and the fix."""
    if not isinstance(name, str):
        raise TypeError(
            f"{call}: {argument} must be a GPU's name as a str (e.g. 'NVIDIA GeForce RTX "
            f"3090', as torch.cuda.get_device_name() gives it), got {name!r}"
        )
    return name


def normalize_gpu_name(name: str) -> str:
    """Reduce a GPU's name to the key the reference tables are matched on.

    Upper-cases, splits on spaces, ``-`` and ``_`` (and a series or Ti/SUPER glued to the
    number: ``RTX3090TI`` is ``RTX 3090 TI``), drops vendor words (NVIDIA, GeForce, Tesla,
    Quadro, RTX, GTX) and form-factor or memory-size words (SXM4, PCIe, 80GB, HBM3), then
    applies a small alias table. Words that change the card (Ti, SUPER, Laptop, a trailing S
    or G) are kept.

    Args:
        name: a name as NVML, ``nvidia-smi`` or ``torch.cuda.get_device_name`` report it,
            or as the tables spell it.

    Returns:
        The normalised key, e.g. ``"3090 TI"``.

    Raises:
        TypeError: ``name`` is not a str.

    Example:
        >>> normalize_gpu_name("NVIDIA GeForce RTX 3090 Ti")
        '3090 TI'
        >>> normalize_gpu_name("Tesla V100-SXM2-32GB"), normalize_gpu_name("NVIDIA A10G")
        ('V100', 'A10G')
        >>> normalize_gpu_name("rtx3090ti")
        '3090 TI'
    """
    upper = _check_name("normalize_gpu_name", name).upper().strip()
    upper = _GLUED_SUFFIX.sub(r" \1", _GLUED_SERIES.sub(r"\1 ", upper))
    words = re.split(r"[\s\-_]+", upper)
    kept = [w for w in words if w and w not in _VENDOR_WORDS and not _VARIANT_WORD.match(w)]
    key = " ".join(kept)
    return _ALIASES.get(key, key)


def _read_csv(filename: str) -> list[dict[str, str]]:
    text = (files("trainperf.bench") / "data" / filename).read_text(encoding="utf-8")
    lines = [line for line in text.splitlines() if line.strip() and not line.startswith("#")]
    return list(csv.DictReader(io.StringIO("\n".join(lines))))


@lru_cache(maxsize=1)
def _throughput_rows() -> tuple[tuple[str, tuple[tuple[str, float], ...]], ...]:
    rows = []
    for row in _read_csv("seed_gpu_throughput.csv"):
        values = tuple((col, float(v)) for col, v in row.items() if col != "gpu" and v)
        rows.append((row["gpu"], values))
    return tuple(rows)


def reference_throughput() -> dict[str, dict[str, float]]:
    """The reference table's measured inference throughput, images/s, by GPU and column.

    Columns are ``<model>_<precision>`` with timm's model names: ``resnet50_fp16``,
    ``resnet50_fp32``, ``vit_base_patch16_224_fp16``, ``vit_base_patch16_224_fp32``.
    Measured with PyTorch 1.9 (which used TF32 for fp32 on Ampere and newer), synthetic
    input on the GPU, weights cast to the precision, 1,920 images per iteration.

    Returns:
        A fresh dict ``{gpu: {column: images_per_s}}`` in the table's order.

    Example:
        >>> table = reference_throughput()
        >>> table["3090"]["resnet50_fp16"]
        2395.3
    """
    return {gpu: dict(values) for gpu, values in _throughput_rows()}


@dataclass(frozen=True)
class GpuSpec:
    """A GPU's datasheet figures as the reference table quotes them.

    Attributes:
        gpu: the table's name for the card.
        memory_gb: memory in GB as quoted, e.g. ``"16/32"`` where two sizes exist.
        fp32_tflops: plain fp32 (no TF32) TFLOP/s.
        fp16_tflops: fp16 TFLOP/s (tensor cores where the card has them; "approx" notes say
            the guide rounded).
        note: the architecture and caveats.
    """

    gpu: str
    memory_gb: str
    fp32_tflops: float
    fp16_tflops: float
    note: str


@lru_cache(maxsize=1)
def _spec_rows() -> tuple[GpuSpec, ...]:
    return tuple(
        GpuSpec(
            gpu=row["gpu"],
            memory_gb=row["memory_gb"],
            fp32_tflops=float(row["fp32_tflops"]),
            fp16_tflops=float(row["fp16_tflops"]),
            note=row["note"],
        )
        for row in _read_csv("seed_gpu_specs.csv")
    )


def gpu_specs() -> tuple[GpuSpec, ...]:
    """The reference datasheet table, one :class:`GpuSpec` per card.

    Example:
        >>> [s.gpu for s in gpu_specs()][:3]
        ['Tesla P40', 'TITAN Xp', '1080 Ti']
    """
    return _spec_rows()


def find_gpu_spec(name: str) -> GpuSpec | None:
    """The datasheet figures of the card called ``name`` (any spelling), or None if unlisted.

    Example:
        >>> find_gpu_spec("NVIDIA A100-SXM4-80GB").fp16_tflops
        312.0
        >>> find_gpu_spec("NVIDIA H200") is None
        True

    Raises:
        TypeError: ``name`` is not a str.
    """
    key = normalize_gpu_name(_check_name("find_gpu_spec", name))
    for spec in _spec_rows():
        if normalize_gpu_name(spec.gpu) == key:
            return spec
    return None


def find_reference_gpu(name: str) -> str | None:
    """The throughput table's row for the card called ``name``, or None when it has none.

    Example:
        >>> find_reference_gpu("NVIDIA GeForce RTX 3090"), find_reference_gpu("NVIDIA RTX A4000")
        ('3090', 'A4000')
        >>> find_reference_gpu("NVIDIA GeForce RTX 3060 Ti") is None
        True

    Raises:
        TypeError: ``name`` is not a str.
    """
    key = normalize_gpu_name(_check_name("find_reference_gpu", name))
    for gpu, _ in _throughput_rows():
        if normalize_gpu_name(gpu) == key:
            return gpu
    return None


@dataclass(frozen=True)
class ReferenceComparison:
    """How a measured throughput compares with the reference GPUs.

    Attributes:
        gpu: this GPU's name as reported.
        column: the table column compared against, e.g. ``"resnet50_fp16"``.
        images_per_s: the measured throughput.
        reference_gpu: the table's row for this very card, or None when it is not listed.
        reference_images_per_s: that row's figure (None when unlisted, or when the row has
            no figure for ``column``).
        ratio: measured / reference (None when unlisted).
        rank: this GPU's place among the other reference GPUs, 1 = fastest.
        out_of: how many GPUs were ranked (the reference rows plus this one).
        next_faster: the reference GPU just faster than this one and its figure, or None.
        next_slower: the reference GPU just slower, or None.
        warning: set when a listed card runs well under its reference (< 0.8x).
        notes: caveats about the comparison (precision stand-ins, TF32, settings).
    """

    gpu: str
    column: str
    images_per_s: float
    reference_gpu: str | None
    reference_images_per_s: float | None
    ratio: float | None
    rank: int
    out_of: int
    next_faster: tuple[str, float] | None
    next_slower: tuple[str, float] | None
    warning: str | None
    notes: tuple[str, ...]

    def __str__(self) -> str:
        lines = []
        if self.ratio is not None and self.reference_gpu is not None:
            lines.append(
                f"Reference: {self.reference_gpu} {self.column} {self.reference_images_per_s:.1f} "
                f"images/s; this {self.gpu}: {self.images_per_s:.1f} ({self.ratio:.2f}x)."
            )
        place = f"Rank {self.rank} of {self.out_of} reference GPUs for {self.column}"
        around = []
        if self.next_faster is not None:
            around.append(f"below {self.next_faster[0]} ({self.next_faster[1]:.1f})")
        if self.next_slower is not None:
            around.append(f"above {self.next_slower[0]} ({self.next_slower[1]:.1f})")
        lines.append(place + (": " + ", ".join(around) if around else "") + ".")
        if self.warning:
            lines.append(f"WARNING: {self.warning}")
        lines.extend(f"Note: {n}" for n in self.notes)
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """Every field, JSON-safe: ``next_faster``/``next_slower`` as ``[gpu, images_per_s]``.

        Example:
            >>> c = compare_to_reference("NVIDIA GeForce RTX 3090", "resnet50", "fp16", 1800.0)
            >>> c.to_dict()["reference_gpu"], type(c.to_dict()["notes"]).__name__
            ('3090', 'list')
        """
        return result_dict(self)


def _capability(value: object) -> tuple[int, int] | None:
    """``compute_capability`` as a ``(major, minor)`` tuple of Python ints, or None."""
    if value is None:
        return None
    pair = tuple(value) if isinstance(value, (tuple, list)) else ()
    numbers = [as_real_number(v) for v in pair]
    if len(numbers) != 2 or not all(isinstance(n, int) for n in numbers):
        raise TypeError(
            f"compute_capability must be None or a (major, minor) pair of ints, e.g. (8, 0) "
            f"as torch.cuda.get_device_capability() gives it, got {value!r}"
        )
    return (int(pair[0]), int(pair[1]))


TF32_CAVEAT = (
    "the reference fp32 figures were measured with PyTorch 1.9, which used TF32 for fp32 "
    "matmuls and convolutions on Ampere and newer GPUs by default; current PyTorch keeps "
    "cuDNN convolutions on TF32 but matmuls in full fp32 unless "
    "torch.set_float32_matmul_precision('high') is set"
)


def _rate(images_per_s: object) -> float:
    """``images_per_s`` checked, as a Python float: a NumPy scalar or a tensor kept as given
    is refused by json.dumps; an infinite rate ranks and divides, but its ratio is no JSON
    number."""
    rate = as_real_number(images_per_s)
    if rate is None:
        raise TypeError(
            "images_per_s must be a real number (int, float or NumPy scalar), got "
            f"{images_per_s!r}: pass float(x)"
        )
    if not (rate > 0 and math.isfinite(rate)):
        raise ValueError(f"images_per_s must be > 0 and finite, got {images_per_s!r}")
    return float(rate)


def compare_to_reference(
    gpu_name: str,
    model: ModelName,
    precision: BenchPrecision,
    images_per_s: float,
    *,
    compute_capability: tuple[int, int] | None = None,
    tf32_matmul: bool | None = None,
    tf32_cudnn: bool | None = None,
) -> ReferenceComparison:
    """Compare a measured inference throughput with the reference table.

    Ratio to the same card when it is listed, and in any case the rank among the listed
    cards. The table has no bf16 column: bf16 is compared with fp16 (the same tensor-core
    rate on Ampere and newer), with a note saying so. For fp32 on Ampere or newer
    (compute capability >= 8.0) the TF32 caveat is noted, and no slowness warning is given
    when this run kept the model's fp32 work off TF32 and the reference did not: ResNet-50 is
    convolutions (``tf32_cudnn=False``), ViT-B/16 matmuls (``tf32_matmul=False``). PyTorch's
    defaults keep convolutions on TF32 and matmuls off it, so a default fp32 ResNet-50 run
    is like-for-like (and warned about when slow) while a default fp32 ViT-B/16 run is not.

    Args:
        gpu_name: this GPU's name, any spelling.
        model: ``"resnet50"`` or ``"vit_b_16"``.
        precision: ``"fp32"``, ``"fp16"`` or ``"bf16"``.
        images_per_s: the measured throughput (> 0).
        compute_capability: this GPU's ``(major, minor)``, for the TF32 caveat.
        tf32_matmul: whether this run allowed TF32 for fp32 matmuls (None: unknown).
        tf32_cudnn: whether this run allowed TF32 for fp32 cuDNN convolutions (None:
            unknown).

    Returns:
        A :class:`ReferenceComparison`.

    Raises:
        TypeError: ``gpu_name`` is not a str, ``compute_capability`` is neither None nor
            a ``(major, minor)`` pair of ints (a tuple or list; NumPy ints too), or
            ``images_per_s`` is not a real number (an int, a float or a NumPy scalar of
            either; not a bool, a string or a tensor).
        ValueError: unknown ``model`` or ``precision``, or ``images_per_s`` not finite and
            > 0.

    Example:
        >>> c = compare_to_reference("NVIDIA GeForce RTX 3090", "resnet50", "fp16", 1800.0)
        >>> c.reference_gpu, round(c.ratio, 2), c.warning is not None
        ('3090', 0.75, True)
        >>> compare_to_reference("NVIDIA H200", "resnet50", "fp16", 10000.0).rank
        1
    """
    _check_name("compare_to_reference", gpu_name, "gpu_name")
    choice("model", model, sorted(MODEL_COLUMNS))
    choice("precision", precision, ("fp32", "fp16", "bf16"))
    compute_capability = _capability(compute_capability)
    images_per_s = _rate(images_per_s)
    notes: list[str] = []
    table_precision = "fp16" if precision == "bf16" else precision
    if precision == "bf16":
        notes.append("the reference table has no bf16 column; compared with its fp16 figures")
    column = f"{MODEL_COLUMNS[model]}_{table_precision}"
    ampere_or_newer = compute_capability is not None and compute_capability >= (8, 0)
    # The switch the model's fp32 work goes through; the reference ran both on TF32.
    work, tf32_used = (
        ("convolutions", tf32_cudnn) if model == "resnet50" else ("matmuls", tf32_matmul)
    )
    tf32_differs = precision == "fp32" and ampere_or_newer and tf32_used is False
    if precision == "fp32" and (ampere_or_newer or compute_capability is None):
        notes.append(TF32_CAVEAT)

    own = find_reference_gpu(gpu_name)
    # A row with an empty cell has no figure for that column: it is left out of the ranking.
    figures = {gpu: dict(values).get(column) for gpu, values in _throughput_rows()}
    others = [(g, v) for g, v in figures.items() if g != own and v is not None]
    faster = sorted((v, g) for g, v in others if v > images_per_s)
    slower = sorted(((v, g) for g, v in others if v <= images_per_s), reverse=True)
    reference = None if own is None else figures[own]
    if own is not None and reference is None:
        notes.append(f"the reference table has no {column} figure for {own}")
    ratio = None if reference is None else images_per_s / reference
    warning = None
    if ratio is not None and ratio < SLOW_RATIO:
        if tf32_differs:
            notes.append(
                f"{ratio:.2f}x the reference, but this run kept fp32 {work} off TF32 and the "
                # tf32=True is bench_model's; trainperf.cli rewrites it as --tf32.
                "reference did not: run with tf32=True for a like-for-like comparison"
            )
        else:
            warning = (
                f"this {gpu_name} runs at {ratio:.2f}x the reference {own} "
                f"({images_per_s:.1f} vs {reference:.1f} images/s): a throttled or sick card? "
                "Check clocks, power and temperature (nvidia-smi -q -d CLOCK,POWER,TEMPERATURE) "
                "and that no other process uses the GPU."
            )
    return ReferenceComparison(
        gpu=gpu_name,
        column=column,
        images_per_s=images_per_s,
        reference_gpu=own,
        reference_images_per_s=reference,
        ratio=ratio,
        rank=len(faster) + 1,
        out_of=len(others) + 1,
        next_faster=(faster[0][1], faster[0][0]) if faster else None,
        next_slower=(slower[0][1], slower[0][0]) if slower else None,
        warning=warning,
        notes=tuple(notes),
    )
