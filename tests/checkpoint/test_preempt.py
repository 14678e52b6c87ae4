"""trainperf.checkpoint._preempt: the handler only sets a flag, handlers come back on exit,
and every rank of a group stops at the same step."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

import trainperf.checkpoint._preempt as preempt_module
from tests.checkpoint import _agree
from tests.checkpoint._fake_nccl import FakeNccl
from tests.ddp._distributed import FORK, spawn
from trainperf.checkpoint import Preemption
from trainperf.checkpoint._preempt import agreement_interval, signal_numbers


def test_signal_names_and_numbers_are_checked() -> None:
    assert signal_numbers(("SIGTERM", "usr1", int(signal.SIGUSR2), "SIGTERM")) == (
        signal.SIGTERM,
        signal.SIGUSR1,
        signal.SIGUSR2,
    )
    assert signal_numbers("TERM") == (signal.SIGTERM,)
    with pytest.raises(ValueError, match=r"unknown signal 'SIGNOPE'; use a name such as"):
        signal_numbers(("SIGNOPE",))
    with pytest.raises(ValueError, match=r"SIGKILL cannot be caught by any process"):
        signal_numbers(("SIGKILL",))
    with pytest.raises(ValueError, match=r"signals must name at least one signal"):
        signal_numbers(())
    with pytest.raises(TypeError, match=r"signals must be names such as 'SIGTERM' or numbers"):
        signal_numbers((1.5,))  # type: ignore[arg-type]


def test_options_are_checked() -> None:
    with pytest.raises(ValueError, match=r"grace_s must be"):
        Preemption(grace_s=float("nan"))
    with pytest.raises(ValueError, match=r"check_every must be an int >= 1, got 0"):
        Preemption(check_every=0)


def test_agreement_interval_keeps_the_check_under_its_budget() -> None:
    assert agreement_interval(0.0) == 1
    assert agreement_interval(5e-5) == 1
    assert agreement_interval(1.2e-3) == 24  # 1.2 ms over 24 steps: 50 us a step
    for cost in (3e-5, 2e-4, 7e-4, 5e-3):
        for step in (0.001, 0.005, 0.010):
            every = agreement_interval(cost, step)
            assert cost / every <= 5e-5 * (1 + 1e-9)  # half of 1 % of a 10 ms step


def test_agreement_interval_never_spans_more_than_a_second_of_steps() -> None:
    assert agreement_interval(60.0) == 100  # a slow check, 10 ms steps: still once a second
    assert agreement_interval(0.5, step_s=0.25) == 4
    assert agreement_interval(0.002, step_s=2.0) == 1  # long steps: every step


def test_a_signal_sets_the_flag_and_a_second_one_does_no_harm() -> None:
    before = signal.getsignal(signal.SIGUSR1)
    with Preemption(("SIGUSR1", "SIGUSR2"), grace_s=10) as stop:
        assert stop.requested is False and stop.deadline_s is None and stop.signal is None
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)
        assert stop.requested is True and stop.signal == "SIGUSR1"
        deadline = stop.deadline_s
        assert deadline is not None and 9.0 < deadline <= 10.0
        os.kill(os.getpid(), signal.SIGUSR2)  # a second signal: still just a flag
        time.sleep(0.05)
        assert stop.requested is True and stop.signals_received == 2
        later = stop.deadline_s
        assert later is not None and later <= deadline
    assert signal.getsignal(signal.SIGUSR1) is before  # put back on exit
    assert "requested=True" in repr(stop)


def test_nested_preemptions_all_see_the_signal() -> None:
    # The inner one's handler replaced the outer one's: a SIGTERM inside two Checkpointers'
    # blocks (a model's and an EMA's) stopped the inner loop only.
    with Preemption(("SIGUSR1",)) as outer, Preemption(("SIGUSR1", "SIGUSR2")) as inner:
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)
        assert inner.requested and outer.requested and outer.signal == "SIGUSR1"
    with Preemption(("SIGUSR2",)) as outer:
        with Preemption(("SIGUSR2",)):
            pass
        os.kill(os.getpid(), signal.SIGUSR2)  # after the inner block: the outer's again
        time.sleep(0.05)
        assert outer.requested and outer.signals_received == 1


@pytest.mark.parametrize("outer_signals", [("SIGUSR1",), ("SIGUSR1", "SIGUSR2")])
def test_blocks_exited_out_of_order_leave_the_live_one_and_then_the_original_handler(
    outer_signals: tuple[str, ...],
) -> None:
    # Entered A then B, exited A then B: A's exit put back the original handler under B (a
    # signal no longer reached B), and B's exit then installed A's stale handler for good.
    called: list[int] = []

    def original(signum: int, frame: object) -> None:
        called.append(signum)

    before = {s: signal.signal(s, original) for s in (signal.SIGUSR1, signal.SIGUSR2)}
    try:
        a = Preemption(outer_signals).__enter__()
        b = Preemption(("SIGUSR1",)).__enter__()
        a.__exit__(None, None, None)
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)
        assert b.requested and b.signals_received == 1 and called == []
        assert a.signals_received == 0  # exited: no longer told
        b.__exit__(None, None, None)
        assert signal.getsignal(signal.SIGUSR1) is original
        assert signal.getsignal(signal.SIGUSR2) is original
        assert preempt_module.active_signals() == ()
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)
        assert called == [signal.SIGUSR1] and b.signals_received == 1
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def test_a_middle_block_exited_first_keeps_the_others_chained() -> None:
    called: list[int] = []

    def original(signum: int, frame: object) -> None:
        called.append(signum)

    before = signal.signal(signal.SIGUSR1, original)
    try:
        a = Preemption(("SIGUSR1",)).__enter__()
        b = Preemption(("SIGUSR1",)).__enter__()
        c = Preemption(("SIGUSR1",)).__enter__()
        b.__exit__(None, None, None)
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)
        assert (a.signals_received, b.signals_received, c.signals_received) == (1, 0, 1)
        a.__exit__(None, None, None)
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)
        assert (a.signals_received, c.signals_received) == (1, 2)
        c.__exit__(None, None, None)
        assert signal.getsignal(signal.SIGUSR1) is original
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)
        assert called == [signal.SIGUSR1]
    finally:
        signal.signal(signal.SIGUSR1, before)


def test_a_handler_that_is_not_a_preemption_is_put_back_not_called() -> None:
    # Calling it could raise (KeyboardInterrupt, SystemExit) in the middle of the final save.
    called: list[int] = []
    before = signal.signal(signal.SIGUSR1, lambda signum, frame: called.append(signum))
    try:
        with Preemption(("SIGUSR1",)) as stop:
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(0.05)
            assert stop.requested
        assert called == []
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)
        assert called == [signal.SIGUSR1]
    finally:
        signal.signal(signal.SIGUSR1, before)


def test_it_must_be_entered_once_and_in_the_main_thread() -> None:
    stop = Preemption(("SIGUSR1",))
    errors: list[BaseException] = []

    def enter() -> None:
        try:
            stop.__enter__()
        except RuntimeError as e:
            errors.append(e)

    t = threading.Thread(target=enter)
    t.start()
    t.join(timeout=30)
    assert len(errors) == 1 and "must be entered in the main thread" in str(errors[0])
    with stop, pytest.raises(RuntimeError, match=r"already active; enter it once"):
        stop.__enter__()


@pytest.mark.slow  # two forked gloo ranks
@pytest.mark.parametrize("check_every", [5, None])
def test_every_rank_stops_at_the_same_step_when_one_is_signalled(check_every: int | None) -> None:
    results = spawn(
        _agree.stop_step_when_only_rank1_is_signalled, args=(40, check_every), start_method=FORK
    )
    r0, r1 = results[0], results[1]
    assert r0["step"] == r1["step"] and r0["step"] is not None and r0["step"] >= 40
    if check_every is not None:
        assert r0["step"] <= 45 and r0["every"] == r1["every"] == 5  # the next check
    else:  # measured: the same interval, and cost, on both ranks
        assert r0["every"] == r1["every"] >= 1 and r0["cost"] == r1["cost"] > 0
    assert r0["signal"] == r1["signal"] == "SIGUSR1"  # rank 0 learns which signal it was
    assert 0 < r0["deadline"] <= 30 and 0 < r1["deadline"] <= 30


def test_the_flags_are_compared_on_the_ranks_own_gpu_under_nccl(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    FakeNccl(monkeypatch, rank=1, gpus=2)  # set_device never called: cuda:0 current
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert preempt_module._group() == (2, torch.device("cuda", 1))


def test_a_signal_early_in_a_run_of_long_steps_is_agreed_within_about_a_second(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before: the interval chosen on entry assumed 10 ms steps (up to 100 steps between
    # checks for a comparison of 5 ms), and the first check did not re-choose it: with 50 ms
    # steps a signal at the third step was agreed only at the 100th (5 s late; 50 s with
    # 0.5 s steps, past the 25 s grace period, so the ranks were killed without a save).
    # One rank of a group stands in: its comparison takes 5 ms and returns its own values.
    monkeypatch.setattr(preempt_module, "_group", lambda: (1, torch.device("cpu")))

    def slow_reduce(self: Preemption, values: list[float]) -> list[float]:
        time.sleep(0.005)
        return list(values)

    monkeypatch.setattr(Preemption, "_reduce", slow_reduce)
    with Preemption(("SIGUSR1",)) as stop:
        for step in range(1, 101):
            time.sleep(0.05)  # a 50 ms step
            if step == 3:
                stop._handle(signal.SIGUSR1, None)
            if stop.requested:
                break
    assert stop.requested and step <= 3 + 21  # a check at least once a second of steps
    assert stop.check_every <= 20
