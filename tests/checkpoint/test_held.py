"""trainperf.checkpoint._held: each version of a step file is read once, by retention in
this process or in the forked writer, and a changed file is read again."""

from __future__ import annotations

import collections
import errno
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import trainperf.checkpoint._checkpointer as checkpointer_module
import trainperf.checkpoint._held as held_module
import trainperf.checkpoint._writer_fork as writer_fork_module
from trainperf import Checkpointer
from trainperf.checkpoint._held import held_step, known, learn
from trainperf.checkpoint._steps import main_file
from trainperf.checkpoint._writer_fork import fork_writes


def _count_skims(monkeypatch: pytest.MonkeyPatch, log: Path) -> None:
    """Start from nothing read, and log each file skimmed (to a file: a forked writer's
    calls count too)."""
    real = held_module.skim
    monkeypatch.setattr(held_module, "_HELD", {})

    def counted(path: Path) -> Any:
        with open(log, "a") as f:
            f.write(path.name + "\n")
        return real(path)

    monkeypatch.setattr(held_module, "skim", counted)


def _skims(log: Path) -> collections.Counter[str]:
    return collections.Counter(log.read_text().split()) if log.exists() else collections.Counter()


def test_an_unchanged_file_is_read_once_and_a_changed_one_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "skims.log"
    _count_skims(monkeypatch, log)
    path = main_file(tmp_path, 10)
    torch.save({"w": torch.ones(2), "trainperf": {"step": 10}}, path)
    foreign = main_file(tmp_path, 20)
    torch.save({"other": "run"}, foreign)
    for _ in range(3):
        assert held_step(path) == 10
        assert "not written by Checkpointer.save" in str(held_step(foreign))
    assert _skims(log) == {path.name: 1, foreign.name: 1}
    torch.save({"w": torch.ones(2), "trainperf": {"step": 10}}, foreign)  # now a step file
    assert held_step(foreign) == 10
    assert _skims(log) == {path.name: 1, foreign.name: 2}


def test_a_read_the_system_refused_is_not_remembered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = main_file(tmp_path, 10)
    torch.save({"w": torch.ones(2), "trainperf": {"step": 10}}, path)
    monkeypatch.setattr(held_module, "_HELD", {})
    real = held_module.skim
    monkeypatch.setattr(
        held_module, "skim", lambda p: (_ for _ in ()).throw(OSError(errno.EIO, "I/O error"))
    )
    with pytest.raises(OSError, match=r"cannot read checkpoint .*step-000000010\.pt: I/O"):
        held_step(path, raise_read_errors=True)
    assert str(held_step(path)).startswith("OSError")
    monkeypatch.setattr(held_module, "skim", real)  # the disk is back: the file is fine
    assert held_step(path) == 10


def test_retention_reads_each_file_once_however_many_saves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # keep= skimmed every step file's pickle again at every save (0.2 s a file of 12,000
    # tensors), and a foreign file, never deleted, at every save for good.
    log = tmp_path / "skims.log"
    run = tmp_path / "run"
    run.mkdir()
    torch.save({"other": "run"}, main_file(run, 999))
    _count_skims(monkeypatch, log)
    ckpt = Checkpointer(run, keep=2)
    for step in range(1, 7):
        ckpt.save({"w": torch.full((3,), float(step))}, step=step)
    assert ckpt.steps() == [5, 6, 999]
    # The files it wrote itself are never read back; the foreign one once.
    assert _skims(log) == {"step-000000999.pt": 1}


@pytest.mark.skipif(not fork_writes(), reason="the forked writer needs fork (Linux)")
def test_what_the_forked_writer_read_comes_back_to_the_training_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Retention runs in the forked writer, whose answers died with it: every save's child
    # read every file again.
    log = tmp_path / "skims.log"
    run = tmp_path / "run"
    run.mkdir()
    torch.save({"other": "run"}, main_file(run, 999))
    _count_skims(monkeypatch, log)
    monkeypatch.setattr(checkpointer_module, "fork_writes", lambda: True)
    ckpt = Checkpointer(run, keep=2)
    for step in range(1, 6):
        handle = ckpt.save({"w": torch.full((3,), float(step))}, step=step, blocking=False)
        assert handle.writer == "process"
        ckpt.wait()
    assert ckpt.steps() == [4, 5, 999]
    assert _skims(log) == {"step-000000999.pt": 1}


def test_learn_keeps_what_known_gave_and_ignores_anything_else(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "skims.log"
    _count_skims(monkeypatch, log)
    path = main_file(tmp_path, 10)
    torch.save({"w": torch.ones(2), "trainperf": {"step": 10}}, path)
    assert held_step(path) == 10
    sent = known(tmp_path)
    assert known(tmp_path / "elsewhere") == []
    monkeypatch.setattr(held_module, "_HELD", {})
    elsewhere = os.fspath(tmp_path / "elsewhere" / "step-000000010.pt")
    junk = [["short"], [str(path), 1, 2, 3, 4, 5, True], [elsewhere, *sent[0][1:]], "junk"]
    learn(tmp_path, [*sent, *junk])
    assert {str(path): (tuple(sent[0][:6]), 10)} == held_module._HELD
    assert held_step(path) == 10 and _skims(log) == {path.name: 1}


def test_the_answers_kept_are_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(held_module, "_HELD", {})
    monkeypatch.setattr(held_module, "_LIMIT", 2)
    paths = [main_file(tmp_path, s) for s in (1, 2, 3)]
    for path in paths:
        path.write_bytes(b"not a checkpoint")
        held_step(path)
    assert list(held_module._HELD) == [os.fspath(p) for p in paths[1:]]


def test_the_answers_kept_follow_the_files_retention_keeps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The answers for the files keep= deleted stayed: one more per save, for good.
    monkeypatch.setattr(held_module, "_HELD", {})
    ckpt = Checkpointer(tmp_path, keep=2)
    for step in range(1, 31):
        ckpt.save({"w": torch.ones(1)}, step=step)
    assert ckpt.steps() == [29, 30]
    assert len(held_module._HELD) == 2
    assert held_module.known(tmp_path) == [
        [*held_module.version(main_file(tmp_path, s)), s] for s in (29, 30)
    ]


@pytest.mark.skipif(not fork_writes(), reason="the forked writer needs fork (Linux)")
def test_the_forked_writer_sends_back_only_the_answers_for_files_still_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The child sent every answer it had for the directory, deleted files' too, and the
    # parent kept them all: the message and the cache grew by one entry per save.
    monkeypatch.setattr(held_module, "_HELD", {})
    monkeypatch.setattr(checkpointer_module, "fork_writes", lambda: True)
    sent: list[int] = []
    real = writer_fork_module.learn

    def counted(*args: Any) -> None:
        sent.append(len(args[-1]))
        real(*args)

    monkeypatch.setattr(writer_fork_module, "learn", counted)
    torch.save({"other": "run"}, main_file(tmp_path, 999))
    ckpt = Checkpointer(tmp_path, keep=2)
    for step in range(1, 16):
        assert ckpt.save({"w": torch.ones(1)}, step=step, blocking=False).writer == "process"
        ckpt.wait()
    assert ckpt.steps() == [14, 15, 999]
    assert len(sent) == 15 and max(sent) <= 3  # the two kept and the foreign file
    assert len(held_module._HELD) <= 3


class _CountingDict(dict[str, Any]):
    """Counts the keys handed out by iterating it."""

    handed_out = 0

    def __iter__(self) -> Any:
        for key in list(super().__iter__()):
            _CountingDict.handed_out += 1
            yield key


def test_dropping_the_oldest_answers_does_not_copy_the_whole_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each answer kept past the limit copied the whole key list: learning 4096 answers
    # took 0.19 s of the reaper thread, holding the GIL, at every save.
    monkeypatch.setattr(_CountingDict, "handed_out", 0)
    monkeypatch.setattr(held_module, "_HELD", _CountingDict())
    monkeypatch.setattr(held_module, "_LIMIT", 8)
    paths = [os.fspath(main_file(tmp_path, s)) for s in range(200)]
    for step, path in enumerate(paths):
        held_module._remember((path, 1, step, 1, 1, 1), step)
    # One key looked at per answer dropped (192), not the whole cache at each answer kept.
    assert _CountingDict.handed_out <= len(paths)
    assert list(dict.keys(held_module._HELD)) == paths[-8:]


class _Forgetting:
    """A dict's key iterator, before whose first key another thread forgets ``other``."""

    def __init__(self, held: dict[str, Any], other: str) -> None:
        self.held, self.other, self.keys = held, other, dict.__iter__(held)

    def __next__(self) -> str:
        self.held.pop(self.other, None)  # forget(): the dict changes size mid-iteration
        return next(self.keys)


class _RacedDict(dict[str, Any]):
    """A dict that another thread (the reaper's ``learn``/``forget``) changes between
    ``iter()`` and ``next()`` while this one drops the oldest answer."""

    def __iter__(self) -> Any:
        return _Forgetting(self, list(dict.keys(self))[1])


def test_another_thread_changing_the_answers_while_dropping_the_oldest_is_no_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # next(iter(_HELD)) raised "RuntimeError: dictionary changed size during iteration"
    # out of save/restore/latest when the reaper thread changed it in between.
    first, second, third = (os.fspath(main_file(tmp_path, s)) for s in (1, 2, 3))
    raced = _RacedDict({first: ((first, 1, 1, 1, 1, 1), 1), second: ((second, 1, 2, 1, 1, 1), 2)})
    monkeypatch.setattr(held_module, "_HELD", raced)
    monkeypatch.setattr(held_module, "_LIMIT", 2)
    held_module._remember((third, 1, 3, 1, 1, 1), 3)
    assert list(dict.keys(raced)) == [first, third]  # the newest answer kept, the bound held
