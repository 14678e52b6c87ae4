"""Benchmarks that say whether a GPU runs at its expected speed.

- :func:`bench_model`: a ResNet-50 / ViT-B/16 throughput benchmark, compared with the
  reference table (a GPU cloud provider's published figures, PyTorch 1.9);
- :func:`bench_matmul`: matrix-product TFLOP/s per dtype, against the datasheet;
- :func:`bench_h2d`: host-to-device bandwidth, pageable vs pinned.

``trainperf bench model|matmul|h2d`` runs them from the command line.
"""

from __future__ import annotations

from trainperf._utils.public import set_public_module
from trainperf.bench._common import Skipped
from trainperf.bench._h2d import H2DResult, bench_h2d
from trainperf.bench._matmul import MATMUL_DTYPES, MatmulDtype, MatmulResult, bench_matmul
from trainperf.bench._model import BenchResult, bench_model, format_iteration
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
