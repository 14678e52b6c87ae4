"""trainperf.checkpoint._checkpointer_warn: the warning that the directory already holds a
later step than the one saved, for files there at the first save and for files that appear
later (another process's)."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import trainperf.checkpoint._held as held_module
from trainperf import Checkpointer
from trainperf.errors import CheckpointError


def _arrives(run: Path, elsewhere: Path, step: int) -> None:
    """Step ``step``'s file appears in ``run``, written by another Checkpointer (another
    process: renamed into place, as its writes are)."""
    path = Checkpointer(elsewhere).save({"w": torch.ones(1)}, step=step).path
    assert path is not None
    os.replace(path, run / path.name)


def test_a_later_step_written_by_another_process_is_warned_of_once_per_new_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The directory was read at the first save only: step 500 written afterwards by another
    # run was never named, though a resume would continue from it, not from this run.
    run = tmp_path / "run"
    ckpt = Checkpointer(run, keep=10)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ckpt.save({"w": torch.ones(1)}, step=10)
    _arrives(run, tmp_path / "other", 500)
    with pytest.warns(UserWarning, match=r"save\(step=20\): .* already holds step 500"):
        ckpt.save({"w": torch.ones(1)}, step=20)

    def no_reads(path: Path) -> Any:
        raise AssertionError(f"read {path}")

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per step seen, not at every save
        monkeypatch.setattr(held_module, "skim", no_reads)  # nothing new: names only
        ckpt.save({"w": torch.ones(1)}, step=30)
        monkeypatch.undo()
    _arrives(run, tmp_path / "other", 600)
    with pytest.warns(UserWarning, match=r"save\(step=40\): .* already holds step 600"):
        ckpt.save({"w": torch.ones(1)}, step=40)


def test_a_later_file_that_a_resume_would_skip_is_not_warned_of(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path)
    ckpt.save({"w": torch.ones(1)}, step=10)
    torch.save({"other": "tool"}, tmp_path / "step-000000900.pt")  # foreign: restore skips it
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ckpt.save({"w": torch.ones(1)}, step=20)
    (tmp_path / "step-000000950.pt").write_bytes(b"cut short")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ckpt.save({"w": torch.ones(1)}, step=30)


def test_a_later_step_this_run_has_passed_is_not_warned_of(tmp_path: Path) -> None:
    run = tmp_path / "run"
    ckpt = Checkpointer(run)
    ckpt.save({"w": torch.ones(1)}, step=700)
    _arrives(run, tmp_path / "other", 600)  # below this run's newest: a resume takes 700
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ckpt.save({"w": torch.ones(1)}, step=710)


def test_a_later_misnamed_copy_that_every_resume_would_refuse_is_warned_of(
    tmp_path: Path,
) -> None:
    # A copy of step 10 named step 900 was left out as a file restore would skip: no
    # warning, though restore and latest raise at it, so every resume of this run failed.
    ckpt = Checkpointer(tmp_path, keep=2)
    ten = ckpt.save({"w": torch.ones(1)}, step=10).path
    assert ten is not None
    (tmp_path / "step-000000900.pt").write_bytes(ten.read_bytes())
    with pytest.warns(UserWarning) as caught:
        ckpt.save({"w": torch.ones(1)}, step=20)
    (message,) = [str(w.message) for w in caught]
    assert "save(step=20): latest() and restore() will raise CheckpointError" in message
    assert "step-000000900.pt holds step 10, but its name says step 900" in message
    assert "move it out of" in message
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once, not at every save
        for step in (30, 40, 50):
            ckpt.save({"w": torch.ones(1)}, step=step)
    with pytest.raises(CheckpointError, match=r"restore stops at step 900"):
        ckpt.restore({"w": torch.zeros(1)})
