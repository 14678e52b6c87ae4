"""trainperf.ddp._failures: what the launcher records about a rank that failed."""

from __future__ import annotations

import pytest

from trainperf.ddp import _injob, _watchdog
from trainperf.ddp._failures import DEATH_SLACK_S, load_advice, startup_problem, summarize
from trainperf.ddp._worker import _describe

_IMPORT_ERROR = """\
Traceback (most recent call last):
  File "/tmp/train.py", line 3, in <module>
    import missing_package
ModuleNotFoundError: No module named 'missing_package'
"""


@pytest.mark.parametrize(("code", "by_signal"), [(1, False), (-9, True)])
def test_a_start_up_failure_records_whether_a_signal_ended_the_worker(
    code: int, by_signal: bool
) -> None:
    problem = startup_problem(1, 100.0, _IMPORT_ERROR, code)
    assert problem is not None
    assert problem.slack == DEATH_SLACK_S
    assert problem.by_signal is by_signal
    assert "No module named 'missing_package'" in problem.summary


def test_a_main_the_script_defines_under_its_main_guard_is_named_with_the_fix() -> None:
    # Under spawn the worker's import of the script skips the guarded block, so a main
    # defined there is missing ("Can't get attribute 'train' on <module '__mp_main__'>");
    # the advice spoke only of installing the module or putting it on sys.path.
    def train() -> None: ...

    # As the script's guarded block defines it: in __main__, at its top level.
    train.__module__, train.__qualname__ = "__main__", "train"
    advice = load_advice(train)
    assert "define train at the script's top level" in advice
    assert 'outside the if __name__ == "__main__": block' in advice
    # A module of its own keeps the import advice.
    assert "installed, or in a directory on sys.path" in load_advice(load_advice)


@pytest.mark.parametrize(
    ("code", "call"),
    [("no data", "sys.exit('no data')"), (3, "sys.exit(3)"), ("3", "sys.exit('3')")],
)
def test_a_sys_exit_is_named_alike_by_launch_and_inside_a_job(code: object, call: str) -> None:
    # launch's spawner said "called sys.exit(no data)" (str of the code), the in-job errors
    # "called sys.exit('no data')"; sys.exit(3) and sys.exit("3") read the same.
    exc = SystemExit(code)
    assert summarize(_describe(1, exc)) == f"called {call}"
    assert _injob._raised(exc) == f"called {call}"
    assert _watchdog._raised(exc) == f"called {call}"


@pytest.mark.parametrize("cls", [ValueError, RuntimeError])  # ValueError in recent torch
def test_a_second_init_process_group_in_main_is_named_with_the_fix(cls: type) -> None:
    # torch's bare "trying to initialize the default process group twice!" did not say that
    # launch() had already initialised it for main.
    twice = _describe(0, cls("trying to initialize the default process group twice!"))
    summary = summarize(twice)
    assert summary.startswith(f"raised {cls.__name__}: trying to initialize the default")
    assert "launch() already set up the process group for main" in summary
    assert "remove main's dist.init_process_group call" in summary
    assert "if not dist.is_initialized()" in summary
    other = summarize(_describe(0, cls("something else")))
    assert "already set up" not in other
