"""trainperf.checkpoint._checkpointer: Checkpointer's files, background saves, retention,
failures raised at the next call, and restore into live objects."""

from __future__ import annotations

import collections
import errno
import gc
import http
import json
import os
import random
import signal
import threading
import time
import warnings
import weakref
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import trainperf.checkpoint._checkpointer as checkpointer_module
import trainperf.checkpoint._checkpointer_restore as restore_module
import trainperf.checkpoint._held as held_module
import trainperf.checkpoint._read as read_module
import trainperf.checkpoint._writer as writer_module
import trainperf.checkpoint._writer_fork as writer_fork
from tests.checkpoint import _agree
from tests.checkpoint._common import as_if_from_newer_torch, held_thread_writes
from tests.ddp._distributed import FORK, spawn
from trainperf import Checkpointer, MixedPrecision, host_limits, load_checkpoint
from trainperf._utils.atomic import temp_name
from trainperf.checkpoint import SaveHandle
from trainperf.checkpoint._steps import this_host
from trainperf.errors import CheckpointError, StateDictMismatchError, UnsafeCheckpointError


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _trained() -> dict[str, Any]:
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(5, 4)).sum().backward()
        opt.step()
        sched.step()
    return {"model": model, "optimizer": opt, "scheduler": sched}


# ------------------------------------------------------------------------------- files


def test_a_step_file_is_a_save_checkpoint_file_named_by_step(tmp_path: Path) -> None:
    state = _trained()
    handle = Checkpointer(tmp_path).save({**state, "epoch": 2}, step=7)
    assert handle.done() and handle.writer == "blocking"
    assert handle.path == tmp_path / "step-000000007.pt"
    plain = torch.load(handle.path, weights_only=True)  # torch alone reads it, weights only
    assert sorted(plain) == ["epoch", "model", "optimizer", "scheduler", "trainperf"]
    assert plain["epoch"] == 2 and plain["trainperf"]["step"] == 7
    assert sorted(plain["trainperf"]["rng"]) == ["cuda", "numpy", "python", "torch"]
    fresh = _model()
    fresh.load_state_dict(load_checkpoint(handle.path)["model"])
    for a, b in zip(fresh.parameters(), state["model"].parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("writer", ["process", "thread"])
def test_a_background_save_holds_its_steps_values_bit_for_bit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writer: str
) -> None:
    if writer == "thread":  # what GPU tensors get: staged copies written by a thread
        monkeypatch.setattr(checkpointer_module, "fork_writes", lambda: False)
    w = torch.arange(1_000_000, dtype=torch.float32)
    ckpt = Checkpointer(tmp_path)
    handle = ckpt.save({"w": w, "n": 1}, step=1, blocking=False)
    assert handle.writer == writer
    w.mul_(-1)  # the next training step, right after save returned
    ckpt.wait()
    assert handle.done()
    saved = load_checkpoint(handle.path)
    assert torch.equal(saved["w"], torch.arange(1_000_000, dtype=torch.float32))
    assert saved["n"] == 1 and os.listdir(tmp_path) == ["step-000000001.pt"]


@pytest.mark.slow  # five background writes, one after another
def test_keep_deletes_older_files_only_once_a_newer_one_is_written(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path, keep=2)
    for step in (10, 20, 30, 40):
        ckpt.save({"step": step}, step=step, blocking=False)
    ckpt.wait()
    assert ckpt.steps() == [30, 40]
    ckpt.save({"f": lambda: 0}, step=50, blocking=False)  # this write fails
    with pytest.raises(CheckpointError, match=r"background save of step 50 failed"):
        ckpt.wait()
    assert ckpt.steps() == [30, 40]  # nothing deleted for a write that never landed
    assert ckpt.latest() == tmp_path / "step-000000040.pt"


def test_keep_leaves_a_step_the_user_write_protected(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path, keep=1)
    ckpt.save({"best": 1}, step=10)
    ckpt.latest().chmod(0o444)  # keep this one
    for step in (20, 30):
        ckpt.save({"step": step}, step=step, blocking=step == 20)
    ckpt.wait()
    assert ckpt.steps() == [10, 30]
    assert load_checkpoint(tmp_path / "step-000000010.pt")["best"] == 1


def test_keep_counts_no_foreign_file_and_deletes_no_real_step_for_it(tmp_path: Path) -> None:
    # A file with a step file's name but not Checkpointer's contents (copied in from
    # elsewhere) held one of the keep= places, so the real step 20 was deleted.
    ckpt = Checkpointer(tmp_path, keep=2)
    ckpt.save({"w": torch.ones(1)}, step=10)
    foreign = tmp_path / "step-000000999.pt"
    torch.save({"other": "run"}, foreign)
    # Not "already holds step 999" (a resume skips it): that it is not one restore loads.
    with pytest.warns(UserWarning) as caught:
        ckpt.save({"w": torch.full((1,), 20.0)}, step=20)
    (message,) = [str(w.message) for w in caught]
    assert "step-000000999.pt (step 999, later than this save) is not a checkpoint" in message
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once
        ckpt.save({"w": torch.full((1,), 30.0)}, step=30)
    assert ckpt.steps() == [20, 30, 999]
    assert torch.load(foreign) == {"other": "run"}  # nor is the foreign file deleted
    w = torch.zeros(1)
    with pytest.warns(UserWarning, match=r"skipping checkpoint .*step-000000999\.pt: .*not "):
        assert ckpt.latest() == tmp_path / "step-000000030.pt"
    with pytest.warns(UserWarning, match=r"skipping checkpoint .*step-000000999\.pt: .*not "):
        assert ckpt.restore({"w": w}) == 30


@pytest.mark.timeout(20)
def test_a_named_pipe_with_a_step_files_name_is_skipped_not_waited_on(tmp_path: Path) -> None:
    # Reading its pickle opened it, which waits for a writer: save, latest and restore hung.
    ckpt = Checkpointer(tmp_path)
    ckpt.save({"w": torch.ones(1)}, step=1)
    os.mkfifo(tmp_path / "step-000000009.pt")
    with pytest.warns(UserWarning, match=r"step-000000009\.pt .*a named pipe \(FIFO\)"):
        ckpt.save({"w": torch.ones(1)}, step=2)
    with pytest.warns(UserWarning, match=r"skipping checkpoint .*a named pipe \(FIFO\)"):
        assert ckpt.latest() == tmp_path / "step-000000002.pt"
    with pytest.warns(UserWarning, match=r"skipping checkpoint .*a named pipe \(FIFO\)"):
        assert ckpt.restore({"w": torch.zeros(1)}) == 2


def test_the_skip_warnings_of_latest_and_restore_name_the_callers_line(tmp_path: Path) -> None:
    # Their loops live in _checkpointer_restore, a frame below the methods: the warning
    # must still point at the script's call, not at trainperf.
    ckpt = Checkpointer(tmp_path)
    ckpt.save({"w": torch.ones(1)}, step=1)
    (tmp_path / "step-000000002.pt").write_bytes(b"not a checkpoint")
    with pytest.warns(UserWarning, match="skipping checkpoint") as latest:
        ckpt.latest()
    with pytest.warns(UserWarning, match="skipping checkpoint") as restore:
        ckpt.restore({"w": torch.zeros(1)})
    assert [w.filename for w in (*latest, *restore)] == [__file__, __file__]


def test_restore_refuses_a_step_file_copied_to_another_steps_name(tmp_path: Path) -> None:
    # step-000000007.pt, a copy of step 3's file, restored step 3 under step 7's name: the
    # loop resumed at step 3 while latest() named step 7 and keep= counted it as step 7.
    ckpt = Checkpointer(tmp_path, keep=5)
    for step in (1, 2, 3):
        ckpt.save({"w": torch.full((2,), float(step))}, step=step)
    copy = tmp_path / "step-000000007.pt"
    copy.write_bytes((tmp_path / "step-000000003.pt").read_bytes())
    w = torch.zeros(2)
    why = (
        r"stops at step 7: .*step-000000007\.pt holds step 3, but its name says step 7 "
        r"\(copied or renamed .*wrong step; step-000000003\.pt is there too, so this is a "
        r"copy: move it out of "
    )
    with pytest.raises(CheckpointError, match="restore " + why) as info:
        ckpt.restore({"w": w})
    assert info.value.path == copy and torch.equal(w, torch.zeros(2))  # nothing loaded
    with pytest.raises(CheckpointError, match="latest " + why):
        ckpt.latest()
    copy.unlink()
    assert ckpt.restore({"w": w}) == 3 and torch.equal(w, torch.full((2,), 3.0))


def test_restore_refuses_a_misnamed_step_file_before_loading_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The whole file was loaded (onto the GPU with device="cuda") and only then refused.
    ckpt = Checkpointer(tmp_path)
    ckpt.save({"w": torch.ones(2)}, step=3)
    (tmp_path / "step-000000007.pt").write_bytes((tmp_path / "step-000000003.pt").read_bytes())
    monkeypatch.setattr(held_module, "_HELD", {})  # as a new process: nothing read yet
    loads: list[Path] = []
    real = restore_module.load_checkpoint

    def counted(path: Path, *args: Any, **kwargs: Any) -> Any:
        loads.append(path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(restore_module, "load_checkpoint", counted)
    with pytest.raises(CheckpointError, match=r"restore stops at step 7: .* holds step 3"):
        ckpt.restore({"w": torch.zeros(2)})
    assert loads == []
    (tmp_path / "step-000000007.pt").unlink()
    assert ckpt.restore({"w": torch.zeros(2)}) == 3 and loads == [tmp_path / "step-000000003.pt"]


def test_restore_refuses_a_step_file_renamed_and_names_its_right_name(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path)
    ckpt.save({"w": torch.ones(1)}, step=100)
    (tmp_path / "step-000000100.pt").rename(tmp_path / "step-000000200.pt")
    with pytest.raises(
        CheckpointError, match=r"holds step 100, .*; rename it to step-000000100\.pt if it is"
    ):
        ckpt.restore({"w": torch.zeros(1)})


def test_latest_names_a_legacy_format_file_as_restore_loads_it(tmp_path: Path) -> None:
    # latest() read only zip directories, so it skipped the newest file restore() loads.
    ckpt = Checkpointer(tmp_path)
    for step in (10, 20):
        ckpt.save({"w": torch.full((2,), float(step))}, step=step)
    newest = tmp_path / "step-000000020.pt"
    legacy = torch.load(newest, weights_only=False)
    torch.save(legacy, newest, _use_new_zipfile_serialization=False)
    w = torch.zeros(2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ckpt.latest() == newest
        assert ckpt.restore({"w": w}) == 20
    assert torch.equal(w, torch.full((2,), 20.0))


def test_a_name_with_extra_leading_zeros_is_no_step_to_any_method(tmp_path: Path) -> None:
    # steps() listed step 50 from step-0000000050.pt, and latest() and restore() then looked
    # for step-000000050.pt: "No such file" warnings, and nothing restored.
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save({"w": torch.ones(1)}, step=50)
    odd = tmp_path / "step-0000000050.pt"
    (tmp_path / "step-000000050.pt").rename(odd)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ckpt.steps() == [] and ckpt.latest() is None and ckpt.restore({}) == 0
    ckpt.save({"w": torch.ones(1)}, step=60)
    assert odd.exists()


def test_a_save_below_a_step_on_disk_warns_once_that_a_resume_would_take_that_one(
    tmp_path: Path,
) -> None:
    with Checkpointer(tmp_path, keep=2) as old_run:
        old_run.save({"step": 300}, step=300)
    ckpt = Checkpointer(tmp_path, keep=2)  # a new run from scratch, the same directory
    with pytest.warns(UserWarning, match=r"save\(step=10\): .* already holds step 300") as told:
        ckpt.save({"step": 10}, step=10)
    assert "a resume would continue from step 300" in str(told[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per Checkpointer
        ckpt.save({"step": 20}, step=20)
        ckpt.save({"step": 30}, step=30, blocking=False)
        ckpt.wait()
        assert ckpt.steps() == [30, 300] and ckpt.restore({}) == 300  # what it warned of
        fresh = Checkpointer(tmp_path / "fresh")  # steps above all on disk: silent
        fresh.save({"step": 1}, step=1)
        fresh.save({"step": 1}, step=1)  # the same step again (a final save): silent


def test_a_run_resumed_past_a_damaged_newest_file_saves_without_a_false_alarm(
    tmp_path: Path,
) -> None:
    ckpt = Checkpointer(tmp_path)
    for step in (10, 20, 30):
        ckpt.save({"w": torch.full((1000,), float(step))}, step=step)
    newest = tmp_path / "step-000000030.pt"
    newest.write_bytes(newest.read_bytes()[:500])  # cut short
    resumed = Checkpointer(tmp_path)
    state = {"w": torch.zeros(1000)}
    with pytest.warns(UserWarning, match=r"skipping checkpoint .*step-000000030\.pt"):
        assert resumed.restore(state) == 20
    with warnings.catch_warnings():
        # Not "a resume would continue from step 30": restore skips that file, as it did.
        warnings.simplefilter("error")
        resumed.save(state, step=21)
    with pytest.warns(UserWarning, match=r"skipping checkpoint .*step-000000030\.pt"):
        assert Checkpointer(tmp_path).restore(state) == 21


def test_an_unpicklable_value_is_raised_by_the_next_save_chained_with_the_path(
    tmp_path: Path,
) -> None:
    ckpt = Checkpointer(tmp_path)
    ckpt.save({"w": torch.ones(2)}, step=1)
    handle = ckpt.save({"w": torch.ones(2), "fn": lambda: 1}, step=2, blocking=False)
    with pytest.raises(
        CheckpointError,
        match=r"background save of step 2 failed: not saving .*step-000000002\.pt: "
        r"state\['fn'\] holds a value that cannot be pickled \(.*Can't pickle .*; no older "
        r"checkpoint was deleted",
    ) as info:
        ckpt.save({"w": torch.full((2,), 3.0)}, step=3, blocking=False)
    assert info.value.path == tmp_path / "step-000000002.pt" and info.value.__cause__ is not None
    # Step 3 was saved (blocking) before the failure was raised: an error that ends the run
    # does not cost the state it was given.
    saved = tmp_path / "step-000000003.pt"
    assert str(info.value).endswith(f"; step 3 was saved to {saved} before this was raised")
    assert handle.done() and ckpt.steps() == [1, 3]
    assert torch.equal(load_checkpoint(ckpt.latest())["w"], torch.full((2,), 3.0))
    ckpt.save({"w": torch.ones(2)}, step=4)  # raised once: the Checkpointer carries on
    assert ckpt.steps() == [1, 3, 4]


def test_a_save_every_skips_is_made_when_it_reports_a_failed_write(tmp_path: Path) -> None:
    # A loop that calls save on every step learns of the failure at a skipped step; the
    # error may end the run, so that step's state is saved first.
    ckpt = Checkpointer(tmp_path, every=10)
    ckpt.save({"w": torch.ones(2)}, step=10)
    failed = ckpt.save({"w": torch.ones(2), "fn": lambda: 1}, step=20, blocking=False)
    deadline = time.monotonic() + 60
    while not failed.done() and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(CheckpointError, match=r"background save of step 20 failed") as info:
        ckpt.save({"w": torch.full((2,), 5.0)}, step=23)
    assert "step 23 was saved to" in str(info.value)
    assert ckpt.steps() == [10, 23]
    assert torch.equal(load_checkpoint(ckpt.latest())["w"], torch.full((2,), 5.0))
    assert ckpt.save({"w": torch.ones(2)}, step=24).writer == "skipped"  # told once


def test_a_save_that_fails_after_a_failed_write_notes_the_earlier_failure(
    tmp_path: Path,
) -> None:
    ckpt = Checkpointer(tmp_path)
    ckpt.save({"w": torch.ones(2)}, step=1)
    ckpt.save({"fn": lambda: 1}, step=2, blocking=False)
    with pytest.raises(
        CheckpointError,
        match=r"not saving .*step-000000003\.pt: state\['fn'\] .* cannot be pickled",
    ) as info:
        ckpt.save({"fn": lambda: 2}, step=3)
    assert info.value.path == tmp_path / "step-000000003.pt"
    assert "; earlier, the background save of step 2 failed: not saving" in str(info.value)
    assert ckpt.steps() == [1]


def test_a_save_refused_after_a_failed_write_warns_the_earlier_failure(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path)
    ckpt.save({"fn": lambda: 1}, step=2, blocking=False)
    with (
        pytest.warns(UserWarning, match=r"background save of step 2 failed"),
        pytest.raises(ValueError, match=r"trainperf"),
    ):
        ckpt.save({"trainperf": 1}, step=3)


def test_a_blocking_save_that_fails_raises_at_once(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path)
    with pytest.raises(CheckpointError, match=r"not saving .*: state\['fn'\] .* cannot be pickled"):
        ckpt.save({"fn": lambda: 1}, step=1)
    assert ckpt.steps() == [] and ckpt.latest() is None


def test_a_second_save_waits_for_the_one_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = held_thread_writes(monkeypatch)
    ckpt = Checkpointer(tmp_path)
    first = ckpt.save({"n": 1}, step=1, blocking=False)
    assert first.wait(timeout=0.05) is False and not first.done()
    assert "writing" in repr(first)
    threading.Timer(0.2, release.set).start()
    ckpt.save({"n": 2}, step=2, blocking=False)  # returns only after step 1 is on disk
    assert first.done() and (tmp_path / "step-000000001.pt").exists()
    ckpt.wait()
    assert ckpt.steps() == [1, 2]


def test_ctrl_c_while_the_writer_thread_starts_never_lets_the_next_save_refill_its_buffers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Thread.start() waits for the new thread: a Ctrl-C there raises from save() with the
    # writer running (or about to). The notebook goes on; the next save must not stage
    # into the buffers that writer still reads, or step 1's file gets step 2's values.
    release = held_thread_writes(monkeypatch)
    real_start = threading.Thread.start
    interrupts = [KeyboardInterrupt()]

    def start(thread: threading.Thread) -> None:
        real_start(thread)
        if interrupts and thread.name == "trainperf-checkpoint-writer":
            raise interrupts.pop()

    monkeypatch.setattr(threading.Thread, "start", start)
    ckpt = Checkpointer(tmp_path, keep=5)
    w = torch.full((1024,), 1.0)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save({"w": w}, step=1, blocking=False)
    w.fill_(2.0)
    threading.Timer(0.2, release.set).start()
    ckpt.save({"w": w}, step=2, blocking=False)
    w.fill_(3.0)
    ckpt.wait()
    assert 2 in ckpt.steps()
    for step in ckpt.steps():  # step 1's write either finished or never began
        saved = load_checkpoint(tmp_path / f"step-{step:09d}.pt")["w"]
        assert torch.equal(saved, torch.full((1024,), float(step))), (step, saved[:3])
    assert not writer_module.pending_handles()  # nothing left for the exit hook to wait on


def test_every_skips_other_steps_unless_forced(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path, every=10)
    skipped = ckpt.save({"n": 1}, step=5)
    assert skipped.writer == "skipped" and skipped.path is None and skipped.done()
    ckpt.save({"n": 2}, step=10)
    ckpt.save({"n": 3}, step=15, force=True)
    assert ckpt.steps() == [10, 15]


def test_a_skipped_step_does_not_wait_for_the_write_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = held_thread_writes(monkeypatch)
    ckpt = Checkpointer(tmp_path, every=10)
    writing = ckpt.save({"n": 1}, step=10, blocking=False)
    for step in range(11, 15):  # the loop calls save every step: these return at once
        assert ckpt.save({"n": step}, step=step).writer == "skipped"
    assert not writing.done()
    release.set()
    ckpt.wait()
    assert ckpt.steps() == [10]


def test_a_stop_request_saves_whatever_every_says(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path, every=100)
    with ckpt.preemption(("SIGUSR1",)) as stop:
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)
        assert stop.requested
        assert ckpt.save({"n": 37}, step=37).writer == "blocking"
    assert ckpt.steps() == [37]
    # The final save may come after the block: the stop stays requested.
    assert ckpt.save({"n": 38}, step=38).writer == "blocking"


def test_a_stop_request_saves_whatever_every_says_when_preemption_was_called_again(
    tmp_path: Path,
) -> None:
    ckpt = Checkpointer(tmp_path, every=1000)
    with ckpt.preemption(("SIGUSR1",)) as stop:
        with ckpt.preemption(("SIGUSR2",)):  # a helper's block, say: a second Preemption
            pass
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)
        assert stop.requested
        assert ckpt.save({"n": 1234}, step=1234).writer == "blocking"
    assert ckpt.steps() == [1234]


def test_preemption_objects_made_per_epoch_are_not_kept_by_the_checkpointer(
    tmp_path: Path,
) -> None:
    # Every preemption() was appended to a list that was never pruned: a loop that entered
    # one per epoch kept them all (with their handlers) for the Checkpointer's life.
    ckpt = Checkpointer(tmp_path, every=1000)
    made = []
    for _ in range(50):
        with ckpt.preemption(("SIGUSR1",)) as stop:
            pass
        made.append(weakref.ref(stop))
    del stop
    gc.collect()
    assert [ref for ref in made if ref() is not None] == []
    # A stop requested in a block whose object is gone since still saves whatever every says.
    with ckpt.preemption(("SIGUSR1",)) as stop:
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)
        assert stop.requested
    del stop
    gc.collect()
    assert ckpt.save({"n": 7}, step=7).writer == "blocking"


def test_the_memory_check_falls_back_to_a_blocking_save_with_the_numbers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tight = replace(host_limits(), memory_available=300 << 20, memory_total=8 << 30)
    monkeypatch.setattr(checkpointer_module, "host_limits", lambda: tight)
    ckpt = Checkpointer(tmp_path)
    with pytest.warns(
        UserWarning,
        match=r"needs up to 38 MiB more host memory \(one copy of the state\), but 300 MiB "
        r"is available .*saving synchronously instead",
    ):
        handle = ckpt.save({"w": torch.zeros(10_000_000)}, step=1, blocking=False)
    assert handle.writer == "blocking" and ckpt.steps() == [1]


@pytest.mark.parametrize(
    ("call", "code", "fix"),
    [
        ("fork", errno.EAGAIN, r"the limit on processes or threads is reached"),
        ("fork", errno.ENOMEM, r"vm\.overcommit_memory"),
        ("pipe", errno.EMFILE, r"ulimit -n"),
    ],
)
def test_a_refused_fork_or_pipe_falls_back_to_a_blocking_save_with_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, call: str, code: int, fix: str
) -> None:
    # os.fork's BlockingIOError (a pids limit) or os.pipe's EMFILE came out of save raw,
    # and the step was not saved at all.
    def refused(*args: Any) -> Any:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(writer_fork.os, call, refused)
    ckpt = Checkpointer(tmp_path)
    with pytest.warns(
        UserWarning,
        match=rf"save\(step=1, blocking=False\): the system refused the forked writer .*{fix}"
        r".*saving synchronously instead",
    ):
        handle = ckpt.save({"w": torch.arange(4.0)}, step=1, blocking=False)
    monkeypatch.undo()
    assert handle.writer == "blocking" and ckpt.steps() == [1]
    w = torch.zeros(4)
    assert ckpt.restore({"w": w}) == 1 and torch.equal(w, torch.arange(4.0))


# ------------------------------------------------------------------- finding files


def test_latest_skips_a_cut_short_file_and_restore_a_damaged_one(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path)
    for step in (1, 2, 3):
        ckpt.save({"w": torch.full((1000,), float(step))}, step=step)
    newest = tmp_path / "step-000000003.pt"
    newest.write_bytes(newest.read_bytes()[:500])  # cut short (a copy that stopped)
    with pytest.warns(UserWarning, match=r"skipping checkpoint .*step-000000003\.pt"):
        assert ckpt.latest() == tmp_path / "step-000000002.pt"
    middle = tmp_path / "step-000000002.pt"
    data = bytearray(middle.read_bytes())
    at = bytes(data).index(np.float32(2.0).tobytes() * 8)
    data[at] ^= 0xFF  # one flipped byte in the tensor data: the zip directory is fine
    middle.write_bytes(bytes(data))
    state = {"w": torch.zeros(1000)}
    with pytest.warns(UserWarning, match=r"skipping checkpoint") as caught:
        assert ckpt.restore(state) == 1
    said = [str(w.message) for w in caught]
    assert any("step-000000003.pt" in m and "truncated" in m for m in said)
    assert any("step-000000002.pt" in m and "damaged" in m for m in said)
    assert torch.equal(state["w"], torch.full((1000,), 1.0))
    # The run goes on from step 1, keep=3: the two files that do not load take no place
    # among the three kept (and are not deleted); step 1 goes once three good ones exist.
    for step in (4, 5, 6):
        ckpt.save({"w": torch.full((1000,), float(step))}, step=step)
    assert ckpt.steps() == [2, 3, 4, 5, 6]
    # Step 2 written again replaces the damaged file: it counts, and goes in its turn.
    with pytest.warns(UserWarning, match="already holds step 6"):  # below the newest
        ckpt.save({"w": torch.full((1000,), 2.0)}, step=2)
    ckpt.save({"w": torch.full((1000,), 7.0)}, step=7)
    assert ckpt.steps() == [3, 5, 6, 7]


def test_latest_after_restore_found_the_newest_damaged_names_the_step_restored(
    tmp_path: Path,
) -> None:
    # restore() fell back from step 2 (a flipped byte: its pickle is fine) to step 1, but
    # latest() still named step 2, "the one restore would load": a run that logged or
    # copied latest() after resuming took the corrupt file.
    ckpt = Checkpointer(tmp_path)
    for step in (1, 2):
        ckpt.save({"w": torch.full((1000,), float(step))}, step=step)
    newest = tmp_path / "step-000000002.pt"
    data = bytearray(newest.read_bytes())
    data[bytes(data).index(np.float32(2.0).tobytes() * 8)] ^= 0xFF
    newest.write_bytes(bytes(data))
    assert ckpt.latest() == newest  # the pickle alone cannot tell
    with pytest.warns(UserWarning, match=r"skipping checkpoint .*step-000000002\.pt"):
        assert ckpt.restore({"w": torch.zeros(1000)}) == 1
    with pytest.warns(UserWarning, match=r"step-000000002\.pt: restore found it damaged"):
        assert ckpt.latest() == tmp_path / "step-000000001.pt"
    # Written again in the background: good again once written, before any wait().
    ckpt.save({"w": torch.full((1000,), 2.0)}, step=2, blocking=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ckpt.latest() == newest
    ckpt.wait()


@pytest.mark.parametrize("repair", ["copied back", "saved by another checkpointer"])
def test_a_damaged_file_put_right_is_named_by_latest_and_counted_by_keep(
    tmp_path: Path, repair: str
) -> None:
    # restore() found step 2 damaged; the user put a good copy back (or another
    # Checkpointer of the directory wrote step 2 again), but latest() kept skipping it
    # with a false warning, and keep never counted nor deleted it: a step found damaged
    # stays so only while its file is the one found so.
    ckpt = Checkpointer(tmp_path, keep=2)
    for step in (1, 2):
        ckpt.save({"w": torch.full((1000,), float(step))}, step=step)
    newest = tmp_path / "step-000000002.pt"
    good = newest.read_bytes()
    data = bytearray(good)
    data[bytes(data).index(np.float32(2.0).tobytes() * 8)] ^= 0xFF
    newest.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match=r"skipping checkpoint .*step-000000002\.pt"):
        assert ckpt.restore({"w": torch.zeros(1000)}) == 1
    if repair == "copied back":
        newest.write_bytes(good)  # same inode, same size
        os.utime(newest, ns=(10**18, 10**18))  # cp -p from a backup: the backup's mtime
    else:
        Checkpointer(tmp_path, keep=2).save({"w": torch.full((1000,), 2.0)}, step=2, force=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ckpt.latest() == newest
        for step in (3, 4):
            ckpt.save({"w": torch.full((1000,), float(step))}, step=step)
    assert ckpt.steps() == [3, 4]  # step 2 counted, and went in its turn


def test_a_step_restore_loads_after_its_link_is_mended_is_not_damaged_any_more(
    tmp_path: Path,
) -> None:
    # A step file that is a link to a file on a mount not up yet: restore skipped it and
    # loaded step 1; once the target was back, restore loaded step 9, but latest() still
    # skipped it ("restore found it damaged and loaded an older step").
    directory, store = tmp_path / "ckpt", tmp_path / "store"
    ckpt = Checkpointer(directory, keep=2)
    ckpt.save({"w": torch.ones(1)}, step=1)
    Checkpointer(store).save({"w": torch.full((1,), 9.0)}, step=9)
    target = store / "step-000000009.pt"
    target.rename(store / "moved.pt")
    (directory / "step-000000009.pt").symlink_to(target)
    with pytest.warns(UserWarning, match=r"skipping checkpoint .*step-000000009\.pt"):
        assert ckpt.restore({"w": torch.zeros(1)}) == 1
    (store / "moved.pt").rename(target)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ckpt.restore({"w": torch.zeros(1)}) == 9
        assert ckpt.latest() == directory / "step-000000009.pt"


def test_a_step_restore_loads_on_a_later_try_is_not_damaged_any_more(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The file did not change, yet it loaded the second time (bad bytes from a flaky
    # network filesystem, once): what restore loads is not damaged, whatever it found before.
    ckpt = Checkpointer(tmp_path)
    for step in (1, 2):
        ckpt.save({"w": torch.full((4,), float(step))}, step=step)
    real = restore_module.load_checkpoint
    glitches = [CheckpointError("CRC-32 mismatch (a read glitch)")]

    def flaky(path: Path, *args: Any, **kwargs: Any) -> Any:
        if glitches:
            raise glitches.pop()
        return real(path, *args, **kwargs)

    monkeypatch.setattr(restore_module, "load_checkpoint", flaky)
    with pytest.warns(UserWarning, match=r"skipping checkpoint .*step-000000002\.pt"):
        assert ckpt.restore({"w": torch.zeros(4)}) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ckpt.restore({"w": torch.zeros(4)}) == 2
        assert ckpt.latest() == tmp_path / "step-000000002.pt"


def test_restore_out_of_memory_stops_rather_than_fall_back_to_an_older_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = Checkpointer(tmp_path)
    for step in (1, 2):
        ckpt.save({"w": torch.full((4,), float(step))}, step=step)

    def allocation_fails(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8")

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "skipping checkpoint": the file is fine
        monkeypatch.setattr(torch, "load", allocation_fails)
        with pytest.raises(MemoryError, match=r"step-000000002\.pt .*not damaged"):
            ckpt.restore({"w": torch.zeros(4)})
    monkeypatch.undo()
    assert ckpt.restore({"w": torch.zeros(4)}) == 2  # nothing was marked damaged


@pytest.mark.parametrize(
    ("code", "kind", "fix"),
    [
        (errno.EIO, OSError, r"check the storage and retry"),
        (errno.EACCES, PermissionError, r"check its permissions"),
        (errno.EMFILE, OSError, r"ulimit -n"),
    ],
)
def test_restore_stops_on_a_file_it_cannot_read_rather_than_fall_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int, kind: type, fix: str
) -> None:
    # An unreadable file was "damaged": restore warned, fell back to step 1 (or 0), and the
    # run went on from there while the real newest checkpoint sat unread.
    ckpt = Checkpointer(tmp_path)
    for step in (1, 2):
        ckpt.save({"w": torch.full((4,), float(step))}, step=step)
    real_open = open

    def failing_open(path: Any, *args: Any, **kwargs: Any) -> Any:
        if str(path).endswith("step-000000002.pt"):
            raise OSError(code, os.strerror(code), str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(read_module, "open", failing_open, raising=False)
    w = torch.zeros(4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "skipping checkpoint": the file may be fine
        with pytest.raises(
            kind,
            match=rf"restore stops at step 2 .*cannot read checkpoint .*step-000000002\.pt.*{fix}",
        ) as info:
            ckpt.restore({"w": w})
    assert info.value.errno == code and not isinstance(info.value, CheckpointError)
    assert torch.equal(w, torch.zeros(4))  # nothing older was put in
    monkeypatch.undo()
    assert ckpt.restore({"w": w}) == 2 and torch.equal(w, torch.full((4,), 2.0))


@pytest.mark.parametrize(("code", "kind"), [(errno.EIO, OSError), (errno.EACCES, PermissionError)])
def test_latest_stops_on_a_file_it_cannot_read_as_restore_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int, kind: type
) -> None:
    # latest() warned "skipping checkpoint" and returned step 1: a resume from it lost the
    # steps since, while restore() stopped on the same file.
    ckpt = Checkpointer(tmp_path)
    for step in (1, 2, 3):
        ckpt.save({"w": torch.full((1000,), float(step))}, step=step)
    newest = tmp_path / "step-000000003.pt"
    newest.write_bytes(newest.read_bytes()[:500])  # cut short: still skipped
    real_skim = held_module.skim

    def failing_skim(path: Path) -> Any:
        if path.name == "step-000000002.pt":
            raise OSError(code, os.strerror(code), str(path))
        return real_skim(path)

    monkeypatch.setattr(held_module, "skim", failing_skim)
    monkeypatch.setattr(held_module, "_HELD", {})  # as a new process: nothing read yet
    with (
        warnings.catch_warnings(record=True) as caught,
        pytest.raises(
            kind,
            match=r"latest stops at step 2 rather than fall back to an older checkpoint: "
            r"cannot read checkpoint .*step-000000002\.pt",
        ) as info,
    ):
        warnings.simplefilter("always")
        ckpt.latest()
    assert info.value.errno == code and not isinstance(info.value, CheckpointError)
    assert [str(w.message).split(":")[0] for w in caught] == [f"skipping checkpoint {newest}"]
    monkeypatch.undo()
    with pytest.warns(UserWarning, match=r"skipping checkpoint .*step-000000003\.pt"):
        assert ckpt.latest() == tmp_path / "step-000000002.pt"


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a file whatever its mode")
def test_latest_stops_on_a_file_without_read_permission(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path)
    for step in (1, 2):
        ckpt.save({"w": torch.full((4,), float(step))}, step=step)
    newest = tmp_path / "step-000000002.pt"
    newest.chmod(0)
    try:
        with pytest.raises(PermissionError, match=r"latest stops at step 2 .*check its permis"):
            ckpt.latest()
    finally:
        newest.chmod(0o644)


def test_a_damaged_step_written_again_in_the_background_counts_and_goes(tmp_path: Path) -> None:
    # A forked writer's own record of the replaced file stays in its copy of the
    # Checkpointer: the parent must clear it too, or keep never counts nor deletes it.
    ckpt = Checkpointer(tmp_path, keep=2)
    for step in (1, 2, 3):
        ckpt.save({"w": torch.full((1000,), float(step))}, step=step)
    newest = tmp_path / "step-000000003.pt"
    data = bytearray(newest.read_bytes())
    data[bytes(data).index(np.float32(3.0).tobytes() * 8)] ^= 0xFF
    newest.write_bytes(bytes(data))
    resumed = Checkpointer(tmp_path, keep=2)
    with pytest.warns(UserWarning, match="damaged"):
        assert resumed.restore({"w": torch.zeros(1000)}) == 2
    for step in (3, 4, 5, 6):
        handle = resumed.save({"w": torch.full((1000,), float(step))}, step=step, blocking=False)
        resumed.wait()
    assert handle.writer == ("process" if writer_fork.fork_writes() else "thread")
    assert resumed.steps() == [5, 6]


def test_state_over_shared_memory_is_copied_before_a_background_save_returns(
    tmp_path: Path,
) -> None:
    # A fork shares a shared mapping's pages: the loop's next write would reach the file.
    from multiprocessing import shared_memory

    shm = shared_memory.SharedMemory(create=True, size=4 * 1024)
    try:
        array = np.ndarray((1024,), dtype=np.float32, buffer=shm.buf)
        array[:] = 1.0
        tensor = torch.from_numpy(np.ndarray((1024,), dtype=np.float32, buffer=shm.buf))
        for name, value in (("array", array), ("tensor", tensor)):
            array[:] = 1.0
            ckpt = Checkpointer(tmp_path / name)
            handle = ckpt.save({"x": value}, step=1, blocking=False)
            array[:] = 2.0  # the next training step, right after save returned
            ckpt.wait()
            assert handle.writer == "thread", name
            assert np.all(np.asarray(load_checkpoint(handle.path)["x"]) == 1.0), name
        del array, tensor, value
    finally:
        shm.close()
        shm.unlink()


def test_a_killed_writers_temp_file_goes_when_the_directory_is_opened(tmp_path: Path) -> None:
    Checkpointer(tmp_path).save({"n": 1}, step=1)
    stale = temp_name(tmp_path / "step-000000002.pt", this_host(), 0)
    stale.write_bytes(b"half of a save killed with -9")
    ckpt = Checkpointer(tmp_path)
    assert ckpt.removed_temps == [stale.name] and not stale.exists()
    assert ckpt.steps() == [1]


def test_a_directory_that_is_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "runs").write_text("a log")
    with pytest.raises(CheckpointError, match=r"runs is a file, not a directory: give a directory"):
        Checkpointer(tmp_path / "runs")
    with pytest.raises(CheckpointError, match=r"exp1 is in .*runs, a file, not a directory"):
        Checkpointer(tmp_path / "runs" / "exp1")  # it raised a bare NotADirectoryError


def test_a_directory_replaced_by_a_file_is_named_not_a_bare_traceback(tmp_path: Path) -> None:
    # steps(), latest(), restore() and save() raised os.listdir's bare NotADirectoryError.
    ckpt = Checkpointer(tmp_path / "runs")
    ckpt.save({"w": torch.ones(1)}, step=1)
    for name in os.listdir(tmp_path / "runs"):
        os.unlink(tmp_path / "runs" / name)
    os.rmdir(tmp_path / "runs")
    (tmp_path / "runs").write_text("a log")
    calls = {
        "steps": ckpt.steps,
        "latest": ckpt.latest,
        "restore": lambda: ckpt.restore({"w": torch.zeros(1)}),
        "save": lambda: ckpt.save({"w": torch.ones(1)}, step=2),
    }
    for method, call in calls.items():
        with pytest.raises(
            CheckpointError, match=r"runs is a file, not a directory: give a directory"
        ):
            call()
        assert (tmp_path / "runs").read_text() == "a log", method


def _listdir_refused(monkeypatch: pytest.MonkeyPatch, directory: Path) -> None:
    """os.listdir of ``directory`` fails with EACCES, as for a mode-0 directory (whose mode
    root ignores)."""
    real = os.listdir

    def listdir(path: Any = ".") -> list[str]:
        if os.fspath(path) == os.fspath(directory):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(path))
        return real(path)

    monkeypatch.setattr(os, "listdir", listdir)


def test_a_directory_that_cannot_be_listed_is_named_with_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Checkpointer(), steps(), latest() and restore() raised a bare PermissionError from
    # os.listdir, naming neither the Checkpointer nor what to check.
    ckpt = Checkpointer(tmp_path)
    ckpt.save({"w": torch.ones(1)}, step=1)
    _listdir_refused(monkeypatch, tmp_path)
    calls = {
        "Checkpointer": lambda: Checkpointer(tmp_path),
        "steps": ckpt.steps,
        "latest": ckpt.latest,
        "restore": lambda: ckpt.restore({"w": torch.zeros(1)}),
    }
    for method, call in calls.items():
        with pytest.raises(
            PermissionError,
            match=rf"cannot list the Checkpointer directory {tmp_path}: Permission denied\. "
            r"The step files in it may be fine: check the permissions of it and the "
            r"directories above it \(ls -ld",
        ) as info:
            call()
        assert info.value.errno == errno.EACCES, method


@pytest.mark.skipif(os.geteuid() == 0, reason="root lists a directory whatever its mode")
def test_a_directory_without_read_permission_is_named_with_the_fix(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    Checkpointer(runs).save({"w": torch.ones(1)}, step=1)
    runs.chmod(0)
    try:
        with pytest.raises(PermissionError, match=r"cannot list the Checkpointer directory"):
            Checkpointer(runs)
    finally:
        runs.chmod(0o755)


def test_a_directory_with_a_step_files_name_names_a_checkpointers_fix(tmp_path: Path) -> None:
    # It said to "give a file path such as .../step-000000009.pt/checkpoint.pt": a
    # Checkpointer names its files itself.
    (tmp_path / "step-000000009.pt").mkdir()
    with pytest.raises(
        CheckpointError,
        match=r"step-000000009\.pt: it is a directory.* a Checkpointer names its step files "
        r"itself: remove that directory, or rename it",
    ) as info:
        Checkpointer(tmp_path).save({"w": torch.ones(1)}, step=9)
    assert "give a file path" not in str(info.value)


@pytest.mark.timeout(20)
def test_a_named_pipe_at_a_step_files_name_names_a_checkpointers_fix(tmp_path: Path) -> None:
    # It said to "save to a regular file's path": a Checkpointer names its files itself.
    fifo = tmp_path / "step-000000009.pt"
    os.mkfifo(fifo)
    with pytest.raises(
        CheckpointError,
        match=r"step-000000009\.pt: it is a named pipe \(FIFO\), not a regular file, and a "
        r"Checkpointer names its step files itself: remove that file, or rename it",
    ) as info:
        Checkpointer(tmp_path).save({"w": torch.ones(1)}, step=9)
    assert "regular file's path" not in str(info.value) and fifo.is_fifo()


def test_an_empty_step_file_is_called_empty_in_every_warning(tmp_path: Path) -> None:
    # Save, latest and restore said "neither a torch zip archive nor a legacy torch.save
    # file" of a zero-byte file: a save or copy cut off, not a foreign file.
    ckpt = Checkpointer(tmp_path)
    ckpt.save({"w": torch.ones(1)}, step=1)
    (tmp_path / "step-000000009.pt").write_bytes(b"")
    empty = r"step-000000009\.pt.* empty \(0 bytes\)"
    with pytest.warns(UserWarning, match=rf"{empty}: a save or copy that was cut off"):
        ckpt.save({"w": torch.ones(1)}, step=2)
    with pytest.warns(UserWarning, match=rf"skipping checkpoint .*{empty}"):
        assert ckpt.latest() == tmp_path / "step-000000002.pt"
    with pytest.warns(UserWarning, match=rf"skipping checkpoint .*{empty}"):
        assert Checkpointer(tmp_path).restore({"w": torch.zeros(1)}) == 2


@pytest.mark.timeout(20)
def test_a_named_pipe_with_a_temp_files_name_is_not_opened(tmp_path: Path) -> None:
    # Removing dead writers' temp files opened it write-only, which waits for a reader:
    # Checkpointer() hung.
    fifo = temp_name(tmp_path / "step-000000002.pt", this_host(), 0)
    os.mkfifo(fifo)
    ckpt = Checkpointer(tmp_path)
    assert ckpt.removed_temps == [] and fifo.is_fifo()
    ckpt.save({"w": torch.ones(1)}, step=2)  # its first slot taken: the next one is used
    assert ckpt.steps() == [2] and fifo.is_fifo()


def test_a_directory_under_home_is_expanded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    ckpt = Checkpointer("~/runs")
    ckpt.save({"x": torch.ones(1)}, step=1)
    assert ckpt.directory == tmp_path / "home" / "runs" and ckpt.steps() == [1]
    assert not (tmp_path / "~").exists()


def test_a_relative_directory_stays_put_after_chdir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    here, elsewhere = tmp_path / "here", tmp_path / "elsewhere"
    # Another run's checkpoints under the same relative name in the new working directory.
    other = Checkpointer(elsewhere / "runs", keep=5)
    for step in (1, 2, 3):
        other.save({"x": torch.full((2,), -1.0)}, step=step)
    here.mkdir()
    monkeypatch.chdir(here)
    ckpt = Checkpointer("runs", keep=1)
    ckpt.save({"x": torch.ones(2)}, step=4)
    monkeypatch.chdir(elsewhere)  # the script moves on; the checkpoints must not
    ckpt.save({"x": torch.full((2,), 5.0)}, step=5)
    assert ckpt.directory == here / "runs" and ckpt.steps() == [5]
    assert other.steps() == [1, 2, 3]  # keep=1 deleted nothing of the other run
    state = {"x": torch.zeros(2)}
    assert ckpt.restore(state) == 5 and torch.equal(state["x"], torch.full((2,), 5.0))


def test_arguments_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"keep must be an int >= 1, got 0"):
        Checkpointer(tmp_path, keep=0)
    with pytest.raises(ValueError, match=r"every must be None or an int >= 1, got 2.5"):
        Checkpointer(tmp_path, every=2.5)  # type: ignore[arg-type]
    ckpt = Checkpointer(tmp_path)
    with pytest.raises(ValueError, match=r"step must be an int >= 0, got -1"):
        ckpt.save({}, step=-1)
    with pytest.raises(ValueError, match=r"blocking must be one of \(True, False\), got 'no'"):
        ckpt.save({}, step=1, blocking="no")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"Checkpointer.save takes a dict of what to save"):
        ckpt.save([1, 2], step=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"the state's keys must be strings, got \[1\]"):
        ckpt.save({1: 2}, step=1)  # type: ignore[dict-item]
    with pytest.raises(ValueError, match=r"the key 'trainperf' is reserved"):
        ckpt.save({"trainperf": 1}, step=1)
    with pytest.raises(TypeError, match=r"Checkpointer.restore takes a dict of the live objects"):
        ckpt.restore(nn.Linear(1, 1))  # type: ignore[arg-type]


# --------------------------------------------------------------------------- restore


def test_restore_without_a_checkpoint_returns_0(tmp_path: Path) -> None:
    model = _model()
    before = [p.clone() for p in model.parameters()]
    assert Checkpointer(tmp_path / "new").restore({"model": model}) == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_restore_puts_every_object_and_the_random_state_back(tmp_path: Path) -> None:
    state = _trained()
    mp = MixedPrecision("cpu", precision="fp32")
    scaler = torch.amp.GradScaler("cpu", init_scale=512.0)
    extra = {"schedulers": [state["scheduler"]], "best": 0.25, "tag": ("a", 1)}
    saved_state = {**state, "mp": mp, "scaler": scaler, "extra": extra, "epoch": 4}
    ckpt = Checkpointer(tmp_path)
    random.seed(3)
    torch.manual_seed(3)
    ckpt.save({**saved_state, "model": nn.DataParallel(state["model"])}, step=12)
    expected = (random.random(), torch.rand(2).tolist())
    fresh = _trained()
    torch.manual_seed(77)
    fresh["model"] = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    fresh["optimizer"] = torch.optim.Adam(fresh["model"].parameters(), lr=0.1)
    fresh["scheduler"] = torch.optim.lr_scheduler.StepLR(fresh["optimizer"], 1, gamma=0.5)
    live: dict[str, Any] = {
        **fresh,
        "mp": MixedPrecision("cpu", precision="fp32"),
        "scaler": torch.amp.GradScaler("cpu"),
        "extra": {"schedulers": [fresh["scheduler"]], "best": 9.0, "tag": ("b", 2)},
        "epoch": 0,
    }
    assert ckpt.restore(live) == 12
    assert (random.random(), torch.rand(2).tolist()) == expected
    for a, b in zip(live["model"].parameters(), state["model"].parameters(), strict=True):
        assert torch.equal(a, b)
    assert json.dumps(str(live["optimizer"].state_dict())) == json.dumps(
        str(state["optimizer"].state_dict())
    )
    assert live["scheduler"].last_epoch == state["scheduler"].last_epoch == 3
    assert live["scaler"].get_scale() == 512.0
    assert live["epoch"] == 4 and live["extra"]["best"] == 0.25 and live["extra"]["tag"] == ("a", 1)


def test_restore_says_which_entries_the_checkpoint_lacks(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path)
    ckpt.save({"model": _model()}, step=1)
    with pytest.raises(ValueError, match=r"has no entry 'ema' \(it holds \['model'\]\)"):
        ckpt.restore({"model": _model(), "ema": _model()})
    with pytest.raises(StateDictMismatchError, match=r"does not fit Linear"):
        ckpt.restore({"model": nn.Linear(4, 8)})


def test_a_model_that_does_not_fit_names_a_fix_restore_takes(tmp_path: Path) -> None:
    # The message said "pass strict=False", which restore has no parameter for.
    ckpt = Checkpointer(tmp_path)
    ckpt.save({"model": nn.Linear(2, 2)}, step=1)
    with pytest.raises(StateDictMismatchError, match=r"1 shape mismatch") as info:
        ckpt.restore({"model": nn.Linear(3, 2)})  # the bias fits, the weight does not
    text = str(info.value)
    assert "pass strict=False" not in text, text
    assert (
        "or restore without it (Checkpointer.restore loads modules strictly), then pass "
        "trainperf.load_checkpoint(path)['model'] to trainperf.load_state_dict(module, ..., "
        "strict=False) to load only the keys that fit."
    ) in text, text


def test_a_value_that_cannot_be_loaded_names_a_fix_restore_takes(tmp_path: Path) -> None:
    # The refusal of values without data (a sparse buffer into a dense one) still said
    # "pass strict=False", which restore has no parameter for.
    class Buffered(nn.Module):
        def __init__(self, sparse: bool) -> None:
            super().__init__()
            eye = torch.eye(3)
            self.register_buffer("b", eye.to_sparse() if sparse else eye)

    ckpt = Checkpointer(tmp_path)
    ckpt.save({"model": Buffered(sparse=True)}, step=1)
    with pytest.raises(StateDictMismatchError, match=r"cannot be loaded into the model") as info:
        ckpt.restore({"model": Buffered(sparse=False)})
    text = str(info.value)
    assert "pass strict=False" not in text, text
    assert "drop those keys and restore without it" in text, text


def test_a_nested_model_that_does_not_fit_names_the_top_level_entry_to_leave_out(
    tmp_path: Path,
) -> None:
    # "restore without it" named state['nets'][0], but restore takes top-level entries only.
    ckpt = Checkpointer(tmp_path)
    ckpt.save({"nets": [nn.Linear(2, 2), nn.Linear(2, 2)]}, step=1)
    with pytest.raises(StateDictMismatchError, match=r"1 shape mismatch") as info:
        ckpt.restore({"nets": [nn.Linear(3, 2), nn.Linear(2, 2)]})
    text = str(info.value)
    assert (
        "or restore without the entry 'nets' that holds it (Checkpointer.restore takes "
        "top-level entries whole and loads modules strictly; load its other objects from the "
        "file yourself), then pass trainperf.load_checkpoint(path)['nets'][0] to "
        "trainperf.load_state_dict(module, ..., strict=False) to load only the keys that fit."
    ) in text, text


@pytest.mark.parametrize("device", ["gpu", "CPU"])
def test_restore_refuses_a_device_that_is_not_one_before_reading_any_file(
    tmp_path: Path, device: str, recwarn: pytest.WarningsRecorder
) -> None:
    ckpt = Checkpointer(tmp_path)
    for step in (1000, 2000):
        ckpt.save({"model": _model()}, step=step)
    with pytest.raises(ValueError, match=rf"invalid device '{device}': expected 'auto', 'cpu'"):
        ckpt.restore({"model": _model()}, device=device)  # it returned 0: a restart
    assert not [w for w in recwarn if "skipping checkpoint" in str(w.message)]
    assert ckpt.steps() == [1000, 2000]


@pytest.mark.parametrize("device", ["cpu:0", torch.device("cpu", 0)])
def test_restore_onto_cpu_with_an_index_restores_the_newest_step(
    tmp_path: Path, device: Any, recwarn: pytest.WarningsRecorder
) -> None:
    # Before: torch.load cannot map onto "cpu:0", every file was skipped as damaged, and the
    # run restarted from step 0.
    ckpt = Checkpointer(tmp_path)
    ckpt.save({"model": _model()}, step=1000)
    assert ckpt.restore({"model": _model()}, device=device) == 1000
    assert not [w for w in recwarn if "skipping checkpoint" in str(w.message)]


def test_a_plain_dict_gets_the_entries_it_lacks_and_a_tensor_is_copied_into(
    tmp_path: Path,
) -> None:
    queue = torch.zeros(4)
    state: dict[str, Any] = {"model": _model(), "meta": {}, "queue": torch.arange(4.0)}
    state["meta"].update(best_acc=0.93, best_step=100)
    Checkpointer(tmp_path).save(state, step=100)
    meta: dict[str, Any] = {"tag": "kept"}  # a fresh run's dict, before training filled it
    live: dict[str, Any] = {"model": _model(), "meta": meta, "queue": queue}
    assert Checkpointer(tmp_path).restore(live) == 100
    assert live["meta"] is meta and meta == {"tag": "kept", "best_acc": 0.93, "best_step": 100}
    assert live["queue"] is queue and torch.equal(queue, torch.arange(4.0))  # copied into
    # Another shape, another dtype (never cast: 2.7 would become 2), or a tensor that cannot
    # be written (expanded: one element in four places): replaced by the saved one.
    for other in (torch.zeros(3), torch.zeros(4, dtype=torch.int64), torch.zeros(1).expand(4)):
        live["queue"] = other
        Checkpointer(tmp_path).restore(live)
        assert live["queue"] is not other and torch.equal(live["queue"], torch.arange(4.0))


def test_a_nested_state_dict_is_saved_with_its_keys_as_given(tmp_path: Path) -> None:
    ema = nn.Sequential()
    ema.add_module("module", nn.Linear(2, 2))  # timm's ModelEmaV2: its one child is `module`
    Checkpointer(tmp_path).save({"ema_states": {"ema": ema.state_dict()}}, step=1)
    saved = load_checkpoint(tmp_path / "step-000000001.pt")["ema_states"]["ema"]
    assert sorted(saved) == ["module.bias", "module.weight"]
    ema.load_state_dict(saved)  # as save_checkpoint keeps it


Pair = collections.namedtuple("Pair", "gen disc")


def test_a_namedtuple_of_modules_is_restored_into_its_modules(tmp_path: Path) -> None:
    before = torch.serialization.get_safe_globals()
    torch.serialization.add_safe_globals([Pair])  # as the docs advise for a namedtuple
    try:
        saved = Pair(_model(), nn.Linear(2, 2))
        Checkpointer(tmp_path).save({"nets": saved, "tag": 1}, step=1)
        torch.manual_seed(5)
        live: dict[str, Any] = {"nets": Pair(_model(), nn.Linear(2, 2)), "tag": 0}
        gen, disc = live["nets"]
        assert Checkpointer(tmp_path).restore(live) == 1
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before)
    assert live["nets"].gen is gen and live["nets"].disc is disc  # loaded into, not replaced
    assert torch.equal(disc.weight, saved.disc.weight) and live["tag"] == 1


def test_a_loader_resumes_mid_epoch_through_save_and_restore(tmp_path: Path) -> None:
    data = TensorDataset(torch.arange(48))
    torch.manual_seed(5)
    loader = DataLoader(data, batch_size=4, shuffle=True)
    ckpt = Checkpointer(tmp_path)
    assert ckpt.restore({"loader": loader}) == 0  # tracks the loader from its first batch
    it = iter(loader)
    for _ in range(5):
        next(it)
    ckpt.save({"loader": loader}, step=5, blocking=False)
    rest = [b[0].tolist() for b in it]
    ckpt.wait()
    torch.manual_seed(0)
    again = DataLoader(data, batch_size=4, shuffle=True)
    assert Checkpointer(tmp_path).restore({"loader": again}) == 5
    assert [b[0].tolist() for b in again] == rest


def test_a_loader_never_given_to_restore_is_saved_with_a_warning(tmp_path: Path) -> None:
    loader = DataLoader(TensorDataset(torch.arange(8)), batch_size=2)
    with pytest.warns(UserWarning, match=r"loader 'loader' was not given to Checkpointer.restore"):
        Checkpointer(tmp_path).save({"loader": loader}, step=1)
    assert load_checkpoint(tmp_path / "step-000000001.pt")["loader"] is None


def test_the_context_manager_waits_for_the_write(tmp_path: Path) -> None:
    with Checkpointer(tmp_path) as ckpt:
        handle: SaveHandle = ckpt.save({"w": torch.ones(10)}, step=3, blocking=False)
    assert handle.done() and ckpt.steps() == [3]
    assert repr(ckpt) == f"Checkpointer({str(tmp_path)!r}, keep=3)"


@pytest.mark.slow  # two forked gloo ranks
def test_under_a_group_rank0_writes_and_each_rank_gets_its_own_random_state(
    tmp_path: Path,
) -> None:
    results = spawn(_agree.save_and_restore_on_two_ranks, args=(str(tmp_path),), start_method=FORK)
    assert results[0]["step"] == results[1]["step"] == 5
    assert results[0]["same_draws"] and results[1]["same_draws"]
    assert results[0]["weights"] == results[1]["weights"]  # rank 0's model, on both
    assert results[0]["files"] == ["step-000000005.pt", "step-000000005.rank-00001.pt"]


# -------------------------------------------------------------------------------- GPU


@pytest.mark.requires_cuda
def test_a_gpu_state_is_staged_into_pinned_buffers_and_saved_bit_for_bit(tmp_path: Path) -> None:
    w = torch.arange(1_000_000, device="cuda", dtype=torch.float32)
    model = nn.Linear(4, 4).cuda()
    ckpt = Checkpointer(tmp_path)
    for step in (1, 2):  # the second reuses the first one's pinned buffers
        handle = ckpt.save({"w": w, "model": model}, step=step, blocking=False)
        assert handle.writer == "thread"
        w.mul_(-1)  # the next step changes the GPU tensor right away
        ckpt.wait()
    buffers = ckpt._staging._buffers
    assert buffers and all(b.is_pinned() for b in buffers)
    saved = load_checkpoint(tmp_path / "step-000000002.pt")
    assert torch.equal(saved["w"], -torch.arange(1_000_000, dtype=torch.float32))
    assert saved["trainperf"]["rng"]["cuda"] is not None  # every CUDA device's state
    fresh = nn.Linear(4, 4).cuda()
    assert ckpt.restore({"w": torch.zeros(1), "model": fresh}) == 2
    assert next(fresh.parameters()).device.type == "cuda"
    for a, b in zip(fresh.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.requires_cuda
def test_restore_onto_a_gpu_sets_the_generators_and_the_loader_from_the_cpu(
    tmp_path: Path,
) -> None:
    loader = DataLoader(TensorDataset(torch.arange(8.0)), batch_size=2, shuffle=True)
    state: dict[str, Any] = {"model": nn.Linear(2, 2).cuda(), "loader": loader}
    ckpt = Checkpointer(tmp_path)
    ckpt.restore(state)
    next(iter(loader))
    ckpt.save(state, step=1)
    expected = torch.rand(3)
    torch.manual_seed(99)
    assert ckpt.restore(state, device="cuda") == 1  # the file's tensors loaded onto the GPU
    assert torch.equal(torch.rand(3), expected)


def test_restore_hands_the_generator_and_loader_states_over_on_the_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import trainperf.checkpoint._payload as payload

    moved: list[str] = []
    real = payload.to_device

    def spy(obj: Any, device: Any) -> Any:
        moved.append(str(device))
        return real(obj, device)

    monkeypatch.setattr(payload, "to_device", spy)
    loader = DataLoader(TensorDataset(torch.arange(8.0)), batch_size=2, shuffle=True)
    state: dict[str, Any] = {"model": _model(), "loader": loader}
    ckpt = Checkpointer(tmp_path)
    ckpt.restore(state)
    ckpt.save(state, step=1)
    assert ckpt.restore(state) == 1
    assert moved == ["cpu", "cpu"]  # the loader's state, then the generators'


def _epoch_loop(
    make: Any, shape: str, epochs: int, folder: Path, stop: int | None = None
) -> list[tuple[int, tuple[int, ...], float]]:
    """An epoch loop as scripts write it, a save at step ``stop`` then the run ends: (epoch,
    batch, a random draw) per step. ``shape`` "epochs": ``for epoch in range(step //
    len(loader), epochs)`` with ``set_epoch`` where the sampler has it; "while": ``while
    step < total``, the loader iterated again and again."""
    loader = make()
    sampler = loader.sampler
    ckpt = Checkpointer(folder, keep=2)
    step = ckpt.restore({"loader": loader})
    total, seen = epochs * len(loader), []

    def one_pass(epoch: int) -> bool:
        nonlocal step
        for (batch,) in loader:
            seen.append((epoch, tuple(batch.tolist()), round(torch.rand(1).item(), 6)))
            step += 1
            if step == stop:
                ckpt.save({"loader": loader}, step=step)
                return True
            if step == total:
                break
        return False

    if shape == "epochs":
        for epoch in range(step // len(loader), epochs):
            if isinstance(sampler, DistributedSampler):
                sampler.set_epoch(epoch)
            if one_pass(epoch):
                break
    else:
        while step < total and not one_pass(step // len(loader)):
            pass
    return seen


@pytest.mark.parametrize("shape", ["epochs", "while"])
@pytest.mark.parametrize("sampler", ["shuffle", "distributed"])
@pytest.mark.parametrize(
    "drop_last, stop",
    [(False, 7), (False, 10), (False, 11), (False, 20), (True, 13), (True, 26)],
)
def test_a_save_at_any_batch_resumes_the_epoch_loop_exactly(
    tmp_path: Path, shape: str, sampler: str, drop_last: bool, stop: int
) -> None:
    # A save at an epoch's last batch (10 and 20 of 10-batch epochs; 13 and 26 with 13),
    # taken before the loader's StopIteration, was kept as an unfinished pass: the resumed
    # `for epoch in range(step // len(loader), E)` spent its next epoch on that pass's empty
    # tail and trained one epoch fewer, silently.
    data = TensorDataset(torch.arange(40))
    batch_size = 3 if drop_last else 4

    def make() -> DataLoader[Any]:
        if sampler == "distributed":
            order = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
            return DataLoader(data, batch_size=batch_size, sampler=order, drop_last=drop_last)
        return DataLoader(data, batch_size=batch_size, shuffle=True, drop_last=drop_last)

    torch.manual_seed(0)
    straight = _epoch_loop(make, shape, 3, tmp_path / "straight")
    torch.manual_seed(0)
    first = _epoch_loop(make, shape, 3, tmp_path / "run", stop=stop)
    torch.manual_seed(999)  # the resumed process starts from other random states
    rest = _epoch_loop(make, shape, 3, tmp_path / "run")
    assert len(first) == stop and len(straight) == 3 * len(make())
    assert first + rest == straight


@pytest.mark.parametrize(
    "value",
    [
        http.HTTPStatus.OK,
        torch.Generator().manual_seed(1),
        {"w": torch.ones(3), "status": [http.HTTPStatus.OK]},  # beside tensors too
    ],
)
def test_a_value_restore_could_never_load_is_refused_before_it_is_written(
    tmp_path: Path, value: Any
) -> None:
    # Saved, it made every checkpoint unloadable: restore skipped them all and returned 0.
    ckpt = Checkpointer(tmp_path)
    ckpt.save({"model": nn.Linear(2, 2), "epoch": 1}, step=1)
    refused = r"not saving .*step-000000002\.pt: state\['extra'\] holds a value that restore"
    with pytest.raises(CheckpointError, match=refused):
        ckpt.save({"model": nn.Linear(2, 2), "extra": value}, step=2)
    ckpt.save({"extra": value}, step=3, blocking=False)  # the writer refuses it
    with pytest.raises(CheckpointError, match=r"state\['extra'\] holds a value that restore"):
        ckpt.wait()
    assert ckpt.steps() == [1]


@pytest.mark.parametrize("writer", ["process", "thread"])
def test_a_background_save_is_checked_in_the_callers_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writer: str
) -> None:
    # The check widens torch's allow-list while it loads: from the writer thread, a load in
    # the training thread meanwhile saw it widened, or had its own entries taken away.
    if writer == "thread":
        monkeypatch.setattr(checkpointer_module, "fork_writes", lambda: False)
    real, threads = writer_module.save_refusal, []

    def recorded(value: Any) -> Any:
        threads.append(threading.current_thread())
        return real(value)

    monkeypatch.setattr(writer_module, "save_refusal", recorded)
    ckpt = Checkpointer(tmp_path)
    assert ckpt.save({"w": torch.ones(2), "n": 1}, step=1, blocking=False).writer == writer
    ckpt.wait()
    assert threads and set(threads) == {threading.main_thread()}


def test_a_complete_checkpoint_that_weights_only_refuses_stops_restore(tmp_path: Path) -> None:
    # Written by an older trainperf (or with the class allowed then): restore must not fall
    # back to an older file, or 0, and lose every step since.
    model = nn.Linear(2, 2)
    Checkpointer(tmp_path).save({"model": model, "status": 1}, step=1)
    with torch.serialization.safe_globals([http.HTTPStatus]):
        Checkpointer(tmp_path).save({"model": model, "status": http.HTTPStatus.OK}, step=2)
    with pytest.raises(UnsafeCheckpointError, match=r"stops at step 2 rather than fall back"):
        Checkpointer(tmp_path).restore({"model": nn.Linear(2, 2), "status": None})
    with torch.serialization.safe_globals([http.HTTPStatus]):
        state: dict[str, Any] = {"model": nn.Linear(2, 2), "status": None}
        assert Checkpointer(tmp_path).restore(state) == 2
    assert state["status"] is http.HTTPStatus.OK


def test_a_step_file_from_a_newer_torch_stops_restore(tmp_path: Path) -> None:
    # It was skipped as damaged for step 1 (and left out of keep=), losing the steps since,
    # on a machine whose torch is older than the one that saved it.
    ckpt = Checkpointer(tmp_path)
    for step in (1, 2):
        ckpt.save({"w": torch.full((1,), float(step))}, step=step)
    as_if_from_newer_torch(tmp_path / "step-000000002.pt")
    w = torch.zeros(1)
    with pytest.raises(
        CheckpointError, match=r"restore stops at step 2 rather than fall back .*newer PyTorch"
    ):
        Checkpointer(tmp_path).restore({"w": w})
    assert torch.equal(w, torch.zeros(1))  # step 1 was not loaded instead


def test_nested_entries_the_checkpoint_lacks_are_named(tmp_path: Path) -> None:
    nets = {"gen": nn.Linear(2, 2)}
    Checkpointer(tmp_path).save({"nets": nets, "heads": [nn.Linear(2, 2)]}, step=5)
    live = {"nets": {"gen": nn.Linear(2, 2), "disc": nn.Linear(2, 2)}, "heads": [nn.Linear(2, 2)]}
    with pytest.raises(ValueError, match=r"step-000000005\.pt: the checkpoint's nets has no entry "
                       r"'disc' to load into it \(it holds 'gen'\)"):  # fmt: skip
        Checkpointer(tmp_path).restore(live)
    assert not torch.equal(live["nets"]["gen"].weight, nets["gen"].weight)  # nothing loaded
    two_heads = {"nets": {"gen": nn.Linear(2, 2)}, "heads": [nn.Linear(2, 2), nn.Linear(2, 2)]}
    with pytest.raises(ValueError, match=r"heads holds 1 items, the live one 2 with objects"):
        Checkpointer(tmp_path).restore(two_heads)
    plain: dict[str, Any] = {
        "nets": {"gen": nn.Linear(2, 2), "note": "new"},
        "heads": [nn.Linear(2, 2)],
    }
    assert Checkpointer(tmp_path).restore(plain) == 5  # a plain value the file lacks: kept
    assert torch.equal(plain["nets"]["gen"].weight, nets["gen"].weight)
    assert plain["nets"]["note"] == "new"


def test_lists_and_arrays_in_state_are_updated_in_place(tmp_path: Path) -> None:
    # A list of another length was replaced in state: the loop's own `history` went stale,
    # and the next save lost what it appended after the restore.
    ckpt = Checkpointer(tmp_path)
    ckpt.save({"history": [1.0, 2.0], "ema": np.arange(3.0), "ro": np.arange(2)}, step=1)
    history: list[float] = []
    ema = np.zeros(3)
    read_only = np.zeros(2, dtype=np.int64)
    read_only.flags.writeable = False
    state: dict[str, Any] = {"history": history, "ema": ema, "ro": read_only}
    assert Checkpointer(tmp_path).restore(state) == 1
    assert state["history"] is history and history == [1.0, 2.0]
    assert state["ema"] is ema and ema.tolist() == [0.0, 1.0, 2.0]
    assert state["ro"] is not read_only and state["ro"].tolist() == [0, 1]  # replaced instead
    history.append(3.0)
    ckpt.save(state, step=2)
    latest = ckpt.latest()
    assert latest is not None and load_checkpoint(latest)["history"] == [1.0, 2.0, 3.0]


def test_sets_and_dicts_in_state_are_updated_in_place(tmp_path: Path) -> None:
    # A set was replaced by the loaded one: the loop's `seen` went stale, and the next save
    # lost what it added after the restore.
    ckpt = Checkpointer(tmp_path)
    ckpt.save({"seen": {1, 2}, "meta": {"tags": {"a"}, "best": 0.5}}, step=1)
    seen: set[int] = set()
    tags: set[str] = {"stale"}
    meta: dict[str, Any] = {"tags": tags, "best": 0.0}
    state: dict[str, Any] = {"seen": seen, "meta": meta}
    assert Checkpointer(tmp_path).restore(state) == 1
    assert state["seen"] is seen and seen == {1, 2}
    assert state["meta"] is meta and meta["tags"] is tags and tags == {"a"}
    assert meta["best"] == 0.5
    seen.add(3)
    ckpt.save(state, step=2)
    latest = ckpt.latest()
    assert latest is not None and load_checkpoint(latest)["seen"] == {1, 2, 3}


class _Refuses:
    """An object whose load_state_dict fails whatever it is given (after restore's checks)."""

    def state_dict(self) -> dict[str, int]:
        return {"n": 1}

    def load_state_dict(self, state: Any) -> None:
        raise KeyError("n_new")


def _saved_pair(folder: Path) -> nn.Module:
    model = nn.Linear(2, 2)
    with torch.no_grad():
        model.weight.fill_(7.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": model, "optimizer": opt, "other": _Refuses(), "epoch": 3}
    Checkpointer(folder).save(state, step=5)
    return model


@pytest.mark.parametrize(
    ("second", "error", "match"),
    [
        (
            lambda m: torch.optim.SGD([{"params": [m.weight]}, {"params": [m.bias]}], lr=0.1),
            ValueError,
            r"state\['optimizer'\] cannot be restored: the optimizer has 2 parameter group\(s\) "
            r"of \[1, 1\] parameters, the checkpoint's 1 of \[2\]",
        ),
        (
            lambda m: nn.Linear(3, 3),
            StateDictMismatchError,
            r"state\['optimizer'\] does not fit its saved weights; nothing was loaded",
        ),
    ],
    ids=["optimizer-groups", "module-for-optimizer"],
)
def test_an_entry_that_does_not_fit_is_found_before_anything_is_loaded(
    tmp_path: Path, second: Any, error: type, match: str
) -> None:
    # The model was loaded, then the optimizer's load_state_dict raised torch's bare error:
    # a half-restored state, and no word of which entry or file.
    _saved_pair(tmp_path)
    model = nn.Linear(2, 2)
    before = model.weight.detach().clone()
    with pytest.raises(error, match=rf"step-000000005\.pt \(step 5\): {match}"):
        Checkpointer(tmp_path).restore({"model": model, "optimizer": second(model)})
    assert torch.equal(model.weight, before)  # nothing loaded


@pytest.mark.parametrize(
    ("entry", "live", "match"),
    [
        (
            "epoch",
            lambda m: nn.Linear(2, 2),
            r"state\['epoch'\] is a Linear, but the checkpoint holds an int",
        ),
        (
            "other",
            lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
            r"state\['other'\] cannot be restored: the checkpoint holds a dict there, not an "
            r"optimizer's",
        ),
    ],
    ids=["int-for-module", "dict-for-optimizer"],
)
def test_an_entry_given_the_wrong_object_is_named_before_anything_is_loaded(
    tmp_path: Path, entry: str, live: Any, match: str
) -> None:
    # An int into a module was torch's TypeError; a dict into an optimizer a bare KeyError.
    _saved_pair(tmp_path)
    model = nn.Linear(2, 2)
    before = model.weight.detach().clone()
    with pytest.raises(ValueError, match=rf"step-000000005\.pt \(step 5\): {match}"):
        Checkpointer(tmp_path).restore({"model": model, entry: live(model)})
    assert torch.equal(model.weight, before)


def test_a_load_that_fails_after_the_checks_names_the_entry_file_and_step(tmp_path: Path) -> None:
    _saved_pair(tmp_path)
    model = nn.Linear(2, 2)
    state = {"model": model, "other": _Refuses()}
    with pytest.raises(
        CheckpointError,
        match=r"step-000000005\.pt \(step 5\): state\['other'\]\.load_state_dict failed "
        r"\(KeyError: 'n_new'\)\. Loaded before it: state\['model'\]",
    ) as info:
        Checkpointer(tmp_path).restore(state)
    assert isinstance(info.value.__cause__, KeyError)


def test_a_loader_entry_that_is_not_a_position_is_found_before_anything_is_loaded(
    tmp_path: Path,
) -> None:
    model = nn.Linear(2, 2)
    Checkpointer(tmp_path).save({"model": model, "loader": {"weight": 1}}, step=1)
    fresh = nn.Linear(2, 2)
    before = fresh.weight.detach().clone()
    loader = DataLoader(TensorDataset(torch.arange(8.0)), batch_size=2)
    with pytest.raises(ValueError, match=r"checkpoint entry 'loader' is not a DataLoader position"):
        Checkpointer(tmp_path).restore({"model": fresh, "loader": loader})
    assert torch.equal(fresh.weight, before)


def _zip_loop(
    make: Any, epochs: int, folder: Path, stop_epoch: int | None = None
) -> list[tuple[int, tuple[int, ...]]]:
    """An epoch loop that takes its batches through zip (no StopIteration from the loader)
    and saves after each epoch, the next epoch's number in the state; it ends after saving
    epoch ``stop_epoch``."""
    loader = make()
    state: dict[str, Any] = {"loader": loader, "epoch": 0}
    ckpt = Checkpointer(folder)
    ckpt.restore(state)
    seen = []
    for epoch in range(state["epoch"], epochs):
        for _, (batch,) in zip(range(len(loader)), loader, strict=False):
            seen.append((epoch, tuple(batch.tolist())))
        state["epoch"] = epoch + 1
        ckpt.save(state, step=epoch + 1)
        if epoch == stop_epoch:
            return seen
    return seen


def test_a_pass_the_loop_let_go_of_at_its_last_batch_resumes_as_over(tmp_path: Path) -> None:
    # zip(range(len(loader)), loader) takes every batch and never the StopIteration: saved
    # after the epoch, the pass is over (a resumed run that went on with it got 0 batches).
    data = TensorDataset(torch.arange(40))

    def make() -> DataLoader[Any]:
        return DataLoader(data, batch_size=4, shuffle=True)

    torch.manual_seed(0)
    straight = _zip_loop(make, 3, tmp_path / "straight")
    torch.manual_seed(0)
    first = _zip_loop(make, 3, tmp_path / "run", stop_epoch=0)
    torch.manual_seed(999)
    rest = _zip_loop(make, 3, tmp_path / "run")
    assert len(first) == 10 and len(rest) == 20
    assert first + rest == straight
