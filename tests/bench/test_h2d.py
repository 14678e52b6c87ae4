"""trainperf.bench._h2d: bench_h2d's checks on the CPU, and a run on a GPU."""

from __future__ import annotations

import dataclasses
import importlib
import json
import re

import pytest
import torch

from tests.bench._fakes import FakeCopies
from trainperf.bench import H2DResult, bench_h2d
from trainperf.bench._common import RunTimeLimitExceeded
from trainperf.errors import DeviceError

h2d_module = importlib.import_module("trainperf.bench._h2d")
common_module = importlib.import_module("trainperf.bench._common")


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
    with pytest.raises(ValueError, match=r"size_bytes=9223372036854775808\): .* address") as e:
        bench_h2d(size_bytes=2**63)
    # The fix names the parameter with a value to pass, as bench_matmul's does.
    assert str(e.value).endswith(
        ": use a smaller size_bytes (e.g. size_bytes=536870912, the default: 512 MiB)"
    )


def test_bench_h2d_on_a_cpu_only_host_does_not_advise_the_cpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DeviceError, match="needs CUDA") as caught:
        bench_h2d(size_bytes=1024, device="cuda")
    assert "device='cpu'" not in str(caught.value) and "no CPU fallback" in str(caught.value)


def test_copies_past_the_free_host_memory_are_refused_before_filling_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before: the pageable and the pinned buffer were filled until the kernel's OOM killer
    # ended the process with no message. Two 2 MiB buffers are 4 MiB of host memory.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cuda0 = torch.device("cuda", 0)
    monkeypatch.setattr(h2d_module, "resolve_device", lambda device, allowed: cuda0)
    limits = dataclasses.replace(common_module.host_limits(), memory_available=3 * 2**20)
    monkeypatch.setattr(common_module, "host_limits", lambda: limits)
    expected = (
        r"^bench_h2d\(size_bytes=2097152\): a pageable and a pinned copy need 4 MiB of host "
        r"memory, and 3 MiB is available"
    )
    with pytest.raises(MemoryError, match=expected):
        bench_h2d(size_bytes=2 * 2**20, iterations=1)


@pytest.mark.requires_cuda
def test_bench_h2d_on_cuda() -> None:
    r = bench_h2d(size_bytes=32 * 2**20, iterations=2)
    assert isinstance(r, H2DResult)
    assert r.pageable_gb_per_s > 0 and r.pinned_gb_per_s > 0
    assert r.pinned_speedup == pytest.approx(r.pinned_gb_per_s / r.pageable_gb_per_s)
    with pytest.raises(DeviceError, match="does not exist"):
        bench_h2d(size_bytes=1024, device=f"cuda:{torch.cuda.device_count()}")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_bench_h2d_auto_device_needs_cuda_like_none() -> None:
    with pytest.raises(DeviceError, match="bench_h2d needs CUDA"):
        bench_h2d(size_bytes=1024, device="auto")


def test_h2d_result_to_dict_is_json_safe_and_its_str_is_the_report() -> None:
    r = H2DResult("cuda:0", "NVIDIA H200", 512 * 2**20, 5, 7.2, 54.5, 54.5 / 7.2)
    data = r.to_dict()
    assert json.loads(json.dumps(data)) == data
    assert data == {
        "device": "cuda:0", "gpu_name": "NVIDIA H200", "size_bytes": 512 * 2**20,
        "iterations": 5, "pageable_gb_per_s": 7.2, "pinned_gb_per_s": 54.5,
        "pinned_speedup": 54.5 / 7.2,
    }  # fmt: skip
    assert str(r) == f"host -> NVIDIA H200, 512 MiB per copy:\n{r.summary()}"
    odd = H2DResult("cuda:1", None, 1000, 1, 1.0, 2.0, 2.0)
    assert str(odd).splitlines()[0] == "host -> cuda:1, 1000 bytes per copy:"


@pytest.mark.requires_cuda
def test_bench_h2d_takes_numpy_counts_and_its_result_is_json_safe() -> None:
    # Before: the result held the np.int64 size_bytes and iterations (json.dumps refuses).
    np = pytest.importorskip("numpy")
    r = bench_h2d(size_bytes=np.int64(2**20), iterations=np.int64(1))
    data = r.to_dict()
    assert json.loads(json.dumps(data)) == data
    assert type(r.size_bytes) is int and type(r.iterations) is int


# ------------------------------------------------------------------ the run-time limit


def test_copies_estimated_past_max_seconds_are_refused_after_the_first_timed_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before: `trainperf bench h2d --iterations 1000000` ran for hours, with no estimate.
    # Here a pageable copy takes 0.1 s and a pinned one 0.01 s: 31 h.
    fake = FakeCopies(monkeypatch, h2d_module, pageable=0.1, pinned=0.01)
    with pytest.raises(ValueError) as caught:
        bench_h2d(size_bytes=2 * 2**20, iterations=10**6)
    assert str(caught.value) == (
        "bench_h2d(iterations=1000000): 2000002 copies of 2 MiB (1 warm-up and 1000000 timed, "
        "pageable and pinned) would take about 30.6 h on cuda:0 (0.021 GB/s pageable, 0.21 "
        "GB/s pinned, from the first timed copy of each), more than max_seconds=300: use "
        "fewer iterations (e.g. iterations=2180) or a larger max_seconds (e.g. "
        "max_seconds=140000)"
    )
    assert isinstance(caught.value, RunTimeLimitExceeded)
    # A warm-up and a timed copy of each, no more.
    assert fake.copies == ["pageable", "pageable", "pinned", "pinned"]


def test_copies_each_past_max_seconds_are_told_to_be_smaller(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The fix names the option and a value: 64 MiB copies of 300 s a round, three rounds:
    # 900 s; 16 MiB copies take 225 s, within 0.8 x 300.
    FakeCopies(monkeypatch, h2d_module, pageable=200.0, pinned=100.0)
    with pytest.raises(ValueError, match=r"more than max_seconds=300: use a smaller size_bytes "
                       r"\(e.g. size_bytes=16777216\) or a larger max_seconds \(e.g. "
                       r"max_seconds=1100\)$"):  # fmt: skip
        bench_h2d(size_bytes=64 * 2**20, iterations=2)


def test_a_single_timed_copy_of_each_is_never_refused_after_it_ran(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # With iterations=1 the estimate would come after the only timed copies, with nothing
    # left to spare: a run past the limit (4 copies, 320 s) is not refused.
    fake = FakeCopies(monkeypatch, h2d_module, pageable=100.0, pinned=60.0)
    r = bench_h2d(size_bytes=2 * 2**20, iterations=1)
    assert fake.copies == ["pageable", "pageable", "pinned", "pinned"]
    assert r.pageable_gb_per_s == pytest.approx(2 * 2**20 / 100.0 / 1e9)


def test_each_suggestion_runs_when_the_rerun_is_a_little_slower(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The suggestions leave room (not 272 rounds of 1.1 s beside the warm-up's, exactly
    # 300 s, nor the estimate as max_seconds): a rerun 1% slower still fits.
    FakeCopies(monkeypatch, h2d_module, pageable=1.0, pinned=0.1)
    with pytest.raises(ValueError) as caught:
        bench_h2d(size_bytes=2 * 2**20, iterations=10**4)
    suggested = dict(re.findall(r"e\.g\. (\w+)=(\d+)", str(caught.value)))
    assert set(suggested) == {"iterations", "max_seconds"}
    for name, value in suggested.items():
        FakeCopies(monkeypatch, h2d_module, pageable=1.01, pinned=0.101)
        kwargs = {"iterations": 10**4, name: int(value)}
        assert bench_h2d(size_bytes=2 * 2**20, **kwargs).pinned_gb_per_s > 0  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("size_mib", "suggested"),
    # 1 MiB (not 256 KiB) for 2 MiB copies of 400 s a round; none smaller than 1 MiB copies.
    [(2, "a smaller size_bytes (e.g. size_bytes=1048576) or "), (1, "")],
)
def test_a_smaller_size_suggested_is_whole_mib(
    monkeypatch: pytest.MonkeyPatch, size_mib: int, suggested: str
) -> None:
    FakeCopies(monkeypatch, h2d_module, pageable=300.0, pinned=100.0)
    with pytest.raises(RunTimeLimitExceeded) as caught:
        bench_h2d(size_bytes=size_mib * 2**20, iterations=2)
    assert str(caught.value).endswith(
        f"more than max_seconds=300: use {suggested}a larger max_seconds (e.g. max_seconds=1500)"
    )


@pytest.mark.parametrize(
    ("iterations", "pageable", "pinned", "max_seconds"),
    [
        (5, 0.08, 0.01, 300.0),  # the defaults: 512 MiB at 7 and 54 GB/s, about 1 s
        # Two timed copies: a rate that took in the (10x slower) warm-up would be off.
        (2, 0.08, 0.01, 300.0),
        (1, 0.08, 0.01, 300.0),
        (2000, 0.1, 0.01, 300.0),  # 220 s: within
        (5000, 0.1, 0.01, None),  # 550 s, no limit
    ],
)
def test_copies_within_max_seconds_run_whole(
    monkeypatch: pytest.MonkeyPatch,
    iterations: int,
    pageable: float,
    pinned: float,
    max_seconds: float | None,
) -> None:
    fake = FakeCopies(monkeypatch, h2d_module, pageable=pageable, pinned=pinned)
    r = bench_h2d(size_bytes=2 * 2**20, iterations=iterations, max_seconds=max_seconds)
    assert fake.copies.count("pageable") == fake.copies.count("pinned") == 1 + iterations
    assert r.pageable_gb_per_s == pytest.approx(2 * 2**20 / pageable / 1e9)
    assert r.pinned_gb_per_s == pytest.approx(2 * 2**20 / pinned / 1e9)


@pytest.mark.parametrize("max_seconds", [0, -1, float("nan"), "300"])
def test_bench_h2ds_max_seconds_must_be_a_positive_number_or_none(max_seconds: object) -> None:
    with pytest.raises(ValueError, match=r"max_seconds must be a positive number of seconds"):
        bench_h2d(size_bytes=1024, max_seconds=max_seconds)  # type: ignore[arg-type]
