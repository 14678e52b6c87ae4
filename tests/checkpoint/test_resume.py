"""End to end: a killed or preempted run resumed from its Checkpointer equals the run that was
never interrupted, bit for bit; kill -9 during background writes never loses the previous
checkpoint; a full disk, a read-only directory and an unpicklable value are raised at the
next call with the older checkpoints intact.

Every test here starts processes (training runs, forked trainers, a private mount
namespace), so all are marked slow.
"""

from __future__ import annotations

import json
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from trainperf import Checkpointer, load_checkpoint
from trainperf.errors import CheckpointError

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300  # a loaded 2-core machine: generous, never a measure of speed


def _train(*args: str | Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.checkpoint._train", *map(str, args)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _finish(proc: subprocess.Popen[str]) -> str:
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0, out
    return out


def _wait_for(proc: subprocess.Popen[str], line: str) -> str:
    """Read the run's output until ``line`` (the run keeps going)."""
    assert proc.stdout is not None
    seen = []
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        got = proc.stdout.readline()
        if not got:
            break
        seen.append(got)
        if got.strip() == line:
            return "".join(seen)
    proc.kill()
    proc.wait()
    raise AssertionError(f"never printed {line!r}:\n{''.join(seen)}")


def _assert_identical(a_path: Path, b_path: Path) -> None:
    a, b = torch.load(a_path), torch.load(b_path)
    assert list(a["model"]) == list(b["model"])
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert sorted(sa) == sorted(sb) and sa  # Adam's moments and step counts
    for i in sa:
        for key in sa[i]:
            assert torch.equal(sa[i][key], sb[i][key]), (i, key)
    assert a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """60 steps, never interrupted."""
    d = tmp_path_factory.mktemp("straight")
    _finish(_train(d / "ckpt", d / "out.pt"))
    return d / "out.pt"


# ------------------------------------------------------------------------ exact resume


def test_sigkill_after_a_background_save_then_resume_equals_the_straight_run(
    tmp_path: Path, straight: Path
) -> None:
    run = _train(tmp_path / "ckpt", tmp_path / "unused.pt", "--hold-at", "37")
    try:
        _wait_for(run, "holding 37")  # the step-30 background save has completed
        run.send_signal(signal.SIGKILL)
        assert run.wait(timeout=TIMEOUT_S) == -signal.SIGKILL
    finally:
        run.kill()
        run.wait()
    assert Checkpointer(tmp_path / "ckpt").steps() == [10, 20, 30]
    out = _finish(_train(tmp_path / "ckpt", tmp_path / "resumed.pt"))
    assert "rank 0 restored 30" in out
    _assert_identical(straight, tmp_path / "resumed.pt")


def test_sigterm_under_preemption_saves_at_37_and_resume_equals_the_straight_run(
    tmp_path: Path, straight: Path
) -> None:
    run = _train(tmp_path / "ckpt", tmp_path / "unused.pt", "--hold-at", "37", "--preempt")
    _wait_for(run, "holding 37")
    run.send_signal(signal.SIGTERM)
    assert "rank 0 stopped at 37" in _finish(run)
    assert Checkpointer(tmp_path / "ckpt").steps() == [20, 30, 37]
    out = _finish(_train(tmp_path / "ckpt", tmp_path / "resumed.pt"))
    assert "rank 0 restored 37" in out
    _assert_identical(straight, tmp_path / "resumed.pt")


def test_under_ddp_launch_sigterm_to_the_launcher_then_resume_equals_the_straight_run(
    tmp_path: Path,
) -> None:
    _finish(_train(tmp_path / "straight", tmp_path / "straight.pt", "--ranks", "2"))
    run = _train(
        tmp_path / "ckpt", tmp_path / "unused.pt", "--hold-at", "37", "--preempt", "--ranks", "2"
    )
    _wait_for(run, "holding 37")
    time.sleep(0.5)  # both ranks are holding: only rank 0 prints
    run.send_signal(signal.SIGTERM)  # what scancel or a spot reclaim does to the launcher
    try:
        out, _ = run.communicate(timeout=TIMEOUT_S)
    finally:
        run.kill()
        run.wait()
    # The launcher forwards SIGTERM to its ranks and waits for them (up to a grace period):
    # both ranks save at the step they agreed on.
    assert "rank 0 stopped at 37" in out and "rank 1 stopped at 37" in out, out
    files = sorted(os.listdir(tmp_path / "ckpt"))
    assert "step-000000037.pt" in files and "step-000000037.rank-00001.pt" in files, files
    out = _finish(_train(tmp_path / "ckpt", tmp_path / "resumed.pt", "--ranks", "2"))
    assert "rank 0 restored 37" in out and "rank 1 restored 37" in out
    _assert_identical(tmp_path / "straight.pt", tmp_path / "resumed.pt")


# -------------------------------------------------------------------------- crash loop

CRASH_TRIALS = int(os.environ.get("TRAINPERF_CRASH_TRIALS", "12"))
CRASH_FLOATS = 50 * 1024 * 1024  # 200 MiB of float32


def _crash_trainer(directory: Path, ready: int) -> None:
    """Background saves back to back, each of a 200 MiB tensor filled with its step."""
    ckpt = Checkpointer(directory, keep=2)
    step = max(ckpt.steps(), default=0)
    w = torch.empty(CRASH_FLOATS)
    if step == 0:  # the first trial: one complete checkpoint before the kills begin
        step = 1
        w.fill_(1.0)
        ckpt.save({"w": w, "step": 1}, step=1, blocking=False)
        ckpt.wait()
    os.write(ready, b"go")
    while True:
        step += 1
        w.fill_(float(step))
        ckpt.save({"w": w, "step": step}, step=step, blocking=False)


def _alive_in_group(pgid: int) -> list[int]:
    alive = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            alive.append(int(entry))
    return alive


_TRAINER = (
    "import sys; from pathlib import Path; "
    "from tests.checkpoint.test_resume import _crash_trainer; "
    "_crash_trainer(Path(sys.argv[1]), int(sys.argv[2]))"
)


def _one_crash(directory: Path, delay_s: float) -> None:
    # A fresh interpreter, not a fork of this one: a fork of the test process inherits
    # whatever threads earlier tests left (and their locks), which can hang the child.
    read_fd, write_fd = os.pipe()
    proc = subprocess.Popen(
        [sys.executable, "-c", _TRAINER, str(directory), str(write_fd)],
        pass_fds=(write_fd,),
        start_new_session=True,  # its own process group: the kill takes the writer with it
        cwd=ROOT,
    )
    pid = proc.pid
    os.close(write_fd)
    try:
        ready, _, _ = select.select([read_fd], [], [], TIMEOUT_S)
        assert ready and os.read(read_fd, 2) == b"go"
        time.sleep(delay_s)
    finally:
        os.killpg(pid, signal.SIGKILL)  # the trainer and its writer, as a job kill does
        proc.wait()
        os.close(read_fd)
    deadline = time.monotonic() + 60
    while _alive_in_group(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not _alive_in_group(pid)


def test_kill_9_during_background_writes_never_loses_the_previous_checkpoint(
    tmp_path: Path,
) -> None:
    # 12 trials by default: a 200 MiB background write takes ~2.5 s on the loaded 2-core test
    # machine, so each trial is a few seconds; TRAINPERF_CRASH_TRIALS=50 runs the 50.
    # The kill lands anywhere in the fork, the write, the rename or the retention.
    rng = random.Random(15)
    directory = tmp_path / "ckpt"
    for trial in range(CRASH_TRIALS):
        _one_crash(directory, rng.uniform(0.0, 6.0))
        ckpt = Checkpointer(directory, keep=2)  # the next open: stale temp files go
        names = os.listdir(directory) if directory.exists() else []
        assert not [n for n in names if ".tmp-" in n], (trial, names)
        latest = ckpt.latest()
        assert latest is not None, (trial, names)  # the first trial saved one before its kill
        saved = load_checkpoint(latest)
        step = saved["trainperf"]["step"]
        assert latest.name == f"step-{step:09d}.pt" and saved["step"] == step
        assert saved["w"].shape == (CRASH_FLOATS,)
        assert bool((saved["w"] == float(step)).all()), (trial, step)


# ----------------------------------------------------------------- disk and directory

_FAULT_SCRIPT = textwrap.dedent(
    """
    import json, subprocess, sys, torch
    from trainperf import Checkpointer, load_checkpoint
    from trainperf.errors import CheckpointError
    d, mode = sys.argv[1], sys.argv[2]
    ckpt = Checkpointer(d)
    ckpt.save({"w": torch.full((1 << 20,), 1.0)}, step=1)       # 4 MiB: fits
    if mode == "readonly":
        subprocess.run(["mount", "-o", "remount,ro", d], check=True)
        state = {"w": torch.full((1 << 20,), 2.0)}
    else:
        state = {"w": torch.full((16 << 20,), 2.0)}             # 64 MiB: does not
    ckpt.save(state, step=2, blocking=False)
    result = {}
    try:
        ckpt.save({"w": torch.ones(1)}, step=3)
    except CheckpointError as e:
        result = {"error": str(e), "path": str(e.path), "cause": repr(e.__cause__)}
    old = load_checkpoint(d + "/step-000000001.pt")
    result["old_intact"] = bool((old["w"] == 1.0).all())
    result["steps"] = ckpt.steps()
    import os
    result["files"] = sorted(os.listdir(d))
    print(json.dumps(result))
    """
)


def _in_private_mount(tmp_path: Path, mode: str) -> dict[str, Any]:
    """Run the fault script on a 32 MiB tmpfs seen only by a private mount namespace."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1) for a private mount namespace")
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True, timeout=60)
    if probe.returncode != 0:
        pytest.skip(f"no private mount namespace here: {probe.stderr.decode().strip()}")
    mnt = tmp_path / "small"
    mnt.mkdir()
    script = tmp_path / "fault.py"
    script.write_text(_FAULT_SCRIPT)
    cmd = (
        f'mount -t tmpfs -o size=32m tmpfs "{mnt}" && '
        f'exec "{sys.executable}" "{script}" "{mnt}" {mode}'
    )
    proc = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", cmd],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    if proc.returncode != 0 and "mount:" in proc.stderr and "permission" in proc.stderr.lower():
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # The namespace died with the process: nothing is mounted here, the directory is empty.
    assert os.listdir(mnt) == [] and not os.path.ismount(mnt)
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def test_a_full_disk_during_a_background_write_is_raised_at_the_next_save(tmp_path: Path) -> None:
    result = _in_private_mount(tmp_path, "enospc")
    assert "background save of step 2 failed" in result["error"]
    assert (
        "No space left on device (the disk is full: free space or save to another disk)"
        in (result["error"])
    )
    assert result["path"].endswith("step-000000002.pt") and "28" in result["cause"]  # ENOSPC
    assert result["old_intact"] and result["steps"] == [1]
    assert result["files"] == ["step-000000001.pt"]  # no temp file left behind


def test_a_read_only_directory_is_raised_at_the_next_save(tmp_path: Path) -> None:
    result = _in_private_mount(tmp_path, "readonly")
    assert "background save of step 2 failed" in result["error"]
    assert "(the filesystem is read-only: save to a writable disk)" in result["error"]
    assert result["old_intact"] and result["steps"] == [1]
    assert result["files"] == ["step-000000001.pt"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through a mode-0555 directory")
def test_a_directory_without_write_permission_is_raised_at_the_next_save(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path / "d")
    ckpt.save({"w": torch.ones(4)}, step=1)
    (tmp_path / "d").chmod(0o555)
    try:
        ckpt.save({"w": torch.zeros(4)}, step=2, blocking=False)
        with pytest.raises(CheckpointError, match=r"no permission to write there") as info:
            ckpt.wait()
    finally:
        (tmp_path / "d").chmod(0o755)
    assert info.value.path == tmp_path / "d" / "step-000000002.pt"
    assert ckpt.steps() == [1] and torch.equal(load_checkpoint(ckpt.latest())["w"], torch.ones(4))
