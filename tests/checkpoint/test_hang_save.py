"""A long save on one rank while the others wait is not a hang (issue #16), and a background
save still running when ``main`` returns is finished, not killed (issue #15).

Rank 0's save takes three times ``hang_timeout`` (its file write slowed down) while rank 1
waits in a collective or has returned; the save, and a wait for a background one, mark
themselves as known slow work for the launcher's hang detection, so the job runs to the
end with every checkpoint on disk.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import trainperf.ddp as ddp
from tests.ddp._distributed import LONG, launch_fork
from trainperf.checkpoint import Checkpointer, _files, _writer, save_checkpoint

SAVE_S = 6.0


def _slowed(write: Any, seconds: float = SAVE_S) -> Any:
    def slow(path: Path, body: Any, **options: Any) -> Any:
        time.sleep(seconds)
        return write(path, body, **options)

    return slow


def _long_save(directory: str, kind: str) -> str:
    if ddp.rank() == 0:  # the fork's own copy of the modules: nothing leaks into the test
        _files.write_checkpoint_file = _slowed(_files.write_checkpoint_file)  # type: ignore[assignment]
        _writer.write_checkpoint_file = _slowed(_writer.write_checkpoint_file)  # type: ignore[assignment]
    dist.all_reduce(torch.ones(2))
    state = {"w": torch.ones(3)}
    if kind == "save_checkpoint":
        save_checkpoint(state, Path(directory) / "c.pt", distributed=True)
    else:
        Checkpointer(directory).save(state, step=1)  # blocking
    dist.barrier()
    return "done"


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["save_checkpoint", "Checkpointer"])
def test_a_save_longer_than_hang_timeout_is_not_a_hang(tmp_path: Path, kind: str) -> None:
    assert launch_fork(_long_save, str(tmp_path), kind, timeout=LONG, hang_timeout=2.0) == "done"
    assert any(tmp_path.iterdir())


def _long_background_save(directory: str, mode: str) -> str:
    # At exit the write outlasts the launcher's 10 s for a rank to exit after main returned.
    seconds = 12.0 if mode == "exit" else SAVE_S
    if ddp.rank() == 0:
        _writer.write_checkpoint_file = _slowed(_writer.write_checkpoint_file, seconds)  # type: ignore[assignment]
    dist.all_reduce(torch.ones(2))
    ckpt = Checkpointer(directory)
    ckpt.save({"w": torch.ones(3)}, step=1, blocking=False)
    if mode == "next":  # the second save waits for the first write
        ckpt.save({"w": torch.ones(3)}, step=2, blocking=False)
        dist.barrier()
    elif mode == "wait":
        ckpt.wait()
    # "exit": main returns with the write in flight; the rank finishes it before reporting
    return "done"


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["next", "wait", "exit"])
def test_waiting_for_a_background_save_is_not_a_hang_and_the_file_is_written(
    tmp_path: Path, mode: str
) -> None:
    out = launch_fork(_long_background_save, str(tmp_path), mode, timeout=LONG, hang_timeout=2.0)
    assert out == "done"
    assert (tmp_path / "step-000000001.pt").is_file(), sorted(p.name for p in tmp_path.iterdir())
