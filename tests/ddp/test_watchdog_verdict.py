"""trainperf.ddp._watchdog_verdict: the watchdog's decisions, each a pure function of what the
ranks posted (``judge`` itself is tested in test_watchdog.py, through its re-export)."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from trainperf.ddp import _hang
from trainperf.ddp._hang_report import HangReport
from trainperf.ddp._hang_view import RankView
from trainperf.ddp._progress_slots import SLOT_SIZE
from trainperf.ddp._progress_tracker import Tracker
from trainperf.ddp._watchdog_verdict import speaker, verdict_record, view

USER = "/home/me/train.py"
MAIN = threading.main_thread().ident or 0
DUMP = f'Thread 0x{MAIN:x} (most recent call first):\n  File "{USER}", line 20 in main\n'


def _record(status: str, dump: str = DUMP) -> dict[str, Any]:
    """A rank's report as the watchdog posts it, from a slot this (main) thread owns."""
    buf = bytearray(SLOT_SIZE)
    Tracker(buf).ready(armed=True)
    return {"status": status, "slot": bytes(buf).hex(), "dump": dump}


def _report(*ranks: RankView) -> HangReport:
    return HangReport(5.0, 6.0, len(ranks), _hang.diagnose(list(ranks)), ranks, option="timeout")


@pytest.mark.parametrize("status", ["running", "returned", "gone"])
def test_a_view_keeps_the_posted_status_and_only_a_running_ranks_stacks(status: str) -> None:
    seen = view(3, _record(status))
    assert (seen.rank, seen.status) == (3, status)
    assert (seen.where is not None) == (status == "running")
    if status == "running":
        assert seen.where is not None and seen.where.site == f"{USER}:20"


def test_a_view_without_a_dump_has_no_frames() -> None:
    seen = view(1, _record("running", dump=""))
    assert seen.status == "running" and seen.where is None and seen.stack == ()


def test_the_lowest_running_rank_that_answered_speaks_and_counts_the_answering() -> None:
    ranks = (
        RankView(0, "returned", "running"),
        RankView(1, "running", "running", answered=False),
        RankView(2, "running", "running"),
        RankView(3, "running", "running"),
    )
    report = _report(*ranks)
    assert speaker(report, me=3) == 2
    record = verdict_record(report, me=3)
    assert record["speaker"] == 2 and record["answering"] == 2
    assert record["message"] == str(report) and record["report"] == report.to_dict()


def test_with_no_running_rank_answering_the_caller_speaks_itself() -> None:
    report = _report(
        RankView(0, "gone", "running"), RankView(1, "running", "running", answered=False)
    )
    assert speaker(report, me=1) == 1
    assert verdict_record(report, me=1)["answering"] == 0
