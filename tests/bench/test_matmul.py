"""trainperf.bench._matmul: bench_matmul on the CPU (and on a faked or real GPU)."""

from __future__ import annotations

import dataclasses
import importlib
import json
import re
from collections.abc import Callable

import pytest
import torch

from tests.bench._fakes import fake_mixed_host, fake_volta
from trainperf.bench import MatmulResult, bench_matmul
from trainperf.bench._common import RunTimeLimitExceeded
from trainperf.errors import DeviceError

matmul_module = importlib.import_module("trainperf.bench._matmul")
host_notes_module = importlib.import_module("trainperf.bench._host_notes")
common_module = importlib.import_module("trainperf.bench._common")


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
        ({"dtype": "tf32"}, DeviceError, "needs a CUDA GPU"),
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


def test_bf16_on_a_pre_ampere_gpu_is_a_device_error(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_volta(monkeypatch, matmul_module)
    with pytest.raises(DeviceError, match=r"needs compute capability 8\.0\+ .* has 7\.0"):
        bench_matmul("bf16")


def test_bf16_is_checked_on_the_gpu_asked_for_not_the_current_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake_mixed_host(monkeypatch, matmul_module)
    with pytest.raises(DeviceError, match=r"8\.0\+ \(Ampere\); cuda:1 has 7\.0"):
        bench_matmul("bf16", device="cuda:1")


# --------------------------------------------------------------------------- the result protocol


def test_matmul_result_to_dict_is_json_safe_and_its_str_is_the_report(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(matmul_module, "gpu_name", lambda device: "NVIDIA GeForce RTX 3090")
    r = bench_matmul("fp32", size=32, iterations=1, device="cpu")
    data = r.to_dict()
    assert json.loads(json.dumps(data)) == data
    assert data["notes"] == list(r.notes) and data["datasheet_tflops"] == 35.58
    assert r.notes  # a CPU is far below a 3090
    assert str(r) == "\n".join([r.summary(), *(f"      note: {n}" for n in r.notes)])


@pytest.mark.parametrize("native_bf16", [True, False])
def test_emulated_half_precision_on_the_cpu_says_so(
    monkeypatch: pytest.MonkeyPatch, native_bf16: bool
) -> None:
    monkeypatch.setattr(host_notes_module, "cpu_has_bf16_kernels", lambda: native_bf16)
    fp16 = bench_matmul("fp16", size=32, iterations=1, warmup=1, device="cpu")
    assert any("no native fp16 arithmetic" in n for n in fp16.notes), fp16.notes
    bf16 = bench_matmul("bf16", size=32, iterations=1, warmup=1, device="cpu")
    assert any("no native bf16" in n for n in bf16.notes) is not native_bf16
    fp32 = bench_matmul("fp32", size=32, iterations=1, warmup=1, device="cpu")
    assert not any("no native" in n for n in fp32.notes)


@pytest.mark.parametrize("size", [3_000_000_000, 10**20])
def test_bench_matmul_refuses_a_size_past_what_a_tensor_can_address(size: int) -> None:
    # torch would raise "Storage size calculation overflowed" (or a TypeError past int64).
    with pytest.raises(ValueError, match=rf"bench_matmul\(size={size}\): a {size}x{size} fp32 "
                       r"matrix is .* bytes, more than a tensor can address"):  # fmt: skip
        bench_matmul("fp32", size=size, iterations=1, device="cpu")


def test_a_size_too_large_names_the_parameter_and_a_size_to_use() -> None:
    # Before: "use a smaller size", a word the command line could not turn into --size.
    with pytest.raises(ValueError) as caught:
        bench_matmul("fp32", size=3_000_000_000, device="cpu")
    assert str(caught.value).endswith(": use a smaller size (e.g. size=8192, the default on a GPU)")


def test_a_cpu_run_past_the_free_host_memory_is_refused_before_filling_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before: torch.randn filled the matrices until the kernel's OOM killer ended the process
    # (no message) or the host swapped. Three 1024x1024 fp32 matrices are 12 MiB.
    limits = common_module.host_limits()
    small = dataclasses.replace(limits, memory_available=8 * 2**20)
    monkeypatch.setattr(common_module, "host_limits", lambda: small)
    needs = r"matrices need 12 MiB of host memory, and 8 MiB is available"
    with pytest.raises(
        MemoryError, match=rf"^bench_matmul\(size=1024\): three 1024x1024 fp32 {needs}"
    ) as caught:
        bench_matmul("fp32", size=1024, iterations=1, device="cpu")
    # Before: "use a smaller size", which the CLI could not turn into its --size option.
    assert str(caught.value).endswith("): use a smaller size (e.g. size=512)")
    assert bench_matmul("fp32", size=512, iterations=1, device="cpu").size == 512


def test_bench_matmul_takes_numpy_counts_and_its_result_is_json_safe() -> None:
    # Before: the result held the np.int64 size and iterations, which json.dumps refuses.
    np = pytest.importorskip("numpy")
    counts = {"size": np.int64(32), "iterations": np.int64(2), "warmup": np.int64(1)}
    r = bench_matmul("fp32", device="cpu", **counts)
    data = r.to_dict()
    assert json.loads(json.dumps(data)) == data
    assert type(r.size) is int and type(r.iterations) is int
    assert (r.size, r.iterations) == (32, 2)


# ------------------------------------------------------------------ the estimate before the run


def _fake_products(
    monkeypatch: pytest.MonkeyPatch, seconds: Callable[[int, list[int]], float]
) -> tuple[list[int], list[int]]:
    """No product runs: a timed block of ``n x n`` products takes ``seconds(n, timed)`` a
    product, ``timed`` the sizes timed so far, this one included. Returns the sizes whose
    matrices were made and the sizes timed, in order."""
    made: list[int] = []
    timed: list[int] = []

    def product_timer(dtype: str, size: int, device: object) -> Callable[[int, int], float]:
        made.append(size)

        def seconds_per_product(iterations: int, warmup: int) -> float:
            timed.append(size)
            return seconds(size, timed)

        return seconds_per_product

    monkeypatch.setattr(matmul_module, "_product_timer", product_timer)
    return made, timed


def _slow_host(monkeypatch: pytest.MonkeyPatch, flops_per_s: float) -> list[int]:
    """Products of every size take ``2 * n**3 / flops_per_s`` seconds, and none runs; returns
    the sizes timed, in order."""
    return _fake_products(monkeypatch, lambda size, timed: 2 * size**3 / flops_per_s)[1]


def test_a_run_estimated_past_max_seconds_is_refused_before_it_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before: `trainperf bench matmul --device cpu --size 50000` ran for hours, with no
    # estimate. Here a 1 GFLOP/s host: 13 products of 8192x8192 take about 4.0 h.
    timed = _slow_host(monkeypatch, 1e9)
    with pytest.raises(ValueError) as caught:
        bench_matmul("fp32", size=8192, device="cpu")
    message = str(caught.value)
    assert message.startswith("bench_matmul(size=8192): 13 fp32 products (3 warm-up, 10 timed)")
    assert "would take about 4.0 h on cpu" in message
    assert "more than max_seconds=300" in message
    # The fix: a size that fits (2048: 13 products in 223 s; 4096 would take 30 min)...
    assert "use a smaller size (e.g. size=2048)" in message
    # ... or the limit that lets this one run.
    assert message.endswith("or a larger max_seconds (e.g. max_seconds=18000)")
    assert isinstance(caught.value, RunTimeLimitExceeded)
    assert 8192 not in timed  # the probe stopped well short of the full size
    assert bench_matmul("fp32", size=8192, device="cpu", max_seconds=None).size == 8192


def test_the_estimate_takes_the_fastest_of_three_products_at_the_probe_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A host busy for one product (a rate 3x lower) would refuse a run that fits, were that
    # product alone to set the estimate. At 1 GFLOP/s the probe stops at 512x512 (0.27 s;
    # 256x256 takes 34 ms), whose first product is slowed 3x: from it, 13 products of
    # 1024x1024 would take 84 s; from the two others, 28 s, within 60 s.
    def seconds(size: int, timed: list[int]) -> float:
        busy = 3.0 if size == 512 and timed.count(size) == 1 else 1.0
        return busy * 2 * size**3 / 1e9

    made, timed = _fake_products(monkeypatch, seconds)
    plan = matmul_module.matmul_plan("fp32", size=1024, device="cpu", max_seconds=60)
    assert plan.size == 1024
    assert timed == [128, 256, 512, 512, 512]  # three at the final size, no more
    assert made == [128, 256, 512]  # the three on the same matrices
    # The limit itself is kept: 28 s is refused under max_seconds=20.
    with pytest.raises(ValueError, match=r"about 28 s on cpu \(1 GFLOP/s measured on a 512x512"):
        matmul_module.matmul_plan("fp32", size=1024, device="cpu", max_seconds=20)


def test_the_probe_is_the_rate_of_the_fastest_product_at_its_final_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    times = iter([0.001, 0.2, 0.1, 0.4])  # 128 (short), then 256 three times
    _fake_products(monkeypatch, lambda size, timed: next(times))
    n, rate = matmul_module._probe("fp32", 8192, torch.device("cpu"))
    assert (n, rate) == (256, 2 * 256**3 / 0.1)


def test_a_run_within_max_seconds_runs() -> None:
    r = bench_matmul("fp32", size=64, iterations=2, device="cpu", max_seconds=60)
    assert r.size == 64


@pytest.mark.parametrize("max_seconds", [0, -1, float("nan"), "300"])
def test_max_seconds_must_be_a_positive_number_or_none(max_seconds: object) -> None:
    with pytest.raises(ValueError, match=r"max_seconds must be a positive number of seconds"):
        bench_matmul("fp32", size=16, device="cpu", max_seconds=max_seconds)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("size", "iterations", "flops_per_s", "max_seconds", "refused"),
    [
        (8192, 10, 1e9, 300.0, True),  # 4 h
        (256, 10, 1e9, 300.0, False),  # 0.4 s
        (50_000, 20, 50e12, 300.0, False),  # an H100's fp32: about 2 min
        (50_000, 10, 100e9, 300.0, True),  # a CPU: 9 h
        (50_000, 10, 100e9, None, False),  # no limit
        (16, 10**9, 1e9, 300.0, True),  # tiny products, but a billion of them: 2.3 h
    ],
)
def test_the_run_time_rule(
    size: int, iterations: int, flops_per_s: float, max_seconds: float | None, refused: bool
) -> None:
    estimate, fix = matmul_module._too_long(size, 3, iterations, flops_per_s, max_seconds)
    assert estimate == matmul_module._estimated_seconds(size, 3 + iterations, flops_per_s)
    assert (fix is not None) is refused


def test_too_many_iterations_are_told_how_many_fit() -> None:
    # Not only "a smaller size", where the iterations are what make the run long.
    _, fix = matmul_module._too_long(16, 3, 10**9, 1e9, 300.0)
    assert fix == (
        "use a smaller size (e.g. size=4), fewer iterations (e.g. iterations=29296872) or a "
        "larger max_seconds (e.g. max_seconds=9900)"
    )


@pytest.mark.parametrize(("size", "iterations"), [(16, 10**9), (8192, 10), (50_000, 10)])
def test_each_suggestion_fits_a_rerun_a_little_slower(size: int, iterations: int) -> None:
    # Neither iterations that fill max_seconds exactly nor the estimate rounded up as the
    # max_seconds, which a rerun 1% slower would pass again.
    _, fix = matmul_module._too_long(size, 3, iterations, 1e9, 300.0)
    assert fix is not None
    suggested = {name: int(value) for name, value in re.findall(r"e\.g\. (\w+)=(\d+)", fix)}
    slower = 1e9 / 1.01
    for name, value in suggested.items():
        rerun = {"size": size, "iterations": iterations, "max_seconds": 300.0, name: value}
        assert (
            matmul_module._too_long(
                rerun["size"], 3, rerun["iterations"], slower, rerun["max_seconds"]
            )[1]
            is None
        ), name


def test_the_size_suggested_fits_the_limit() -> None:
    fits = matmul_module._size_within(300.0, 13, 1e9)
    assert matmul_module._estimated_seconds(fits, 13, 1e9) <= 300.0
    assert matmul_module._estimated_seconds(2 * fits, 13, 1e9) > 300.0
    assert matmul_module._size_within(1e-9, 13, 1e9) == 1  # never a size of 0


def test_a_refusal_names_the_iterations_that_make_the_run_long(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before: "bench_matmul(size=16): ..." (the CLI's "--size 16: ..."), naming the size,
    # where a billion products of 16x16 are what take 2.3 h.
    _slow_host(monkeypatch, 1e9)
    with pytest.raises(RunTimeLimitExceeded) as caught:
        bench_matmul("fp32", size=16, iterations=10**9, device="cpu")
    assert str(caught.value).startswith(
        "bench_matmul(size=16, iterations=1000000000): 1000000003 fp32 products "
    )


def test_a_refusal_names_a_warm_up_that_makes_the_run_long(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Fewer warm-up products are suggested, and the warm-up named, where it alone is what
    # would not fit.
    _slow_host(monkeypatch, 1e9)
    with pytest.raises(RunTimeLimitExceeded) as caught:
        bench_matmul("fp32", size=16, iterations=10, warmup=10**12, device="cpu")
    message = str(caught.value)
    assert message.startswith("bench_matmul(warmup=1000000000000): 1000000000010 fp32 ")
    suggested = re.search(r"fewer warm-up products \(e\.g\. warmup=(\d+)\)", message)
    assert suggested is not None
    assert matmul_module._too_long(16, int(suggested[1]), 10, 1e9 / 1.01, 300.0)[1] is None


def test_a_smaller_size_is_suggested_only_where_one_fits() -> None:
    # Before: "use a smaller size (e.g. size=1), ...", though a trillion products of 1x1
    # would take 33 min at 1 GFLOP/s, past the limit as well.
    _, fix = matmul_module._too_long(16, 3, 10**12, 1e9, 300.0)
    assert fix is not None and "smaller size" not in fix
    assert fix.startswith("use fewer iterations (e.g. iterations=")
