"""The crash-loop trainer of ``test_resume``, and the warm interpreter its runs are forked from.

``crash_trainer`` makes background saves back to back, each of a 200 MiB tensor filled with
its step, until it is killed. Each kill trial needs a trainer that has never been killed, and
starting a fresh interpreter (importing torch) for each costs seconds on the loaded 2-core
test machine: 50 trials did not fit in the test timeout. So ``python -m
tests.checkpoint._crash`` starts one interpreter (the "zygote") that imports everything once
and then, for each line ``DIRECTORY`` on its stdin, forks a trainer that leads its own
process group (``killpg`` takes the trainer, as a job kill does; its forked writer, in a
session of its own, dies with it by the parent-death signal) and reports on stdout:

- ``pid N`` once the trainer is forked, ``go`` once it has a complete checkpoint and starts
  saving in a loop, and ``reaped STATUS`` once the trainer has died (the zygote waits for it
  before it reads the next line).

The zygote runs no torch operation and starts no thread (the test sets
``OPENBLAS_NUM_THREADS=1``, or NumPy's OpenBLAS starts an idle one at import), and checks that
it has one thread before each fork: a forked trainer inherits no lock some other thread held,
as a fresh interpreter would not. It dies with its parent (the test), and each trainer with
the zygote.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import torch

from trainperf import Checkpointer
from trainperf._utils.lifetime import die_with_parent

CRASH_FLOATS = 50 * 1024 * 1024  # 200 MiB of float32


def _say(fd: int, line: str) -> None:
    os.write(fd, f"{line}\n".encode())  # one write of a short line: atomic on a pipe


def crash_trainer(directory: Path, out_fd: int) -> None:
    """Background saves back to back, each of a 200 MiB tensor filled with its step; says
    ``go`` on ``out_fd`` once a complete checkpoint exists."""
    ckpt = Checkpointer(directory, keep=2)
    step = max(ckpt.steps(), default=0)
    w = torch.empty(CRASH_FLOATS)
    if step == 0:  # the first trial: one complete checkpoint before the kills begin
        step = 1
        w.fill_(1.0)
        ckpt.save({"w": w, "step": 1}, step=1, blocking=False)
        ckpt.wait()
    _say(out_fd, "go")
    while True:
        step += 1
        w.fill_(float(step))
        ckpt.save({"w": w, "step": step}, step=step, blocking=False)


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _fork_trainer(directory: Path, zygote: int) -> int:
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child's coverage is not collected
        code = 1
        try:
            os.setsid()
            die_with_parent(zygote)
            crash_trainer(directory, sys.stdout.fileno())
        finally:
            os._exit(code)
    return pid


def zygote() -> None:
    """Fork one trainer per directory read from stdin; see the module docstring."""
    # The test starts it from its main thread: the parent-death signal, and no watcher
    # thread (the zygote must have one thread when it forks).
    die_with_parent(os.getppid(), from_main=True)
    out = sys.stdout.fileno()
    for line in sys.stdin:
        if threading.active_count() != 1 or _threads() != 1:
            _say(out, f"error: {_threads()} threads before the fork")
            return
        pid = _fork_trainer(Path(line.strip()), os.getpid())
        _say(out, f"pid {pid}")
        _, status = os.waitpid(pid, 0)
        _say(out, f"reaped {status}")


if __name__ == "__main__":
    zygote()
