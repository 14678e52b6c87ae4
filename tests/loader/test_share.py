"""trainperf.loader._share: under DDP the loader is tuned once per host, on local rank 0.

Two gloo ranks (``tests/ddp/_distributed.py``'s ``spawn``, with a short process-group
timeout so that a regression fails instead of hanging): only local rank 0 measures, both get
the same settings, and the report says where they came from; a rank that calls alone is
not kept waiting for ever. Then the hand-over itself on an in-process store.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch.distributed as dist

from tests.ddp._distributed import FORK, spawn
from tests.loader._ddp_workers import tune_and_count
from tests.loader._fakes import Waits, quick
from trainperf.limits import usable_cpus
from trainperf.loader import _share, tune_loader


def ranks(**kwargs: Any) -> dict[int, Any]:
    return spawn(tune_and_count, 2, kwargs=kwargs, start_method=FORK, timeout_s=30.0)


@pytest.mark.slow
@pytest.mark.parametrize("cache", [False, True])
def test_only_local_rank_0_measures_and_both_ranks_get_its_choice(cache: bool) -> None:
    out = ranks(cache=cache)
    assert out[0]["measured"] == [0] and out[1]["measured"] == []
    assert out[0]["best_kwargs"] == out[1]["best_kwargs"]
    assert out[0]["shared_from"] is None and out[1]["shared_from"] == 0
    assert out[0]["cpus"] == out[1]["cpus"] == usable_cpus(2)  # the host's CPUs, halved
    assert "shared with the other 1 local rank" in out[0]["text"]
    assert "tuned on local rank 0 (rank 0) and shared" in out[1]["text"]
    # Local rank 0 reads the cache itself on a second call, and shares that too.
    if cache:
        again = ranks(cache=True)
        assert again[0]["from_cache"] and again[0]["measured"] == []
        assert again[1]["measured"] == [] and again[1]["shared_from"] == 0


@pytest.mark.slow
def test_local_rank_0_calling_alone_does_not_wait_for_the_others() -> None:
    out = ranks(cache=False, callers=(0,))
    assert out[0]["measured"] == [0] and out[0]["seconds"] < 3.0 + 2.0
    assert out[1] == {"called": False}


@pytest.mark.slow  # about 4 s: rank 1 waits out the budget (3 s) and tunes
def test_a_rank_whose_local_rank_0_never_calls_tunes_on_its_own_after_a_bounded_wait() -> None:
    # Not grace_s: ddp.launch takes a keyword of that name for itself.
    out = ranks(cache=False, callers=(1,), share_grace_s=0.5)
    assert out[0] == {"called": False}
    assert out[1]["measured"] == [0] and out[1]["shared_from"] is None
    assert "local rank 0 sent no settings within 3.5 s" in out[1]["text"]


def test_launcher_variables_without_a_process_group_tune_here_and_say_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    report = tune_loader(Waits(), 4, **quick(max_workers=0))
    assert report.shared_from is None and report.cpus == usable_cpus(2)
    assert any("no process group" in n and "tuned on its own" in n for n in report.notes)


# --------------------------------------------------------------------------- the hand-over


def test_a_sent_entry_is_received() -> None:
    store = dist.HashStore()
    _share.send_entry(store, "k", 3, {"best": {"num_workers": 2}})
    assert _share.receive_entry(store, "k", 1.0) == (3, {"best": {"num_workers": 2}})


def test_nothing_sent_in_time_is_none() -> None:
    assert _share.receive_entry(dist.HashStore(), "missing", 0.05) is None


def test_a_failure_on_local_rank_0_is_raised_on_the_others() -> None:
    store = dist.HashStore()
    _share.send_failure(store, "k", 0, RuntimeError("the dataset fails in the main process"))
    with pytest.raises(
        RuntimeError,
        match=r"local rank 0 \(rank 0\) failed to tune the loader, so it has no settings to "
        r"share: RuntimeError: the dataset fails in the main process",
    ):
        _share.receive_entry(store, "k", 1.0)


def test_calls_with_the_same_arguments_get_their_own_keys() -> None:
    first, second = _share.call_key("host", "abc"), _share.call_key("host", "abc")
    assert first != second and first.startswith("trainperf/tune_loader/host/abc/")


def test_entries_are_json_and_a_malformed_one_is_none() -> None:
    store = dist.HashStore()
    _share.send_entry(store, "k", 0, {"a": [1, None]})
    assert json.loads(store.get("k")) == {"entry": {"a": [1, None]}, "rank": 0}
    store.set("bad", "{not json")
    assert _share.receive_entry(store, "bad", 1.0) is None


# SLURM_STEPID: the older name of SLURM_STEP_ID, read too (launch_env.in_srun_step).
_LAUNCH_VARS = (
    "LOCAL_RANK",
    "SLURM_LOCALID",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_STEP_ID",
    "SLURM_STEPID",
)


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"LOCAL_RANK": "1", "SLURM_LOCALID": "0"}, 1),  # torchrun's, whatever SLURM says
        ({"SLURM_LOCALID": "1", "SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_STEP_ID": "0"}, 1),
        ({"SLURM_LOCALID": "1", "SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_STEPID": "0"}, 1),
        # A batch script's SLURM_LOCALID=0, inherited by every rank a launcher other than
        # srun starts: not this rank's place on the host, so the global rank (all here).
        ({"SLURM_LOCALID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "4"}, 3),
        ({}, 3),
    ],
)
def test_the_local_rank_is_read_as_the_ddp_helpers_read_it(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], expected: int
) -> None:
    # Before: SLURM_LOCALID was read outside an srun step too, so under a batch script
    # every rank took itself for local rank 0 (trainperf.ddp's local_rank() does not).
    for name in _LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(dist, "get_rank", lambda: 3)
    monkeypatch.setattr(dist, "get_world_size", lambda: 4)
    assert _share._local_rank(4) == expected


def test_a_malformed_local_rank_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "one")
    with pytest.raises(ValueError, match=r"LOCAL_RANK.*'one'"):
        _share._local_rank(4)
