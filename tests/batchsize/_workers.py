"""What the 2-rank tests run on every rank (module level, so spawned workers import it)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tests.batchsize._fakes import QUICK
from trainperf.batchsize import _tune, tune_batch_size


def tune_ddp(global_batch: int) -> dict[str, Any]:
    """Tune a DDP-wrapped model (gradients all-reduced in every backward) on this rank."""
    torch.set_num_threads(1)
    _tune.DEFAULT_PROBE = QUICK  # short windows (a fresh process: the fixture is not here)
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(x: torch.Tensor) -> None:
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    before = [p.detach().clone() for p in model.parameters()]
    try:
        report = tune_batch_size(
            step, lambda n: torch.randn(n, 8), model=model, optimizer=opt, device="cpu",
            global_batch=global_batch, max_size=16, budget_s=30, progress=False, cache=False,
        )  # fmt: skip
    except ValueError as e:
        return {"error": str(e)}
    return {
        "batch_size": report.batch_size,
        "accumulation_steps": report.accumulation_steps,
        "world_size": report.world_size,
        "sizes": [c.batch_size for c in report.candidates],
        "restored": all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)),
        "notes": list(report.notes),
    }


def oom_on_rank_1(where: str) -> dict[str, Any]:
    """Tune a sleeping step on this rank; on rank 1 alone, every step raises
    ``torch.OutOfMemoryError`` while sizes are measured in alternation
    (``where="alternation"``), or at 32 and above in a probe (``where="probe"``)."""
    import time

    import torch.distributed as dist

    from trainperf.batchsize import _probe

    torch.set_num_threads(1)
    _tune.DEFAULT_PROBE = QUICK
    rank = dist.get_rank()
    inside = {"alternation": False}
    alternate = _probe.Prober._alternate

    def watched(self: _probe.Prober, *args: Any) -> Any:
        inside["alternation"] = True
        try:
            return alternate(self, *args)
        finally:
            inside["alternation"] = False

    _probe.Prober._alternate = watched  # type: ignore[method-assign]

    def step(x: torch.Tensor) -> None:
        n = len(x)
        fails = inside["alternation"] if where == "alternation" else n >= 32
        if rank == 1 and fails:
            raise torch.OutOfMemoryError(f"CUDA out of memory (simulated on rank 1, batch {n})")
        time.sleep(0.002 + n * 0.00005)  # throughput rises with the size all the way

    report = tune_batch_size(
        step, lambda n: torch.zeros(n, 4), model=(), device="cpu", max_size=64, budget_s=60,
        progress=False, cache=False,
    )  # fmt: skip  # model=(): the step changes no state
    return {
        "batch_size": report.batch_size,
        "statuses": {c.batch_size: c.status for c in report.candidates},
        "reasons": {c.batch_size: c.reason for c in report.candidates if c.status == "oom"},
        "notes": list(report.notes),
    }


def cache_on_rank_0_only(cache_root: str) -> dict[str, Any]:
    """Tune twice, each rank with its own cache directory; before the second call rank 1's
    cache file is removed, so only rank 0 finds the stored choice."""
    import os

    import torch.distributed as dist

    from trainperf.batchsize._cache import cache_path

    torch.set_num_threads(1)
    _tune.DEFAULT_PROBE = QUICK
    rank = dist.get_rank()
    os.environ["XDG_CACHE_HOME"] = os.path.join(cache_root, f"rank{rank}")

    def step(x: torch.Tensor) -> None:
        x.square().sum()

    def tune() -> Any:
        return tune_batch_size(
            step, lambda n: torch.zeros(n, 4), model=(), device="cpu", max_size=8, budget_s=60,
            progress=False,
        )  # fmt: skip  # model=(): the step changes no state

    first = tune()
    stored = cache_path().exists()
    dist.barrier()
    if rank == 1:
        cache_path().unlink()
    dist.barrier()
    second = tune()
    return {
        "stored": stored,
        "from_cache": (first.from_cache, second.from_cache),
        "batch_size": second.batch_size,
    }


def untrained_on_rank_1() -> str:
    """Tune a step that trains its model on rank 0 and only runs it forward on rank 1;
    the error's text, or "no error"."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    _tune.DEFAULT_PROBE = QUICK
    trains = dist.get_rank() == 0
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(x: torch.Tensor) -> None:
        opt.zero_grad()
        loss = model(x).square().mean()
        if trains:
            loss.backward()
            opt.step()

    try:
        tune_batch_size(
            step, lambda n: torch.randn(n, 8), model=model, optimizer=opt, device="cpu",
            max_size=8, budget_s=30, progress=False, cache=False,
        )  # fmt: skip
    except ValueError as e:
        return str(e)
    return "no error"
