"""trainperf.ddp._progress: a rank's slot round-trips, and the wrappers record collectives."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from trainperf.ddp import _progress, _progress_tracker
from trainperf.ddp._progress_slots import (
    HISTORY,
    SLOT_SIZE,
    Collective,
    State,
    read_slot,
)
from trainperf.ddp._progress_tracker import Tracker


def test_a_fresh_slot_reads_as_starting_with_no_history() -> None:
    state = read_slot(bytearray(SLOT_SIZE))
    assert (state.progress, state.state, state.history, state.current) == (0, 0, (), None)


def test_the_tracker_writes_what_the_launcher_reads() -> None:
    buf = bytearray(3 * SLOT_SIZE)
    tracker = Tracker(buf, index=2)
    tracker.ready(armed=True)
    tracker.enter("all_reduce", (torch.ones(4, 8),), {})
    inside = read_slot(buf, 2)
    assert inside.state == State.IN_COLLECTIVE and inside.armed
    current = inside.current
    assert current is not None
    assert (current.op, current.detail, current.seq) == ("all_reduce", "float32[4, 8]", 1)
    assert current.file == __file__ and current.function.startswith("test_the_tracker")
    tracker.exit()
    tracker.step()
    after = read_slot(buf, 2)
    assert after.state == State.RUNNING and after.current is None
    assert (after.progress, after.steps, after.entered) == (3, 1, 1)  # ready, exit, step
    assert read_slot(buf, 0).progress == 0  # other slots untouched
    tracker.returned()
    assert read_slot(buf, 2).state == State.RETURNED


def test_the_history_keeps_the_last_collectives_in_order() -> None:
    buf = bytearray(SLOT_SIZE)
    tracker = Tracker(buf)
    for i in range(HISTORY + 3):
        tracker.enter("broadcast", ([torch.zeros(i + 1, dtype=torch.int64)] * 2,), {})
        tracker.exit()
    tracker.enter("barrier", (), {"async_op": True})
    history = read_slot(buf).history
    assert [c.seq for c in history] == list(range(HISTORY + 4 - HISTORY + 1, HISTORY + 5))
    assert history[-2].detail == f"int64[{HISTORY + 3}] x2" and not history[-2].async_op
    assert history[-1].op == "barrier" and history[-1].async_op


def test_a_long_call_site_keeps_the_end_of_its_path() -> None:
    c = Collective(5, "all_reduce", "float32[1]", "/" + "deep/" * 80 + "train.py", 7, "main")
    text = c.encode()
    assert len(text) <= 256
    back = Collective.decode(5, text)
    assert back is not None and back.file.endswith("deep/train.py") and back.line == 7
    assert Collective.decode(1, b"garbage") is None


def test_the_wrapper_records_the_outer_call_only(monkeypatch: pytest.MonkeyPatch) -> None:
    buf = bytearray(SLOT_SIZE)
    tracker = Tracker(buf)
    monkeypatch.setattr(_progress, "_installed", [tracker])
    seen: list[int] = []

    def inner(t: torch.Tensor) -> None:
        seen.append(read_slot(buf).state)

    watched_inner = _progress._wrap("all_gather", inner)

    def outer(t: torch.Tensor) -> str:
        watched_inner(t)  # e.g. all_gather_object calling all_gather
        return "done"

    watched = _progress._wrap("all_gather_object", outer)
    assert watched(torch.ones(2)) == "done"
    assert seen == [State.IN_COLLECTIVE]
    state = read_slot(buf)
    assert [c.op for c in state.history] == ["all_gather_object"] and state.progress == 1

    def fails(t: torch.Tensor) -> None:
        raise RuntimeError("peer gone")

    with pytest.raises(RuntimeError, match="peer gone"):
        _progress._wrap("all_reduce", fails)(torch.ones(1))
    assert read_slot(buf).state == State.RUNNING and tracker.depth == 0


def test_a_dataloader_batch_is_progress_and_uninstall_restores_the_iterator() -> None:
    from torch.utils.data import DataLoader, dataloader

    original = dataloader._BaseDataLoaderIter.__next__
    buf = bytearray(SLOT_SIZE)
    _progress.install(Tracker(buf))
    try:
        batches = list(DataLoader(range(6), batch_size=2))
        # An evaluation loop (no optimizer step, no collective) still moves the job on.
        assert len(batches) == 3 and read_slot(buf).progress == 3
    finally:
        _progress.uninstall()
    assert dataloader._BaseDataLoaderIter.__next__ is original
    list(DataLoader(range(4), batch_size=2))
    assert read_slot(buf).progress == 3


def test_busy_marks_the_slot_outermost_first_and_counts_as_progress(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import threading
    import time

    buf = bytearray(SLOT_SIZE)
    tracker = Tracker(buf)
    monkeypatch.setattr(_progress, "_installed", [tracker])
    with _progress.busy("saving checkpoint /ckpt/step-3.pt"):
        with _progress.busy("fsync"):
            inside = read_slot(buf)
        assert read_slot(buf).busy_since > 0  # still in the outer block
    after = read_slot(buf)
    assert inside.busy == "saving checkpoint /ckpt/step-3.pt"
    assert 0 < time.time() - inside.busy_since < 60
    assert after.busy_since == 0 and after.busy == "" and after.progress == 2  # in, out
    # Another thread's work does not hold the job up: not marked.
    seen: list[float] = []

    def elsewhere() -> None:
        with _progress.busy("background save"):
            seen.append(read_slot(buf).busy_since)

    thread = threading.Thread(target=elsewhere)
    thread.start()
    thread.join()
    assert seen == [0.0]
    # A long text is cut to fit its slot.
    with _progress.busy("x" * 1000):
        assert read_slot(buf).busy == "x" * 254


def test_busy_without_detection_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_progress, "_installed", [])
    with _progress.busy("saving"):
        pass


def test_busy_counts_up_to_the_cap() -> None:
    from trainperf.ddp._progress_slots import BUSY_CAP, SlotState, busy_counts

    inside = SlotState(1, 0, 0, 0.0, 0, State.RUNNING, True, (), 1000.0, "saving")
    assert busy_counts(inside, 1000.0 + BUSY_CAP * 2.0 - 0.1, 2.0)
    assert not busy_counts(inside, 1000.0 + BUSY_CAP * 2.0 + 0.1, 2.0)
    outside = SlotState(1, 0, 0, 0.0, 0, State.RUNNING, True, ())
    assert not busy_counts(outside, 1000.0, 2.0)


def test_busy_in_a_forked_child_leaves_the_rank_s_slot_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import os

    buf = bytearray(SLOT_SIZE)
    tracker = Tracker(buf)
    monkeypatch.setattr(_progress, "_installed", [tracker])
    monkeypatch.setattr(tracker, "pid", os.getpid() + 1)  # as a forked writer sees it
    with _progress.busy("saving checkpoint in a forked writer"):
        assert read_slot(buf).busy_since == 0


def test_busy_does_not_count_while_the_rank_is_in_a_collective_inside_it() -> None:
    # A sharded state_dict() inside a save is a collective: the rank waits for the others,
    # so a hang there is a hang at once (was: hidden for BUSY_CAP x the timeout).
    from trainperf.ddp._progress_slots import SlotState, busy_counts

    saving = SlotState(1, 1, 0, 0.0, 0, State.RUNNING, True, (), 1000.0, "saving")
    assert busy_counts(saving, 1001.0, 2.0)
    in_collective = SlotState(1, 1, 0, 0.0, 0, State.IN_COLLECTIVE, True, (), 1000.0, "saving")
    assert not busy_counts(in_collective, 1001.0, 2.0)


def test_a_forked_child_writes_nothing_into_the_rank_s_slot() -> None:
    import mmap
    import os

    buf = mmap.mmap(-1, SLOT_SIZE)  # shared with a forked child, like the launcher's file
    tracker = Tracker(buf)
    tracker.ready(armed=True)
    tracker.busy_enter("saving checkpoint /ckpt/step-1.pt")
    before = bytes(buf)
    pid = os.fork()
    if pid == 0:  # an evaluation process, a DataLoader worker: it inherits the tracker
        code = 0
        try:
            tracker.batch()
            tracker.step()
            tracker.enter("all_reduce", (torch.ones(2),), {})
            tracker.exit()
            tracker.busy_exit()
            tracker.busy_enter("the child's own work")
            tracker.returned()
        except BaseException:
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert bytes(buf) == before  # still the parent's: inside its busy() block, progress 2
    assert read_slot(buf).busy_since > 0 and read_slot(buf).progress == 2
    buf.close()


def test_a_thread_s_write_never_clears_the_busy_mark(monkeypatch: pytest.MonkeyPatch) -> None:
    # Thread B packs the header with the fields it read; meanwhile the main thread enters
    # busy(). Without one lock across reading and packing, B's stale busy_since (0) lands
    # after the main thread's mark and clears it.
    import threading

    buf = bytearray(SLOT_SIZE)
    tracker = Tracker(buf)
    packing, entered = threading.Event(), threading.Event()
    real = _progress_tracker._HEADER

    class SlowHeader:
        def pack_into(self, *args: Any) -> None:
            if threading.current_thread().name == "writer-b":
                packing.set()
                entered.wait(0.4)  # the main thread's busy_enter gets this long to land
            real.pack_into(*args)

        def unpack_from(self, *args: Any) -> Any:
            return real.unpack_from(*args)

    monkeypatch.setattr(_progress_tracker, "_HEADER", SlowHeader())
    writer = threading.Thread(target=tracker.batch, name="writer-b")
    writer.start()
    assert packing.wait(10)

    def enter() -> None:
        tracker.busy_enter("saving checkpoint /ckpt/step-2.pt")
        entered.set()

    busy_thread = threading.Thread(target=enter)
    busy_thread.start()
    writer.join(10)
    busy_thread.join(10)
    assert not writer.is_alive() and not busy_thread.is_alive()
    state = read_slot(buf)
    assert state.busy_since > 0, "a concurrent write cleared the busy mark"
    assert state.progress == 2  # both writes counted


def test_ddp_s_constructor_collectives_in_cpp_are_recorded_with_the_user_s_line() -> None:
    # DDP(model) checks and broadcasts the parameters in C++ (dist._verify_params_across_
    # processes, dist._broadcast_coalesced): unwatched, a rank waiting there for one still
    # building its model looked busy in its own code, and no hang was ever declared.
    import torch.distributed as dist
    from torch import nn

    names = ("_verify_params_across_processes", "_broadcast_coalesced")
    originals = {name: getattr(dist, name) for name in names}
    buf = bytearray(SLOT_SIZE)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    _progress.install(Tracker(buf))
    try:
        nn.parallel.DistributedDataParallel(nn.Linear(4, 2))  # DDP line
    finally:
        _progress.uninstall()
        dist.destroy_process_group()
    assert {name: getattr(dist, name) for name in originals} == originals
    state = read_slot(buf)
    assert state.state == State.RUNNING and state.progress == len(state.history)
    ops = [c.op for c in state.history]
    assert ops == ["_verify_params_across_processes", "_broadcast_coalesced"], ops
    check = state.history[0]
    assert check.detail == "float32[2, 4] x2", check  # the parameters, not the group
    assert check.file == __file__ and check.function.startswith("test_ddp_s_constructor")


def test_a_collective_given_its_tensors_by_keyword_is_described() -> None:
    # dist._broadcast_coalesced(pg, tensors=[...], ...) was recorded with no description.
    buf = bytearray(SLOT_SIZE)
    tracker = Tracker(buf)
    tracker.enter("_broadcast_coalesced", (), {"tensors": [torch.zeros(2, 3)] * 2})
    tracker.exit()
    assert read_slot(buf).history[-1].detail == "float32[2, 3] x2"


def test_new_group_is_recorded_as_a_call_every_rank_must_make() -> None:
    # It waits for the other ranks in torch's Python (a store-based barrier), so the stack
    # looked like busy code: a rank waiting there for a slow one never made a hang.
    import torch.distributed as dist

    buf = bytearray(SLOT_SIZE)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    _progress.install(Tracker(buf))
    try:
        dist.new_group([0])  # no tensor: nothing to describe
    finally:
        _progress.uninstall()
        dist.destroy_process_group()
    (call,) = read_slot(buf).history
    assert (call.op, call.detail, call.file) == ("new_group", "", __file__), call
