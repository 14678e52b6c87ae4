"""trainperf.bench._model: bench_model on the CPU (and on a faked or real GPU)."""

from __future__ import annotations

import importlib
import json
import re
import statistics
import time
from collections.abc import Iterator

import pytest
import torch

from tests.bench._fakes import FakeBatches, fake_mixed_host, fake_volta
from trainperf._utils import imports as _imports
from trainperf.amp import _tf32
from trainperf.bench import BenchResult, bench_matmul, bench_model, format_iteration
from trainperf.bench._common import RunTimeLimitExceeded
from trainperf.bench._reference import SLOW_RATIO
from trainperf.errors import DeviceError
from trainperf.limits import HostLimits

model_module = importlib.import_module("trainperf.bench._model")
host_notes_module = importlib.import_module("trainperf.bench._host_notes")
run_module = importlib.import_module("trainperf.bench._model_run")

# One warm-up batch and one timed batch of one small image: each CPU run takes about a second.
TINY = {"device": "cpu", "batch_size": 1, "image_size": 32, "iterations": 1, "warmup_batches": 1}


def test_format_iteration_is_the_reference_line() -> None:
    assert format_iteration(3, 1234.56, 1.5554) == "Iteration 3, 1234.6 images/s in 1.555 s."


@pytest.mark.slow
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


@pytest.mark.slow
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
        # Past what a tensor can address: checked before torch overflows or a model is built.
        ({"image_size": 4_000_000_000}, r"image_size=4000000000\): its input batch .* is "),
        ({"batch_size": 10**20}, r"batch_size=100000000000000000000, .*smaller batch_size"),
    ],
)
def test_bench_model_rejects_bad_arguments(kwargs: dict[str, object], match: str) -> None:
    args = {**TINY, **kwargs}
    with pytest.raises(ValueError, match=match):
        bench_model(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"train": "no"}, "train must be True or False, got 'no'"),
        ({"channels_last": 1}, "channels_last must be True or False, got 1"),
        ({"compare": "false"}, "compare must be True or False"),
        ({"tf32": "off"}, "tf32 must be True, False or None, got 'off'"),
    ],
)
def test_bench_model_refuses_a_flag_that_is_not_a_bool(
    kwargs: dict[str, object], match: str
) -> None:
    # Before: train="no" was taken as true and trained.
    with pytest.raises(TypeError, match=match):
        bench_model(**{**TINY, **kwargs})  # type: ignore[arg-type]


@pytest.mark.parametrize(("precision", "native_bf16", "noted"),
                         [("fp16", True, True), ("bf16", False, True), ("bf16", True, False),
                          ("fp32", False, False)])  # fmt: skip
def test_emulated_half_precision_on_the_cpu_is_noted_as_bench_matmul_does(
    monkeypatch: pytest.MonkeyPatch, precision: str, native_bf16: bool, noted: bool
) -> None:
    # Before: bench model in fp16 on a CPU without fp16 kernels gave a figure with no note
    # that torch emulated it, where bench matmul said so.
    monkeypatch.setattr(model_module, "_build", lambda model, size: torch.nn.Conv2d(3, 1, 1))
    monkeypatch.setattr(host_notes_module, "cpu_has_bf16_kernels", lambda: native_bf16)
    r = bench_model("resnet50", precision, **TINY)  # type: ignore[arg-type]
    emulated = [n for n in r.notes if "torch emulates it" in n]
    matmul = bench_matmul(precision, size=8, iterations=1, warmup=1, device="cpu")  # type: ignore[arg-type]
    assert emulated == [n for n in matmul.notes if "torch emulates it" in n]
    assert bool(emulated) is noted


@pytest.mark.parametrize("tf32", [True, False, None])
def test_tf32_on_the_cpu_is_noted_as_having_no_effect(
    monkeypatch: pytest.MonkeyPatch, tf32: bool | None
) -> None:
    # Before: tf32=True on the CPU ran silently as if it had done something (bench_matmul
    # skips its tf32 there with the reason).
    monkeypatch.setattr(model_module, "_build", lambda model, size: torch.nn.Conv2d(3, 1, 1))
    r = bench_model("resnet50", "fp32", tf32=tf32, **TINY)
    noted = [n for n in r.notes if "tf32" in n.lower()]
    if tf32:
        assert noted == [
            "tf32=True has no effect on cpu: TF32 is a tensor-core mode of CUDA GPUs "
            "(compute capability 8.0, Ampere, and newer)"
        ]
    else:
        assert noted == []


@pytest.mark.parametrize(("capability", "noted"), [((7, 0), True), ((8, 0), False)])
def test_tf32_on_a_pre_ampere_gpu_is_noted_as_having_no_effect(
    monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int], noted: bool
) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    notes = model_module._tf32_notes(True, torch.device("cuda", 0))
    assert notes == (
        ("tf32=True has no effect on cuda:0: TF32 needs compute capability 8.0 (Ampere) or "
         "newer, and it has 7.0",) if noted else ()
    )  # fmt: skip


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


def test_bf16_on_a_pre_ampere_gpu_is_a_device_error(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_volta(monkeypatch, model_module)
    with pytest.raises(DeviceError, match=r"bf16 needs a GPU with compute capability 8\.0"):
        bench_model("resnet50", "bf16")


def test_bf16_is_checked_on_the_gpu_asked_for_not_the_current_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake_mixed_host(monkeypatch, model_module)
    with pytest.raises(DeviceError, match=r"bf16 needs .* cuda:1 has 7\.0"):
        bench_model("resnet50", "bf16", device="cuda:1")


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


@pytest.mark.slow
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
    monkeypatch.setattr(run_module, "tf32_state", lambda: defaults)


# One warm-up and one timed batch at the reference's 224 px.
AT_224 = {"device": "cpu", "image_size": 224, "iterations": 1, "batches_per_iteration": 1,
          "warmup_batches": 1}  # fmt: skip


@pytest.mark.slow
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


@pytest.mark.slow
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
    assert cpu.comparison is None
    # Nothing to note but, on a host other jobs keep busy, that it was (doctor's load check).
    assert [n for n in cpu.notes if not n.startswith("the host was busy while measuring")] == []


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


# --------------------------------------------------------------------------- the result protocol


def test_bench_result_to_dict_is_json_safe_and_its_str_is_the_report(fake_a100: None) -> None:
    r = bench_model("resnet50", "fp32", batch_size=8, **AT_224)
    data = r.to_dict()
    assert json.loads(json.dumps(data)) == data
    assert data["iteration_seconds"] == list(r.iteration_seconds)
    assert r.comparison is not None and data["comparison"] == r.comparison.to_dict()
    lines = str(r).splitlines()
    assert lines[0] == r.summary()
    assert "\n".join(lines[1:]) == "\n".join([str(r.comparison), *(f"Note: {n}" for n in r.notes)])


@pytest.mark.slow
def test_a_busy_host_is_noted_with_doctors_load_check(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_notes_module, "cgroup_cpu_pressure", lambda: None)
    monkeypatch.setattr(host_notes_module, "load_average", lambda: 40.0)
    result = bench_model("resnet50", "fp32", device="cpu", warmup_batches=1)
    busy = [n for n in result.notes if n.startswith("the host was busy while measuring")]
    assert busy and "40.0" in busy[0] and "run fewer jobs at once" in busy[0]
    assert "Note: the host was busy" in str(result)
    monkeypatch.setattr(host_notes_module, "load_average", lambda: 0.0)
    quiet = bench_model("resnet50", "fp32", device="cpu", warmup_batches=1)
    assert not any("busy" in n for n in quiet.notes)


def test_a_shared_hosts_load_is_not_read_as_a_busy_host(monkeypatch: pytest.MonkeyPatch) -> None:
    # A container allowed 2 of a 64-core host's CPUs: a host-wide load of 40 is other tenants
    # on other cores, not contention for this run's (before: noted as "the host was busy").
    monkeypatch.setattr(host_notes_module, "load_average", lambda: 40.0)
    monkeypatch.setattr(host_notes_module, "cgroup_cpu_pressure", lambda: (0.01, "cgroup"))
    pod = HostLimits(64, 64, 2.0, 2, 2**36, None, 2**35, None, None)
    monkeypatch.setattr(host_notes_module, "host_limits", lambda: pod)
    result = bench_model(
        "resnet50", device="cpu", batch_size=1, image_size=32, iterations=1, warmup_batches=1
    )
    assert not any(n.startswith("the host was busy") for n in result.notes)


def test_a_quota_job_crowding_its_own_cpus_is_noted(monkeypatch: pytest.MonkeyPatch) -> None:
    # A container allowed 2 of a 64-core host's CPUs whose own threads waited for them 60 %
    # of the last minute: a host-wide load of 40 is under 1.5 x 64 (before: no note).
    monkeypatch.setattr(host_notes_module, "load_average", lambda: 40.0)
    monkeypatch.setattr(host_notes_module, "cgroup_cpu_pressure", lambda: (0.6, "cgroup"))
    pod = HostLimits(64, 64, 2.0, 2, 2**36, None, 2**35, None, None)
    monkeypatch.setattr(host_notes_module, "host_limits", lambda: pod)
    result = bench_model(
        "resnet50", device="cpu", batch_size=1, image_size=32, iterations=1, warmup_batches=1
    )
    busy = [n for n in result.notes if n.startswith("the host was busy while measuring")]
    assert busy and "CPU pressure 60%" in busy[0] and "(2 CPUs) waited" in busy[0]


# ------------------------------------------------------------------ the run-time limit


def test_a_model_run_estimated_past_max_seconds_is_refused_after_the_second_warm_up_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before: `trainperf bench model --device cpu --batch-size 256 --image-size 224` printed
    # nothing for 45+ s, and larger settings ran for hours, with no estimate. Here the first
    # batch takes 20 s (one-off setup), the others 10 s: 102 batches would take 17 min.
    fake = FakeBatches(monkeypatch, 20.0, 10.0)
    with pytest.raises(ValueError) as caught:
        bench_model("resnet50", "fp32", device="cpu", batch_size=256, image_size=224,
                    iterations=100, max_seconds=300)  # fmt: skip
    assert str(caught.value) == (
        "bench_model(batch_size=256, image_size=224, iterations=100): 102 resnet50 fp32 "
        "inference batches "
        "(2 warm-up, 100 timed in 100 iterations) would take about 17 min on cpu (25.6 "
        "images/s, 10 s per batch, measured on the second warm-up batch), more than "
        "max_seconds=300: use a smaller batch_size (e.g. batch_size=32), a smaller "
        "image_size, fewer iterations (e.g. iterations=22) or a larger max_seconds (e.g. "
        "max_seconds=1300)"
    )
    assert isinstance(caught.value, RunTimeLimitExceeded)
    assert fake.ran == 2  # refused before the rest of the warm-up and any timed batch
    # The default limit is the same 300 s as bench_matmul's.
    fake.events.clear()
    with pytest.raises(ValueError, match=r"more than max_seconds=300: "):
        bench_model("resnet50", "fp32", device="cpu", batch_size=256, iterations=100)


def test_a_model_refusal_names_the_counts_that_make_the_run_long(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before: "bench_model(batch_size=2, image_size=64): ..." (the CLI's "--batch-size 2
    # --image-size 64: ..."), where a thousand iterations are what take 5.6 h.
    FakeBatches(monkeypatch, 20.0, 10.0)
    with pytest.raises(RunTimeLimitExceeded) as caught:
        bench_model("resnet50", "fp32", device="cpu", iterations=1000)
    assert str(caught.value).startswith(
        "bench_model(batch_size=2, image_size=64, iterations=1000): 1002 resnet50 fp32 "
        "inference batches "
    )


def test_a_first_batch_past_max_seconds_is_refused_without_a_second(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A batch of an hour: the run is past the limit already, whatever setup the first held.
    fake = FakeBatches(monkeypatch, 3600.0)
    with pytest.raises(ValueError, match=r"4 resnet50 fp32 inference batches \(2 warm-up, 2 "
                       r"timed in 2 iterations\) would take about 4.0 h on cpu .* measured on "
                       r"the first warm-up batch, one-off setup included\), more than "
                       r"max_seconds=300: use a smaller batch_size"):  # fmt: skip
        bench_model("resnet50", "fp32", device="cpu", batch_size=256, image_size=224)
    assert fake.ran == 1


def test_with_one_warm_up_batch_the_first_timed_iteration_gives_the_estimate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The only warm-up batch holds the one-off setup, so it sets no estimate; the first
    # timed iteration (two batches of 10 s) does, at the synchronisation it ends with anyway.
    # (The warm-up batch is quick here: one that leaves the run's fit in doubt has the first
    # timed batch checked on its own, as the test of a huge iteration below shows.)
    seen: list[int] = []
    fake = FakeBatches(monkeypatch, 1.0, 10.0)
    with pytest.raises(ValueError, match=r"201 resnet50 fp32 inference batches \(1 warm-up, "
                       r"200 timed in 100 iterations\) would take about 34 min on cpu \(0.2 "
                       r"images/s, 10 s per batch, measured on the first timed iteration\).*"
                       r"fewer iterations \(e.g. iterations=11\)"):  # fmt: skip
        bench_model("resnet50", "fp32", device="cpu", batch_size=2, iterations=100,
                    batches_per_iteration=2, warmup_batches=1,
                    on_iteration=lambda i, rate, s: seen.append(i))  # fmt: skip
    assert fake.ran == 3 and seen == [0]


@pytest.mark.parametrize(
    ("kwargs", "seconds"),
    [
        # A GPU's defaults (batch 128 at 224 px, 15 warm-up batches, 5 x 15 timed): even a
        # slow card at 300 images/s, after a first batch of 10 s of cuDNN autotuning, takes
        # 38 s.
        ({"batch_size": 128, "image_size": 224, "batches_per_iteration": 15,
          "warmup_batches": 15, "iterations": 5}, (10.0, 128 / 300)),
        # The CPU defaults, at 5 s a batch.
        ({}, (5.0,)),
        ({"max_seconds": None, "iterations": 1000}, (10.0,)),  # no limit
    ],
)  # fmt: skip
def test_a_run_within_max_seconds_runs_whole(
    monkeypatch: pytest.MonkeyPatch, kwargs: dict[str, object], seconds: tuple[float, ...]
) -> None:
    fake = FakeBatches(monkeypatch, *seconds)
    r = bench_model("resnet50", "fp32", device="cpu", **kwargs)  # type: ignore[arg-type]
    assert fake.ran == r.warmup_batches + len(r.iteration_seconds) * r.batches_per_iteration


def test_the_limit_adds_no_synchronisation_to_the_timed_iterations(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The first two warm-up batches are each synchronised, to time them; the rest of the
    # warm-up runs unsynchronised, and each timed iteration is two batches, then one sync.
    fake = FakeBatches(monkeypatch, 0.01)
    bench_model("resnet50", "fp32", device="cpu", warmup_batches=3, iterations=2,
                batches_per_iteration=2)  # fmt: skip
    assert fake.events == ["b", "s", "b", "s", "b", "s", "b", "b", "s", "b", "b", "s"]


@pytest.mark.parametrize("max_seconds", [0, -1, float("nan"), "300"])
def test_bench_models_max_seconds_must_be_a_positive_number_or_none(max_seconds: object) -> None:
    with pytest.raises(ValueError, match=r"max_seconds must be a positive number of seconds"):
        bench_model("resnet50", max_seconds=max_seconds, **TINY)  # type: ignore[arg-type]


def test_each_suggestion_runs_when_the_rerun_is_a_little_slower(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The suggestions leave room (not iterations=28: 300 s, nor max_seconds=1020 for 1020 s),
    # so a rerun 1% slower still fits. A batch's time is in proportion to its images here, as
    # the batch_size suggestion assumes on the CPU.
    FakeBatches(monkeypatch, 20.0, 10.0)
    asked = {"device": "cpu", "batch_size": 256, "image_size": 224, "iterations": 100}
    with pytest.raises(ValueError) as caught:
        bench_model("resnet50", "fp32", **asked)  # type: ignore[arg-type]
    suggested = {name: int(value) for name, value in
                 re.findall(r"e\.g\. (\w+)=(\d+)", str(caught.value))}  # fmt: skip
    assert set(suggested) == {"batch_size", "iterations", "max_seconds"}
    for name, value in suggested.items():
        share = value / 256 if name == "batch_size" else 1.0
        fake = FakeBatches(monkeypatch, 20.0 * share, 10.0 * 1.01 * share)
        r = bench_model("resnet50", "fp32", **{**asked, name: value})  # type: ignore[arg-type]
        assert fake.ran == r.warmup_batches + len(r.iteration_seconds), name


@pytest.mark.parametrize(("iterations", "fitting"), [(1, 239), (2, 119)])
def test_with_one_warm_up_batch_a_huge_iteration_is_refused_after_its_first_batch(
    monkeypatch: pytest.MonkeyPatch, iterations: int, fitting: int
) -> None:
    # Before: the limit was checked only after the first timed iteration (with iterations=1,
    # never), so a billion batches per iteration ran on until the process was killed. The
    # first warm-up batch (setup included) leaves the run's fit in doubt, so the first timed
    # batch is timed on its own and the run refused there, naming what fits.
    fake = FakeBatches(monkeypatch, 1.0, max_batches=10)
    with pytest.raises(RunTimeLimitExceeded) as caught:
        bench_model("resnet50", "fp32", device="cpu", batches_per_iteration=10**9,
                    warmup_batches=1, iterations=iterations)  # fmt: skip
    message = str(caught.value)
    assert fake.ran == 2, message
    assert message.startswith(
        "bench_model(batch_size=2, image_size=64, batches_per_iteration=1000000000): "
    )
    assert "measured on the first timed batch), more than max_seconds=300: use " in message
    assert f"fewer batches_per_iteration (e.g. batches_per_iteration={fitting})" in message
    # What it suggests runs.
    fake = FakeBatches(monkeypatch, 1.0)
    r = bench_model("resnet50", "fp32", device="cpu", batches_per_iteration=fitting,
                    warmup_batches=1, iterations=iterations)  # fmt: skip
    assert fake.ran == 1 + iterations * fitting and len(r.iteration_seconds) == iterations


@pytest.mark.parametrize("timed", [5.5, 11.0])
def test_with_one_warm_up_batch_a_single_timed_batch_is_not_refused_once_it_has_run(
    monkeypatch: pytest.MonkeyPatch, timed: float
) -> None:
    # Before: a slow warm-up batch (6 s: 12 s estimated, past max_seconds=10) had the first
    # timed batch checked on its own, and with one timed batch in all that check came after
    # the whole run: RunTimeLimitExceeded, and the result it had measured was lost.
    fake = FakeBatches(monkeypatch, 6.0, timed)
    r = bench_model("resnet50", "fp32", device="cpu", iterations=1, batches_per_iteration=1,
                    warmup_batches=1, max_seconds=10)  # fmt: skip
    assert fake.ran == 2 and r.iteration_seconds == (timed,)


def test_with_one_warm_up_batch_a_settling_first_timed_batch_does_not_refuse_a_run_that_fits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before: the first timed batch (4 s, still settling) set the estimate, 7 x 4 = 28 s, and
    # the run was refused after two batches, though it takes 6 + 4 + 5 x 0.5 = 12.5 s. That
    # batch only stops an iteration that alone is past the limit; the first iteration's
    # average (5 s / 3) gives the estimate, as before.
    fake = FakeBatches(monkeypatch, 6.0, 4.0, 0.5)
    r = bench_model("resnet50", "fp32", device="cpu", iterations=2, batches_per_iteration=3,
                    warmup_batches=1, max_seconds=20)  # fmt: skip
    assert fake.ran == 7 and r.iteration_seconds == (5.0, 1.5)
    assert fake.now == 12.5


def test_a_first_warm_up_batch_that_fits_adds_no_synchronisation_to_the_timed_iterations(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # With one warm-up batch that says the run fits, the timed iterations are synchronised
    # only after their last batch, as before.
    fake = FakeBatches(monkeypatch, 0.01)
    bench_model("resnet50", "fp32", device="cpu", warmup_batches=1, iterations=2,
                batches_per_iteration=2)  # fmt: skip
    assert fake.events == ["b", "s", "s", "b", "b", "s", "b", "b", "s"]


def test_a_smaller_image_size_is_not_suggested_at_the_models_minimum(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before: "use a smaller image_size, ..." at resnet50's minimum of 32 px, which it refuses.
    FakeBatches(monkeypatch, 20.0, 10.0)
    with pytest.raises(RunTimeLimitExceeded) as caught:
        bench_model("resnet50", "fp32", device="cpu", image_size=32, iterations=100)
    fix = str(caught.value).split("more than max_seconds=300: ")[1]
    assert fix == "use fewer iterations (e.g. iterations=22) or a larger max_seconds (e.g. " \
        "max_seconds=1300)"  # fmt: skip
    with pytest.raises(RunTimeLimitExceeded) as caught:
        bench_model("vit_b_16", "fp32", device="cpu", image_size=16, iterations=100)
    assert "image_size" not in str(caught.value).split("more than max_seconds=300: ")[1]


def test_a_huge_warm_up_is_refused_with_fewer_warm_up_batches_that_fit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before: no warm-up fix, though the warm-up alone is what takes 17 min.
    fake = FakeBatches(monkeypatch, 1.0)
    with pytest.raises(RunTimeLimitExceeded) as caught:
        bench_model("resnet50", "fp32", device="cpu", warmup_batches=1000)
    message = str(caught.value)
    assert message.startswith("bench_model(batch_size=2, image_size=64, warmup_batches=1000): ")
    assert "fewer warmup_batches (e.g. warmup_batches=238)" in message
    assert "fewer iterations" not in message
    fake = FakeBatches(monkeypatch, 1.0)
    bench_model("resnet50", "fp32", device="cpu", warmup_batches=238)
    assert fake.ran == 240


@pytest.mark.parametrize("on_iteration", [5, "print"])
def test_an_on_iteration_that_is_not_callable_is_refused_before_the_run(
    monkeypatch: pytest.MonkeyPatch, on_iteration: object
) -> None:
    # Before: "'int' object is not callable" after the first timed iteration.
    fake = FakeBatches(monkeypatch, 0.01)
    expected = (
        r"on_iteration must be None or a callable taking \(index, images_per_s, seconds\), "
        rf"got {re.escape(repr(on_iteration))}: pass a function"
    )
    with pytest.raises(TypeError, match=expected):
        bench_model("resnet50", device="cpu", on_iteration=on_iteration)  # type: ignore[arg-type]
    assert fake.ran == 0
