"""trainperf.ddp._hang: the root-cause rules, one test each, on hand-made rank views."""

from __future__ import annotations

import json

import pytest

from trainperf.ddp._hang import diagnose
from trainperf.ddp._hang_report import HangReport
from trainperf.ddp._hang_view import RankView
from trainperf.ddp._progress_slots import Collective
from trainperf.ddp._stacks import Activity, Frame

F = "/home/me/train.py"


def _c(seq: int, op: str = "all_reduce", line: int = 24, detail: str = "float32[4]") -> Collective:
    return Collective(seq, op, detail, F, line, "main")


def _waits(
    rank: int, c: Collective, history: tuple[Collective, ...] = (), steps: int = 0
) -> RankView:
    return RankView(rank, "running", "collective", collective=c, history=(*history, c), steps=steps)


def _busy(rank: int, activity: Activity = "running", line: int = 21) -> RankView:
    where = Frame(F, line, "main")
    return RankView(rank, "running", activity, where=where, stack=(where,))


def test_a_rank_outside_any_collective_while_others_wait_is_the_cause() -> None:
    v = diagnose([_waits(0, _c(3)), _busy(1, line=21), _waits(2, _c(3))])
    assert (v.kind, v.root) == ("outside", (1,))
    assert v.headline.startswith(f"rank 1 is busy outside any collective at {F}:21 in main")
    assert f"while ranks 0, 2 wait in all_reduce float32[4] (collective #3) at {F}:24" in v.headline
    assert "raise hang_timeout" in v.advice


def test_a_rank_that_has_gone_is_the_cause_not_the_interconnect() -> None:
    v = diagnose([_waits(0, _c(2)), RankView(1, "gone", "running")])  # it may have crashed
    assert (v.kind, v.root) == ("gone", (1,))
    assert v.headline.startswith("rank 1 has exited without returning from main")
    assert "while rank 0 waits in all_reduce float32[4] (collective #2)" in v.headline
    assert "none is missing" not in v.headline and "interconnect" not in v.advice
    assert "its own output" in v.advice
    # With a rank that returned too: the gone one is blamed, the returned one mentioned.
    views = [_waits(0, _c(2)), RankView(1, "gone", "running"), RankView(2, "returned", "running")]
    v = diagnose(views)
    assert (v.kind, v.root) == ("gone", (1,))
    assert v.headline.endswith("; rank 2 returned from main")


def test_ranks_that_could_not_be_asked_are_not_said_to_have_exited() -> None:
    # The watchdog alone, its store gone: it knows its own rank only.
    views = [RankView(0, "unknown", "running"), _waits(1, _c(2)), RankView(2, "unknown", "running")]
    v = diagnose(views)
    assert (v.kind, v.root) == ("unreachable", ())
    assert v.headline.startswith("rank 1 waits in all_reduce float32[4] (collective #2)")
    assert "ranks 0, 2 could not be asked: the store that connects the ranks failed" in v.headline
    assert "exited" not in v.headline and "store" in v.advice
    busy = diagnose([RankView(0, "unknown", "running"), _busy(1)])
    assert busy.kind == "unreachable" and "returned" not in busy.advice


@pytest.mark.parametrize("status", ["returned"])
def test_ranks_waiting_for_one_that_finished_call_a_collective_it_never_will(
    status: str,
) -> None:
    finished = RankView(1, status, "running")  # type: ignore[arg-type]
    v = diagnose([_waits(0, _c(2)), finished, _waits(2, _c(2))])
    assert (v.kind, v.root) == ("mismatch", (0, 2))  # not "stalled", nobody blamed
    assert v.headline.startswith("rank 0 waits in all_reduce float32[4] (collective #2)")
    assert "a collective that rank 1 never will" in v.headline
    assert f"around {F}:24" in v.advice and "interconnect" not in v.advice


def test_a_dataloader_wait_a_lock_and_a_thread_wait_are_named_with_their_fix() -> None:
    v = diagnose([_waits(0, _c(3)), _busy(1, "dataloader")])
    assert v.root == (1,) and "waits for a batch from its DataLoader" in v.headline
    assert "__getitem__" in v.advice and "timeout=" in v.advice
    # num_workers=0: the dataset runs in the rank, DataLoader(timeout=) does not apply.
    getitem = Frame("/home/me/data.py", 9, "__getitem__")
    fetch = Frame("/torch/utils/data/_utils/fetch.py", 54, "<listcomp>")
    inline = RankView(1, "running", "dataloader", where=getitem, stack=(getitem, fetch))
    v = diagnose([_waits(0, _c(3)), inline])
    assert "rank 1 loads a batch in the rank itself (num_workers=0), in its dataset at " in (
        v.headline
    )
    assert "/home/me/data.py:9" in v.advice and "does not apply" in v.advice
    assert "num_workers=0 runs __getitem__ in the rank" not in v.advice
    threads = ((0x7F, Frame(F, 9, "hold"), "time.sleep(1e9)"),)
    where = Frame(F, 30, "main")
    view = RankView(1, "running", "lock", where=where, line="with lock:", threads=threads)
    v = diagnose([_waits(0, _c(3)), view])
    assert v.root == (1,) and f"is blocked on a lock at {F}:30 in main (`with lock:`)" in v.headline
    assert "another of its threads holds it" in v.advice
    report = HangReport(3.0, 3.2, 2, v, (_waits(0, _c(3)), view))
    assert f"other thread 0x7f: {F}:9 in hold (`time.sleep(1e9)`)" in str(report)
    joins = RankView(1, "running", "thread-wait", where=where, line="t.join()", threads=threads)
    v = diagnose([_waits(0, _c(3)), joins])
    assert v.root == (1,) and "waits for another of its threads" in v.headline
    assert "(`t.join()`)" in v.headline and "lock" not in v.headline
    assert "Signal on every path" in v.advice and "lock" not in v.advice
    child = RankView(1, "running", "process-wait", where=where, line="q.get()", threads=threads)
    v = diagnose([_waits(0, _c(3)), child])
    assert v.root == (1,) and "waits for another process (a multiprocessing queue" in v.headline
    assert "get(timeout=...)" in v.advice and "exit code" in v.advice


def test_a_rank_busy_after_the_others_returned_is_the_cause() -> None:
    done = RankView(0, "returned", "running")
    v = diagnose([done, _busy(1)])
    assert (v.kind, v.root) == ("returned", (1,))
    assert v.headline.endswith("after rank 0 returned from main")


def test_a_rank_that_called_sys_exit_is_not_said_to_have_returned_from_main() -> None:
    # Its slot says returned; the report said "returned from main" of a sys.exit(0).
    done = RankView(0, "returned", "running", exit_call="sys.exit(0)")
    v = diagnose([done, _busy(1)])
    assert (v.kind, v.root) == ("returned", (1,))
    assert v.headline.endswith("after rank 0 called sys.exit(0) in main"), v.headline
    both = [done, RankView(2, "returned", "running", exit_call="sys.exit(0)"), _busy(1)]
    assert diagnose(both).headline.endswith("after ranks 0, 2 called sys.exit(0) in main")


def test_a_rank_that_said_how_it_ended_is_named_so() -> None:
    # Under watchdog() there is no main: a rank that left the block, or raised in it, says
    # so itself; the report said "returned from main" or "exited without returning from
    # main (an error or a crash)".
    left = RankView(0, "returned", "running", finished="left the watchdog() block")
    assert diagnose([left, _busy(1)]).headline.endswith("after rank 0 left the watchdog() block")
    raised = RankView(1, "gone", "running", finished="raised ValueError in the watchdog() block")
    v = diagnose([_waits(0, _c(2)), raised])
    assert (v.kind, v.root) == ("gone", (1,))
    assert v.headline.startswith(
        "rank 1 raised ValueError in the watchdog() block, while rank 0"
    ), v.headline


def test_a_rank_past_the_ddp_backward_others_wait_in_is_the_cause() -> None:
    stuck = RankView(0, "running", "backward", where=Frame(F, 95, "main"), steps=2)
    ahead = _waits(1, _c(9, "barrier", 98, ""), steps=3)
    v = diagnose([stuck, ahead])
    assert (v.kind, v.root) == ("ddp", (1,))
    assert "optimizer steps rank 0: 2, rank 1: 3" in v.headline
    assert "find_unused_parameters=True" in v.advice
    # Without more steps on the waiting rank, it is an ordinary mismatch (both named).
    v = diagnose([stuck, _waits(1, _c(9, "barrier", 98, ""), steps=2)])
    assert v.kind == "mismatch" and v.root == (0, 1)


def test_the_rank_outside_the_largest_group_of_collectives_is_the_cause() -> None:
    odd = _waits(1, _c(3, "all_gather", 64, "float32[4] x3"))
    v = diagnose([_waits(0, _c(3)), odd, _waits(2, _c(3))])
    assert (v.kind, v.root) == ("mismatch", (1,))
    assert "rank 1 waits in all_gather float32[4] x3 (collective #3)" in v.headline
    assert "TORCH_DISTRIBUTED_DEBUG=DETAIL" in v.advice
    # Same op, other shape: a mismatch too.
    v = diagnose([_waits(0, _c(3)), _waits(1, _c(3, detail="float32[8]")), _waits(2, _c(3))])
    assert v.root == (1,)


def test_with_two_ranks_the_one_that_skipped_a_collective_is_found_by_its_history() -> None:
    # Both ran all_reduce(A:54) -> broadcast(B:56) -> A -> B ...; rank 1 went A -> A.
    a, b = (lambda s: _c(s, "all_reduce", 54)), (lambda s: _c(s, "broadcast", 56))
    past = (a(1), b(2), a(3), b(4), a(5))
    v = diagnose([_waits(0, b(6), past), _waits(1, a(6), past)])
    assert (v.kind, v.root) == ("mismatch", (1,))
    # Without history to tell them apart, both are named.
    v = diagnose([_waits(0, _c(3, "all_reduce", 66)), _waits(1, _c(3, "all_gather", 64))])
    assert v.root == (0, 1)


def test_a_fix_that_blames_several_ranks_names_each_of_their_lines() -> None:
    # Rank 1 called barrier() once more than rank 0, which went on to all_reduce: both are
    # named, and the fix pointed at rank 0's line only (the extra barrier is on rank 1's).
    v = diagnose([_waits(0, _c(4, "all_reduce", 77)), _waits(1, _c(4, "barrier", 76, ""))])
    assert v.root == (0, 1)
    assert f"around {F}:77 and {F}:76." in v.advice, v.advice
    # Ranks at one line name it once; past three lines, the rest are counted.
    views = [_waits(r, _c(4, "all_gather", 60 + r % 5)) for r in range(8)] + [_waits(8, _c(4))]
    v = diagnose(views)
    assert f"around {F}:60, {F}:61, {F}:62 and 3 more." in v.advice, v.advice


def test_ranks_at_the_same_call_with_fewer_collectives_skipped_one_earlier() -> None:
    v = diagnose([_waits(0, _c(7)), _waits(1, _c(6)), _waits(2, _c(7))])
    assert (v.kind, v.root) == ("behind", (1,))


def test_every_rank_in_the_same_collective_blames_nobody() -> None:
    v = diagnose([_waits(0, _c(3)), _waits(1, _c(3))])
    assert (v.kind, v.root) == ("stalled", ())
    assert "doctor --dist" in v.advice


@pytest.mark.parametrize("op", ["recv", "send"])
def test_every_rank_in_a_blocking_recv_is_an_ordering_deadlock_not_the_interconnect(
    op: str,
) -> None:
    v = diagnose([_waits(0, _c(1, op, line=9)), _waits(1, _c(1, op, line=9))])
    assert (v.kind, v.root) == ("mismatch", (0, 1))
    assert f"every peer is in a {op} too (a send/recv ordering deadlock)" in v.headline
    assert "isend" in v.advice and f"{F}:9" in v.advice and "doctor --dist" not in v.advice
    # A send facing a recv that never completes is another story (other src/dst or tags).
    mixed = diagnose([_waits(0, _c(1, "send")), _waits(1, _c(1, "recv"))])
    assert "ordering deadlock" not in mixed.headline


def test_ranks_all_stuck_outside_collectives_are_all_named() -> None:
    v = diagnose([_busy(0, "dataloader"), _busy(1, "dataloader")])
    assert (v.kind, v.root) == ("outside", (0, 1))


def test_a_rank_that_sent_no_stack_is_named_as_such() -> None:
    silent = RankView(1, "running", "running", answered=False)
    v = diagnose([_waits(0, _c(3)), silent])
    report = HangReport(3.0, 4.0, 2, v, (_waits(0, _c(3)), silent))
    assert v.root == (1,) and "rank 1 sent no stack" in str(report)
    # Not "is busy outside any collective" with a fix that looks "at the call site": its
    # watchdog thread could not run (C code holding the GIL), so nothing is known of it.
    assert v.headline.startswith("rank 1 did not answer: its stacks could not be read"), v
    assert "busy" not in v.headline and "the call site" not in v.advice, v
    assert "py-spy dump --native" in v.advice


def test_the_advice_names_the_limit_as_the_caller_named_it() -> None:
    # watchdog(timeout=...) has no hang_timeout to raise.
    views = (_waits(0, _c(3)), _busy(1))
    report = HangReport(3.0, 3.4, 2, diagnose(list(views)), views, option="timeout")
    text = str(report)
    assert "(timeout=3)" in text and "hang_timeout" not in text
    assert "raise the watchdog's timeout (or pass timeout=None)" in text
    assert "hang_timeout" not in report.to_dict()["advice"]
    launched = HangReport(3.0, 3.4, 2, diagnose(list(views)), views)
    assert "raise hang_timeout (or pass hang_timeout=None)" in str(launched)


def test_the_returned_advice_under_watchdog_names_no_main() -> None:
    # watchdog() (torchrun, SLURM) has no main: its advice said "the other ranks finished
    # main ... otherwise make it return".
    left = RankView(0, "returned", "running", finished="left the watchdog() block")
    views = (left, _busy(1))
    report = HangReport(3.0, 3.4, 2, diagnose(list(views)), views, option="timeout")
    advice = report.to_dict()["advice"]
    assert "main" not in advice and "return" not in advice, advice
    assert "the other ranks left the watchdog() block (or ended their script)" in advice
    assert "raise the watchdog's timeout; otherwise make it finish too" in advice
    assert advice in str(report)
    launched = HangReport(3.0, 3.4, 2, diagnose(list(views)), views)
    assert "the other ranks finished main while rank 1" in launched.to_dict()["advice"]


def test_the_report_reads_and_serialises() -> None:
    views = (_waits(0, _c(3), steps=2), _busy(1))
    report = HangReport(3.0, 3.4, 2, diagnose(list(views)), views)
    text = str(report)
    assert text.startswith("no progress on any of 2 ranks for 3 s (hang_timeout=3): rank 1 is")
    assert "Each rank:\n  rank 0 waits in all_reduce" in text and "(2 optimizer steps)" in text
    assert f'Stack of rank 1, main thread (most recent call last):\n  File "{F}", line 21' in text
    data = json.loads(json.dumps(report.to_dict()))
    assert data["root_ranks"] == [1] and data["kind"] == "outside"
    assert data["ranks"][0]["collective"]["site"] == f"{F}:24"
    assert data["ranks"][1]["where"] == {"file": F, "line": 21, "function": "main"}


def test_ranks_that_crashed_while_being_stopped_are_named_first() -> None:
    from trainperf.ddp._hang_report import Ending

    views = (_waits(0, _c(3)), _busy(1), _waits(2, _c(3)))
    endings = (
        Ending(0, -15, "stopped by SIGTERM", True),
        Ending(1, -11, "died from signal SIGSEGV (a crash in native code)", False),
        Ending(2, -15, "stopped by SIGTERM", True),
    )
    report = HangReport(3.0, 3.4, 3, diagnose(list(views)), views, endings=endings)
    text = str(report)
    assert "While the ranks were stopped:\n  rank 1 died from signal SIGSEGV" in text
    assert text.endswith("Ranks 0, 2: stopped by SIGTERM.")
    data = json.loads(json.dumps(report.to_dict()))
    assert data["endings"][1] == {
        "rank": 1,
        "exitcode": -11,
        "how": "died from signal SIGSEGV (a crash in native code)",
        "expected": False,
    }


def test_a_rank_stuck_in_known_slow_work_is_named_with_it() -> None:
    where = Frame(F, 40, "save")
    stuck = RankView(
        1, "running", "running", where=where, stuck_in="saving checkpoint /c.pt", stuck_s=31.0
    )
    v = diagnose([_waits(0, _c(3, "barrier", 50, "")), stuck])
    assert (v.kind, v.root) == ("outside", (1,))
    assert v.headline.startswith(f"rank 1 is stuck in saving checkpoint /c.pt for 31 s at {F}:40")
    assert "10 x the timeout" in v.advice


def test_the_rules_stay_linear_in_the_number_of_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    # Under watchdog() one rank diagnoses every rank's view: comparing views pairwise (a
    # list-membership test per rank) took seconds at a few thousand ranks.
    n = 300
    views = [_waits(r, _c(9)) for r in range(n)]
    views[7] = _waits(7, _c(9, "all_gather", 64))
    compared = [0]
    plain_eq = RankView.__eq__

    def counting_eq(self: RankView, other: object) -> bool:
        compared[0] += 1
        return bool(plain_eq(self, other))

    monkeypatch.setattr(RankView, "__eq__", counting_eq)
    v = diagnose(views)
    str(HangReport(3.0, 3.1, n, v, tuple(views)))
    assert v.root == (7,)
    assert compared[0] <= 2 * n, compared[0]


def test_torch_compile_excuses_a_stall_only_up_to_the_cap() -> None:
    from trainperf.ddp._hang import is_hang
    from trainperf.ddp._hang_view import RankView
    from trainperf.ddp._progress_slots import BUSY_CAP

    waits = RankView(0, "running", "collective")
    compiles = RankView(1, "running", "running", compiling=True)
    assert not is_hang([waits, compiles])  # no stall length given: compiling excuses it
    assert not is_hang([waits, compiles], stalled_s=BUSY_CAP * 2.0 - 0.1, timeout=2.0)
    assert is_hang([waits, compiles], stalled_s=BUSY_CAP * 2.0 + 0.1, timeout=2.0)
    assert compiles.doing().startswith("is stuck in torch.compile's compilation")
