"""A seeded CPU training loop that checkpoints with Checkpointer, for the resume tests.

Run as ``python -m tests.checkpoint._train DIR OUT [options]`` from the repository root. It
trains a small network with dropout (so the random state matters), Adam and a StepLR on a
shuffling DataLoader with workers, saves ``blocking=False`` every ``--save-every`` steps,
and at the end writes its parameters and optimizer state to ``OUT``.

``--hold-at S``: at step S, wait for the last background save, print ``holding S`` and
wait: forever (the test SIGKILLs it), or with ``--preempt`` until a signal asks it to stop,
then save blocking and exit. ``--ranks 2`` runs it under ``trainperf.ddp.launch`` on two gloo
ranks (each rank seeded differently, a DistributedLoader, DDP).
"""

from __future__ import annotations

import argparse
import faulthandler
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainperf import Checkpointer, DieWithParent, seed_everything

# On this signal every thread's Python stack goes to stderr: what a test that sees the run
# hang sends to each of its processes (a forked writer inherits the handler).
DUMP_SIGNAL = signal.SIGRTMIN + 5

SAMPLES, BATCH = 104, 8  # 13 batches an epoch: steps 30 and 37 fall mid-epoch


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(SAMPLES, 6, generator=g)
    return TensorDataset(x, (x.sum(1, keepdim=True) > 0).float())


def _loader(ranks: int) -> DataLoader[Any]:
    if ranks > 1:
        from trainperf.ddp import distributed_loader

        # No workers: each spawned rank would start its own (slow under spawn).
        return distributed_loader(_data(), BATCH // ranks, seed=7)
    return DataLoader(
        _data(),
        batch_size=BATCH,
        shuffle=True,
        num_workers=2,
        worker_init_fn=DieWithParent(None),
    )


def _step(model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> None:
    x, y = batch
    opt.zero_grad()
    loss = nn.functional.binary_cross_entropy_with_logits(model(x), y)
    loss.backward()
    opt.step()


def train(args: argparse.Namespace) -> None:
    import trainperf.ddp as ddp

    faulthandler.register(DUMP_SIGNAL, all_threads=True, chain=False)
    rank = ddp.rank()
    seed_everything(100 + rank)  # each rank its own stream: its own file must restore it
    net = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 1))
    model = ddp.wrap_model(net)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
    loader = _loader(args.ranks)
    ckpt = Checkpointer(args.dir, keep=3)
    state = {"model": model, "optimizer": opt, "scheduler": sched, "loader": loader}
    step = ckpt.restore(state)
    print(f"rank {rank} restored {step}", flush=True)
    with ckpt.preemption(("SIGTERM",), grace_s=20) as stop:
        while step < args.steps:
            for batch in loader:
                _step(model, opt, batch)
                sched.step()
                step += 1
                if step % args.save_every == 0:
                    ckpt.save(state, step=step, blocking=False)
                if step == args.hold_at:
                    ckpt.wait()  # the kill comes after this save completed
                    print(f"holding {step}", flush=True)
                    while not (args.preempt and stop.requested):
                        time.sleep(0.01)
                if stop.requested:
                    ckpt.save(state, step=step)
                    print(f"rank {rank} stopped at {step}", flush=True)
                    return
                if step == args.steps:
                    break
    ckpt.wait()
    if rank == 0:
        inner = ddp_inner(model)
        torch.save({"model": inner.state_dict(), "optimizer": opt.state_dict()}, args.out)


def ddp_inner(model: nn.Module) -> nn.Module:
    from trainperf.checkpoint import unwrap_model

    return unwrap_model(model)


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("dir", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--hold-at", type=int, default=-1)
    p.add_argument("--preempt", action="store_true")
    p.add_argument("--ranks", type=int, default=1)
    args = p.parse_args(argv)
    faulthandler.register(DUMP_SIGNAL, all_threads=True, chain=False)
    if args.ranks > 1:
        from trainperf.ddp import launch

        launch(train, args, nprocs=args.ranks, backend="gloo")
    else:
        train(args)


if __name__ == "__main__":
    main(sys.argv[1:])
