"""trainperf.bench: the reference tables, GPU-name matching, and the three benchmarks."""

from __future__ import annotations

import csv
import importlib
import io
import statistics
import time
from collections.abc import Iterator
from importlib.resources import files

import pytest
import torch

from trainperf._utils import imports as _imports
from trainperf.amp import _tf32
from trainperf.bench import (
    BenchResult,
    H2DResult,
    MatmulResult,
    bench_h2d,
    bench_matmul,
    bench_model,
    compare_to_reference,
    find_gpu_spec,
    find_reference_gpu,
    format_iteration,
    gpu_specs,
    normalize_gpu_name,
    reference_throughput,
)
from trainperf.bench._reference import SLOW_RATIO, TF32_CAVEAT
from trainperf.errors import DeviceError

model_module = importlib.import_module("trainperf.bench._model")
matmul_module = importlib.import_module("trainperf.bench._matmul")

# One warm-up batch and one timed batch of one small image: each CPU run takes about a second.
TINY = {"device": "cpu", "batch_size": 1, "image_size": 32, "iterations": 1, "warmup_batches": 1}


def _csv_rows(name: str) -> list[dict[str, str]]:
    text = (files("trainperf.bench") / "data" / name).read_text()
    return list(csv.DictReader(io.StringIO("\n".join(
        line for line in text.splitlines() if line and not line.startswith("#")
    ))))  # fmt: skip


# --------------------------------------------------------------------------- reference tables


def test_reference_table_has_every_row_and_column_of_the_csv() -> None:
    rows = _csv_rows("seed_gpu_throughput.csv")
    table = reference_throughput()
    assert list(table) == [r["gpu"] for r in rows]
    for row in rows:
        assert table[row["gpu"]] == {k: float(v) for k, v in row.items() if k != "gpu"}
    assert set(table["V100"]) == {
        "resnet50_fp16",
        "resnet50_fp32",
        "vit_base_patch16_224_fp16",
        "vit_base_patch16_224_fp32",
    }


def test_reference_table_is_a_fresh_copy() -> None:
    reference_throughput()["3090"]["resnet50_fp16"] = -1.0
    assert reference_throughput()["3090"]["resnet50_fp16"] > 0


def test_specs_table_loads() -> None:
    specs = gpu_specs()
    assert [s.gpu for s in specs] == [r["gpu"] for r in _csv_rows("seed_gpu_specs.csv")]
    assert all(s.fp32_tflops > 0 and s.fp16_tflops > 0 for s in specs)


@pytest.mark.parametrize(
    ("reported", "row"),
    [
        ("NVIDIA GeForce RTX 3090", "3090"),
        ("NVIDIA GeForce RTX 3090 Ti", "3090 Ti"),
        ("NVIDIA GeForce RTX 3080 Ti", "3080 Ti"),
        ("NVIDIA GeForce RTX 3080", "3080"),
        ("NVIDIA GeForce RTX 3060", "3060"),
        ("NVIDIA GeForce RTX 3060 Ti", None),
        ("NVIDIA GeForce RTX 3060 Laptop GPU", None),
        ("NVIDIA GeForce RTX 4090", "4090"),
        ("NVIDIA GeForce RTX 4080 SUPER", None),
        ("NVIDIA GeForce RTX 2080 Ti", "2080 Ti"),
        ("NVIDIA GeForce GTX 1080 Ti", "1080 Ti"),
        ("GeForce GTX 1080", None),
        ("NVIDIA TITAN Xp", "TITAN Xp"),
        ("NVIDIA TITAN X (Pascal)", None),
        ("Tesla V100-SXM2-32GB", "V100"),
        ("Tesla V100-PCIE-16GB", "V100"),
        ("Tesla V100-DGXS-32GB", "V100"),
        ("Tesla V100S-PCIE-32GB", None),
        ("Tesla T4", "Tesla T4"),
        ("Tesla P40", "Tesla P40"),
        ("NVIDIA A100-SXM4-80GB", "A100"),
        ("NVIDIA A100 80GB PCIe", "A100"),
        ("NVIDIA A100-PCIE-40GB", "A100"),
        ("NVIDIA A10", "A10"),
        ("NVIDIA A10G", None),
        ("NVIDIA A40", "A40"),
        ("NVIDIA RTX A4000", "A4000"),
        ("NVIDIA RTX A5000", "A5000"),
        ("NVIDIA L40", "L40"),
        ("NVIDIA L40S", None),
        ("NVIDIA H200", None),
        ("NVIDIA H100 80GB HBM3", None),
    ],
)
def test_gpu_names_match_reference_rows_exactly(reported: str, row: str | None) -> None:
    assert find_reference_gpu(reported) == row


def test_every_reference_row_matches_itself_and_only_itself() -> None:
    keys = [normalize_gpu_name(gpu) for gpu in reference_throughput()]
    assert len(set(keys)) == len(keys)
    for gpu in reference_throughput():
        assert find_reference_gpu(gpu) == gpu


def test_specs_lookup_by_reported_name() -> None:
    a100 = find_gpu_spec("NVIDIA A100-SXM4-40GB")
    assert a100 is not None and a100.gpu == "A100 SXM4"
    rtx = find_gpu_spec("NVIDIA GeForce RTX 3090")
    assert rtx is not None and rtx.fp32_tflops == 35.58
    assert find_gpu_spec("NVIDIA GeForce RTX 3090 Ti") is None


# --------------------------------------------------------------------------- comparison


def test_known_gpu_at_its_reference_speed() -> None:
    ref = reference_throughput()["A100"]["resnet50_fp16"]
    c = compare_to_reference("NVIDIA A100-SXM4-80GB", "resnet50", "fp16", ref)
    assert c.reference_gpu == "A100" and c.ratio == pytest.approx(1.0)
    assert c.warning is None
    faster = [g for g, v in reference_throughput().items() if g != "A100" and v[c.column] > ref]
    assert c.rank == len(faster) + 1
    assert c.out_of == len(reference_throughput())
    assert "Rank" in str(c) and "1.00x" in str(c)


def test_known_gpu_well_under_reference_is_warned_about() -> None:
    ref = reference_throughput()["3090"]["vit_base_patch16_224_fp16"]
    c = compare_to_reference("NVIDIA GeForce RTX 3090", "vit_b_16", "fp16", ref * 0.5)
    assert c.column == "vit_base_patch16_224_fp16"
    assert c.ratio == pytest.approx(0.5)
    assert c.warning is not None and "0.50x" in c.warning and "nvidia-smi" in c.warning
    assert "WARNING" in str(c)
    ok = compare_to_reference("NVIDIA GeForce RTX 3090", "vit_b_16", "fp16", ref * SLOW_RATIO)
    assert ok.warning is None


def test_unknown_gpu_is_ranked_among_the_reference_gpus() -> None:
    table = reference_throughput()
    top = max(table, key=lambda g: table[g]["resnet50_fp16"])
    fast = compare_to_reference("NVIDIA H200", "resnet50", "fp16", 10_000.0)
    assert fast.reference_gpu is None and fast.ratio is None and fast.warning is None
    assert (fast.rank, fast.out_of) == (1, len(table) + 1)
    assert fast.next_faster is None
    assert fast.next_slower == (top, table[top]["resnet50_fp16"])
    slow = compare_to_reference("NVIDIA H200", "resnet50", "fp16", 1.0)
    assert slow.rank == slow.out_of and slow.next_slower is None


def test_bf16_is_compared_with_the_fp16_column_and_says_so() -> None:
    c = compare_to_reference("NVIDIA A40", "resnet50", "bf16", 1800.0)
    assert c.column == "resnet50_fp16"
    assert any("bf16" in n for n in c.notes)


def test_fp32_on_ampere_carries_the_tf32_caveat_and_no_false_alarm() -> None:
    ref = reference_throughput()["A100"]["vit_base_patch16_224_fp32"]
    off = compare_to_reference(
        "NVIDIA A100-SXM4-40GB", "vit_b_16", "fp32", ref / 3,
        compute_capability=(8, 0), tf32_matmul=False,
    )  # fmt: skip
    assert TF32_CAVEAT in off.notes
    assert off.warning is None and any("--tf32" in n for n in off.notes)
    on = compare_to_reference(
        "NVIDIA A100-SXM4-40GB", "vit_b_16", "fp32", ref / 3,
        compute_capability=(8, 0), tf32_matmul=True,
    )  # fmt: skip
    assert on.warning is not None
    volta = compare_to_reference(
        "Tesla V100-SXM2-16GB", "resnet50", "fp32", 1300.0, compute_capability=(7, 0)
    )
    assert TF32_CAVEAT not in volta.notes


def test_fp32_resnet50_goes_by_the_cudnn_tf32_flag_not_the_matmul_one() -> None:
    # PyTorch's defaults: convolutions on TF32, matmuls off it. ResNet-50 is convolutions.
    ref = reference_throughput()["A100"]["resnet50_fp32"]
    default = compare_to_reference(
        "NVIDIA A100-SXM4-80GB", "resnet50", "fp32", ref / 3,
        compute_capability=(8, 0), tf32_matmul=False, tf32_cudnn=True,
    )  # fmt: skip
    assert default.warning is not None and "0.33x" in default.warning
    off = compare_to_reference(
        "NVIDIA A100-SXM4-80GB", "resnet50", "fp32", ref / 3,
        compute_capability=(8, 0), tf32_matmul=True, tf32_cudnn=False,
    )  # fmt: skip
    assert off.warning is None
    assert any("convolutions off TF32" in n and "--tf32" in n for n in off.notes)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"model": "resnet18"}, "model must be one of"),
        ({"precision": "fp8"}, "precision must be"),
        ({"images_per_s": 0.0}, "images_per_s must be > 0"),
    ],
)
def test_compare_to_reference_rejects_bad_arguments(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {
        "gpu_name": "NVIDIA A40", "model": "resnet50", "precision": "fp16", "images_per_s": 1.0,
    }  # fmt: skip
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        compare_to_reference(**args)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- bench_model


def test_format_iteration_is_the_reference_line() -> None:
    assert format_iteration(3, 1234.56, 1.5554) == "Iteration 3, 1234.6 images/s in 1.555 s."


def test_bench_model_on_cpu_records_settings_and_iterations() -> None:
    seen: list[tuple[int, float, float]] = []
    r = bench_model(
        "resnet50", "fp32", device="cpu", warmup_batches=1, on_iteration=lambda *a: seen.append(a)
    )
    assert isinstance(r, BenchResult)
    assert (r.model, r.precision, r.device, r.gpu_name) == ("resnet50", "fp32", "cpu", None)
    # The CPU defaults: a token run of two iterations of one batch of 2 images at 64 px.
    assert (r.batch_size, r.image_size, r.batches_per_iteration) == (2, 64, 1)
    assert [i for i, _, _ in seen] == [0, 1]
    assert r.iteration_seconds == tuple(s for _, _, s in seen)
    for rate, seconds in zip(r.iteration_images_per_s, r.iteration_seconds, strict=True):
        assert rate == pytest.approx(r.images_per_iteration / seconds)
    assert r.images_per_s == statistics.median(r.iteration_images_per_s)
    assert r.comparison is None and r.torch_version == torch.__version__
    assert "resnet50 fp32 inference on cpu" in r.summary()


def test_bench_model_training_channels_last_and_vit() -> None:
    trained = bench_model(
        "resnet50", "fp32", train=True, channels_last=True, **{**TINY, "batch_size": 2}
    )
    assert trained.train and trained.channels_last and trained.images_per_s > 0
    vit = bench_model("vit_b_16", "bf16", **TINY)
    assert vit.model == "vit_b_16" and vit.images_per_s > 0


def test_bench_model_restores_tf32_settings() -> None:
    before = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    r = bench_model("resnet50", "fp32", tf32=before[0] == "highest", **TINY)
    assert r.tf32_matmul == (before[0] == "highest")
    assert (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32) == before


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"model": "resnet18"}, "model must be one of"),
        ({"precision": "fp8"}, "precision must be one of"),
        ({"batch_size": 0}, "batch_size must be an int >= 1"),
        ({"iterations": 0}, "iterations must be an int >= 1"),
        ({"model": "vit_b_16", "image_size": 40}, "multiple of 16"),
        ({"image_size": 16}, "resnet50 needs image_size >= 32"),
        ({"train": True}, "training needs batch_size >= 2"),
        ({"device": "tpu"}, "invalid device 'tpu': expected 'auto', 'cpu', 'cuda'"),
        ({"device": "meta"}, "device 'meta' is not supported here: expected 'auto', 'cpu'"),
    ],
)
def test_bench_model_rejects_bad_arguments(kwargs: dict[str, object], match: str) -> None:
    args = {**TINY, **kwargs}
    with pytest.raises(ValueError, match=match):
        bench_model(**args)  # type: ignore[arg-type]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_bench_model_on_missing_cuda_says_so() -> None:
    with pytest.raises(DeviceError, match="CUDA is not available"):
        bench_model(**{**TINY, "device": "cuda"})  # type: ignore[arg-type]


class _NoHalf(torch.nn.Module):
    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error = error

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise self.error


def test_a_missing_kernel_becomes_not_implemented(monkeypatch: pytest.MonkeyPatch) -> None:
    missing = RuntimeError("\"slow_conv2d_cpu\" not implemented for 'Half'")
    monkeypatch.setattr(model_module, "_build", lambda model, size: _NoHalf(missing))
    with pytest.raises(NotImplementedError, match="not supported on cpu"):
        bench_model("resnet50", "fp16", **TINY)
    other = RuntimeError("CUDA error: an illegal memory access was encountered")
    monkeypatch.setattr(model_module, "_build", lambda model, size: _NoHalf(other))
    with pytest.raises(RuntimeError, match="illegal memory access"):
        bench_model("resnet50", "fp16", **TINY)


def test_bf16_on_a_pre_ampere_gpu_is_not_implemented(monkeypatch: pytest.MonkeyPatch) -> None:
    # A faked Volta: both checks run before anything touches the (absent) GPU.
    cuda0 = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    monkeypatch.setattr(model_module, "resolve_device", lambda device: cuda0)
    monkeypatch.setattr(matmul_module, "resolve_device", lambda device: cuda0)
    with pytest.raises(NotImplementedError, match=r"bf16 needs a GPU with compute capability 8\.0"):
        bench_model("resnet50", "bf16")
    with pytest.raises(NotImplementedError, match=r"needs compute capability 8\.0\+ .* has 7\.0"):
        bench_matmul("bf16")


def test_bf16_is_checked_on_the_gpu_asked_for_not_the_current_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A mixed host: the current device (cuda:0) is a Hopper, cuda:1 a Volta.
    capabilities = {0: (9, 0), 1: (7, 0)}
    cuda1 = torch.device("cuda", 1)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    monkeypatch.setattr(
        torch.cuda, "get_device_capability", lambda device=None: capabilities[device.index]
    )
    monkeypatch.setattr(model_module, "resolve_device", lambda device: cuda1)
    monkeypatch.setattr(matmul_module, "resolve_device", lambda device: cuda1)
    with pytest.raises(NotImplementedError, match=r"bf16 needs .* cuda:1 has 7\.0"):
        bench_model("resnet50", "bf16", device="cuda:1")
    with pytest.raises(NotImplementedError, match=r"8\.0\+ \(Ampere\); cuda:1 has 7\.0"):
        bench_matmul("bf16", device="cuda:1")


@pytest.fixture
def new_tf32_api() -> Iterator[None]:
    """The state a user of torch's new per-backend API leaves: legacy getters then raise."""
    matmul = getattr(torch.backends.cuda.matmul, "fp32_precision", None)
    if matmul is None:
        pytest.skip("this torch has no per-backend fp32_precision API")
    saved = _tf32._snapshot()
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    yield
    _tf32._restore(saved)


def test_bench_reads_and_restores_tf32_after_the_new_api_was_used(new_tf32_api: None) -> None:
    before = _tf32.tf32_state()
    raw = torch.backends.cuda.matmul.fp32_precision
    assert bench_matmul("fp32", size=16, iterations=1, warmup=1, device="cpu").tflops > 0
    kept = bench_model("resnet50", **TINY)
    assert (kept.tf32_matmul, kept.tf32_cudnn) == (before.matmul, before.cudnn)
    off = bench_model("resnet50", tf32=False, **TINY)
    assert (off.tf32_matmul, off.tf32_cudnn) == (False, False)
    assert _tf32.tf32_state() == before
    assert torch.backends.cuda.matmul.fp32_precision == raw


class _Slow(torch.nn.Module):
    """Stands in for a torchvision model: a trainable head, and a sleep that caps its speed."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.head = torch.nn.Linear(3, 1000)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)  # 64 images take >= 0.1 s: <= 640 images/s, far under an A100
        return self.head(x.mean(dim=(2, 3)))


@pytest.fixture
def fake_a100(monkeypatch: pytest.MonkeyPatch) -> None:
    """bench_model on the CPU, reporting as an A100 with PyTorch's default TF32 flags."""
    monkeypatch.setattr(model_module, "_build", lambda model, size: _Slow(0.1))
    monkeypatch.setattr(model_module, "gpu_name", lambda device: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    defaults = _tf32.TF32State(matmul=False, cudnn=True)
    monkeypatch.setattr(model_module, "tf32_state", lambda: defaults)


# One warm-up and one timed batch at the reference's 224 px.
AT_224 = {"device": "cpu", "image_size": 224, "iterations": 1, "batches_per_iteration": 1,
          "warmup_batches": 1}  # fmt: skip


def test_bench_model_warns_about_a_known_gpu_well_under_its_reference(fake_a100: None) -> None:
    r = bench_model("resnet50", "fp32", batch_size=64, **AT_224)
    c = r.comparison
    assert c is not None and c.reference_gpu == "A100" and c.column == "resnet50_fp32"
    assert c.ratio is not None and c.ratio < SLOW_RATIO
    # Convolutions ran on TF32, as the reference's did: a like-for-like comparison.
    assert c.warning is not None and "throttled or sick" in c.warning
    assert (r.tf32_matmul, r.tf32_cudnn) == (False, True)
    vit = bench_model("vit_b_16", "fp32", batch_size=64, **AT_224).comparison
    # ViT's matmuls ran in full fp32 and the reference's on TF32: a note, not a warning.
    assert vit is not None and vit.warning is None
    assert any("matmuls off TF32" in n for n in vit.notes)


def test_bench_model_notes_why_it_gives_no_warning_or_no_comparison(fake_a100: None) -> None:
    small = bench_model("resnet50", "fp32", batch_size=8, **AT_224)
    assert small.comparison is not None and small.comparison.warning is None
    assert any("batch 8 is small" in n for n in small.notes)
    trained = bench_model("resnet50", "fp32", batch_size=2, train=True, **AT_224)
    assert trained.comparison is None
    assert any("the reference table is inference" in n for n in trained.notes)
    resized = bench_model("resnet50", "fp32", batch_size=2, **{**AT_224, "image_size": 64})
    assert resized.comparison is None and any("at 224px" in n for n in resized.notes)
    cpu = bench_model("resnet50", "fp32", batch_size=2, compare=False, **AT_224)
    assert cpu.comparison is None and cpu.notes == ()


def test_bench_model_without_torchvision_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_imports, "is_available", lambda name: name != "torchvision")
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'trainperf\[vision\]'"):
        bench_model("resnet50", "fp32", **TINY)


@pytest.mark.requires_cuda
def test_bench_model_on_cuda_compares_with_the_reference() -> None:
    r = bench_model("resnet50", "fp16", device="cuda", batch_size=8, iterations=2,
                    batches_per_iteration=2)  # fmt: skip
    assert r.gpu_name == torch.cuda.get_device_name()
    assert r.comparison is not None and r.comparison.column == "resnet50_fp16"
    assert 1 <= r.comparison.rank <= r.comparison.out_of
    small = bench_model("resnet50", "fp16", device="cuda", image_size=64, iterations=1)
    assert small.comparison is None and any("224px" in n for n in small.notes)


# --------------------------------------------------------------------------- bench_matmul


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_bench_matmul_on_cpu(dtype: str) -> None:
    r = bench_matmul(dtype, size=64, iterations=3, device="cpu")  # type: ignore[arg-type]
    assert isinstance(r, MatmulResult)
    assert (r.dtype, r.size, r.iterations, r.device) == (dtype, 64, 3, "cpu")
    assert r.tflops == pytest.approx(2 * 64**3 / r.seconds / 1e12)
    assert r.datasheet_tflops is None and r.gpu_name is None
    assert f"{dtype}:" in r.summary()


def test_bench_matmul_restores_the_matmul_precision() -> None:
    saved = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        bench_matmul("fp32", size=32, iterations=1, device="cpu")
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(saved)


def test_bench_matmul_compares_with_the_datasheet(monkeypatch: pytest.MonkeyPatch) -> None:
    # Pretend the CPU is a 3090 to exercise the datasheet lookup; 35.58 TFLOP/s fp32.
    monkeypatch.setattr(matmul_module, "gpu_name", lambda device: "NVIDIA GeForce RTX 3090")
    r = bench_matmul("fp32", size=64, iterations=2, device="cpu")
    assert r.datasheet_tflops == 35.58
    assert r.datasheet_fraction == pytest.approx(r.tflops / 35.58)
    assert any("of the datasheet" in n for n in r.notes)  # a CPU is far below a 3090
    assert "of the datasheet's 35.58" in r.summary()
    # bf16 has no column: on Ampere (the 3090 is 8.6) it is held against fp16's 71 TFLOP/s.
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 6))
    bf16 = bench_matmul("bf16", size=64, iterations=1, device="cpu")
    assert bf16.datasheet_tflops == 71 and bf16.datasheet_fraction is not None
    assert any("compared with its fp16 figure" in n for n in bf16.notes)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    older = bench_matmul("bf16", size=64, iterations=1, device="cpu")
    assert older.datasheet_tflops is None and any("no bf16 figure" in n for n in older.notes)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"dtype": "int8"}, ValueError, "dtype must be one of"),
        ({"size": 0}, ValueError, "size must be an int >= 1"),
        ({"iterations": -1}, ValueError, "iterations must be an int >= 1"),
        ({"warmup": 0}, ValueError, "warmup must be an int >= 1"),
        ({"dtype": "tf32"}, NotImplementedError, "needs a CUDA GPU"),
    ],
)
def test_bench_matmul_rejects(kwargs: dict[str, object], error: type, match: str) -> None:
    args: dict[str, object] = {"dtype": "fp32", "size": 16, "device": "cpu", **kwargs}
    with pytest.raises(error, match=match):
        bench_matmul(**args)  # type: ignore[arg-type]


@pytest.mark.requires_cuda
def test_bench_matmul_on_cuda_all_dtypes() -> None:
    for dtype in ("fp32", "tf32", "bf16", "fp16"):
        r = bench_matmul(dtype, size=1024, iterations=3)  # type: ignore[arg-type]
        assert r.device.startswith("cuda") and r.tflops > 0


# --------------------------------------------------------------------------- bench_h2d


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_bench_h2d_needs_cuda() -> None:
    with pytest.raises(DeviceError, match="bench_h2d needs CUDA"):
        bench_h2d(size_bytes=1024)


def test_bench_h2d_rejects_cpu_and_bad_sizes() -> None:
    with pytest.raises(ValueError, match="needs a CUDA device"):
        bench_h2d(size_bytes=1024, device="cpu")
    with pytest.raises(ValueError, match="size_bytes must be an int >= 1"):
        bench_h2d(size_bytes=0)
    with pytest.raises(ValueError, match="iterations must be an int >= 1"):
        bench_h2d(iterations=0)


@pytest.mark.requires_cuda
def test_bench_h2d_on_cuda() -> None:
    r = bench_h2d(size_bytes=32 * 2**20, iterations=2)
    assert isinstance(r, H2DResult)
    assert r.pageable_gb_per_s > 0 and r.pinned_gb_per_s > 0
    assert r.pinned_speedup == pytest.approx(r.pinned_gb_per_s / r.pageable_gb_per_s)
    with pytest.raises(DeviceError, match="does not exist"):
        bench_h2d(size_bytes=1024, device=f"cuda:{torch.cuda.device_count()}")
