"""What a faster step is predicted to gain: lower precision, a larger batch, the GPU.

Pure functions of the measured :class:`Figures` (see ``_predict``), on the mean step ``T``
(wall time over steps), its data wait ``w`` and the rest ``c = T - w``:

- **Lower precision** (:func:`precision_fix`, ``MixedPrecision``): on a GPU the reference
  table's fp16/fp32 throughput ratio ``r`` for this GPU (or its tensor-core GPUs' median)
  on the share ``g`` of the step the GPU is busy: ``1 / ((1 - g) + g / r)``; on a CPU with
  native bf16, ``r`` is what a small MLP training step gained under bf16 autocast
  (``_cpu_bf16``) and ``g`` the share of the step not spent waiting for data, at most
  the share the loop's process spent on a CPU outside that wait (a step that sleeps
  gains nothing).
- **A larger batch** (:func:`batch_fix`, ``tune_batch_size``): doubling it keeps the host's
  time per step and doubles the GPU's: ``min(2, 1 / g)``.
- **The GPU** (:func:`gpu_fix`): a loop on the CPU says nothing of its speed on the GPU:
  not predicted.
"""

from __future__ import annotations

import math
import statistics

from trainperf.monitor._figures import (
    Figures,
    capacity,
    compute_s,
    gpu_share,
    main_cores,
    mean_step_s,
)
from trainperf.monitor._verdict import NOT_PREDICTED, Fix

__all__ = ["batch_fix", "gpu_fix", "precision_fix", "reference_ratio"]

PRECISION_CALL = "trainperf.MixedPrecision()"
BATCH_CALL = "trainperf.tune_batch_size(train_step, sample, model=model, optimizer=optimizer)"
GPU_CALL = "model.to(device); batch = trainperf.to_device(batch, device)"


def _geomean_ratio(row: dict[str, float]) -> tuple[float, float, float] | None:
    try:
        cnn = row["resnet50_fp16"] / row["resnet50_fp32"]
        vit = row["vit_base_patch16_224_fp16"] / row["vit_base_patch16_224_fp32"]
    except (KeyError, ZeroDivisionError):
        return None
    return math.sqrt(cnn * vit), cnn, vit


def reference_ratio(gpu_name: str | None) -> tuple[float, str]:
    """The fp16/fp32 throughput ratio the reference table gives a GPU, and whence.

    The geometric mean of the table's ResNet-50 and ViT-B/16 ratios for the GPU; for a GPU
    the table lacks, the median of that over its tensor-core GPUs (fp16 faster than fp32).

    Example:
        >>> ratio, where = reference_ratio("NVIDIA A100-SXM4-80GB")
        >>> round(ratio, 2), where.split(" (")[0].split()[-1]
        (1.3, 'A100')
        >>> reference_ratio("NVIDIA H200")[1].startswith("NVIDIA H200 is not in the reference")
        True
    """
    from trainperf.bench import find_reference_gpu, reference_throughput

    table = reference_throughput()
    row = find_reference_gpu(gpu_name) if gpu_name else None
    found = _geomean_ratio(table[row]) if row else None
    if row is not None and found is not None:
        mean, cnn, vit = found
        return mean, (
            f"the reference table's fp16/fp32 throughput for the {row} (ResNet-50 {cnn:.2f}x, "
            f"ViT-B/16 {vit:.2f}x: {mean:.2f}x, their geometric mean)"
        )
    tensor = [r[0] for v in table.values() if (r := _geomean_ratio(v)) and r[1] > 1]
    median = statistics.median(tensor)
    name = gpu_name or "this GPU"
    return median, (
        f"{name} is not in the reference table: the median of its {len(tensor)} tensor-core "
        f"GPUs' fp16/fp32 throughput ({median:.2f}x)"
    )


def precision_fix(f: Figures) -> Fix | None:
    """``MixedPrecision``: the reference ratio on the GPU's busy share (Amdahl's law).

    None when a lower precision is already in use; 1.0 where ``MixedPrecision`` keeps fp32
    (a CPU without native bf16, a GPU before tensor cores, or one already chose fp32).
    """
    if f.precision is not None and f.precision[0] != "fp32":
        return None
    if f.precision is not None:
        basis = f"MixedPrecision is in use and chose fp32 ({f.precision[1]}): no lower precision"
        return Fix("compute-bound", PRECISION_CALL, 1.0, basis)
    if not f.cuda_used:
        gain = f.setup.cpu_bf16_speedup
        if f.setup.cpu_native_bf16 and gain is not None:
            if gain <= 1.0:
                basis = (
                    f"a small MLP training step ran no faster under bf16 autocast than in "
                    f"fp32 on this CPU ({gain:.2f}x, measured by a probe): no gain"
                )
                return Fix("compute-bound", PRECISION_CALL, 1.0, basis)
            g, where = _cpu_step_share(f)
            basis = (
                f"a small MLP training step ran {gain:.2f}x faster under bf16 autocast than "
                f"in fp32 on this CPU (measured by a probe), on the {g:.0%} of step time "
                f"{where}"
            )
            return Fix("compute-bound", PRECISION_CALL, 1 / ((1 - g) + g / gain), basis)
        if f.setup.cpu_native_bf16:
            basis = (
                f"{NOT_PREDICTED}: bf16 on this CPU is not in the reference table; "
                "`trainperf bench matmul --device cpu` measures it"
            )
        else:
            basis = "this CPU has no native bf16, so MixedPrecision keeps fp32: no gain"
        return Fix("compute-bound", PRECISION_CALL, 1.0, basis)
    cap = f.setup.gpu_capability
    if cap is not None and cap < (7, 0):
        basis = f"compute capability {cap[0]}.{cap[1]} has no fast fp16: MixedPrecision keeps fp32"
        return Fix("compute-bound", PRECISION_CALL, 1.0, basis)
    ratio, where = reference_ratio(f.setup.gpu_name)
    busy = gpu_share(f)
    g = 1.0 if busy is None else busy
    speedup = 1 / ((1 - g) + g / ratio)
    share = "all (not measured)" if busy is None else f"{g:.0%}"
    basis = f"{where}, on the {share} of step time the GPU is busy"
    return Fix("compute-bound", PRECISION_CALL, speedup, basis)


def _cpu_step_share(f: Figures) -> tuple[float, str]:
    """The share of a CPU loop's step time bf16 can speed up, and what it is: the share
    not spent waiting for data, but no more than the CPU the loop's process used outside
    that wait (its sampled CPU, the hypervisor's steal undone): a step that sleeps or waits
    on the network computes in little of its time, and lower precision cannot shorten the
    rest."""
    step, work = mean_step_s(f), compute_s(f)
    if step <= 0:
        return 1.0, "not spent waiting for data"
    own = main_cores(f)
    if own is None:
        # No CPU sample (a run shorter than the sampling interval): a step that sleeps
        # cannot be told from one that computes, so this is an upper bound.
        return work / step, (
            "not spent waiting for data (an upper bound: the process's CPU was not sampled; "
            "a longer run, or a shorter `interval`, measures it)"
        )
    used = max(0.0, own / (capacity(f) / f.cpus) * step - (f.wait_cpu_s or 0.0))
    if used < work:
        return used / step, "the loop's process computed (its sampled CPU)"
    return work / step, "not spent waiting for data"


def batch_fix(f: Figures) -> Fix | None:
    """``tune_batch_size``: a doubled batch on a GPU busy ``g`` of the step: ``min(2, 1/g)``."""
    busy = gpu_share(f)
    if not f.cuda_used or busy is None:
        return None
    speedup = 2.0 if busy <= 0.5 else 1 / busy
    basis = (
        f"twice the batch: the host's time per step stays and the GPU's, busy {busy:.0%} of "
        "the step, doubles, if memory allows (tune_batch_size finds the largest that fits)"
    )
    return Fix("compute-bound", BATCH_CALL, speedup, basis)


def gpu_fix(f: Figures) -> Fix:
    """Moving the loop to the GPU: not predicted (the step's speed there is not measured)."""
    basis = (
        f"{NOT_PREDICTED}: a loop on the CPU says nothing of its speed on the GPU; "
        "`trainperf bench model` shows what this GPU does"
    )
    return Fix("gpu-unused", GPU_CALL, 1.0, basis)
