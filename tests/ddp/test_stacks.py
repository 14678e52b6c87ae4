"""trainperf.ddp._stacks: faulthandler dumps parsed, and what a rank's main thread is doing."""

from __future__ import annotations

import faulthandler
import io
import logging
import multiprocessing
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from trainperf.ddp._stacks import Frame, classify, is_user_file, parse_dump, user_frame

TORCH = os.path.dirname(torch.__file__)
THREADING = threading.__file__

_DUMP = f"""\
Thread 0x00007f5c9a7fc640 (most recent call first):
  File "{THREADING}", line 324 in wait
  File "/home/me/train.py", line 12 in worker

Current thread 0x00007f5ca0f5e740 (most recent call first):
  File "{TORCH}/distributed/distributed_c10d.py", line 3913 in all_reduce
  File "/home/me/train.py", line 30 in main
  File "/home/me/train.py", line 40 in <module>
"""


def test_a_dump_is_parsed_into_threads_innermost_frame_first() -> None:
    threads = parse_dump(_DUMP)
    assert [(hex(t.ident), t.current) for t in threads] == [
        ("0x7f5c9a7fc640", False),
        ("0x7f5ca0f5e740", True),
    ]
    main = threads[1]
    assert main.frames[0] == Frame(f"{TORCH}/distributed/distributed_c10d.py", 3913, "all_reduce")
    assert user_frame(main.frames) == Frame("/home/me/train.py", 30, "main")
    # A second dump in the same file: only the newest counts.
    again = parse_dump(_DUMP + "\n" + _DUMP.replace("line 30", "line 31"))
    assert len(again) == 2 and again[1].frames[1].line == 31


def test_a_real_dump_of_this_process_parses() -> None:
    stop = threading.Event()
    helper = threading.Thread(target=stop.wait, daemon=True)
    helper.start()
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"dump-{os.getpid()}.txt"
    try:
        with path.open("w") as f:
            faulthandler.dump_traceback(f, all_threads=True)
        threads = parse_dump(path.read_text())
    finally:
        stop.set()
        path.unlink(missing_ok=True)
    idents = {t.ident for t in threads}
    assert threading.main_thread().ident in idents and helper.ident in idents
    mine = next(t for t in threads if t.ident == threading.main_thread().ident)
    assert any(f.function == "test_a_real_dump_of_this_process_parses" for f in mine.frames)


def test_torch_trainperf_and_the_standard_library_are_not_user_code() -> None:
    assert is_user_file("/home/me/train.py")
    assert not is_user_file(f"{TORCH}/nn/modules/module.py")
    assert not is_user_file(THREADING)
    assert not is_user_file("<frozen runpy>")
    assert user_frame(()) is None
    internals = (Frame(f"{TORCH}/x.py", 1, "f"),)
    assert user_frame(internals) == internals[0]  # nothing of the user's: the innermost


def _frames(*spec: tuple[str, int, str]) -> tuple[Frame, ...]:
    return tuple(Frame(*s) for s in spec)


def test_each_activity_is_recognised(tmp_path: Path) -> None:
    user = ("/home/me/train.py", 30, "main")
    assert classify(_frames(user), in_collective=True) == "collective"
    backward = _frames((f"{TORCH}/autograd/graph.py", 829, "_engine_run_backward"), user)
    assert classify(backward, in_collective=False) == "backward"
    loader = _frames((f"{TORCH}/utils/data/dataloader.py", 733, "__next__"), user)
    assert classify(loader, in_collective=False) == "dataloader"
    waits = _frames((THREADING, 324, "wait"), (THREADING, 629, "wait"), user)  # Event.wait
    assert classify(waits, in_collective=False) == "thread-wait"
    semaphore = _frames((THREADING, 507, "acquire"), user)
    assert classify(semaphore, in_collective=False) == "lock"
    source = tmp_path / "train.py"
    source.write_text(
        "import time\nwith state_lock:\n    time.sleep(1)\nwork.wait()\npid, _ = os.wait()\n"
    )
    at = str(source)
    assert classify(_frames((at, 2, "main")), in_collective=False) == "lock"
    assert classify(_frames((at, 3, "main")), in_collective=False) == "running"
    # An async collective's wait has no frame of its own: the slot says what it waits for.
    assert classify(_frames((at, 4, "main")), in_collective=False, waits_async=True) == "collective"
    assert classify(_frames((at, 4, "main")), in_collective=False) == "running"
    # A process wait after an async collective is not that collective's wait.
    assert classify(_frames((at, 5, "main")), in_collective=False, waits_async=True) == (
        "process-wait"
    )
    assert classify((), in_collective=False) == "running"


def _blocked_on(kind: str) -> tuple[Callable[[], object], Callable[[], object]]:
    """(what a thread blocks in, what releases it) for each blocking call tested below."""
    lock, event, q = threading.Lock(), threading.Event(), queue.Queue[int]()
    if kind == "lock":
        lock.acquire()

        def acquire() -> None:
            lock.acquire()  # the line says so: acquire() has no Python frame of its own
            lock.release()

        return acquire, lock.release
    if kind == "with-lock":
        lock.acquire()

        def with_lock() -> None:
            with lock:
                pass

        return with_lock, lock.release
    if kind == "with-mutex":  # any name: `with self._mutex:`, `with lock2:`
        mutex2 = threading.RLock()
        taken = threading.Event()

        def hold() -> None:
            with mutex2:
                taken.set()
                event.wait()

        threading.Thread(target=hold, daemon=True).start()
        taken.wait()

        def with_mutex() -> None:
            with mutex2:
                pass

        return with_mutex, event.set
    if kind == "simple-queue":  # queue.SimpleQueue.get waits in C: no frame of its own
        sq = queue.SimpleQueue[int]()

        def simple_get() -> None:
            sq.get()

        return simple_get, lambda: sq.put(1)
    if kind == "mp-queue":  # a multiprocessing Queue that nothing puts into
        mq = multiprocessing.get_context("spawn").Queue()

        def mp_get() -> None:
            mq.get()
            mq.close()

        return mp_get, lambda: mq.put(1)
    if kind == "subprocess":  # a child that never exits until killed
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        return child.wait, child.kill
    if kind == "condition":
        cond = threading.Condition()
        cond.acquire()

        def with_condition() -> None:
            with cond:
                pass

        return with_condition, cond.release
    if kind == "logging":  # another thread holds the handler's lock (a write to a full pipe)
        handler = logging.StreamHandler(io.StringIO())
        logger = logging.getLogger("trainperf.tests.blocked")
        logger.addHandler(handler)
        logger.propagate = False
        handler.acquire()
        return (lambda: logger.warning("blocked")), handler.release
    if kind == "semaphore":
        sem = threading.Semaphore(0)
        return sem.acquire, sem.release
    if kind == "event":
        return event.wait, event.set
    if kind == "queue":
        return q.get, lambda: q.put(1)
    assert kind == "join"
    inner = threading.Thread(target=event.wait, daemon=True)
    inner.start()
    return inner.join, event.set


def test_installed_packages_are_not_the_standard_library_even_below_its_directory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A Python without a venv keeps site-packages below the standard library's directory:
    # a library's own queue-like wait there is not threading's.
    from trainperf.ddp import _stacks

    stdlib = "/usr/lib/python3.11/"
    monkeypatch.setattr(_stacks, "_STDLIB", stdlib)
    monkeypatch.setattr(_stacks, "_SITE", (stdlib + "site-packages/",))
    waits = _frames((stdlib + "threading.py", 320, "wait"), (stdlib + "queue.py", 171, "get"),
                    (stdlib + "site-packages/lib/pool.py", 40, "__enter__"),
                    ("/home/me/train.py", 30, "main"))  # fmt: skip
    assert classify(waits, in_collective=False) == "thread-wait"
    lib = _frames((stdlib + "site-packages/lib/threading.py", 9, "wait"), ("/x/t.py", 1, "m"))
    assert classify(lib, in_collective=False) == "running"


@pytest.mark.parametrize(
    ("kind", "activity"),
    [
        ("lock", "lock"),
        ("with-lock", "lock"),
        ("semaphore", "lock"),
        ("condition", "lock"),
        ("logging", "lock"),
        ("event", "thread-wait"),
        ("queue", "thread-wait"),
        ("join", "thread-wait"),
        ("with-mutex", "lock"),
        ("simple-queue", "thread-wait"),
        ("mp-queue", "process-wait"),
        ("subprocess", "process-wait"),
    ],
)
def test_a_real_stack_says_whether_a_thread_waits_for_a_lock_or_for_another_thread(
    kind: str, activity: str
) -> None:
    block, release = _blocked_on(kind)
    ready = threading.Event()

    def blocked() -> None:
        ready.set()
        block()

    t = threading.Thread(target=blocked, daemon=True)
    t.start()
    ready.wait()
    time.sleep(0.1)
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"lock-{os.getpid()}.txt"
    try:
        with path.open("w") as f:
            faulthandler.dump_traceback(f, all_threads=True)
        thread = next(x for x in parse_dump(path.read_text()) if x.ident == t.ident)
        assert classify(thread.frames, in_collective=False) == activity, thread.frames
    finally:
        release()
        t.join()
        path.unlink(missing_ok=True)


def test_torch_compile_on_any_thread_counts_but_the_compile_pool_s_parked_threads_do_not() -> None:
    from trainperf.ddp._stacks import ThreadStack, compiling_threads

    main = ThreadStack(1, False, (Frame("/home/me/train.py", 30, "main"),))
    worker = ThreadStack(
        2,
        False,
        (
            Frame(f"{TORCH}/_inductor/codecache.py", 2000, "load"),
            Frame(f"{TORCH}/_dynamo/eval_frame.py", 600, "_fn"),
            Frame("/home/me/train.py", 12, "warm_up"),
        ),
    )
    parked = ThreadStack(
        3,
        False,
        (
            Frame(f"{THREADING}", 324, "wait"),
            Frame(f"{TORCH}/_inductor/compile_worker/subproc_pool.py", 250, "_read_thread"),
        ),
    )
    assert not compiling_threads([main, parked])
    assert compiling_threads([main, worker, parked])


def test_only_the_compiler_s_frames_count_as_compiling_not_the_compiled_code_s() -> None:
    from trainperf.ddp._stacks import ThreadStack, compiling, compiling_threads

    user = Frame("/home/me/train.py", 12, "torch_dynamo_resume_in_step_at_9")
    # Compiled code runs under eval_frame.py's wrapper: a rank stuck there is not compiling.
    runtime = (
        Frame("/usr/lib/python3.11/time.py", 1, "sleep"),
        user,
        Frame(f"{TORCH}/_dynamo/eval_frame.py", 1261, "compile_wrapper"),
        Frame(f"{TORCH}/_dynamo/external_utils.py", 60, "inner"),
        Frame(f"{TORCH}/_inductor/output_code.py", 600, "__call__"),
        Frame("/home/me/train.py", 30, "main"),
    )
    assert not compiling(runtime)
    assert not compiling_threads([ThreadStack(1, True, runtime)])
    for part, function in (
        ("_dynamo/convert_frame.py", "_compile"),
        ("_dynamo/symbolic_convert.py", "run"),
        ("_dynamo/output_graph.py", "call_user_compiler"),
        ("_inductor/compile_fx.py", "fw_compiler_base"),
        ("_inductor/graph.py", "codegen"),
        ("_inductor/codegen/simd.py", "codegen_kernel"),
        ("_inductor/codecache.py", "load_by_key_path"),
        ("_inductor/async_compile.py", "wait"),
    ):
        frame = Frame(f"{TORCH}/{part}".replace("/", os.sep), 10, function)
        assert compiling((frame, *runtime)), part


@pytest.mark.parametrize(
    ("line", "activity"),
    [
        ("with lock:", "lock"),
        ("with self._mutex:", "lock"),
        ("with lock2, other:", "lock"),
        ("with self._rlock as held:", "lock"),
        ("with sem:", "lock"),
        ("with self._sem, other:", "lock"),
        ("with get_lock():", "lock"),
        ("with FileLock(path):", "lock"),
        ("with self._lock_for(key) as held:", "lock"),
        ("with semantic_ctx():", "running"),
        ("with self._locks[key]:", "lock"),
        ("with (lock):", "lock"),
        ("with self.lock.writer():", "lock"),
        ("with lock.acquire_timeout(5):", "lock"),
        ("with sem_a:", "lock"),
        ("with self.read_sem2:", "lock"),
        ("with self.mySem:", "lock"),
        ("async with self._mutex:", "lock"),
        ("with lock_a, \\", "lock"),  # continued on the next line
        ('with open(lockfile, "w") as f:', "running"),
        ("with self.lock_path.open() as f:", "running"),
        ("with torch.no_grad():", "running"),
        ("with clock:", "running"),
        ("with open(lockfile) as f:", "running"),
        ("with blocking_io():", "running"),
        ("item = q.get()", "thread-wait"),
        ("item = q.get(True)", "thread-wait"),
        ("item = q.get(timeout=None)", "thread-wait"),
        ('value = cfg.get("lr")', "running"),
        ("pid, status = os.waitpid(pid, 0)", "process-wait"),
        ("pid, status = waitpid(pid, 0)", "process-wait"),
        ("pid, status, usage = os.wait3(0)", "process-wait"),
        ("self.waitpid_done = done.wait(1)", "running"),
    ],
)
def test_a_line_that_blocks_in_c_is_read_from_its_source(
    tmp_path: Path, line: str, activity: str
) -> None:
    src = tmp_path / "train.py"
    src.write_text(f"def main():\n    {line}\n")
    assert classify(_frames((str(src), 2, "main")), in_collective=False) == activity


def test_a_thread_pool_is_threads_and_a_dataloader_s_workers_are_its_own() -> None:
    import multiprocessing.pool as mp_pool
    import multiprocessing.popen_fork as popen_fork
    import multiprocessing.process as mp_process

    user = ("/home/me/train.py", 30, "main")
    pool_py = mp_pool.__file__
    pool = _frames((THREADING, 324, "wait"), (THREADING, 629, "wait"),
                   (pool_py, 765, "wait"), (pool_py, 768, "get"), user)  # fmt: skip
    assert classify(pool, in_collective=False) == "thread-wait"  # a ThreadPool's map
    shutdown = _frames((popen_fork.__file__, 27, "poll"), (popen_fork.__file__, 43, "wait"),
                       (mp_process.__file__, 149, "join"),
                       (f"{TORCH}/utils/data/dataloader.py", 1600, "_shutdown_workers"),
                       (f"{TORCH}/utils/data/dataloader.py", 1650, "__del__"), user)  # fmt: skip
    assert classify(shutdown, in_collective=False) == "dataloader"
    join = _frames((popen_fork.__file__, 27, "poll"), (popen_fork.__file__, 43, "wait"),
                   (mp_process.__file__, 149, "join"), user)  # fmt: skip
    assert classify(join, in_collective=False) == "process-wait"


def test_trainperf_ddp_imports_where_there_are_no_real_time_signals() -> None:
    # macOS has no SIGRTMIN: `import trainperf.ddp` failed there with an AttributeError.
    code = (
        "import signal; del signal.SIGRTMIN; del signal.SIGRTMAX\n"
        "import trainperf.ddp, trainperf.ddp._stacks as s\n"
        "print(s.DUMP_SIGNAL == signal.SIGUSR2)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0 and out.stdout.strip() == "True", out.stderr


def test_the_user_s_own_code_inside_backward_is_that_code_not_ddp_s_wait(
    tmp_path: Path,
) -> None:
    # A custom autograd Function's backward (or a hook) that hangs runs inside backward():
    # it was taken for DDP's all-reduce wait, so the rank waiting for it was blamed.
    dump = tmp_path / "dump.txt"

    class Stuck(torch.autograd.Function):
        @staticmethod
        def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
            return x * 2

        @staticmethod
        def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
            with dump.open("w") as out:
                faulthandler.dump_traceback(out, all_threads=True)
            return grad

    Stuck.apply(torch.ones(2, requires_grad=True)).sum().backward()
    frames = next(t for t in parse_dump(dump.read_text()) if t.current).frames
    assert classify(frames, in_collective=False) == "running"
    where = user_frame(frames)
    assert where is not None and where.file == __file__ and where.function == "backward"
    # With no code of the user's below it, the rank waits in the engine: DDP's all-reduce.
    engine = frames[[f.function for f in frames].index("_engine_run_backward") :]
    assert classify(engine, in_collective=False) == "backward"
