"""trainperf.checkpoint._checkpointer_lock: a second writer in a Checkpointer directory is
told who holds it; a newer Checkpointer in the same process takes the directory over; forked
children and ended ``with`` blocks do not keep the claim."""

from __future__ import annotations

import copy
import gc
import multiprocessing
import os
import pickle
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

from trainperf import Checkpointer

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="flock is POSIX")

_HOLDER = textwrap.dedent(
    """
    import sys, torch
    from trainperf import Checkpointer
    ckpt = Checkpointer(sys.argv[1])
    ckpt.save({"w": torch.ones(2)}, step=1)
    print("saved", flush=True)
    sys.stdin.readline()  # hold the directory until told to go
    """
)

_PROBE = "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDONLY)\n" + (
    "try:\n    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB); print('free')\n"
    "except BlockingIOError:\n    print('held')\n"
)


def _held_elsewhere(directory: Path) -> bool:
    """Whether another process finds the directory's lock taken."""
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, str(directory)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip() == "held"


def test_a_second_process_saving_to_the_directory_is_told_which_process_holds_it(
    tmp_path: Path,
) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "saved"
        ckpt = Checkpointer(tmp_path)
        with pytest.warns(
            UserWarning,
            match=rf"another Checkpointer is saving to this directory \(process {holder.pid}\)"
            r".* keep= deletes the other's: give each run its own directory",
        ) as told:
            ckpt.save({"w": torch.zeros(2)}, step=2)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ckpt.save({"w": torch.zeros(2)}, step=3)  # told once
        assert len(told) == 1
    finally:
        holder.communicate("\n", timeout=60)
    assert holder.returncode == 0
    # The holder is gone: a new writer claims the directory without a word.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Checkpointer(tmp_path).save({"w": torch.zeros(2)}, step=4)
    assert sorted(os.listdir(tmp_path)) == [f"step-00000000{s}.pt" for s in (2, 3, 4)]  # keep=3


def test_a_newer_checkpointer_in_the_process_takes_over_and_the_earlier_one_is_told(
    tmp_path: Path,
) -> None:
    earlier = Checkpointer(tmp_path)
    earlier.save({"n": 1}, step=1)
    newer = Checkpointer(tmp_path)  # a notebook cell run again: no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        newer.save({"n": 2}, step=2)
    with pytest.warns(UserWarning, match=r"a newer Checkpointer in this process took .* over"):
        earlier.save({"n": 3}, step=3)
    assert _held_elsewhere(tmp_path)  # the newer one still holds it


def test_the_claim_ends_with_the_with_block_and_with_the_object(tmp_path: Path) -> None:
    with Checkpointer(tmp_path / "a") as ckpt:
        ckpt.save({"n": 1}, step=1)
        assert _held_elsewhere(tmp_path / "a")
    assert not _held_elsewhere(tmp_path / "a")
    other = Checkpointer(tmp_path / "b")
    other.save({"n": 1}, step=1, blocking=False)
    other.wait()
    assert _held_elsewhere(tmp_path / "b")
    del other
    gc.collect()
    assert not _held_elsewhere(tmp_path / "b")


def _sleep_until_told(conn: object) -> None:
    conn.recv()  # type: ignore[attr-defined]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_does_not_keep_the_claim_after_its_checkpointer_goes(
    tmp_path: Path,
) -> None:
    # A DataLoader worker forked while the Checkpointer held the directory outlives it.
    ckpt = Checkpointer(tmp_path)
    ckpt.save({"n": 1}, step=1)
    ctx = multiprocessing.get_context("fork")
    parent_end, child_end = ctx.Pipe()
    child = ctx.Process(target=_sleep_until_told, args=(child_end,))
    child.start()
    try:
        del ckpt
        gc.collect()
        assert not _held_elsewhere(tmp_path)
    finally:
        parent_end.send("go")
        child.join(60)
    assert child.exitcode == 0


def test_nothing_is_added_to_the_directory(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path / "run")
    ckpt.save({"n": 1}, step=1)
    assert os.listdir(tmp_path / "run") == ["step-000000001.pt"]
    assert _held_elsewhere(tmp_path / "run")


def test_a_copy_of_a_checkpointer_claims_afresh_and_closes_no_descriptor_of_another(
    tmp_path: Path,
) -> None:
    ckpt = Checkpointer(tmp_path / "run")
    ckpt.save({"n": 1}, step=1)
    twin = copy.deepcopy(ckpt)
    del twin
    gc.collect()
    with open(tmp_path / "other.txt", "w") as other:  # may reuse a freed descriptor number
        del ckpt
        gc.collect()  # closes its own descriptor only
        other.write("still open")
        other.flush()
    assert (tmp_path / "other.txt").read_text() == "still open"
    assert not _held_elsewhere(tmp_path / "run")
    # An unpickled copy holds nothing, so it warns while the original holds the directory.
    first = Checkpointer(tmp_path / "b")
    first.save({"n": 1}, step=1)
    copied = pickle.loads(pickle.dumps(first._claim))
    assert copied._fd is None
