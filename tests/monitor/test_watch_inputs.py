"""Tests for ``monitor/_watch_inputs.py``: the watch's notes on the report it analysed."""

from __future__ import annotations

import pytest

from tests.monitor._fakes import samples, steps
from trainperf.monitor import LoopSetup, Sample, WatchReport, analyse
from trainperf.monitor._watch_inputs import wait_elsewhere_noted

_PREFETCHED = LoopSetup(prefetch_thread="prefetch")


def _noted(report: WatchReport) -> tuple[str, ...]:
    return wait_elsewhere_noted(report, "prefetch", "MainThread").verdict.reasons


@pytest.mark.parametrize(
    ("kind", "host"),
    [("compute-bound", samples(15, None, 20, 30)), ("host-bound", samples(15, None, 20, 99))],
)
def test_a_verdict_that_names_the_prefetch_thread_is_not_told_it_again(
    kind: str, host: list[Sample]
) -> None:
    # Before: compute-bound's and held CPUs' own reasons named the prefetch thread, and the
    # watch's note said it all again: two explanations of one unmeasured wait.
    report = analyse(steps(60, 0.0, 0.02), host, cpus=4, wait_measured=False, setup=_PREFETCHED)
    assert report.verdict.kind == kind
    reasons = _noted(report)
    assert reasons == report.verdict.reasons
    assert sum("'prefetch'" in r for r in reasons) == 1, reasons


def test_a_verdict_silent_on_the_data_wait_is_told_why_it_went_unmeasured() -> None:
    report = analyse(steps(3, 0.0, 0.02), wait_measured=False, setup=_PREFETCHED)
    assert report.verdict.kind == "inconclusive"
    reasons = _noted(report)
    assert reasons[:-1] == report.verdict.reasons
    assert reasons[-1].startswith("w.iter() ran in thread 'prefetch', not in 'MainThread'")
