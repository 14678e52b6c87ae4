"""trainperf.ddp._group_exits: what a rank's report or exit without one records."""

from __future__ import annotations

import multiprocessing

from trainperf.ddp._group_exits import (
    not_exited,
    reimported,
    reported,
    returned_then_died,
    unreported,
)
from trainperf.ddp._worker import Failure
from trainperf.ddp._worker_reimport import REIMPORT_EXIT_CODE


def test_a_main_or_argument_that_cannot_be_loaded_would_fail_a_restart_the_same_way() -> None:
    load = Failure(0, 10, "ModuleNotFoundError", "No module named 'x'", "tb", 1.0, "load")
    args = Failure(1, 11, "AttributeError", "no Cfg", "tb", 1.0, "args", "args[0] (m.Cfg)")
    own = Failure(1, 11, "ValueError", "bad batch", "tb", 1.0)
    load_problem, load_repeats = reported(load, None)
    args_problem, args_repeats = reported(args, None)
    assert load_repeats and load_problem.advice.startswith("Fix: ")
    assert args_repeats and "args[0] (m.Cfg)" in args_problem.advice
    problem, repeats = reported(own, None)
    assert not repeats and problem.advice == "" and problem.detail == "tb"


def test_an_exit_without_a_report_is_dated_back_unless_it_is_the_missing_main_guard() -> None:
    exited, repeats = unreported(0, 0, 100.0, reimport=False, startup_text=None)
    assert exited.slack and not exited.by_signal and not repeats
    aborted, _ = unreported(1, -6, 100.0, reimport=False, startup_text=None)
    assert aborted.aborted and aborted.by_signal
    guard, repeats = unreported(1, REIMPORT_EXIT_CODE, 100.0, reimport=True, startup_text=None)
    assert 'if __name__ == "__main__": guard' in guard.summary and repeats and not guard.slack


def test_an_exit_with_code_0_without_a_result_says_how_to_end_main() -> None:
    # It said only "exited with code 0 without returning from main (os._exit?)".
    exited, _ = unreported(1, 0, 100.0, reimport=False, startup_text=None)
    assert exited.summary.startswith("exited with code 0 without returning from main")
    assert exited.advice.startswith("Fix: return from main (or call sys.exit(0))"), exited.advice
    assert "background checkpoint saves" in exited.advice


def test_the_main_guard_exit_status_means_a_reimport_only_before_main_loaded() -> None:
    spawn, fork = multiprocessing.get_context("spawn"), multiprocessing.get_context("fork")
    assert reimported(REIMPORT_EXIT_CODE, spawn, loaded=False)
    assert not reimported(REIMPORT_EXIT_CODE, spawn, loaded=True)
    assert not reimported(REIMPORT_EXIT_CODE, fork, loaded=False)


def test_a_rank_that_finished_then_died_is_named_by_how_it_finished() -> None:
    assert returned_then_died(0, None, -11).startswith("rank 0 returned from main, then died")
    assert returned_then_died(1, "sys.exit()", 3).startswith("rank 1 called sys.exit(), then")


def test_ranks_that_did_not_exit_are_named_by_how_they_finished_main() -> None:
    # Ranks whose main called sys.exit(0) were said to have "returned from main".
    text = not_exited([2, 0, 1], {1: "sys.exit(0)"}, 10.0)
    assert text.startswith(
        "ranks 0, 2 returned from main and rank 1 called sys.exit(0) in main, but did not "
        "exit within 10 s"
    ), text
    assert not_exited([1], {1: "sys.exit()"}, 10.0).startswith("rank 1 called sys.exit() in main,")


def test_a_result_that_cannot_be_pickled_would_fail_a_restart_the_same_way() -> None:
    # max_restarts ran all of main again for a return value that cannot be pickled.
    from trainperf.ddp._worker import _describe
    from trainperf.ddp._worker_pickle import UnsendableResult

    unsendable = UnsendableResult(lambda: 0, TypeError("cannot pickle 'function' object"))
    problem, repeats = reported(_describe(0, unsendable), None)
    assert repeats
    assert problem.summary.startswith("raised TypeError: main returned a value that cannot be")
    _, repeats = reported(_describe(0, ValueError("bad batch")), None)
    assert not repeats


def test_a_group_set_up_while_main_was_imported_would_fail_a_restart_the_same_way() -> None:
    # It was a "setup" failure, restarted under max_restarts; a port clash still is.
    group = Failure(0, 10, "RuntimeError", "set up while this rank imported", "tb", 1.0, "group")
    clash = Failure(0, 10, "RuntimeError", "address already in use", "tb", 1.0, "setup")
    assert reported(group, None)[1]
    assert not reported(clash, None)[1]
