"""trainperf.ddp._stderr: what a spawned worker prints before trainperf code runs in it reaches
the LaunchError (#20.13): the exception a script raises when a worker imports it again, and
the bootstrapping RuntimeError of a process started at import time."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.ddp.test_launch import _clean_env, _processes_with
from trainperf.ddp._stderr import last_traceback, redirected_stderr, unredirected_stderr

_IMPORT_ERROR = """\
Traceback (most recent call last):
  File "<string>", line 1, in <module>
  File "/tmp/train.py", line 3, in <module>
    import missing_package
ModuleNotFoundError: No module named 'missing_package'
"""

_BOOTSTRAP = """\
Traceback (most recent call last):
  File "/usr/lib/python3.11/multiprocessing/spawn.py", line 154, in _check_not_importing_main
    raise RuntimeError('''
RuntimeError:
        An attempt has been made to start a new process before the
        current process has finished its bootstrapping phase.

        This probably means that you are not using fork to start your
"""


def test_the_last_traceback_and_its_exception_are_found() -> None:
    summary, tb = last_traceback("warning: noise\n" + _IMPORT_ERROR)  # type: ignore[misc]
    assert summary == "ModuleNotFoundError: No module named 'missing_package'"
    assert tb.startswith("Traceback (most recent call last):") and "import missing_package" in tb
    assert "noise" not in tb
    # Two tracebacks: the last one counts.
    summary, _ = last_traceback(_IMPORT_ERROR + _BOOTSTRAP)  # type: ignore[misc]
    assert summary == (
        "RuntimeError: An attempt has been made to start a new process before the current "
        "process has finished its bootstrapping phase."
    )
    assert last_traceback("Traceback (most recent call last):\n  File x\n") is None
    assert last_traceback("") is None


def test_the_redirect_gives_fd_2_back_and_forwards_what_came_through(
    capfd: pytest.CaptureFixture[str],
) -> None:
    with redirected_stderr() as captured:
        assert captured is not None
        reader, real = captured
        os.write(2, b"from the child\n")
        os.write(real, b"straight through\n")
    reader.drain(2.0)
    assert reader.fd is None  # both write ends are closed: the pipe reached its end
    assert reader.text() == "from the child\n"
    os.write(2, b"after\n")
    err = capfd.readouterr().err
    assert err.index("straight through") < err.index("after")
    assert "from the child" in err  # forwarded, not swallowed


def test_a_launcher_without_sys_stderr_still_redirects_and_forwards_to_fd_2(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    # pythonw and some embedders set sys.stderr to None: flushing it before the redirect
    # raised AttributeError, and so did forwarding what the worker printed.
    saved = os.dup(2)
    try:
        monkeypatch.setattr(sys, "stderr", None)
        with redirected_stderr() as captured:
            assert captured is not None
            reader, _ = captured
            os.write(2, b"from the child\n")
        reader.drain(2.0)
        monkeypatch.undo()
        assert reader.fd is None and reader.text() == "from the child\n"
        assert capfd.readouterr().err == "from the child\n"  # forwarded once, to fd 2
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _fd2() -> tuple[int, int, bool]:
    st = os.fstat(2)
    return st.st_dev, st.st_ino, stat.S_ISFIFO(st.st_mode)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("second", [redirected_stderr, unredirected_stderr])
def test_concurrent_worker_starts_take_turns_with_fd_2(second: Any) -> None:
    # Two launches in two threads: fd 2 is one per process, so a second redirect made while
    # the first is open used to leave fd 2 on a closed pipe (and a forked worker started
    # meanwhile would inherit the other worker's pipe as its stderr).
    saved, before = os.dup(2), _fd2()
    inside, release = threading.Event(), threading.Event()
    entered: list[float] = []

    def first() -> None:
        with redirected_stderr():
            inside.set()
            release.wait(10)

    def then() -> None:
        inside.wait(10)
        with second():
            entered.append(time.monotonic())

    threads = [threading.Thread(target=first), threading.Thread(target=then)]
    try:
        for t in threads:
            t.start()
        inside.wait(10)
        time.sleep(0.3)
        waited = not entered  # the second start waits for the first to finish
        released = time.monotonic()
        release.set()
        for t in threads:
            t.join(10)
        assert waited, "a second worker start ran while fd 2 was redirected for the first"
        assert entered and entered[0] >= released
        assert _fd2() == before
    finally:
        release.set()
        os.dup2(saved, 2)
        os.close(saved)


_SET_START_METHOD = """\
import multiprocessing
import trainperf.ddp as ddp

multiprocessing.set_start_method("spawn")  # unguarded: runs again in every worker


def main():
    return 1


if __name__ == "__main__":
    print("result", ddp.launch(main, nprocs=2, backend="gloo", max_restarts=1))
"""

_PROCESS_AT_IMPORT = """\
import multiprocessing
import trainperf.ddp as ddp


def main():
    return 1


helper = multiprocessing.get_context("spawn").Process(target=print)  # unguarded
helper.start()
helper.join()

if __name__ == "__main__":
    print("result", ddp.launch(main, nprocs=2, backend="gloo", max_restarts=1))
"""


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    ("source", "cause", "fix"),
    [
        (
            _SET_START_METHOD,
            "could not start: RuntimeError: context has already been set (Python raised it "
            "while the new process imported",
            "so its top level runs in every worker",
        ),
        (
            _PROCESS_AT_IMPORT,
            "could not start: RuntimeError: An attempt has been made to start a new process "
            "before the current process has finished its bootstrapping phase.",
            "starts a process (a multiprocessing Process or Pool, a DataLoader with workers)",
        ),
    ],
    ids=["raises-at-import", "bootstrapping"],
)
def test_a_script_whose_import_fails_in_the_workers_names_the_cause(
    tmp_path: Path, source: str, cause: str, fix: str
) -> None:
    script = tmp_path / "train.py"
    script.write_text(source)
    env = _clean_env()
    marker = f"import-fails-{os.getpid()}-{time.time_ns()}"
    env["TRAINPERF_TEST_MARKER"] = marker
    run = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=180,
    )  # fmt: skip
    out = run.stdout + run.stderr
    error = out[out.index("LaunchError: ") :]
    assert run.returncode == 1, out
    assert cause in error, error
    assert str(script) in error and fix in error, error
    assert 'if __name__ == "__main__":' in error and 'start_method="fork"' in error, error
    # The worker's own traceback, with the script's line, is in the error.
    assert "Traceback from rank" in error and 'train.py", line' in error, error
    # Not the old guess, and no restart: it would fail the same way.
    assert "without reporting an error" not in error, error
    assert "attempt 2" not in out and "restarting" not in out, out
    deadline = time.monotonic() + 10
    while _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _processes_with(marker) == []
