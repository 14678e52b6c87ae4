"""Benchmarks that say whether a GPU runs at its expected speed.

- :func:`bench_model`: a ResNet-50 / ViT-B/16 throughput benchmark, compared with the
  reference table (a GPU cloud provider's published figures, PyTorch 1.9);
- :func:`bench_matmul`: matrix-product TFLOP/s per dtype, against the datasheet;
- :func:`bench_h2d`: host-to-device bandwidth, pageable vs pinned.

Every result (:class:`BenchResult`, :class:`MatmulResult`, :class:`H2DResult`,
:class:`ReferenceComparison`, :class:`Skipped`) reads as a report with ``str()`` and as JSON-safe
data with ``to_dict()``. ``trainperf bench model|matmul|h2d`` runs them from the command line
and prints one or the other (``--json``).

A device that lacks what a setting needs (bf16 before Ampere, TF32 on the CPU, any CUDA for
``bench_h2d``) raises :class:`~trainperf.errors.DeviceError`; a kernel missing from this
PyTorch build raises ``NotImplementedError``.
"""

from __future__ import annotations

from trainperf._utils.public import set_public_module
from trainperf.bench._common import Skipped
from trainperf.bench._h2d import H2DResult, bench_h2d
from trainperf.bench._matmul import MATMUL_DTYPES, MatmulDtype, MatmulResult, bench_matmul
from trainperf.bench._model import bench_model, format_iteration
from trainperf.bench._reference import (
    BenchPrecision,
    GpuSpec,
    ModelName,
    ReferenceComparison,
    compare_to_reference,
    find_gpu_spec,
    find_reference_gpu,
    gpu_specs,
    normalize_gpu_name,
    reference_throughput,
)
from trainperf.bench._result import BenchResult

__all__ = [
    "MATMUL_DTYPES",
    "BenchPrecision",
    "BenchResult",
    "GpuSpec",
    "H2DResult",
    "MatmulDtype",
    "MatmulResult",
    "ModelName",
    "ReferenceComparison",
    "Skipped",
    "bench_h2d",
    "bench_matmul",
    "bench_model",
    "compare_to_reference",
    "find_gpu_spec",
    "find_reference_gpu",
    "format_iteration",
    "gpu_specs",
    "normalize_gpu_name",
    "reference_throughput",
]

set_public_module(globals(), __all__, __name__)
