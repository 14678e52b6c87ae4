"""trainperf.ddp._watchdog: one decision per snapshot, O(ranks) report collection, safe
nesting, and busy() beats (the multi-process torchrun cases are in test_hang_cases)."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import io
import json
import os
import subprocess
import sys
import threading
import time
import weakref
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from trainperf.ddp import _progress, _watchdog
from trainperf.ddp._progress_slots import SLOT_SIZE, Collective, SlotState, State
from trainperf.ddp._progress_tracker import Tracker
from trainperf.ddp._stacks import Frame, ThreadStack
from trainperf.ddp._watchdog import Watchdog, judge, watchdog

TORCH = os.path.dirname(torch.__file__)
MAIN = threading.main_thread().ident or 0
USER = "/home/me/train.py"


class FakeStore:
    """The part of a ``torch.distributed.Store`` the watchdog uses, counting key reads."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.reads: Counter[str] = Counter()  # key prefix ("report") -> values read
        self.lock = threading.Lock()

    def _count(self, key: str) -> None:
        self.reads[key.split("/")[0]] += 1

    def add(self, key: str, n: int) -> int:
        with self.lock:
            value = int(self.data.get(key, b"0")) + n
            self.data[key] = str(value).encode()
            return value

    def set(self, key: str, value: str | bytes) -> None:
        with self.lock:
            self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key: str) -> bytes:
        with self.lock:
            self._count(key)
            return self.data[key]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        with self.lock:
            for key in keys:
                self._count(key)
            return [self.data[k] for k in keys]

    def check(self, keys: list[str]) -> bool:
        with self.lock:
            return all(k in self.data for k in keys)

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        with self.lock:
            current = self.data.get(key)
            if (current is None and expected == "") or current == expected.encode():
                self.data[key] = desired.encode()
            return self.data.get(key, b"")


def _watchdog_on(store: FakeStore, rank: int, world: int, limit: float = 0.3) -> Watchdog:
    """A Watchdog set up as start() does, without a process group or a thread."""
    wd = Watchdog(limit, None)
    wd.rank, wd.world, wd.store = rank, world, store
    wd.buf = bytearray(SLOT_SIZE)
    wd.tracker = Tracker(wd.buf)
    wd.tracker.ready(armed=True)
    wd.limit, wd.poll_s = limit, 0.02
    wd._error_at_start = getattr(sys, "last_value", None)
    return wd


def _dump(*frames: tuple[str, int, str]) -> str:
    lines = [f"Thread 0x{MAIN:x} (most recent call first):"]
    lines += [f'  File "{file}", line {line} in {fn}' for file, line, fn in frames]
    return "\n".join(lines) + "\n"


# The main thread in the user's own code, then (a moment later) inside backward() where
# AOT autograd compiles the backward graph on its first call: a compilation, not a hang.
PLAIN = _dump((USER, 20, "main"))
BACKWARD_WAIT = _dump((f"{TORCH}/_tensor.py", 600, "backward"), (USER, 30, "main"))
BACKWARD_COMPILE = _dump(
    (f"{TORCH}/_inductor/compile_fx.py", 900, "bw_compiler"),
    (f"{TORCH}/autograd/graph.py", 800, "_engine_run_backward"),
    (f"{TORCH}/_tensor.py", 600, "backward"),
    (USER, 30, "main"),
)


def _run_watch(wd: Watchdog, seconds: float) -> None:
    thread = threading.Thread(target=wd._watch, daemon=True)
    thread.start()
    thread.join(seconds)
    wd._stop.set()
    thread.join(5)
    assert not thread.is_alive()


def test_the_stall_is_judged_on_one_snapshot(monkeypatch: pytest.MonkeyPatch) -> None:
    # Each look at the rank alternates between the two moments: checking "compiling?" on
    # one dump and "blocked?" on the next would see a blocked rank that is not compiling.
    store = FakeStore()
    wd = _watchdog_on(store, 0, 2, limit=0.05)
    dumps = iter([PLAIN, BACKWARD_COMPILE] * 1000)
    monkeypatch.setattr(wd, "_own_dump", lambda: next(dumps))
    monkeypatch.setattr(wd, "_collect", lambda stalled_s: {"collected": True})
    _run_watch(wd, 0.5)  # several stalls, each judged
    assert "hang" not in store.data


def test_the_decision_rules() -> None:
    waits = SlotState(7, 3, 0, 0.0, MAIN, State.IN_COLLECTIVE, True, ())
    running = SlotState(7, 3, 0, 0.0, MAIN, State.RUNNING, True, ())
    kw: dict[str, Any] = {"seen_progress": 7, "ended": False, "now": 100.0, "timeout": 5.0}
    assert judge(waits, [], **kw) == "hang"
    assert judge(waits, [], **{**kw, "seen_progress": 6}) == "progress"  # moved meanwhile
    assert judge(running, [], **kw) == "wait"  # busy in its own code
    assert judge(running, [], **{**kw, "ended": True}) == "hang"  # another rank is gone
    backward = ThreadStack(MAIN, False, (Frame(f"{TORCH}/_tensor.py", 600, "backward"),))
    assert judge(running, [backward], **kw) == "hang"
    # torch.compile on a thread other than the main one counts too.
    compiler = ThreadStack(99, False, (Frame(f"{TORCH}/_dynamo/convert_frame.py", 9, "f"),))
    assert judge(waits, [backward, compiler], **kw) == "progress"
    # Inside busy(): progress below the cap (10 x timeout), then a hang like any other wait.
    saving = SlotState(7, 3, 0, 0.0, MAIN, State.RUNNING, True, (), 90.0, "saving")
    assert judge(saving, [], **kw) == "progress"
    assert judge(saving, [backward], **{**kw, "now": 141.0}) == "hang"
    # In a collective inside busy() (a sharded state_dict() during a save): it waits for the
    # others like any rank in a collective, a hang at once (was: progress for 10 x timeout).
    in_save = dataclasses.replace(saving, state=State.IN_COLLECTIVE)
    assert judge(in_save, [], **kw) == "hang"


def test_compiling_counts_as_progress_only_up_to_the_cap() -> None:
    waits = SlotState(7, 3, 0, 0.0, MAIN, State.IN_COLLECTIVE, True, ())
    compiler = ThreadStack(99, False, (Frame(f"{TORCH}/_dynamo/convert_frame.py", 9, "f"),))
    kw: dict[str, Any] = {"seen_progress": 7, "ended": False, "now": 100.0, "timeout": 5.0}
    assert judge(waits, [compiler], **kw, stalled_s=49.0) == "progress"
    assert judge(waits, [compiler], **kw, stalled_s=51.0) == "hang"  # stuck in compilation
    # Compiled code running (the runtime wrapper only) is not compiling.
    runtime = ThreadStack(
        MAIN,
        False,
        (
            Frame(USER, 12, "torch_dynamo_resume_in_f_at_4"),
            Frame(f"{TORCH}/_dynamo/eval_frame.py", 1261, "compile_wrapper"),
        ),
    )
    assert judge(waits, [runtime], **kw) == "hang"


def test_a_rank_in_the_wait_of_an_async_collective_waits_for_the_others(
    tmp_path: Path,
) -> None:
    # work = dist.all_reduce(t, async_op=True); work.wait(): the wait has no Python frame of
    # its own, so the rank was judged busy in its own code ("wait"), and with the cause busy
    # too, no rank declared the hang: the watchdog never fired.
    source = tmp_path / "train.py"
    source.write_text("import time\ntime.sleep(1e9)\nwork = None\nwork.wait()\n")
    issued = Collective(4, "all_reduce", "float32[4]", str(source), 4, "main", async_op=True)
    after_async = SlotState(7, 4, 0, 0.0, MAIN, State.RUNNING, True, (issued,))
    after_sync = dataclasses.replace(
        after_async, history=(dataclasses.replace(issued, async_op=False),)
    )
    kw: dict[str, Any] = {"seen_progress": 7, "ended": False, "now": 100.0, "timeout": 5.0}

    def at(line: int) -> list[ThreadStack]:
        return [ThreadStack(MAIN, False, (Frame(str(source), line, "main"),))]

    assert judge(after_async, at(4), **kw) == "hang"
    # Busy in its own code, its last collective async or not: it waits for nobody.
    assert judge(after_async, at(2), **kw) == "wait"
    assert judge(after_sync, at(4), **kw) == "wait"


def test_a_rank_inside_busy_beats_progress_each_poll() -> None:
    store = FakeStore()
    wd = _watchdog_on(store, 1, 2, limit=0.1)
    wd.tracker.busy_enter("saving checkpoint /ckpt/step-3.pt")
    before = wd.tracker.progress
    _run_watch(wd, 0.4)  # past the timeout, below the cap
    # Every poll added one beat on top of this rank's own (unchanged) progress: beats go in
    # the counter's high bits, real progress in the low ones.
    assert wd.tracker.progress == before
    total = int(store.data["progress"])
    assert total >> 32 >= 3 and total % (1 << 32) == before
    assert "hang" not in store.data


@pytest.mark.slow
def test_the_stall_reported_runs_from_the_last_real_progress_not_the_last_beat(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A rank inside busy() beats every poll; once past the cap it is reported stuck. The
    # stall the report gives counts from the last real progress (was: the last beat).
    store = FakeStore()
    wd = _watchdog_on(store, 0, 2, limit=0.1)
    wd.tracker.busy_enter("saving checkpoint /ckpt/step-3.pt")
    real_time = time.time
    # busy() below the cap (10 x 0.1 s) for the first 0.8 s, then (skewed clock) past it.
    clock = {"skew": 0.0}
    monkeypatch.setattr(time, "time", lambda: real_time() + clock["skew"])
    seen: list[float] = []

    def collect(stalled_s: float) -> dict[str, Any]:
        seen.append(stalled_s)
        return {"collected": True}

    monkeypatch.setattr(wd, "_collect", collect)
    monkeypatch.setattr(wd, "_own_dump", lambda: BACKWARD_WAIT)
    thread = threading.Thread(target=wd._watch, daemon=True)
    thread.start()
    time.sleep(0.8)  # beats: no hang
    assert "hang" not in store.data
    clock["skew"] = 100.0  # now far past the cap: no more beats
    thread.join(20)
    wd._stop.set()
    thread.join(5)
    assert seen, "no hang was declared"
    assert seen[0] >= 0.7, seen  # the beats below the cap did not reset the stall


def _collect_on(world: int, store: FakeStore) -> list[Any]:
    """Every rank of a world collects at once, as after a hang."""
    dogs = [_watchdog_on(store, r, world) for r in range(world)]
    dogs[1].tracker.enter("all_reduce", (torch.ones(4),), {})  # one rank waits in a collective
    store.set("hang", "1")
    results: list[Any] = [None] * world

    def run(rank: int) -> None:
        results[rank] = dogs[rank]._collect(3.0)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results


def _message(result: Any) -> str:
    return str(result["message"] if isinstance(result, dict) else result)


def test_collecting_the_reports_reads_each_one_once() -> None:
    store = FakeStore()
    results = _collect_on(4, store)
    # One rank reads the 4 reports; the others read its verdict (was: each rank read all).
    assert store.reads["report"] == 4, store.reads
    assert store.reads["verdict"] <= 3
    messages = {_message(r) for r in results}
    assert len(messages) == 1, messages
    record = results[0]
    assert record["report"]["world_size"] == 4 and record["answering"] == 4
    assert record["speaker"] == 0  # the lowest rank still running prints
    json.dumps(record)


def test_a_silent_collector_leaves_each_rank_to_judge(monkeypatch: pytest.MonkeyPatch) -> None:
    store = FakeStore()
    store.set("collector", "3")  # claimed by a rank that then died
    monkeypatch.setattr(_watchdog, "COLLECT_S", 0.1)
    dogs = [_watchdog_on(store, r, 2) for r in range(2)]
    t0 = time.monotonic()
    record = dogs[0]._collect(1.0)
    assert time.monotonic() - t0 < 10
    assert record["speaker"] == 0 and "rank 1" in record["message"]  # rank 1 never answered


@pytest.mark.parametrize(
    ("exc", "scope", "status", "said"),
    [
        (None, "the watchdog() block", "returned", "left the watchdog() block"),
        (SystemExit(0), "the watchdog() block", "returned", "called sys.exit(0) in the watch"),
        (SystemExit(), "main", "returned", "called sys.exit() in main"),  # launch in a job
        (None, "main", "returned", "returned from main"),
        (ValueError("x"), "the watchdog() block", "gone", "raised ValueError in the watchdog"),
        (SystemExit(1), "main", "gone", "called sys.exit(1) in main"),
        # Python exits 1 for sys.exit(0.0): it was counted as a clean exit.
        (SystemExit(0.0), "main", "gone", "called sys.exit(0.0) in main"),
        (SystemExit(False), "main", "returned", "called sys.exit(False) in main"),
    ],
)
def test_a_rank_that_left_says_how_and_a_clean_sys_exit_is_not_a_crash(
    exc: BaseException | None, scope: str, status: str, said: str
) -> None:
    # sys.exit(0) inside the block counted as "gone": the report said the rank "has exited
    # without returning from main (an error or a crash)" and blamed it; and a rank that left
    # a watchdog() block was said to have "returned from main", though there is no main.
    store = FakeStore()
    dog = _watchdog_on(store, 1, 2)
    dog.scope, dog.active = scope, True
    dog.__exit__(None if exc is None else type(exc), exc, None)
    record = json.loads(store.data["report/1"])
    assert record["status"] == status
    assert _watchdog._view(1, record).doing().startswith(said)


def test_the_ranks_waiting_for_one_that_called_sys_exit_0_are_blamed_not_it() -> None:
    store = FakeStore()
    left = _watchdog_on(store, 1, 2)
    left.active = True
    with contextlib.suppress(SystemExit), left:
        sys.exit(0)
    waits = _watchdog_on(store, 0, 2)
    waits.tracker.enter("all_reduce", (torch.ones(4),), {})
    store.set("hang", "0")
    message = _message(waits._collect(3.0))
    assert "has exited without returning from main" not in message, message
    assert "after rank 1 called sys.exit(0) in the watchdog() block" in message, message
    assert "rank 0 waits in all_reduce" in message, message


_ENDED = "ended its script (exit status unknown to the watchdog; use `with watchdog():`"


@pytest.mark.parametrize(
    ("uncaught", "status", "said"),
    [(None, "returned", _ENDED), (ValueError("x"), "gone", "raised ValueError (uncaught)")],
)
def test_a_single_watchdog_call_says_at_exit_whether_the_script_failed(
    uncaught: BaseException | None, status: str, said: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The interpreter's exit after an uncaught exception was reported as a return.
    monkeypatch.setattr(sys, "last_value", None, raising=False)
    store = FakeStore()
    dog = _watchdog_on(store, 1, 2)
    dog.active = True
    monkeypatch.setattr(sys, "last_value", uncaught)  # Python sets it on the way out
    dog._at_exit()
    record = json.loads(store.data["report/1"])
    assert (record["status"], record["how"][: len(said)]) == (status, said)


@pytest.mark.parametrize("interactive", [False, True])
def test_an_exit_the_watchdog_cannot_read_is_not_blamed_nor_said_to_be_clean(
    interactive: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # sys.exit(3) or sys.exit("msg") after a single watchdog() call sets no sys.last_value:
    # it was "finished its script". And a sys.last_value left by an error handled before
    # the watchdog started (pytest, code.interact), or by any error in an interactive
    # session, made a clean end "gone": "raised ValueError (uncaught) and exited".
    monkeypatch.setattr(sys, "last_value", ValueError("handled earlier"), raising=False)
    store = FakeStore()
    dog = _watchdog_on(store, 1, 2)
    dog.active = True
    if interactive:
        monkeypatch.setattr(sys, "ps1", ">>> ", raising=False)
        monkeypatch.setattr(sys, "last_value", ValueError("shown at the prompt"))
    dog._at_exit()
    record = json.loads(store.data["report/1"])
    assert record["status"] == "returned", record
    assert record["how"].startswith(_ENDED), record
    assert "finished" not in _watchdog._view(1, record).doing()


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    import torch.distributed as dist

    from tests.ddp.test_launch import _free_port

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(60)
def test_a_nested_watchdog_leaves_the_outer_one_watching(one_rank_group: None) -> None:
    import torch.distributed as dist

    original = dist.all_reduce
    with watchdog(30.0) as outer:
        with watchdog(5.0) as inner:
            assert not inner.active  # nested: does nothing
        assert outer.active and outer._thread is not None and outer._thread.is_alive()
        assert hasattr(dist.all_reduce, "__trainperf_watched__")
        before = outer.tracker.progress
        dist.all_reduce(torch.ones(1))
        assert outer.tracker.progress == before + 1  # still counted
    assert dist.all_reduce is original
    assert not any(t.name == "trainperf-watchdog" for t in threading.enumerate())
    # After the outer one, a new watchdog starts (keys of its own in the store).
    with watchdog(30.0) as again:
        assert again.active
    assert not _watchdog._active and not _progress._installed


@pytest.mark.timeout(60)
def test_a_watchdog_that_ended_is_not_kept_until_the_process_exits(one_rank_group: None) -> None:
    # Each start registered an atexit callback that was never removed: a script with one
    # `with watchdog():` per epoch kept every one of them (and its tracker) alive.
    with watchdog(30.0) as dog:
        assert dog.active
    ended = weakref.ref(dog)
    del dog
    gc.collect()
    assert ended() is None


def test_a_report_path_that_cannot_be_written_is_said_on_stderr(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from trainperf.ddp._watchdog import Watchdog

    blocker = tmp_path / "afile"
    blocker.write_text("a file where a directory would be")
    dog = Watchdog(3.0, blocker / "hang.json")
    dog._publish({"message": "rank 1 is the cause.", "report": {"kind": "outside"}})
    err = capsys.readouterr().err
    assert "trainperf.ddp.watchdog: rank 1 is the cause." in err
    assert f"could not write the report to {blocker / 'hang.json'}" in err
    assert "pass a report_path in a writable directory" in err


def _closed_stream() -> io.TextIOWrapper:
    # A real file, as sys.stderr is: a closed StringIO's flush() does not raise.
    stream = open(os.devnull, "w")  # noqa: SIM115
    stream.close()
    return stream


@pytest.mark.parametrize("stderr", [_closed_stream, lambda: None], ids=["closed", "none"])
def test_the_verdict_reaches_fd_2_and_the_report_file_when_sys_stderr_is_unusable(
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    stderr: Any,
) -> None:
    # A script that closed sys.stderr (or a daemon without one): printing the verdict
    # raised, or went to stdout, and report_path was never written.
    monkeypatch.setattr(sys, "stderr", stderr())
    dog = Watchdog(3.0, tmp_path / "hang.json")
    dog._publish({"message": "rank 1 is the cause.", "report": {"kind": "outside"}})
    assert "trainperf.ddp.watchdog: rank 1 is the cause." in capfd.readouterr().err
    assert json.loads((tmp_path / "hang.json").read_text())["message"] == "rank 1 is the cause."


class _Exited(BaseException):
    """What the stand-in for ``os._exit`` raises, so the test process lives on."""


@pytest.mark.parametrize("stderr", [_closed_stream, lambda: None], ids=["closed", "none"])
def test_a_rank_still_exits_with_124_after_a_hang_when_sys_stderr_is_unusable(
    monkeypatch: pytest.MonkeyPatch, stderr: Any
) -> None:
    # The watchdog thread died on sys.stderr.flush() before os._exit: the rank stayed in its
    # collective, so the job hung after the verdict, for the collectives' whole timeout.
    codes: list[int] = []

    def fake_exit(code: int) -> None:
        codes.append(code)
        raise _Exited

    monkeypatch.setattr(_watchdog.os, "_exit", fake_exit)
    monkeypatch.setattr(_watchdog, "_kill_children", lambda: None)
    monkeypatch.setattr(sys, "stderr", stderr())
    dog = _watchdog_on(FakeStore(), 0, 1)
    record = {"speaker": 0, "answering": 1, "message": "rank 0 is the cause.", "report": {}}
    with pytest.raises(_Exited):
        dog._finish(record)
    assert codes == [_watchdog.EXIT_CODE]


_STDERR_GONE = """
import faulthandler, io, socket, sys
import torch.distributed as dist
from trainperf.ddp import _progress, _watchdog, watchdog

sock = socket.socket()
sock.bind(("127.0.0.1", 0))
port = sock.getsockname()[1]
sock.close()
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
closed = io.StringIO()
closed.close()
for stream in (None, closed):
    sys.stderr = stream
    try:
        with watchdog(30.0) as dog:
            print("ACTIVE", dog.active, faulthandler.is_enabled())
    except Exception as e:
        print("RAISED", repr(e))
    print("AFTER", bool(_watchdog._active), bool(_progress._installed), faulthandler.is_enabled())
dist.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_watchdog_starts_and_ends_cleanly_without_a_usable_sys_stderr() -> None:
    # faulthandler.enable() on a None (or closed) sys.stderr raised out of start(), after
    # the watchdog had registered itself: every later watchdog then did nothing ("nested").
    # A fresh interpreter: pytest keeps faulthandler on, and start() leaves it alone then.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), "src"])}
    proc = subprocess.run(
        [sys.executable, "-c", _STDERR_GONE], env=env, capture_output=True, text=True, timeout=100
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines() == ["ACTIVE True True", "AFTER False False False"] * 2, (
        proc.stdout + proc.stderr
    )
