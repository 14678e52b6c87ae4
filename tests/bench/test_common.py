"""trainperf.bench._common: the Skipped record and the JSON form every result shares."""

from __future__ import annotations

import dataclasses
import importlib
import json
from dataclasses import dataclass

import pytest
import torch

from trainperf.bench import Skipped
from trainperf.bench._common import (
    check_host_memory,
    check_tensor_bytes,
    format_duration,
    resolve_device,
    result_dict,
)

common_module = importlib.import_module("trainperf.bench._common")


def test_skipped_to_dict_is_json_safe_and_its_str_says_why() -> None:
    s = Skipped("matmul", "tf32", "bench_matmul(dtype='tf32') needs a CUDA GPU")
    data = s.to_dict()
    assert json.loads(json.dumps(data)) == data
    assert data == {"benchmark": "matmul", "setting": "tf32", "reason": s.reason}
    assert str(s) == "bench matmul tf32 skipped: bench_matmul(dtype='tf32') needs a CUDA GPU"


@dataclass(frozen=True)
class _Nested:
    pair: tuple[str, float] | None
    items: tuple[Skipped, ...]
    table: dict[str, tuple[int, ...]]


def test_result_dict_turns_tuples_into_lists_at_every_depth() -> None:
    data = result_dict(_Nested(("A100", 1.5), (Skipped("h2d", "x", "y"),), {"k": (1, 2)}))
    assert data == {
        "pair": ["A100", 1.5],
        "items": [{"benchmark": "h2d", "setting": "x", "reason": "y"}],
        "table": {"k": [1, 2]},
    }
    assert json.loads(json.dumps(data)) == data


def test_check_tensor_bytes_allows_up_to_int64_bytes_and_names_the_fix() -> None:
    check_tensor_bytes("f(n=1)", "a tensor", 2**63 - 1, torch.uint8, "use a smaller n")
    check_tensor_bytes("f(n=1)", "a tensor", 2**62 - 1, torch.float16, "use a smaller n")
    expected = (
        r"f\(n=2\): a 2\*\*62 x 2 bf16 tensor is 1.8e\+19 bytes, more than a tensor can "
        r"address \(2\*\*63 - 1\): use a smaller n"
    )
    with pytest.raises(ValueError, match=expected):
        check_tensor_bytes(
            "f(n=2)", "a 2**62 x 2 bf16 tensor", 2**63, torch.bfloat16, "use a smaller n"
        )
    with pytest.raises(ValueError, match="more than a tensor can address"):
        check_tensor_bytes("f(n=3)", "a tensor", 2**63, torch.uint8, "use a smaller n")


def _limited(monkeypatch: pytest.MonkeyPatch, available: int) -> None:
    limits = common_module.host_limits()
    monkeypatch.setattr(
        common_module,
        "host_limits",
        lambda: dataclasses.replace(limits, memory_available=available),
    )


def test_check_host_memory_refuses_more_than_is_available(monkeypatch: pytest.MonkeyPatch) -> None:
    _limited(monkeypatch, 3 * 2**20)
    check_host_memory("f(n=3)", "three tensors", 3 * 2**20, "use a smaller n")
    with pytest.raises(
        MemoryError,
        match=r"^f\(n=4\): three tensors need 4 MiB of host memory, and 3 MiB is available "
        r"\(it would swap, or the kernel would kill the process\): use a smaller n$",
    ):
        check_host_memory("f(n=4)", "three tensors", 4 * 2**20, "use a smaller n")


@pytest.mark.parametrize("device", [f"cuda:{2**70}", "cuda:256"])
def test_resolve_device_refuses_an_index_past_what_torch_holds(
    monkeypatch: pytest.MonkeyPatch, device: str
) -> None:
    # Before: "cuda:256" became cuda:0 (torch wraps the index), "cuda:<2**70>" an "invalid
    # device" error listing 'cuda:<i>', the form it had.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    with pytest.raises(ValueError, match=r"a device index must be <= 127 .*device_count\(\) - 1$"):
        resolve_device(device)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0.05, "0.05 s"), (0.4, "0.4 s"), (2.5, "2.5 s"), (45, "45 s"), (600, "10 min"),
     (14294, "4.0 h"), (3 * 86400, "3.0 days")],
)  # fmt: skip
def test_durations_read_in_their_unit(seconds: float, text: str) -> None:
    # Shared by the three benchmarks' run-time refusals.
    assert format_duration(seconds) == text


# ------------------------------------------------------------------ the run-time limit


def test_suggested_iterations_leave_a_fifth_of_the_limit_to_spare() -> None:
    # Not 28 iterations of 10 s beside 20 s of warm-up (exactly 300 s), which a rerun 1%
    # slower would take past the limit: 22 fit in 0.8 x 300 = 240 s.
    assert common_module.iterations_within(300.0, 20.0, 10.0) == 22
    assert common_module.seconds_to_fit(300.0) == 240.0
    fewer = ["fewer iterations (e.g. iterations=22)"]
    assert common_module.fewer_iterations(300.0, 20.0, 10.0) == fewer
    assert common_module.fewer_iterations(300.0, 20.0, 230.0) == []  # not even one fits


@pytest.mark.parametrize(
    ("estimate", "suggested"),
    [(1020.0, 1300), (400.2, 490), (900.0, 1100), (14293.65, 18000), (110000.11, 140000),
     (2.5, 3)],
)  # fmt: skip
def test_a_suggested_max_seconds_is_a_round_number_past_the_estimate_with_room(
    estimate: float, suggested: int
) -> None:
    # Not max_seconds=ceil(estimate) (1020 for 1020 s), which a rerun 1% slower would pass.
    assert common_module.suggested_max_seconds(estimate) == suggested
    assert suggested >= 1.2 * estimate
    fix = common_module.run_time_fix(estimate, [])
    assert fix == f"use a larger max_seconds (e.g. max_seconds={suggested})"


def test_fixes_after_the_limit_are_named_after_it() -> None:
    fix = common_module.run_time_fix(
        1020.0, ["fewer iterations (e.g. iterations=22)"], after=["a smaller image_size"]
    )
    assert fix == (
        "use fewer iterations (e.g. iterations=22), a larger max_seconds (e.g. "
        "max_seconds=1300) or a smaller image_size"
    )


@pytest.mark.parametrize(
    ("estimate", "max_seconds", "passed"),
    [(300.1, 300.0, 300.0), (300.0, 300.0, None), (1e9, None, None)],
)
def test_the_limit_is_passed_only_past_it(
    estimate: float, max_seconds: float | None, passed: float | None
) -> None:
    assert common_module.limit_passed(estimate, max_seconds) == passed


def test_a_run_time_refusal_is_a_value_error() -> None:
    assert issubclass(common_module.RunTimeLimitExceeded, ValueError)


@pytest.mark.parametrize(
    ("n", "power"), [(0, 0), (1, 1), (2, 2), (3, 2), (1000, 512), (1024, 1024)]
)
def test_the_suggested_sizes_are_powers_of_two(n: int, power: int) -> None:
    assert common_module.power_of_two_at_most(n) == power
