"""trainperf.checkpoint._rank_gpu: the GPU each rank's collectives run on under NCCL, on a
fake NCCL group (CPU only)."""

from __future__ import annotations

import pytest
import torch

from tests.checkpoint._fake_nccl import FakeNccl
from trainperf.checkpoint._rank_gpu import on_rank_gpu, rank_gpu


@pytest.mark.parametrize(
    ("local_rank", "gpus", "current", "bound", "expected"),
    [
        ("1", 2, 0, None, 1),  # set_device never called: LOCAL_RANK's GPU
        ("1", 4, 2, None, 2),  # the script chose cuda:2: kept
        ("1", 4, 0, 3, 3),  # init_process_group(device_id=cuda:3) wins
        ("3", 1, 0, None, 0),  # one visible GPU per rank: cuda:0 is this rank's
        (None, 2, 0, None, 0),  # no LOCAL_RANK: the current device
        ("one", 2, 0, None, 0),  # malformed: the current device, not an error mid-collective
    ],
)
def test_the_ranks_gpu_under_nccl(
    monkeypatch: pytest.MonkeyPatch,
    local_rank: str | None,
    gpus: int,
    current: int,
    bound: int | None,
    expected: int,
) -> None:
    FakeNccl(monkeypatch, gpus=gpus, current=current, bound=bound)
    for name in ("SLURM_NTASKS", "SLURM_PROCID", "SLURM_STEP_ID", "SLURM_LOCALID"):
        monkeypatch.delenv(name, raising=False)
    if local_rank is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
    assert rank_gpu() == torch.device("cuda", expected)


def test_inside_an_srun_step_the_local_rank_is_slurm_localid(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # As trainperf.ddp.local_rank() reads it: a script started by srun has no LOCAL_RANK.
    FakeNccl(monkeypatch, gpus=2, current=0)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    task = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0", "SLURM_LOCALID": "1"}
    for name, value in task.items():
        monkeypatch.setenv(name, value)
    assert rank_gpu() == torch.device("cuda", 1)
    monkeypatch.setenv("SLURM_STEP_ID", "4294967294")  # the batch script, not an srun task
    assert rank_gpu() == torch.device("cuda", 0)


def test_no_gpu_is_entered_under_gloo_or_without_a_group(monkeypatch: pytest.MonkeyPatch) -> None:
    assert rank_gpu() is None  # no group
    fake = FakeNccl(monkeypatch, backend="gloo")
    monkeypatch.setenv("LOCAL_RANK", "1")
    with on_rank_gpu() as gpu:
        assert gpu is None and fake.current == 0


def test_the_callers_current_device_is_back_after_the_block(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = FakeNccl(monkeypatch)
    monkeypatch.setenv("LOCAL_RANK", "1")
    with on_rank_gpu() as gpu:
        assert gpu == torch.device("cuda", 1) and fake.current == 1
    assert fake.current == 0
