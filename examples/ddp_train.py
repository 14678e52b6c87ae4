"""Train a small model with DistributedDataParallel, on one machine or many.

    python examples/ddp_train.py                      # one rank per GPU (NCCL), or 2 CPU ranks
    python examples/ddp_train.py --nprocs 4           # more CPU ranks
    torchrun --nproc-per-node 2 examples/ddp_train.py # unchanged under torchrun (or srun)
    python examples/ddp_train.py --hang-timeout 60    # name a stuck rank after 60 s, not 300

Synthetic regression data, a few epochs; rank 0 prints the loss averaged over all ranks.
Without ``--lr``, the learning rate is 0.01 for a global batch (per-rank batch x ranks) of 64
or more, and scaled down in proportion below that: at 0.01, SGD with momentum diverges to a
NaN loss on this data with global batches of 8 or less.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.data import TensorDataset

import trainperf.ddp as ddp


def make_data(n: int = 4096, features: int = 32) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, features, generator=g)
    w = torch.randn(features, 1, generator=g)
    return TensorDataset(x, x @ w + 0.1 * torch.randn(n, 1, generator=g))


def default_lr(global_batch: int) -> float:
    """0.01, scaled down linearly below a global batch of 64 (the linear scaling rule)."""
    return 0.01 * min(1.0, global_batch / 64)


def train(epochs: int, batch_size: int, lr: float | None) -> float:
    """Runs on every rank; returns the final loss averaged over ranks."""
    torch.manual_seed(0)  # the same initial weights everywhere (DDP also broadcasts rank 0's)
    model = ddp.wrap_model(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)))
    device = next(model.parameters()).device
    loader = ddp.distributed_loader(make_data(), batch_size=batch_size, seed=0)
    if lr is None:
        lr = default_lr(batch_size * ddp.world_size())
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    ddp.print0(
        f"{ddp.world_size()} rank(s), {torch.distributed.get_backend()} on {device.type}, "
        f"{len(loader)} steps per epoch per rank, lr {lr:g}"
    )
    loss_mean = float("nan")
    for epoch in range(epochs):  # the loader reshuffles every epoch by itself
        total = torch.zeros((), device=device)
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            total += loss.detach()
        loss_mean = ddp.all_reduce_mean(total / len(loader)).item()
        print(f"  rank {ddp.rank()}: epoch {epoch} local loss {(total / len(loader)).item():.4f}")
        ddp.print0(f"epoch {epoch}: loss {loss_mean:.4f} (mean over ranks)")
    return loss_mean


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``minimum``, refused with the value otherwise."""

    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    parse.__name__ = f"integer >= {minimum}"  # argparse's word for a non-integer
    return parse


def seconds_or_off(text: str) -> float:
    """An argparse type for --hang-timeout: seconds >= 0, where 0 turns the watch off."""
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (0: off), got {value}")
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--nprocs", type=at_least(1), default=None, help="default: GPUs, or 2 on CPU"
    )
    parser.add_argument("--epochs", type=at_least(1), default=3)
    parser.add_argument("--batch-size", type=at_least(1), default=64, help="per rank")
    parser.add_argument(
        "--lr",
        type=float,
        default=None,
        help="default: 0.01, scaled down below a global batch of 64 (0.01 x batch x ranks / 64)",
    )
    parser.add_argument(
        "--hang-timeout",
        type=seconds_or_off,
        default=300.0,
        help="seconds without progress (0: off)",
    )
    args = parser.parse_args()
    nprocs = args.nprocs or (torch.cuda.device_count() or 2)  # ignored under torchrun/srun
    # A rank that stops making progress (a collective that never completes) is named, with
    # its file:line, after hang_timeout seconds; under torchrun the ranks watch each other.
    final = ddp.launch(
        train,
        args.epochs,
        args.batch_size,
        args.lr,
        nprocs=nprocs,
        hang_timeout=args.hang_timeout or None,
    )
    if ddp.is_main_process():  # under torchrun every rank returns here: print once
        print(f"final loss {final:.4f}")


if __name__ == "__main__":
    main()
