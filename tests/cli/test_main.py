"""trainperf.cli._main: `python -m trainperf`, Ctrl-C (exit 130) and a closed stdout."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.cli._run import TINY, run
from trainperf.cli import main


@pytest.mark.slow
def test_python_dash_m_trainperf() -> None:
    help_run = subprocess.run(
        [sys.executable, "-m", "trainperf", "--help"],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    assert "bench" in help_run.stdout and "doctor" in help_run.stdout
    doctor = subprocess.run(
        [sys.executable, "-m", "trainperf", "doctor", "--json"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    document = json.loads(doctor.stdout)
    assert doctor.returncode == (1 if document["worst"] == "fail" else 0)
    assert [c["name"] for c in document["checks"]][:2] == ["gpus", "torch"]


def test_a_closed_stdout_is_an_error_before_any_work(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import trainperf.doctor

    monkeypatch.setattr(trainperf.doctor, "diagnose", lambda: pytest.fail("ran with no stdout"))
    monkeypatch.setattr(sys, "stdout", None)  # what Python sets when started with `>&-`
    code = main(["doctor", "--json"])
    err = capsys.readouterr().err
    assert code == 1 and err.startswith("trainperf: error: stdout is closed")


@pytest.mark.slow
def test_the_command_on_a_full_disk_or_a_closed_stdout_exits_1_with_one_line() -> None:
    for redirect in ("> /dev/full", ">&-"):
        shell = f"{shlex.quote(sys.executable)} -m trainperf gpus --json {redirect}"
        done = subprocess.run(shell, shell=True, capture_output=False, stderr=subprocess.PIPE,
                              text=True, timeout=120)  # fmt: skip
        assert done.returncode == 1, (redirect, done.stderr)
        assert done.stderr.startswith("trainperf: error: ") and done.stderr.count("\n") == 1


@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_ctrl_c_mid_run_is_one_line_and_exit_130_not_a_traceback(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, json_flag: list[str]
) -> None:
    import trainperf.bench

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        raise KeyboardInterrupt  # what Python raises where Ctrl-C lands, deep inside torch

    monkeypatch.setattr(trainperf.bench, "bench_model", interrupted)
    message = "interrupted (Ctrl-C) before the command finished"
    try:
        code, out, err = run(capsys, "bench", "model", *TINY, *json_flag)
    except KeyboardInterrupt:  # would stop pytest itself
        pytest.fail("Ctrl-C escaped main(): Python prints its traceback")
    assert code == 130 and "Traceback" not in err
    assert err.splitlines()[-1] == f"trainperf: error: {message}"
    if json_flag:
        assert json.loads(out) == {
            "command": "bench model",
            "error": {"type": "KeyboardInterrupt", "message": message},
        }
    else:
        assert out == ""


@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_ctrl_c_before_the_command_runs_is_one_line_and_exit_130(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, json_flag: list[str]
) -> None:
    import trainperf.cli._main

    def interrupted(argv: list[str]) -> Any:
        raise KeyboardInterrupt  # Ctrl-C while the command line is read

    monkeypatch.setattr(trainperf.cli._main, "_parse", interrupted)
    try:
        code, out, err = run(capsys, "gpus", *json_flag)
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C escaped main(): Python prints its traceback")
    message = "interrupted (Ctrl-C) before the command finished"
    assert code == 130 and err == f"trainperf: error: {message}\n"
    if json_flag:
        assert json.loads(out) == {
            "command": None,
            "error": {"type": "KeyboardInterrupt", "message": message},
        }
    else:
        assert out == ""


def _interrupt(process: subprocess.Popen[str]) -> tuple[str, str]:
    """Ctrl-C, sent again every 5 s while the process runs on (one CI run once lost the
    first), then its output."""
    for _ in range(11):
        process.send_signal(signal.SIGINT)
        try:
            return process.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            continue
    return process.communicate(timeout=5)


def test_ctrl_c_while_a_command_imports_torch_exits_130_without_a_traceback(
    tmp_path: Path,
) -> None:
    # A stand-in torch whose import waits, so Ctrl-C lands inside it, as it would in the
    # seconds the real one takes.
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text(
        "import sys, time\nprint('importing torch', file=sys.stderr, flush=True)\ntime.sleep(60)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    argv = [sys.executable, "-m", "trainperf", "bench", "matmul", "--device", "cpu", "--json"]
    with subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as process:  # fmt: skip
        try:
            assert process.stderr is not None
            first = process.stderr.readline()
            assert first == "importing torch\n", first + process.stderr.read()
            out, err = _interrupt(process)
        finally:
            process.kill()
    message = "interrupted (Ctrl-C) before the command finished"
    assert process.returncode == 130 and err == f"trainperf: error: {message}\n"
    assert json.loads(out)["error"] == {"type": "KeyboardInterrupt", "message": message}
