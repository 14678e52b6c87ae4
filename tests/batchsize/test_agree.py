"""Under DDP the ranks tune in lockstep: the same sizes, the same choice, no hang."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.batchsize._workers import cache_on_rank_0_only, oom_on_rank_1, tune_ddp
from tests.ddp._distributed import FORK, fast_start_method, spawn
from trainperf.batchsize._agree import Agreement, world_size
from trainperf.ddp import launch_all


def test_without_a_process_group_there_is_one_rank_and_nothing_to_exchange() -> None:
    agree = Agreement()
    assert world_size() == 1 and not agree.active
    assert agree.combine(maxima=[3.0], minima=[-1.0]) == ([3.0], [-1.0])
    assert agree.any(True) and not agree.any(False)


@pytest.mark.slow  # two ranks started and tuned: several seconds
def test_two_ranks_keep_the_global_batch_and_choose_the_same_size() -> None:
    results = spawn(tune_ddp, world_size=2, args=(64,), start_method=FORK, timeout_s=120)
    r0, r1 = results[0], results[1]
    assert "error" not in r0, r0
    assert r0["world_size"] == r1["world_size"] == 2
    assert r0["batch_size"] == r1["batch_size"] and r0["sizes"] == r1["sizes"]
    assert r0["batch_size"] * r0["accumulation_steps"] * 2 == 64
    assert all(32 % n == 0 and n <= 16 for n in r0["sizes"])  # divisors of 64 / 2
    assert r0["restored"] and r1["restored"]
    assert any("lockstep on 2 ranks" in n for n in r0["notes"])


@pytest.mark.slow
def test_a_global_batch_two_ranks_cannot_share_is_refused_naming_both() -> None:
    results = spawn(tune_ddp, world_size=2, args=(63,), start_method=FORK, timeout_s=120)
    for r in results.values():
        assert r["error"].startswith("global_batch=63 is not divisible by world_size=2")


def _oom_on_rank_1(where: str) -> list[dict[str, object]]:
    # A rank left in another all-reduce (of another size) errors or waits: the hang
    # detector ends that in seconds instead of the collective's timeout.
    return launch_all(  # type: ignore[no-any-return]
        oom_on_rank_1, where, nprocs=2, backend="gloo", start_method=fast_start_method(),
        timeout=60.0, hang_timeout=10.0,
    )  # fmt: skip


@pytest.mark.slow  # two ranks started and tuned: several seconds
def test_an_oom_on_one_rank_in_the_alternation_ends_it_on_both_alike() -> None:
    r0, r1 = _oom_on_rank_1("alternation")
    assert r0["batch_size"] == r1["batch_size"] and r0["statuses"] == r1["statuses"]
    oom = [n for n, status in r0["statuses"].items() if status == "oom"]  # type: ignore[attr-defined]
    assert len(oom) == 1 and r0["batch_size"] != oom[0]  # the first size alternated
    assert r1["reasons"][oom[0]].startswith("CUDA out of memory (simulated on rank 1")  # type: ignore[index]
    assert r0["reasons"][oom[0]] == "out of memory on another rank"  # type: ignore[index]
    assert any(f"{oom[0]} ran out of memory while measured in alternation" in n
               for n in r0["notes"])  # type: ignore[attr-defined]  # fmt: skip


@pytest.mark.slow
def test_an_oom_on_one_rank_in_a_probe_stops_both_alike() -> None:
    r0, r1 = _oom_on_rank_1("probe")
    assert r0["batch_size"] == r1["batch_size"] and r0["statuses"] == r1["statuses"]
    # The growth reaches 32 or jumps over it to 64 (by 4 where samples/s grew almost in
    # proportion), and the refinement then tries midpoints: which sizes fail depends on the
    # path the host's timing takes, but each of them is 32 or above and failed on rank 1.
    oom = sorted(n for n, status in r0["statuses"].items() if status == "oom")  # type: ignore[attr-defined]
    assert oom and oom[0] >= 32 and r0["batch_size"] < 32, r0  # type: ignore[operator]
    assert all(r0["reasons"][n] == "out of memory on another rank" for n in oom)  # type: ignore[index]
    assert all(r1["reasons"][n].startswith("CUDA out of memory (simulated") for n in oom)  # type: ignore[index]


@pytest.mark.slow  # two ranks started and tuned twice
def test_a_cached_choice_on_one_rank_only_is_tuned_again_on_both_without_a_hang(
    tmp_path: Path,
) -> None:
    # Before: the rank holding an entry checked its memory limit in an all-reduce the
    # other rank never joined (it went straight to the search's own collectives).
    results = launch_all(
        cache_on_rank_0_only, str(tmp_path), nprocs=2, backend="gloo",
        start_method=fast_start_method(), timeout=90.0, hang_timeout=15.0,
    )  # fmt: skip
    r0, r1 = results
    assert r0["stored"] and r1["stored"]
    assert r0["from_cache"] == r1["from_cache"] == (False, False)
    assert r0["batch_size"] == r1["batch_size"]
