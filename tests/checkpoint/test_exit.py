"""trainperf.checkpoint: what happens to background saves when the process ends, and what
a background save captures (shared-memory tensors, NumPy arrays)."""

from __future__ import annotations

import collections
import multiprocessing
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import trainperf.checkpoint._checkpointer as checkpointer_module
import trainperf.checkpoint._checkpointer_wait as wait_module
from trainperf.checkpoint import Checkpointer
from trainperf.checkpoint._writer import SaveHandle
from trainperf.checkpoint._writer_snapshot import snapshot_safe
from trainperf.checkpoint._writer_staging import Staging


class Slow:
    """A state value whose pickling takes ``seconds``: the write outlives its caller."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __reduce__(self) -> tuple[Any, ...]:
        time.sleep(self.seconds)
        return (collections.OrderedDict, ())  # loads back (weights_only allows it), empty


_SCRIPT = """
import collections, sys, time, torch
from trainperf.checkpoint import Checkpointer

class Slow:
    def __reduce__(self):
        time.sleep(1.0)
        return (collections.OrderedDict, ())

def train():
    ck = Checkpointer(sys.argv[1])
    ck.save({state}, step=5, blocking=False)

train()
import gc; gc.collect()
"""


def _run(tmp_path: Path, state: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(_SCRIPT.format(state=state)))
    out = tmp_path / "ck"
    return subprocess.run(
        [sys.executable, str(script), str(out)], capture_output=True, text=True, timeout=120
    )


@pytest.mark.slow
def test_exit_finishes_the_save_of_a_checkpointer_that_went_out_of_scope(
    tmp_path: Path,
) -> None:
    done = _run(tmp_path, '{"w": torch.arange(4.0), "slow": Slow()}')
    assert done.returncode == 0, done.stderr
    assert [p.name for p in (tmp_path / "ck").iterdir()] == ["step-000000005.pt"]
    saved = torch.load(tmp_path / "ck" / "step-000000005.pt", weights_only=False)
    assert saved["w"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert "waiting for the background save of step 5" in done.stderr


@pytest.mark.slow
def test_exit_prints_a_failed_background_save_nobody_was_told_of(tmp_path: Path) -> None:
    done = _run(tmp_path, '{"w": torch.zeros(2), "f": lambda: 1}')  # a lambda does not pickle
    assert "ERROR: the background save of step 5 to" in done.stderr, done.stderr
    assert "step-000000005.pt failed" in done.stderr
    assert "no older checkpoint was deleted" in done.stderr
    assert not (tmp_path / "ck" / "step-000000005.pt").exists()


_ATEXIT_SCRIPT = """
import atexit, collections, os, sys, time
import torch  # as a training script does: importing it inside an atexit handler fails

PARENT = os.getpid()

class SlowInTheWriter:  # a forked writer takes long enough to outlive its parent
    def __reduce__(self):
        if os.getpid() != PARENT:
            time.sleep(3)
        return (collections.OrderedDict, ())

def final_save():
    import trainperf.checkpoint._checkpointer as checkpointer_module
    if sys.argv[2] == "thread":
        checkpointer_module.fork_writes = lambda: False
    ck = checkpointer_module.Checkpointer(sys.argv[1])
    h = ck.save({"w": torch.arange(4.0), "slow": SlowInTheWriter()}, step=5, blocking=False)
    print(h.writer)

# trainperf's exit mark runs from threading's exit hooks, before every atexit handler, so a
# handler registered before or after the import runs after it; the checkpoint package is
# first imported in the handler (import trainperf imports no subpackage).
if sys.argv[3] == "before":
    atexit.register(final_save)
import trainperf
if sys.argv[3] == "after":
    atexit.register(final_save)
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("writer", "registered"), [("process", "before"), ("thread", "before"), ("process", "after")]
)
def test_a_background_save_made_as_the_process_exits_is_written(
    tmp_path: Path, writer: str, registered: str
) -> None:
    # Started after trainperf's exit hook had waited, the writer died with the process: the
    # forked one left only its temp file, and the thread aborted the interpreter. The hook
    # runs before every atexit handler (from threading's exit hooks), so a save in one
    # registered after trainperf's import is made blocking too, as the docs now say.
    script = tmp_path / "train.py"
    script.write_text(_ATEXIT_SCRIPT)
    out = tmp_path / "ck"
    done = subprocess.run(
        [sys.executable, str(script), str(out), writer, registered],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["blocking"]
    assert [p.name for p in out.iterdir()] == ["step-000000005.pt"]
    saved = torch.load(out / "step-000000005.pt", weights_only=True)
    assert saved["w"].tolist() == [0.0, 1.0, 2.0, 3.0] and saved["slow"] == {}


def test_a_background_save_after_the_exit_hook_is_made_blocking(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(wait_module, "_EXITED", [False])
    wait_module._wait_at_exit()  # the process is exiting: nothing waits for writers now
    handle = Checkpointer(tmp_path).save({"w": torch.ones(2)}, step=1, blocking=False)
    assert handle.writer == "blocking" and handle.done()
    assert torch.load(tmp_path / "step-000000001.pt")["w"].tolist() == [1.0, 1.0]


def _fork_rank(directory: str) -> None:
    ck = Checkpointer(directory)
    ck.save({"w": torch.ones(3), "slow": Slow(1.0)}, step=3, blocking=False)
    # returns at once: multiprocessing ends this process with os._exit, skipping atexit


@pytest.mark.slow
def test_a_fork_child_ending_in_os_exit_finishes_its_background_save(tmp_path: Path) -> None:
    proc = multiprocessing.get_context("fork").Process(target=_fork_rank, args=(str(tmp_path),))
    proc.start()
    try:
        proc.join(timeout=120)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
    saved = torch.load(tmp_path / "step-000000003.pt", weights_only=False)
    assert saved["w"].tolist() == [1.0, 1.0, 1.0]


def test_snapshot_safe_refuses_shared_memory_tensors() -> None:
    assert snapshot_safe({"a": torch.zeros(3), "b": [torch.ones(1)], "n": 3})
    assert not snapshot_safe({"a": torch.zeros(3), "b": [torch.ones(1).share_memory_()]})


def test_a_shared_memory_tensor_is_saved_as_it_was_at_save(tmp_path: Path) -> None:
    w = torch.zeros(1000).share_memory_()
    ck = Checkpointer(tmp_path)
    handle = ck.save({"w": w}, step=1, blocking=False)
    w.fill_(7.0)  # the next training step, right after save returns
    ck.wait()
    assert handle.writer == "thread"  # a fork would share these pages with the writer
    saved = torch.load(tmp_path / "step-000000001.pt", weights_only=True)
    assert saved["w"].unique().tolist() == [0.0]


def test_staging_deep_copies_numpy_arrays_and_objects() -> None:
    arr = np.zeros(4, dtype=np.float32)
    obj = {"history": [1, 2]}
    staged = Staging().stage({"ema": arr, "meta": [obj, "x", 3], "none": None})
    arr += 1.0
    obj["history"].append(3)
    assert staged["ema"].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert staged["meta"][0] == {"history": [1, 2]}
    assert staged["meta"][1:] == ["x", 3] and staged["none"] is None


def test_the_thread_path_saves_numpy_arrays_as_they_were_at_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(checkpointer_module, "fork_writes", lambda: False)
    ema = np.zeros(100_000, dtype=np.float32)
    ck = Checkpointer(tmp_path)
    handle = ck.save({"w": torch.zeros(2), "ema": ema}, step=1, blocking=False)
    ema += 1.0
    ck.wait()
    assert handle.writer == "thread"
    saved = torch.load(tmp_path / "step-000000001.pt", weights_only=False)
    assert float(saved["ema"].max()) == 0.0


@pytest.mark.requires_cuda
def test_staging_waits_for_the_copies_of_every_cuda_device() -> None:
    tensors = {
        f"w{i}": torch.full((1 << 20,), float(i + 1), device=f"cuda:{i}")
        for i in range(torch.cuda.device_count())
    }
    staged = Staging().stage(tensors)
    for i in range(torch.cuda.device_count()):
        assert staged[f"w{i}"].eq(float(i + 1)).all()


def _nothing() -> None:
    pass


@pytest.mark.slow
def test_a_fork_child_does_not_wait_for_its_parents_background_save(tmp_path: Path) -> None:
    # The parent's write is reaped by a thread the child does not have: waiting would hang.
    handle = SaveHandle(9, tmp_path / "step-000000009.pt", "process")
    handle._track()
    try:
        proc = multiprocessing.get_context("fork").Process(target=_nothing)
        proc.start()
        try:
            proc.join(timeout=60)
            assert proc.exitcode == 0
        finally:
            if proc.is_alive():
                proc.kill()
                proc.join()
    finally:
        handle._finish(None, [])
