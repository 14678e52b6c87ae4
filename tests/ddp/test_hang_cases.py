"""Issue #16's hang cases under ``launch(hang_timeout=...)`` and ``watchdog()`` with torchrun:
HangError within hang_timeout + 30 s naming the right rank and its file:line, every process
gone afterwards; healthy jobs run to the end with no report."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import trainperf.ddp as ddp
from tests.ddp import _hangs
from tests.ddp._distributed import LONG, launch_fork
from tests.ddp.test_launch import _clean_env, _processes_with
from trainperf.ddp import _launch_spawn
from trainperf.errors import HangError, LaunchError

HANG_S = 3.0
CAUSE = _hangs.cause_line("# CAUSE")
WAIT = _hangs.cause_line("# WAIT")
HANGS = str(Path(_hangs.__file__))

# case, ranks, verdict kind, what the message says the cause does, what the others do
CASES: list[tuple[str, int, str, str, str]] = [
    ("busy_loop", 2, "outside", "is busy outside any collective", "waits in all_reduce"),
    ("skips_collective", 2, "mismatch", "waits in all_reduce", "waits in broadcast"),
    ("different_collective", 3, "mismatch", "waits in all_gather", "wait in all_reduce"),
    ("ddp_unused_layer", 2, "ddp", "waits in barrier", "waits inside backward()"),
    ("stuck_dataloader", 2, "outside", "waits for a batch from its DataLoader", "waits in"),
    ("own_lock", 2, "outside", "is blocked on a lock", "waits in all_reduce"),
    ("busy_after_return", 2, "returned", "is busy outside any collective", "returned from"),
    # Its own backward() code was taken for DDP's wait: both ranks, or the other, blamed.
    ("stuck_custom_backward", 2, "outside", "is busy outside any collective", "inside backward"),
    # DDP's constructor waits in C++: it looked like busy code, and no hang was declared.
    ("slow_model_build", 2, "outside", "is busy outside", "waits in _verify_params"),
    # new_group waits in torch's Python (a store-based barrier): the same, until `timeout`.
    ("slow_before_new_group", 2, "outside", "is busy outside", "waits in new_group"),
]


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("case", "nprocs", "kind", "cause", "others"), CASES, ids=[c[0] for c in CASES]
)
def test_each_hang_case_names_the_rank_and_its_line(
    case: str, nprocs: int, kind: str, cause: str, others: str
) -> None:
    t0 = time.monotonic()
    with pytest.raises(HangError, match=r"^no progress on any of \d ranks for \d+ s") as info:
        launch_fork(_hangs.CASES[case], nprocs=nprocs, timeout=LONG, hang_timeout=HANG_S)
    elapsed = time.monotonic() - t0
    assert isinstance(info.value, LaunchError)
    text = str(info.value)
    assert text.startswith(f"no progress on any of {nprocs} ranks for ")
    assert f"rank {_hangs.BAD} is the cause." in text.splitlines()[0], text
    report = info.value.report
    assert report.verdict.kind == kind and report.verdict.root == (_hangs.BAD,), text
    headline = report.verdict.headline
    assert f"rank {_hangs.BAD} {cause}" in headline, headline
    assert f"{HANGS}:{CAUSE[case]}" in headline, headline  # the user's line, not torch's
    assert others in headline, headline
    if case in WAIT:
        assert f"{HANGS}:{WAIT[case]}" in headline, headline
    assert "Every rank was stopped" in text
    assert elapsed < HANG_S + 30  # start-up included
    json.dumps(report.to_dict())  # serialisable


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_collectives_are_numbered_from_mains_first() -> None:
    # The launcher's own start-up barrier is not one of main's: main's first is #1.
    with pytest.raises(HangError) as info:
        launch_fork(_hangs.busy_loop, timeout=LONG, hang_timeout=HANG_S)
    good = next(r for r in info.value.report.ranks if r.rank != _hangs.BAD)
    steps = _hangs.cause_line("# STEP")["_steps"]
    assert [(c.seq, c.op) for c in good.history[:3]] == [(n, "all_reduce") for n in (1, 2, 3)]
    assert good.history[0].site == f"{HANGS}:{steps}"


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_shape_mismatch_that_gloo_aborts_on_is_named_as_a_mismatch() -> None:
    # Under gloo a size mismatch is a crash (SIGABRT), not a hang: the LaunchError says why.
    with pytest.raises(LaunchError) as info:
        launch_fork(_hangs.different_shape, timeout=LONG, hang_timeout=HANG_S)
    text = str(info.value)
    assert "different collectives (a collective mismatch)" in text, text
    site = f"{HANGS}:{CAUSE['different_shape']}"
    assert f"rank 0: all_reduce float32[4] (collective #3) at {site}" in text, text
    assert f"rank 1: all_reduce float32[8] (collective #3) at {site}" in text, text


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_checkpoint_save_of_half_the_timeout_is_not_a_hang() -> None:
    assert launch_fork(_hangs.slow_save, 2.0, timeout=LONG, hang_timeout=4.0) == "done"


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_one_rank_alone_in_a_busy_save_past_the_timeout_is_not_a_hang() -> None:
    # Rank 0 saves for 3 x hang_timeout inside busy() while rank 1 waits in a barrier.
    assert launch_fork(_hangs.busy_save, 6.0, timeout=LONG, hang_timeout=2.0) == "done"


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_rank_that_fails_while_being_stopped_is_named_in_the_hang_error() -> None:
    with pytest.raises(HangError) as info:
        launch_fork(_hangs.busy_loop_failing_on_sigterm, timeout=LONG, hang_timeout=HANG_S)
    text = str(info.value)
    assert f"rank {_hangs.BAD} is the cause." in text.splitlines()[0], text
    assert "While the ranks were stopped:\n  rank 1 exited with code 3" in text, text
    assert "Rank 0: stopped by SIGTERM." in text, text
    endings = {e.rank: (e.exitcode, e.expected) for e in info.value.report.endings}
    assert endings == {0: (-15, True), 1: (3, False)}
    assert info.value.report.to_dict()["endings"][1]["exitcode"] == 3


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_every_rank_busy_in_its_own_code_past_the_timeout_is_not_a_hang() -> None:
    # Nobody waits for anybody: slow work, not a hang (it used to be killed as one).
    assert launch_fork(_hangs.every_rank_busy, 9.0, timeout=LONG, hang_timeout=3.0) == "done"


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_steps_slower_than_a_tenth_of_the_timeout_are_not_a_hang() -> None:
    assert launch_fork(_hangs.slow_steps, 8, 0.45, timeout=LONG, hang_timeout=4.0) == 8


def test_hang_timeout_none_starts_no_detector(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any) -> None:
        raise AssertionError("a detector was made with hang_timeout=None")

    monkeypatch.setattr(_launch_spawn, "HangDetector", refuse)
    assert launch_fork(_hangs.slow_steps, 1, 0.0, hang_timeout=None) == 1


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), float("inf"), "300"])
def test_hang_timeout_must_be_none_or_a_finite_positive_number(value: object) -> None:
    match = r"hang_timeout must be a positive number of seconds \(or None\)"
    with pytest.raises(ValueError, match=match):
        ddp.launch(_hangs.slow_steps, 1, 0.0, nprocs=2, backend="gloo", hang_timeout=value)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"timeout must be a positive number of seconds"):
        ddp.watchdog(value)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("value", "shown"), [(1e-9, r"1e-09"), (0.5, r"0\.5"), (np.float64(0.999), r"0\.999")]
)
def test_a_hang_timeout_below_a_second_is_refused(
    monkeypatch: pytest.MonkeyPatch, value: float, shown: str
) -> None:
    # hang_timeout=1e-9 was accepted, and a healthy job whose rank 0 waited 0.25 s for a
    # slower rank 1 at an all_reduce failed at once: "HangError: no progress on any of 2
    # ranks for 0 s (hang_timeout=1e-09)". Progress is read every 0.1 s to 1 s.
    monkeypatch.setattr(_launch_spawn, "HangDetector", lambda *a: pytest.fail("ranks started"))
    match = rf"hang_timeout={shown} s is below 1 s, the shortest hang timeout: .*or None"
    with pytest.raises(ValueError, match=match):
        ddp.launch(_hangs.slow_steps, 1, 0.0, nprocs=2, backend="gloo", hang_timeout=value)
    with pytest.raises(ValueError, match=rf"^timeout={shown} s is below 1 s, the shortest hang"):
        ddp.watchdog(value)


def test_a_hang_timeout_of_one_second_is_allowed() -> None:
    assert launch_fork(_hangs.slow_steps, 1, 0.0, hang_timeout=1.0) == 1


def test_watchdog_needs_a_process_group_and_is_off_with_none() -> None:
    with pytest.raises(RuntimeError, match=r"watchdog\(\) needs the default process group"):
        ddp.watchdog(10.0)
    with ddp.watchdog(None) as off:
        assert not off.active


# ---------------------------------------------------------------- torchrun with watchdog()

# case, ranks, verdict kind, what the cause does
TORCHRUN_CASES = [
    ("busy_loop", 2, "outside", "is busy outside any collective"),
    ("skips_collective", 2, "mismatch", "waits in all_reduce"),
    # Three ranks: with two, nothing tells which of all_gather / all_reduce is the odd one.
    ("different_collective", 3, "mismatch", "waits in all_gather"),
    ("ddp_unused_layer", 2, "ddp", "waits in barrier"),
    ("busy_after_return", 2, "returned", "is busy outside any collective"),
    ("own_lock", 2, "outside", "is blocked on a lock"),
    ("stuck_dataloader", 2, "outside", "waits for a batch from its DataLoader"),
    ("stuck_custom_backward", 2, "outside", "is busy outside any collective"),
    ("slow_model_build", 2, "outside", "is busy outside any collective"),
    # Four ranks: one collects the reports, every rank prints nothing but the same verdict.
    ("busy_loop", 4, "outside", "is busy outside any collective"),
]


def _torchrun(
    case: str, nprocs: int, report_path: Path, marker: str
) -> subprocess.CompletedProcess[str]:
    env = _clean_env()
    env["OMP_NUM_THREADS"] = "1"
    env["TRAINPERF_TEST_MARKER"] = marker
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", str(nprocs), "--monitor-interval", "0.5",
        HANGS, case, str(HANG_S), str(report_path),
    ]  # fmt: skip
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)


def _all_gone(marker: str) -> None:
    deadline = time.monotonic() + 10
    while _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _processes_with(marker) == []


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    ("case", "nprocs", "kind", "cause"),
    TORCHRUN_CASES,
    ids=[f"{c[0]}-{c[1]}" for c in TORCHRUN_CASES],
)
def test_the_torchrun_variant_gives_the_same_verdict(
    tmp_path: Path, case: str, nprocs: int, kind: str, cause: str
) -> None:
    report_path = tmp_path / "hang.json"
    marker = f"torchrun-hang-{os.getpid()}-{time.time_ns()}"
    t0 = time.monotonic()
    run = _torchrun(case, nprocs, report_path, marker)
    out = run.stdout + run.stderr
    assert run.returncode != 0, out
    assert out.count("trainperf.ddp.watchdog: ") == 1, out  # one rank prints it
    assert "exitcode  : 124" in out, out  # the watchdog's exit, seen by torchrun
    verdict = out[out.index("trainperf.ddp.watchdog: ") :]
    assert f"rank {_hangs.BAD} is the cause." in verdict.splitlines()[0], verdict
    assert f"rank {_hangs.BAD} {cause}" in verdict and f"{HANGS}:{CAUSE[case]}" in verdict, verdict
    if kind == "returned":  # no main under watchdog(): it said "after rank 0 returned from main"
        assert "after rank 0 left the watchdog() block" in verdict, verdict
    report = json.loads(report_path.read_text())
    assert report["kind"] == kind and report["root_ranks"] == [_hangs.BAD], report
    assert report["message"] in verdict and report["world_size"] == nprocs
    assert f"on any of {nprocs} ranks" in verdict
    assert time.monotonic() - t0 < 90
    _all_gone(marker)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_under_torchrun_a_shape_mismatch_that_gloo_aborts_on_names_the_crash(
    tmp_path: Path,
) -> None:
    # gloo aborts (SIGABRT) on a size mismatch: a crash, not a hang, so there is no verdict
    # to give (and none is made up); torchrun names the crashed rank, and the watchdog's
    # faulthandler prints that rank's Python stack with the call site.
    marker = f"torchrun-shape-{os.getpid()}-{time.time_ns()}"
    run = _torchrun("different_shape", 2, tmp_path / "hang.json", marker)
    out = run.stdout + run.stderr
    assert run.returncode != 0, out
    assert "trainperf.ddp.watchdog" not in out and not (tmp_path / "hang.json").exists(), out
    assert "Received data size doesn't match expected size" in out, out
    assert "(SIGABRT)" in out, out  # torchrun's summary of the crashed rank
    fatal = out[out.index("Fatal Python error: Aborted") :]
    site = f'File "{HANGS}", line {CAUSE["different_shape"]} in different_shape'
    assert site in fatal, fatal
    _all_gone(marker)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_under_torchrun_a_busy_save_past_the_timeout_is_not_a_hang(tmp_path: Path) -> None:
    marker = f"torchrun-save-{os.getpid()}-{time.time_ns()}"
    run = _torchrun("busy_save", 2, tmp_path / "hang.json", marker)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert "trainperf.ddp.watchdog" not in out and not (tmp_path / "hang.json").exists()
    _all_gone(marker)


_FAKE_COMPILER = """\
import time


def compile_for(seconds):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        sum(range(1000))
"""


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_long_torch_compile_on_every_rank_is_not_a_hang(tmp_path: Path) -> None:
    # A module whose path looks like torch's compiler: its frames mean "compiling".
    path = tmp_path / "torch" / "_dynamo" / "convert_frame.py"
    path.parent.mkdir(parents=True)
    path.write_text(_FAKE_COMPILER)
    spec = importlib.util.spec_from_file_location("tp_fake_compiler", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = launch_fork(
        _hangs.long_compile, module.compile_for, 2.5 * HANG_S, timeout=LONG, hang_timeout=HANG_S
    )
    assert result == "compiled"


def _torch_compile_works() -> bool:
    try:
        import torch

        compiled = torch.compile(lambda x: x + 1, backend="eager")
        return bool(compiled(torch.ones(1)).item() == 2.0)
    except Exception:
        return False


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_rank_stuck_in_compiled_code_is_named() -> None:
    # Compiled code runs under dynamo's eval_frame wrapper: that is not compiling (was: any
    # torch/_dynamo frame excused the stall forever, and no hang was ever reported).
    if not _torch_compile_works():
        pytest.skip("torch.compile does not work here")
    with pytest.raises(HangError, match="rank 0 is the cause") as caught:
        launch_fork(_hangs.stuck_in_compiled_code, timeout=LONG, hang_timeout=2.0)
    assert f"{HANGS}:{CAUSE['stuck_in_compiled_code']}" in str(caught.value)


def _watched_now() -> tuple[bool, bool]:
    import threading

    import torch.distributed as dist

    wrapped = hasattr(dist.all_reduce, "__trainperf_watched__")
    return wrapped, any(t.name == "trainperf-watchdog" for t in threading.enumerate())


@pytest.mark.timeout(60)
def test_launch_inside_a_job_watches_through_the_watchdog_and_then_restores_torch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import threading

    import torch.distributed as dist

    from tests.ddp.test_launch import _free_port

    original = dist.all_reduce
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), OMP_NUM_THREADS="2")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert ddp.launch(_watched_now, backend="gloo", hang_timeout=30.0) == (True, True)
    assert dist.all_reduce is original
    assert not any(t.name == "trainperf-watchdog" for t in threading.enumerate())
    assert ddp.launch(_watched_now, backend="gloo", hang_timeout=None) == (False, False)


@pytest.mark.timeout(60)
def test_a_rank_that_cannot_open_its_progress_slot_still_runs(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    from trainperf.ddp import _progress_slots

    def full(path: str) -> Any:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_progress_slots, "attach", full)  # forked ranks inherit the patch
    assert launch_fork(_hangs.slow_steps, 2, 0.0, hang_timeout=HANG_S) == 2
    assert (
        "hang detection is off (OSError(28, 'No space left on device'))" in capfd.readouterr().err
    )


# ----------------------------------------------------------------- before every rank joined

_STUCK_MODULE = """
import multiprocessing, threading
LOCK = threading.Lock()
if multiprocessing.current_process().name == "trainperf-rank1":
    LOCK.acquire()
    with LOCK:  # CAUSE: main's module blocks on rank 1 alone
        pass


def main():
    import torch, torch.distributed as dist
    t = torch.ones(1)
    dist.all_reduce(t)
    return float(t)
"""

_STUCK_SCRIPT = """
import multiprocessing, sys, time, uuid
import trainperf.ddp as ddp
import trainperf.ddp._detector as detector
detector.STARTUP_FLOOR_S = 2.0
{main}
if __name__ == "__main__":
    if "main" not in globals():  # imported here only: a spawned rank imports it in trainperf
        from stuck_mod import main
    t0 = time.monotonic()
    try:
        ddp.launch(main, nprocs=2, hang_timeout=2.0, timeout=300)
    except ddp.HangError as e:
        print(e)
        print("KIND", e.report.verdict.kind, e.report.verdict.root)
    print("ELAPSED", time.monotonic() - t0)
"""


def _run_stuck(tmp_path: Path, main: str) -> str:
    (tmp_path / "stuck_mod.py").write_text(_STUCK_MODULE)
    script = tmp_path / "train.py"
    script.write_text(_STUCK_SCRIPT.format(main=main))
    env = _clean_env() | {"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.getcwd()}"}
    marker = f"stuck-{os.getpid()}-{time.monotonic_ns()}"
    env["TRAINPERF_TEST_MARKER"] = marker
    proc = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _processes_with(marker) == []  # every rank stopped
    out = proc.stdout
    assert "KIND outside (1,)" in out and "rank 1 is the cause." in out, out + proc.stderr
    assert "rank 0 waits for every rank to join the process group (before main)" in out, out
    assert "Fix: rank 1 never reached main" in out
    # Named in seconds, not after timeout=300 (with a raw store timeout blamed on rank 0).
    assert float(out.split("ELAPSED")[1]) < 120, out
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_rank_stuck_importing_mains_module_is_named_with_its_line(tmp_path: Path) -> None:
    out = _run_stuck(tmp_path, "")
    line = next(i for i, t in enumerate(_STUCK_MODULE.splitlines(), 1) if "# CAUSE" in t)
    assert "rank 1 has not joined the process group: it is still importing main's" in out, out
    assert f"{tmp_path / 'stuck_mod.py'}:{line}" in out, out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_rank_stuck_in_the_scripts_module_level_code_is_named(tmp_path: Path) -> None:
    main = _STUCK_MODULE.split("\n\n\n", 1)[1]  # main defined in the script itself
    block = (
        'if multiprocessing.current_process().name == "trainperf-rank1" '
        'and __name__ != "__main__":\n'
        "    time.sleep(600)  # the script's own module-level code blocks on rank 1\n"
    )
    out = _run_stuck(tmp_path, main + block)
    assert "rank 1 has not joined the process group: it is still starting" in out, out
    assert "its module-level code runs there too" in out
