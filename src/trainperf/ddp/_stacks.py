"""Every thread's Python stack from a ``faulthandler`` dump, and what the main thread is doing.

A rank registers ``faulthandler.register(signum, file, all_threads=True)``: the dump is
written from the C signal handler, so it comes even from a rank stuck in C code (a
collective, a lock, a DataLoader queue), whether or not that code holds the GIL. Its
format::

    Thread 0x00007f5c9a7fc640 (most recent call first):
      File "/usr/lib/python3.11/threading.py", line 324 in wait
      ...

    Current thread 0x00007f5ca0f5e740 (most recent call first):
      File "train.py", line 12 in main

:func:`classify` reads a rank's main thread (innermost frame first) and its slot into one
:data:`Activity`: inside a collective, inside ``backward()`` (DDP's gradient all-reduce
runs there, from C++), waiting for a DataLoader batch, blocked on a lock, waiting for
another of its threads (``Thread.join``, an ``Event``/``Condition`` wait, a ``queue``),
waiting for another process (a ``multiprocessing`` queue, pipe or join, a ``subprocess``),
or running. Code of the user's that the autograd engine runs inside ``backward()`` (a
custom ``autograd.Function``'s backward, a hook) is judged as that code, not as DDP's wait.
"""

from __future__ import annotations

import ast
import linecache
import os
import re
import signal
import sysconfig
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "DUMP_SIGNAL",
    "Activity",
    "Frame",
    "ThreadStack",
    "classify",
    "compiling",
    "compiling_threads",
    "is_user_file",
    "loads_in_process",
    "parse_dump",
    "source_line",
    "user_frame",
]

# The signal on which a rank's faulthandler dumps its stacks: a real-time signal, which no
# program or batch system uses by default (SLURM's --signal and preemption handlers often
# take SIGUSR1/SIGUSR2). macOS has no real-time signals: SIGUSR2 there; Windows has neither
# (None: no stacks are asked for, and a rank's hang detection says it is off).
DUMP_SIGNAL: int | None = (
    signal.SIGRTMIN + 4 if hasattr(signal, "SIGRTMIN") else getattr(signal, "SIGUSR2", None)
)

# "starting" and "joining" are the launcher's own (a rank that has not reached main, and one
# that waits for it to join the process group); classify never returns them.
Activity = Literal[
    "collective",
    "backward",
    "dataloader",
    "lock",
    "thread-wait",
    "process-wait",
    "running",
    "starting",
    "joining",
]

_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-fA-F]+)")
_FRAME = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d+) in (?P<func>.*)$')
# A line that blocks in C with no Python frame of its own: a lock's acquire, or `with` on
# something named like a lock (:func:`_enters_lock`): a word of its name (`FileLock`,
# `read_sem2`, `mySem`: split at `_`, digits and case) ends in "lock" (`rlock`,
# `spinlock`; not one of _NOT_LOCKS) or is one of _LOCK_WORDS.
_WORDS = re.compile(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])")
_NOT_LOCKS = frozenset(("block", "clock", "unlock"))
_LOCK_WORDS = frozenset(("locks", "mutex", "mutexes", "sem", "sems", "semaphore", "semaphores"))
# Methods of a lock that return what `with` enters: reader-writer locks, timed acquires.
_LOCK_METHODS = re.compile(r"^(acquire\w*|reader|writer|read|write|shared|exclusive)$")
# queue.SimpleQueue.get (a C call): `q.get()`, `q.get(True)`, `q.get(block=...)`,
# `q.get(timeout=...)`; dict.get always takes a key.
_GET_LINE = re.compile(r"\.get\(\s*(\)|True\b|block\s*=|timeout\s*=)")
# Where the standard library waits for another process: a multiprocessing Queue's get, a
# Pipe's recv, Process.join; subprocess's wait and communicate (not a Pool's result: its
# wait ends in threading.py, and a ThreadPool's workers are threads).
_PROCESS_WAITS = tuple(p.replace("/", os.sep) for p in ("multiprocessing/", "/subprocess.py"))
_DATALOADER = "torch/utils/data/".replace("/", os.sep)
_WAITPID_LINE = re.compile(r"\bos\.wait(pid|id|3|4)?\(|(?<![.\w])wait(pid|id|3|4)\(")
_STDLIB = os.path.normpath(sysconfig.get_paths()["stdlib"]) + os.sep
# Installed packages: under the standard library's directory in a Python without a venv
# (/usr/lib/python3.11/site-packages), and not part of it.
_SITE = tuple(os.path.normpath(sysconfig.get_paths()[k]) + os.sep for k in ("purelib", "platlib"))
# Where every blocking wait of threading, queue and concurrent.futures ends, as the
# innermost frame names it (threading.py, any Python version's Thread.join included).
_THREADING = "threading.py"
_BLOCKING = ("acquire", "wait", "wait_for", "join", "_wait_for_tstate_lock", "__enter__")
# Frames on the way there that take a lock rather than wait for another thread to act:
# Semaphore.acquire, `with semaphore:` or `with condition:`, logging's Handler.acquire.
_LOCK_FRAMES = ("acquire", "__enter__")


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    function: str

    @property
    def site(self) -> str:
        return f"{self.file}:{self.line}"

    def __str__(self) -> str:
        return f"{self.site} in {self.function}"


@dataclass(frozen=True)
class ThreadStack:
    ident: int
    current: bool  # the thread that ran the signal handler
    frames: tuple[Frame, ...]  # innermost first, as faulthandler prints them


def parse_dump(text: str) -> list[ThreadStack]:
    """The threads of one dump (the last dump, if the text holds several).

    Example:
        >>> dump = 'Current thread 0x00007f00 (most recent call first):\\n'
        >>> dump += '  File "train.py", line 12 in main\\n  File "train.py", line 20 in <module>\\n'
        >>> [str(f) for f in parse_dump(dump)[0].frames]
        ['train.py:12 in main', 'train.py:20 in <module>']
    """
    threads: list[ThreadStack] = []
    ident: int | None = None
    current = False
    frames: list[Frame] = []
    seen: set[int] = set()

    def flush() -> None:
        if ident is not None:
            threads.append(ThreadStack(ident, current, tuple(frames)))

    for line in text.splitlines():
        head = _THREAD.match(line)
        if head:
            flush()
            ident, current, frames = int(head[2], 16), head[1] == "Current thread", []
            if ident in seen:  # a second dump starts: keep only the newest
                threads.clear()
                seen.clear()
            seen.add(ident)
            continue
        frame = _FRAME.match(line)
        if frame and ident is not None:
            frames.append(Frame(frame["file"], int(frame["line"]), frame["func"]))
    flush()
    return threads


def _package_dirs() -> tuple[str, ...]:
    import torch

    import trainperf

    return tuple(
        os.path.dirname(os.path.abspath(str(m.__file__))) + os.sep for m in (torch, trainperf)
    )


def is_user_file(file: str) -> bool:
    """Whether a frame's file is the user's: not torch, trainperf, the standard library or
    frozen modules.

    Example:
        >>> is_user_file("/home/me/train.py"), is_user_file("<frozen runpy>")
        (True, False)
    """
    if file.startswith("<"):
        return False
    path = os.path.normpath(file)
    return not path.startswith((_STDLIB, *_package_dirs()))


def user_frame(frames: tuple[Frame, ...]) -> Frame | None:
    """The innermost frame in the user's code (torch internals skipped), else the innermost."""
    for frame in frames:
        if is_user_file(frame.file):
            return frame
    return frames[0] if frames else None


def source_line(frame: Frame | None) -> str:
    """The line of source a frame is on, stripped ('' when the file cannot be read)."""
    if frame is None:
        return ""
    return linecache.getline(frame.file, frame.line).strip()


def _in(frames: tuple[Frame, ...], path_part: str, functions: tuple[str, ...]) -> bool:
    part = path_part.replace("/", os.sep)
    return any(part in f.file and f.function in functions for f in frames)


def loads_in_process(frames: tuple[Frame, ...]) -> bool:
    """Whether the DataLoader is running the dataset in this thread (``num_workers=0``):
    its fetcher's frames are on the stack, not a wait for a worker's batch.

    Example:
        >>> inline = (Frame("/home/me/data.py", 9, "__getitem__"),
        ...           Frame("/torch/utils/data/_utils/fetch.py", 54, "<listcomp>"),
        ...           Frame("/torch/utils/data/dataloader.py", 700, "__next__"))
        >>> loads_in_process(inline), loads_in_process(inline[2:])
        (True, False)
    """
    return _in(frames, "torch/utils/data/_utils/fetch.py", ("fetch", "<listcomp>"))


def classify(
    frames: tuple[Frame, ...], *, in_collective: bool, waits_async: bool = False
) -> Activity:
    """What a rank's main thread is doing, from its stack (innermost first) and its slot.

    Args:
        frames: the main thread's frames, innermost first.
        in_collective: the rank's slot says it is inside a Python collective.
        waits_async: its last collective was started with ``async_op=True`` (the wait then
            happens in ``work.wait()``, which has no Python frame of its own).

    Example:
        >>> loop = (Frame("/torch/utils/data/dataloader.py", 700, "__next__"),
        ...         Frame("/home/me/train.py", 30, "main"))
        >>> classify(loop, in_collective=False)
        'dataloader'
    """
    if in_collective:
        return "collective"
    entry = _backward_entry(frames)
    if entry is not None:
        if not any(is_user_file(f.file) for f in frames[:entry]):
            return "backward"
        # The engine runs code of the user's (a custom autograd Function's backward, a
        # hook): the rank is in that code, not waiting in DDP's all-reduce.
        frames = frames[:entry]
    if _in(frames, "torch/utils/data/", ("__next__",)):
        return "dataloader"
    if not frames:
        return "running"
    innermost = frames[0]
    process = _process_wait(frames)
    if process is not None:
        return process
    if _in_threading(innermost) and innermost.function in _BLOCKING:
        takes_lock = any(f.function in _LOCK_FRAMES for f in _stdlib_run(frames))
        return "lock" if takes_lock else "thread-wait"
    line = source_line(innermost)
    if _WAITPID_LINE.search(line):  # os.wait() too: before the async wait's ".wait("
        return "process-wait"
    if waits_async and ".wait(" in line:
        return "collective"
    if _enters_lock(line):
        return "lock"
    if _GET_LINE.search(line):
        return "thread-wait"
    return "running"


def _backward_entry(frames: tuple[Frame, ...]) -> int | None:
    """The index of the innermost frame that runs the autograd engine (``backward()``,
    ``autograd.grad``), else None."""
    for i, f in enumerate(frames):
        if _in((f,), "torch/autograd/", ("backward", "_engine_run_backward")) or _in(
            (f,), "torch/_tensor.py", ("backward",)
        ):
            return i
    return None


def _process_wait(frames: tuple[Frame, ...]) -> Activity | None:
    """ "process-wait" where the standard-library call the stack ends in is one of
    multiprocessing's or subprocess's (:data:`_PROCESS_WAITS`) and its wait is not
    threading's; "dataloader" where the DataLoader made that call (starting or stopping
    its workers); else None."""
    run = _stdlib_run(frames)
    if not run or _in_threading(run[0]):
        return None
    if not any(part in f.file for f in run for part in _PROCESS_WAITS):
        return None
    caller = frames[len(run)] if len(run) < len(frames) else None
    if caller is not None and _DATALOADER in caller.file:
        return "dataloader"
    return "process-wait"


def _lock_named(name: str) -> bool:
    """A word of ``name`` is a lock's: `lock2`, `read_sem`, `FileLock`, `spinlock`; not
    `clock`, `blocking`, `semantic`, `lock_path`'s `path` alone."""
    words = [w.lower() for w in _WORDS.findall(name)]
    return any(w in _LOCK_WORDS or (w.endswith("lock") and w not in _NOT_LOCKS) for w in words)


def _entered_is_lock(expr: ast.expr) -> bool:
    """What a `with` item enters is named like a lock: its last name (`self._mutex`,
    `get_lock()`, `self._locks[key]`, `FileLock(path)`), or a lock's method
    (`self.lock.writer()`, `lock.acquire_timeout(5)`)."""
    while isinstance(expr, ast.Subscript):
        expr = expr.value
    if isinstance(expr, ast.Call):
        func = expr.func
        if isinstance(func, ast.Attribute) and _LOCK_METHODS.match(func.attr):
            return _entered_is_lock(func.value)
        expr = func
    if isinstance(expr, ast.Attribute):
        return _lock_named(expr.attr)
    return isinstance(expr, ast.Name) and _lock_named(expr.id)


def _enters_lock(line: str) -> bool:
    """The line acquires a lock (`.acquire(`) or enters one with `with`."""
    if ".acquire(" in line:
        return True
    code = line.split("#", 1)[0].strip()
    if not re.match(r"(async\s+)?with\b", code):
        return False
    # The items on this line (one continued on the next, `with a, \`, ends in `, \`).
    code = code.rstrip(":\\, ") + ": pass"
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return False
    node = tree.body[0] if tree.body else None
    if not isinstance(node, ast.With | ast.AsyncWith):
        return False
    return any(_entered_is_lock(item.context_expr) for item in node.items)


def _is_stdlib(file: str) -> bool:
    return file.startswith(_STDLIB) and not file.startswith(_SITE)


def _in_threading(frame: Frame) -> bool:
    return _is_stdlib(frame.file) and os.path.basename(frame.file) == _THREADING


def _stdlib_run(frames: tuple[Frame, ...]) -> list[Frame]:
    """The standard-library frames the stack starts with, innermost first: the call the
    program made (``Thread.join``, ``queue.get``, ``Handler.acquire``) down to the wait it
    ends in."""
    run = []
    for f in frames:
        if not _is_stdlib(f.file):
            break
        run.append(f)
    return run


# The frames of torch.compile's compiler: dynamo tracing a frame and building its graph,
# inductor lowering, generating and compiling code (or waiting for its compile workers).
# Not ``_dynamo/eval_frame.py`` (its ``compile_wrapper`` is on the stack whenever compiled
# code runs) nor any other runtime wrapper: a rank stuck in compiled code is not compiling.
_COMPILER = tuple(
    part.replace("/", os.sep)
    for part in (
        "torch/_dynamo/convert_frame.py",
        "torch/_dynamo/symbolic_convert.py",
        "torch/_dynamo/output_graph.py",
        "torch/_inductor/compile_fx.py",
        "torch/_inductor/graph.py",
        "torch/_inductor/codegen/",
        "torch/_inductor/codecache.py",
        "torch/_inductor/async_compile.py",
    )
)


def compiling(frames: tuple[Frame, ...]) -> bool:
    """Whether the stack is inside ``torch.compile``'s compiler (dynamo tracing, inductor
    code generation): a first compilation can take minutes on every rank at once, and is
    not a hang. Running compiled code (under ``eval_frame.py``'s wrapper) is not compiling.

    Example:
        >>> compiling((Frame("/torch/_inductor/graph.py", 900, "run"),))
        True
        >>> compiling((Frame("/torch/_dynamo/eval_frame.py", 1261, "compile_wrapper"),))
        False
    """
    return any(part in f.file for f in frames for part in _COMPILER)


# Inductor's compile-worker pool keeps helper threads (reading the workers' replies, watching
# their health) parked in its own module for the life of the process, compiling or not.
_POOL = f"torch{os.sep}_inductor{os.sep}compile_worker{os.sep}"


def compiling_threads(threads: list[ThreadStack]) -> bool:
    """Whether any thread of a rank is inside ``torch.compile``'s compiler, not only the
    main thread: a compilation may run on a thread of the user's or of a library (a
    training loop driven from a worker thread, a background warm-up compile). The compile
    worker pool's parked helper threads do not count.

    Example:
        >>> idle = ThreadStack(1, False, (Frame("/torch/_inductor/compile_worker/"
        ...     "subproc_pool.py", 250, "_read_thread"),))
        >>> work = ThreadStack(2, False, (Frame("/torch/_dynamo/convert_frame.py", 9, "f"),))
        >>> compiling_threads([idle]), compiling_threads([idle, work])
        (False, True)
    """
    for thread in threads:
        frames = tuple(f for f in thread.frames if _POOL not in f.file)
        if compiling(frames):
            return True
    return False
