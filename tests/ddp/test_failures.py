"""trainperf.ddp._failures: what the launcher records about a rank that failed."""

from __future__ import annotations

import pytest

from trainperf.ddp._failures import DEATH_SLACK_S, startup_problem

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
