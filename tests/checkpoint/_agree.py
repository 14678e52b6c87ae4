"""Run on every rank of a gloo group by test_preempt and test_checkpointer (module level, so
spawned workers can import them)."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import torch.distributed as dist

from trainperf.checkpoint import Preemption


def stop_step_when_only_rank1_is_signalled(
    signal_at: int, check_every: int | None
) -> dict[str, Any]:
    """Rank 1 alone gets SIGUSR1 at step ``signal_at``: both ranks must stop at one step."""
    rank = dist.get_rank()
    with Preemption(("SIGUSR1",), grace_s=30, check_every=check_every) as stop:
        for step in range(1, 2000):
            if rank == 1 and step == signal_at:
                os.kill(os.getpid(), signal.SIGUSR1)
                time.sleep(0.05)  # delivered before the next read
            if stop.requested:
                return {
                    "step": step,
                    "every": stop.check_every,
                    "cost": stop.agree_cost_s,
                    "deadline": stop.deadline_s,
                    "signal": stop.signal,
                }
    return {"step": None}


def save_and_restore_on_two_ranks(directory: str) -> dict[str, Any]:
    """Each rank seeded on its own: rank 0 writes the step file, rank 1 its own part, and
    restore gives each rank its own generator state back."""
    import torch
    from torch import nn

    from trainperf import Checkpointer

    rank = dist.get_rank()
    torch.manual_seed(10 + rank)
    model = nn.Linear(3, 2)
    ckpt = Checkpointer(directory, keep=2)
    ckpt.save({"model": model}, step=5, blocking=False)
    ckpt.wait()
    expected = torch.rand(3).tolist()
    dist.barrier()  # rank 0's file is durable before anyone reads it
    torch.manual_seed(999)
    fresh = nn.Linear(3, 2)
    step = ckpt.restore({"model": fresh})
    return {
        "step": step,
        "same_draws": torch.rand(3).tolist() == expected,
        "weights": [p.tolist() for p in fresh.parameters()],
        "files": sorted(os.listdir(directory)),
    }
