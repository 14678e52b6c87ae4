"""trainperf.ddp._capacity: an nprocs the host's CPUs or memory cannot hold is refused with the
reason and the fix, before the launcher is OOM-killed (#20.4: nprocs=10000 started ~126 ranks
and the launcher died with exit 137 and no message)."""

from __future__ import annotations

import time
from typing import Any

import pytest

import trainperf.ddp as ddp
from tests.ddp import _workers as workers
from tests.ddp._distributed import fast_start_method
from trainperf.ddp import _capacity, _group, _launch_spawn

GIB = 2**30
MIB = 2**20


def test_the_cpu_rule_allows_four_ranks_per_usable_cpu() -> None:
    assert _capacity.cpu_refusal(8, 2) is None
    assert _capacity.cpu_refusal(1, 1) is None
    text = _capacity.cpu_refusal(9, 2)
    assert text is not None
    assert text.startswith("nprocs=9 is more than 4 ranks per usable CPU: this host gives")
    assert "2 CPUs" in text and "at most 8 gloo ranks" in text
    assert "Use nprocs<=8, or set TRAINPERF_OVERSUBSCRIBE=1" in text
    assert "1 CPU " in (_capacity.cpu_refusal(5, 1) or "")


def test_rank_0_is_measured_first_only_when_the_ranks_could_crowd_memory() -> None:
    assert not _capacity.needs_measuring(4, 500 * MIB, 20 * GIB)
    assert _capacity.needs_measuring(41, 500 * MIB, 20 * GIB)  # 20.5 GB > half of 20 GiB
    assert _capacity.needs_measuring(2, 500 * MIB, 1 * GIB)


def test_the_memory_rule_projects_nprocs_ranks_of_rank_0s_size() -> None:
    assert _capacity.memory_refusal(60, 300 * MIB, 20 * GIB) is None  # 17.6 GiB <= 18 GiB
    text = _capacity.memory_refusal(62, 300 * MIB, 20 * GIB)
    assert text is not None
    assert text.startswith("nprocs=62 ranks would need about 18.2 GiB at start-up (300 MiB per")
    assert "but 20.0 GiB is available" in text and "Use nprocs<=61, or free memory" in text
    # A forked rank shares its parent's pages at first: never projected below the floor.
    floor = _capacity.memory_refusal(100, 1 * MIB, 1 * GIB)
    assert floor is not None and "(64 MiB per rank" in floor and "nprocs<=14" in floor
    # Even one rank that does not fit is named as such (nprocs<=1 is the least advice).
    assert "nprocs<=1," in (_capacity.memory_refusal(2, 2 * GIB, 1 * GIB) or "")


@pytest.mark.parametrize(
    ("value", "allowed"),
    [("1", True), ("true", True), ("YES", True), ("0", False), ("no", False), ("", False)],
)
def test_the_override_takes_yes_and_no_words(value: str, allowed: bool) -> None:
    assert _capacity.oversubscription_allowed({"TRAINPERF_OVERSUBSCRIBE": value}) is allowed


def test_an_override_that_is_neither_yes_nor_no_is_refused() -> None:
    with pytest.raises(ValueError, match=r"TRAINPERF_OVERSUBSCRIBE must be 1 or 0 .*got 'maybe'"):
        _capacity.oversubscription_allowed({"TRAINPERF_OVERSUBSCRIBE": "maybe"})


def _counting_starts(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    started: list[int] = []
    original = _group.Group._start_one

    def counting(self: _group.Group, rank: int) -> None:
        started.append(rank)
        original(self, rank)

    monkeypatch.setattr(_group.Group, "_start_one", counting)
    return started


def test_ten_thousand_ranks_are_refused_before_any_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    started = _counting_starts(monkeypatch)
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"^nprocs=10000 is more than 4 ranks per usable CPU"):
        ddp.launch(workers.add, 1, 2, nprocs=10000, backend="gloo", start_method="fork")
    assert started == []
    assert time.monotonic() - t0 < 30


@pytest.mark.timeout(90)
def test_with_the_override_the_memory_projection_stops_them_after_rank_0(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TRAINPERF_OVERSUBSCRIBE", "1")
    # A host with 1 GiB free: 10000 ranks of at least 64 MiB cannot fit, whatever rank 0 uses.
    monkeypatch.setattr(_capacity, "available_memory", lambda: 1 * GIB)
    started = _counting_starts(monkeypatch)
    with pytest.raises(ValueError, match=r"^nprocs=10000 ranks would need about .* at start-up"):
        ddp.launch(workers.add, 1, 2, nprocs=10000, backend="gloo", start_method="fork")
    assert started == [0]  # rank 0 was measured, then stopped (the conftest checks it is gone)


@pytest.mark.timeout(90)
def test_a_measured_launch_that_fits_runs_normally(monkeypatch: pytest.MonkeyPatch) -> None:
    # The launcher looks huge, so rank 0 is measured first; the real rank fits easily.
    monkeypatch.setattr(_launch_spawn, "_own_memory", lambda: 1 << 50)
    started = _counting_starts(monkeypatch)
    kw: dict[str, Any] = {"nprocs": 2, "backend": "gloo", "start_method": fast_start_method()}
    assert ddp.launch_all(workers.add, 2, 3, **kw) == [5, 10]
    assert started == [0, 1]
