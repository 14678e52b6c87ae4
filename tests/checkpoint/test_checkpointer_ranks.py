"""trainperf.checkpoint._checkpointer_ranks: a rank's own file (``step-….rank-0000R.pt``:
its generators and loader positions) read back on restore, in one process posing as each
rank in turn; and the ranks' agreement on restore, on two gloo ranks."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

import trainperf.checkpoint._checkpointer as checkpointer_module
import trainperf.checkpoint._checkpointer_ranks as ranks_module
import trainperf.checkpoint._checkpointer_restore as restore_module
from tests.checkpoint import _ranks
from tests.checkpoint._common import as_if_from_newer_torch
from tests.checkpoint._fake_nccl import FakeNccl, map_locations
from tests.ddp._distributed import FORK, spawn
from trainperf import Checkpointer
from trainperf.checkpoint._loader_state import track
from trainperf.errors import CheckpointError


def _as_rank(monkeypatch: pytest.MonkeyPatch, rank: int) -> None:
    for module in (checkpointer_module, restore_module):  # save, restore
        monkeypatch.setattr(module, "_group", lambda: (rank, 3))


def _saved(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Checkpointer:
    """Steps 1 and 2 of a 3-rank run: each rank's generator seeded with 10 * step + rank."""
    ckpt = Checkpointer(tmp_path, keep=5)
    for step in (1, 2):
        for rank in (0, 1, 2):
            _as_rank(monkeypatch, rank)
            torch.manual_seed(10 * step + rank)
            ckpt.save({"w": torch.full((2,), float(step))}, step=step)
    return ckpt


def _draws_after_seed(seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.rand(4)


def test_each_rank_gets_its_own_step_files_random_state_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = _saved(tmp_path, monkeypatch)
    _as_rank(monkeypatch, 1)
    assert ckpt.restore({"w": torch.zeros(2)}) == 2
    assert torch.equal(torch.rand(4), _draws_after_seed(21))


def test_restore_refuses_a_rank_file_copied_from_another_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Step 1's rank file under step 2's name gave rank 1 step 1's random states and loader
    # positions beside step 2's model, silently.
    ckpt = _saved(tmp_path, monkeypatch)
    copy = tmp_path / "step-000000002.rank-00001.pt"
    shutil.copyfile(tmp_path / "step-000000001.rank-00001.pt", copy)
    _as_rank(monkeypatch, 1)
    w = torch.zeros(2)
    with pytest.raises(
        CheckpointError,
        match=r"restore stops at step 2: .*step-000000002\.rank-00001\.pt holds rank 1's part "
        r"of step 1, but its name says rank 1's part of step 2 \(copied or renamed .*: "
        r"resuming from it would give rank 1 the random states and loader positions of rank "
        r"1's part of step 1; step-000000001\.rank-00001\.pt is there too, so this is a copy",
    ) as info:
        ckpt.restore({"w": w})
    assert info.value.path == copy and torch.equal(w, torch.zeros(2))  # nothing loaded


def test_restore_refuses_another_ranks_file_and_names_its_right_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = _saved(tmp_path, monkeypatch)
    mine = tmp_path / "step-000000002.rank-00001.pt"
    mine.unlink()
    (tmp_path / "step-000000002.rank-00002.pt").rename(mine)
    _as_rank(monkeypatch, 1)
    with pytest.raises(
        CheckpointError,
        match=r"holds rank 2's part of step 2, but its name says rank 1's part of step 2 .*"
        r"rename it to step-000000002\.rank-00002\.pt if it is",
    ):
        ckpt.restore({"w": torch.zeros(2)})


def test_a_misnamed_rank_file_is_refused_before_it_is_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The rank file was loaded whole (all its tensors) before its name was checked, where the
    # main file's pickle alone is read first.
    ckpt = _saved(tmp_path, monkeypatch)
    shutil.copyfile(
        tmp_path / "step-000000001.rank-00001.pt", tmp_path / "step-000000002.rank-00001.pt"
    )
    real = ranks_module.load_checkpoint

    def main_file_only(path: Path, *args: Any, **kwargs: Any) -> Any:
        assert ".rank-" not in path.name, f"loaded {path.name} before checking its name"
        return real(path, *args, **kwargs)

    monkeypatch.setattr(ranks_module, "load_checkpoint", main_file_only)
    monkeypatch.setattr(restore_module, "load_checkpoint", main_file_only)
    _as_rank(monkeypatch, 1)
    with pytest.raises(CheckpointError, match=r"rank-00001\.pt holds rank 1's part of step 1"):
        ckpt.restore({"w": torch.zeros(2)})


def test_a_rank_file_from_a_newer_torch_stops_restore(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # It fell back to rank 0's random states with a warning, where the main file from a
    # newer torch stops restore: the run resumed with rank 1's random numbers changed.
    ckpt = _saved(tmp_path, monkeypatch)
    as_if_from_newer_torch(tmp_path / "step-000000002.rank-00001.pt")
    _as_rank(monkeypatch, 1)
    w = torch.zeros(2)
    with pytest.raises(
        CheckpointError,
        match=r"restore stops at step 2 rather than fall back .*rank-00001\.pt was saved by "
        r"a newer PyTorch",
    ) as info:
        ckpt.restore({"w": w})
    assert info.value.path == tmp_path / "step-000000002.rank-00001.pt"
    assert torch.equal(w, torch.zeros(2))  # nothing loaded


def test_a_foreign_rank_file_is_not_used_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A file of another kind under the rank file's name was dropped without a word (rank 0's
    # random states used instead).
    ckpt = _saved(tmp_path, monkeypatch)
    torch.save([1, 2], tmp_path / "step-000000002.rank-00001.pt")
    _as_rank(monkeypatch, 1)
    with pytest.warns(
        UserWarning,
        match=r"rank 1 has no readable file of its own for step 2 \(.*rank-00001\.pt was not "
        r"written by Checkpointer\.save",
    ):
        assert ckpt.restore({"w": torch.zeros(2)}) == 2
    assert torch.equal(torch.rand(4), _draws_after_seed(20))  # rank 0's, as the warning says


# Two gloo ranks, forked where that is safe, with a short group timeout: a rank left waiting
# for the other fails the test in seconds instead of hanging it.
def _two_ranks(fn: Any, tmp_path: Path, timeout_s: float = 10.0) -> dict[int, Any]:
    return spawn(fn, 2, "gloo", args=(tmp_path,), start_method=FORK, timeout_s=timeout_s)


@pytest.mark.slow  # two forked gloo ranks
def test_a_refused_rank_file_makes_every_rank_raise(tmp_path: Path) -> None:
    # Only rank 1 raised; rank 0 restored step 2 and went on to its next collective, where
    # it waited for rank 1 until the group's timeout, with no error of its own.
    r0, r1 = _two_ranks(_ranks.restore_with_rank1_file_copied_from_step_1, tmp_path).values()
    assert r1.startswith("CheckpointError: Checkpointer.restore stops at step 2: "), r1
    assert "holds rank 1's part of step 1" in r1
    assert r0.startswith(
        "CheckpointError: Checkpointer.restore stops at step 2 on rank 0: another rank could "
        "not restore its own part: rank 1 (CheckpointError: Checkpointer.restore stops at "
        "step 2: "
    ), r0
    assert "holds rank 1's part of step 1" in r0
    assert r0.endswith("[path step-000000002.rank-00001.pt]"), r0


@pytest.mark.slow  # two forked gloo ranks
def test_ranks_that_find_different_steps_all_raise(tmp_path: Path) -> None:
    results = _two_ranks(_ranks.restore_from_directories_with_other_steps, tmp_path)
    for message in results.values():
        assert message.startswith(
            "CheckpointError: Checkpointer.restore: the ranks found different newest steps "
        ), message
        assert "(rank 0: 2, rank 1: 1)" in message and "a filesystem every rank sees" in message


@pytest.mark.slow  # two forked gloo ranks
@pytest.mark.timeout(60)
def test_a_rank_that_fails_before_the_agreement_makes_every_rank_raise_its_cause(
    tmp_path: Path,
) -> None:
    # Rank 1 raised before the agreement: rank 0 waited for it until the group's timeout
    # (30 min by default; 10 s here), then said only that it "waited in vain".
    r0, r1 = _two_ranks(_ranks.restore_with_rank1_directory_unlistable, tmp_path).values()
    assert r1.startswith("PermissionError: [Errno 13] cannot list the Checkpointer "), r1
    assert r0.startswith(
        "CheckpointError: Checkpointer.restore stops on rank 0: rank 1 failed before the "
        "ranks agreed on a step (PermissionError: [Errno 13] cannot list the Checkpointer "
        f"directory {tmp_path}: Permission denied."
    ), r0
    assert "nothing was loaded on this rank" in r0 and "waited" not in r0, r0
    assert r0.endswith(f"[path {tmp_path.name}]"), r0


@pytest.mark.slow  # two forked gloo ranks
@pytest.mark.timeout(60)
def test_a_rank_that_cannot_load_the_agreed_step_makes_every_rank_raise(tmp_path: Path) -> None:
    # Rank 1's model had another shape: it raised, and rank 0 returned step 2 and went on
    # to its next collective (DDP's first all-reduce), where it waited for rank 1 until the
    # group's timeout with a message that said nothing about the checkpoint.
    r0, r1 = _two_ranks(_ranks.restore_with_rank1_model_of_another_shape, tmp_path).values()
    assert r1.startswith("StateDictMismatchError: "), r1
    assert r0.startswith(
        "CheckpointError: Checkpointer.restore stops on rank 0: another rank could not load "
        "step 2 into its objects: rank 1 (StateDictMismatchError: "
    ), r0
    assert "this rank's state was loaded, but training must not go on" in r0, r0
    assert r0.endswith("[path step-000000002.pt]"), r0


@pytest.mark.slow  # two forked gloo ranks, one waiting out a 3 s group timeout
@pytest.mark.timeout(60)
def test_a_rank_stuck_loading_the_agreed_step_makes_the_others_raise(tmp_path: Path) -> None:
    results = _two_ranks(_ranks.restore_with_rank1_stuck_loading, tmp_path, timeout_s=3.0)
    assert results[0].startswith(
        "CheckpointError: Checkpointer.restore loaded step 2 on rank 0, then waited in vain "
        "for the other ranks to say they had loaded it too "
    ), results[0]
    assert "do not go on training with ranks out of step" in results[0], results[0]


@pytest.mark.slow  # two forked gloo ranks, one waiting out a 3 s group timeout
def test_restore_on_one_rank_only_names_the_fix(tmp_path: Path) -> None:
    results = _two_ranks(_ranks.restore_on_rank0_only, tmp_path, timeout_s=3.0)
    assert results[0].startswith(
        "CheckpointError: Checkpointer.restore is a collective under a process group, but "
        "rank 0 waited for the other ranks in vain"
    ), results[0]
    assert "call restore on every rank" in results[0]


def test_a_loader_missing_from_a_rank_file_takes_rank_0s_position_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Rank 1 saved its state without the loader: it took rank 0's position without a word.
    loader = DataLoader(list(range(8)), batch_size=2)
    track(loader)
    it = iter(loader)
    next(it)
    ckpt = Checkpointer(tmp_path)
    _as_rank(monkeypatch, 0)
    ckpt.save({"w": torch.ones(2), "loader": loader}, step=1)
    _as_rank(monkeypatch, 1)
    ckpt.save({"w": torch.ones(2)}, step=1)
    fresh = DataLoader(list(range(8)), batch_size=2)
    with pytest.warns(
        UserWarning,
        match=r"rank 1's own file of step 1 has no position for loader 'loader' .*rank 0's "
        r"position stands in.*give Checkpointer\.save the same loaders on every rank",
    ):
        assert ckpt.restore({"w": torch.zeros(2), "loader": fresh}) == 1
    assert next(iter(fresh)).tolist() == [2, 3]  # rank 0's position: one batch taken


def test_restore_agrees_on_the_ranks_own_gpu_under_nccl(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A torchrun script that never calls torch.cuda.set_device had every rank gather on
    # cuda:0, where NCCL hangs or fails ("Duplicate GPU detected").
    fake = FakeNccl(monkeypatch, rank=1, gpus=2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert Checkpointer(tmp_path).restore({"w": torch.zeros(2)}) == 0
    ranks_module.agree_loaded(tmp_path, 3)
    assert fake.used == [1, 1]  # both agreements
    assert fake.current == 0  # the script's current device is left as it was


@pytest.mark.parametrize(
    ("device", "expected"),
    [
        ("cuda", "cuda:1"),
        ("cuda:0", "cuda:0"),
        # not the GPU with most free memory, which restore itself had resolved "auto" to
        ("auto", "cuda:1"),
    ],
)
def test_restore_onto_cuda_loads_onto_the_ranks_own_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, device: str, expected: str
) -> None:
    # Before: restore(device="cuda") loaded every rank's copy of the step onto cuda:0 (the
    # current device of a script that never calls torch.cuda.set_device).
    ckpt = _saved(tmp_path, monkeypatch)
    _as_rank(monkeypatch, 1)
    FakeNccl(monkeypatch, rank=1, gpus=2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr("trainperf.device.best_device", lambda: torch.device("cuda", 0))
    asked = map_locations(monkeypatch)
    w = torch.zeros(2)
    assert ckpt.restore({"w": w}, device=device) == 2
    assert w.tolist() == [2.0, 2.0]
    assert ("step-000000002.pt", torch.device(expected)) in asked
