"""A long blocking save on one rank while the others wait is not a hang (issue #16).

Rank 0's save takes three times ``hang_timeout`` (its file write slowed down) while rank 1
waits in a collective; the save marks itself as known slow work for the launcher's hang
detection, so the job runs to the end.
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


def _slowed(write: Any) -> Any:
    def slow(path: Path, body: Any) -> Any:
        time.sleep(SAVE_S)
        return write(path, body)

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
