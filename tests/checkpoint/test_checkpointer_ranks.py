"""trainperf.checkpoint._checkpointer_ranks: a rank's own file (``step-….rank-0000R.pt``:
its generators and loader positions) read back on restore, in one process posing as each
rank in turn."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import trainperf.checkpoint._checkpointer as checkpointer_module
from trainperf import Checkpointer
from trainperf.errors import CheckpointError


def _as_rank(monkeypatch: pytest.MonkeyPatch, rank: int) -> None:
    monkeypatch.setattr(checkpointer_module, "_group", lambda: (rank, 3))


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
