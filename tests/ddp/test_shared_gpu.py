"""trainperf.ddp._shared_gpu: the local ranks that share one GPU, found on the store."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from trainperf.ddp._shared_gpu import refuse_shared_gpu
from trainperf.errors import DeviceError, LaunchError

WAIT = timedelta(seconds=5)


def test_ranks_of_one_node_on_one_card_are_refused_with_the_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Each task saw one GPU, the same for all: every rank went to cuda:0 and NCCL failed
    # later with its obscure "Duplicate GPU detected".
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    store = dist.HashStore()
    store.set("trainperf/gpu/0/node1/1", "GPU-a")
    store.set("trainperf/gpu/0/node1/2", "GPU-b")
    with pytest.raises(
        DeviceError,
        match=r"local ranks 0, 1 on node1 share one GPU: 3 ranks run on this node and use "
        r"the same card \(this rank sees 1 GPU, CUDA_VISIBLE_DEVICES='0'\).*"
        r"torchrun --nproc-per-node.*"
        r"srun --gpus-per-task=1.*backend='gloo'",
    ):
        refuse_shared_gpu(store, 0, 3, "GPU-a", WAIT, host="node1")
    # A rank on a card of its own goes on; a card per task (bound by the scheduler) passes.
    refuse_shared_gpu(store, 2, 3, "GPU-b", WAIT, host="node1")
    assert store.get("trainperf/gpu/0/node1/0") == b"GPU-a"


def test_each_node_and_each_torchrun_restart_has_keys_of_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = dist.HashStore()
    store.set("trainperf/gpu/0/node1/1", "GPU-a")  # an earlier attempt, or another node
    store.set("trainperf/gpu/1/node2/1", "GPU-a")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    store.set("trainperf/gpu/1/node1/1", "GPU-b")
    refuse_shared_gpu(store, 0, 2, "GPU-a", WAIT, host="node1")
    assert store.get("trainperf/gpu/1/node1/0") == b"GPU-a"


def test_a_rank_that_posts_no_card_within_the_timeout_is_named() -> None:
    # A bounded wait that gave up quietly skipped the check when a rank was slow to start
    # (nothing lines the ranks up before it): the check waits the group's timeout, then
    # names the ranks that never came.
    store = dist.HashStore()
    store.set("trainperf/gpu/0/h/2", "GPU-c")
    with pytest.raises(LaunchError, match=r"local ranks \[1\] on h did not reach the GPU check"):
        refuse_shared_gpu(store, 0, 3, "GPU-a", timedelta(milliseconds=50), host="h")


def test_a_rank_that_sees_several_gpus_is_not_said_to_see_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # CUDA_VISIBLE_DEVICES differs on the node: this rank sees 0,1 and took cuda:0, the
    # card another rank sees alone; the message said "each sees 1 GPU".
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    store = dist.HashStore()
    store.set("trainperf/gpu/0/h/1", "GPU-a")
    with pytest.raises(DeviceError, match=r"\(this rank sees 2 GPUs, CUDA_VISIBLE_DEVICES='0,1'\)"):
        refuse_shared_gpu(store, 0, 2, "GPU-a", WAIT, host="h")
