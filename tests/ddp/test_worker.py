"""trainperf.ddp._worker: what runs inside each worker (its GPU, a clean exit, a stuck peer)."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

import trainperf.ddp as ddp
from tests.ddp import _workers as workers
from tests.ddp._distributed import fast_start_method, launch_fork
from trainperf.errors import LaunchError


def test_a_local_rank_without_its_gpu_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from trainperf.ddp._worker import rank_device

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert rank_device(1) == torch.device("cuda", 1)
    with pytest.raises(ValueError, match=r"local rank 2 has no GPU: only 2 visible"):
        rank_device(2)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # one GPU bound per task
    assert rank_device(3) == torch.device("cuda", 0)


@pytest.mark.timeout(60)
def test_sys_exit_zero_counts_as_returning_none() -> None:
    assert ddp.launch_all(
        workers.sys_exit_on_rank, 1, 0, nprocs=2, backend="gloo", start_method=fast_start_method()
    ) == [0, None]


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_rank_stuck_in_a_collective_fails_within_the_timeout() -> None:
    # Rank 1 stays alive but never joins: rank 0 must give up after `timeout`, not hang.
    with pytest.raises(LaunchError, match=r"^rank 0 of 2 raised RuntimeError: .*[Tt]imed out"):
        launch_fork(workers.stuck_on_rank, 1, timeout=timedelta(seconds=3))
