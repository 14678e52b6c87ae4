"""trainperf.checkpoint._checkpointer_warn: the warning that the directory already holds a
later step than the one saved, for files there at the first save and for files that appear
later (another process's)."""

from __future__ import annotations

import errno
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


def test_a_later_file_that_a_resume_would_skip_is_warned_of_once(tmp_path: Path) -> None:
    # A later step file cut short (or foreign) was passed over without a word: it sits above
    # every step this run saves, keep= never deletes it, and only a resume's warning named it.
    ckpt = Checkpointer(tmp_path, keep=1)
    ckpt.save({"w": torch.ones(1)}, step=10)
    cut = tmp_path / "step-000000950.pt"
    cut.write_bytes(b"cut short")
    with pytest.warns(UserWarning) as caught:
        ckpt.save({"w": torch.ones(1)}, step=20)
    (message,) = [str(w.message) for w in caught]
    assert f"save(step=20): {cut} (step 950, later than this save) is not a checkpoint" in message
    assert "latest() and restore() skip it" in message and "keep=1 never deletes it" in message
    assert f"copy it again; otherwise move it out of {tmp_path}" in message
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per version of the file, not at every save
        ckpt.save({"w": torch.ones(1)}, step=30)
    torch.save({"other": "tool"}, cut)  # another version: foreign, skipped too
    with pytest.warns(UserWarning, match=r"step-000000950\.pt \(step 950.*not written by"):
        ckpt.save({"w": torch.ones(1)}, step=40)
    assert ckpt.steps() == [40, 950]  # kept: it may be all that is left of something


def test_a_later_file_that_cannot_be_read_is_warned_of_and_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A later step file the disk would not read (EIO) was skipped in silence at every save,
    # while every resume raised at it.
    ckpt = Checkpointer(tmp_path, keep=1)
    ckpt.save({"w": torch.ones(1)}, step=10)
    _arrives(tmp_path, tmp_path / "other", 900)
    real = held_module.skim

    def eio_at_900(path: Path) -> Any:
        if path.name == "step-000000900.pt":
            raise OSError(errno.EIO, "Input/output error")
        return real(path)

    monkeypatch.setattr(held_module, "skim", eio_at_900)
    with pytest.warns(UserWarning) as caught:
        ckpt.save({"w": torch.ones(1)}, step=20)
    (message,) = [str(w.message) for w in caught]
    assert "save(step=20): step 900, later than this save, could not be read" in message
    assert "latest() and restore() will raise OSError at it" in message
    assert "keep=1 never deletes it" in message
    assert "cannot read checkpoint" in message and "Input/output error" in message
    assert "check the storage and retry" in message
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per version of the file
        ckpt.save({"w": torch.ones(1)}, step=30)
    assert ckpt.steps() == [30, 900]


def test_an_unreadable_file_below_the_newest_readable_one_is_not_warned_of(
    tmp_path: Path,
) -> None:
    (tmp_path / "step-000000005.pt").write_bytes(b"cut short")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a resume takes step 10: nothing newer is hidden
        Checkpointer(tmp_path).save({"w": torch.ones(1)}, step=10)


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


def test_a_later_dangling_link_is_warned_of_as_one_that_latest_and_restore_skip(
    tmp_path: Path,
) -> None:
    # A step file's name linked to nothing was called a file "cut short or damaged in a
    # copy: copy it again" at save, while latest() and restore() skip it as a missing file.
    ckpt = Checkpointer(tmp_path, keep=2)
    ckpt.save({"w": torch.ones(1)}, step=1)
    link = tmp_path / "step-000000009.pt"
    link.symlink_to(tmp_path / "gone" / "step-000000009.pt")
    with pytest.warns(UserWarning) as caught:
        ckpt.save({"w": torch.ones(1)}, step=2)
    (message,) = [str(w.message) for w in caught]
    assert f"save(step=2): {link} (step 9, later than this save) is a dangling" in message
    assert f"symbolic link to {tmp_path / 'gone' / 'step-000000009.pt'}" in message
    assert "latest() and restore() skip it for an older step" in message
    assert f"rm {link}" in message and "copy it again" not in message
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once, not at every save
        ckpt.save({"w": torch.ones(1)}, step=3)
    with pytest.warns(UserWarning, match=r"skipping checkpoint .*step-000000009\.pt"):
        assert ckpt.latest() == tmp_path / "step-000000003.pt"
    assert link.is_symlink()  # keep= never deletes it


@pytest.mark.parametrize("blocking", [True, False])
def test_a_directory_with_a_rank_files_name_below_the_kept_steps_is_warned_of_once(
    tmp_path: Path, blocking: bool
) -> None:
    # Retention tried to delete it at every save, and every save warned that it could not.
    odd = tmp_path / "step-000000001.rank-00001.pt"
    odd.mkdir()
    ckpt = Checkpointer(tmp_path, keep=1)
    with pytest.warns(UserWarning) as caught:
        ckpt.save({"w": torch.ones(1)}, step=5, blocking=blocking)
        ckpt.wait()
    (message,) = [str(w.message) for w in caught]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once, not at every save
        for step in (6, 7, 8):
            ckpt.save({"w": torch.ones(1)}, step=step, blocking=blocking)
            ckpt.wait()
    assert odd.is_dir() and ckpt.steps() == [8]
    assert f"{odd}: a directory, not a checkpoint file" in message
    assert f"rm -r {odd}" in message
