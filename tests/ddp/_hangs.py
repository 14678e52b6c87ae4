"""The hang cases of issue #16 as functions every rank runs (module level: spawn imports them).

Each case hangs on purpose; the comment on the line that causes it reads ``# CAUSE``, and
tests find that line with :func:`cause_line`. Run as a script under torchrun with
``watchdog()`` (the torchrun variants):

    python -m torch.distributed.run --standalone --nproc-per-node 2 _hangs.py CASE TIMEOUT REPORT
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

import trainperf.ddp as ddp

HERE = Path(__file__)
BAD = 1  # the rank that causes every hang


def cause_line(marker: str = "# CAUSE") -> dict[str, int]:
    """``{function name: line}`` of each ``# CAUSE <name>`` comment in this file."""
    found = {}
    for number, line in enumerate(HERE.read_text().splitlines(), start=1):
        if marker in line:
            found[line.split(marker, 1)[1].split()[0]] = number
    return found


def _steps(n: int) -> None:
    """A few healthy steps first, so every rank has history."""
    for _ in range(n):
        dist.all_reduce(torch.ones(4))  # STEP _steps


def busy_loop() -> None:
    """Case 1: one rank sleeps forever while the others wait in all_reduce."""
    _steps(3)
    if ddp.rank() == BAD:
        time.sleep(1e9)  # CAUSE busy_loop
    dist.all_reduce(torch.ones(4))  # WAIT busy_loop


def busy_loop_failing_on_sigterm() -> None:
    """Case 1, where the stuck rank's SIGTERM handler exits with code 3 (a failed save)."""
    if ddp.rank() == BAD:
        signal.signal(signal.SIGTERM, lambda signum, frame: os._exit(3))
    busy_loop()


def skips_collective() -> None:
    """Case 2: from step 2 on, one rank skips the broadcast and goes on to the next all_reduce."""
    for step in range(6):
        dist.all_reduce(torch.ones(4))  # CAUSE skips_collective
        if ddp.rank() != BAD or step < 2:
            dist.broadcast(torch.ones(4), src=0)  # WAIT skips_collective


def different_collective() -> None:
    """Case 3: one rank calls all_gather where the others call all_reduce."""
    _steps(2)
    t = torch.ones(4)
    if ddp.rank() == BAD:
        out = [torch.zeros(4) for _ in range(ddp.world_size())]
        dist.all_gather(out, t)  # CAUSE different_collective
    else:
        dist.all_reduce(t)  # WAIT different_collective


def different_shape() -> None:
    """Case 3 (shapes): gloo aborts on a size mismatch instead of hanging (NCCL would hang)."""
    _steps(2)
    dist.all_reduce(torch.ones(8 if ddp.rank() == BAD else 4))  # CAUSE different_shape


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, skip: bool) -> torch.Tensor:
        x = self.a(x)
        return x if skip else self.b(x)


def ddp_unused_layer() -> None:
    """Case 4: in its last step one rank's forward skips a layer; then every rank waits in a
    barrier (before a checkpoint, say): the others' DDP reducer waits forever in backward()."""
    torch.manual_seed(0)
    net = ddp.wrap_model(_Net())
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(3):
        skip = ddp.rank() == BAD and step == 2
        out = net(torch.ones(2, 4), skip=skip)  # the skip
        out.sum().backward()  # WAIT ddp_unused_layer
        opt.step()
        opt.zero_grad()
    dist.barrier()  # CAUSE ddp_unused_layer (where rank 1 waits; it skipped a layer above)


class _StuckDataset(Dataset[int]):
    def __len__(self) -> int:
        return 100

    def __getitem__(self, i: int) -> int:
        if ddp.rank() == BAD and i >= 4:
            time.sleep(1e9)  # a worker stuck in __getitem__
        return i


def stuck_dataloader() -> None:
    """Case 5: one rank's DataLoader worker hangs in __getitem__."""
    loader = DataLoader(_StuckDataset(), batch_size=2, num_workers=1)
    for batch in loader:  # CAUSE stuck_dataloader
        dist.all_reduce(batch.float())  # WAIT stuck_dataloader


def own_lock() -> None:
    """Case 6: one rank blocks on a lock that a thread of its own holds forever."""
    lock = threading.Lock()
    _steps(2)
    if ddp.rank() == BAD:

        def hold() -> None:
            with lock:
                time.sleep(1e9)

        threading.Thread(target=hold, daemon=True).start()
        time.sleep(0.2)
        with lock:  # CAUSE own_lock
            pass
    dist.all_reduce(torch.ones(4))


class _StuckBackward(torch.autograd.Function):
    """A custom autograd Function whose backward hangs on one rank."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        if ddp.rank() == BAD:
            time.sleep(1e9)  # CAUSE stuck_custom_backward
        return grad * 2


def stuck_custom_backward() -> None:
    """One rank hangs in its own autograd Function's backward, which the engine runs inside
    backward(); the others wait there for DDP's gradient all-reduce."""
    net = ddp.wrap_model(nn.Linear(4, 4))
    out = _StuckBackward.apply(net(torch.ones(2, 4)))
    out.sum().backward()  # WAIT stuck_custom_backward


def slow_model_build() -> None:
    """One rank is still building its model (no collective yet) while the others wait in
    DDP's constructor, which checks and broadcasts the parameters from C++."""
    if ddp.rank() == BAD:
        time.sleep(1e9)  # CAUSE slow_model_build
    ddp.wrap_model(nn.Linear(4, 4))  # WAIT slow_model_build


def slow_before_new_group() -> None:
    """One rank is still busy while the others create a subgroup, which every rank must do:
    they wait in new_group's store-based barrier, in torch's own Python."""
    _steps(1)
    if ddp.rank() == BAD:
        time.sleep(1e9)  # CAUSE slow_before_new_group
    dist.new_group(list(range(ddp.world_size())))  # WAIT slow_before_new_group


def busy_after_return() -> str:
    """Case 7 (#20.5): the others return from main; one rank stays busy outside collectives."""
    _steps(2)
    if ddp.rank() == BAD:
        time.sleep(1e9)  # CAUSE busy_after_return
    return "returned"


def slow_save(seconds: float) -> str:
    """Healthy: rank 0 spends ``seconds`` saving a checkpoint while the others wait in a
    barrier."""
    _steps(2)
    if ddp.rank() == 0:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            torch.save({"w": torch.randn(256, 256)}, "/dev/null")
    dist.barrier()
    return "done"


def busy_save(seconds: float) -> str:
    """Healthy: rank 0 spends ``seconds`` (past hang_timeout) in a checkpoint save that
    trainperf marks with ``busy()``, while the others wait in a barrier."""
    from trainperf.ddp._progress import busy

    _steps(2)
    if ddp.rank() == 0:
        with busy("saving checkpoint /tmp/fake/step-2.pt"):
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                torch.save({"w": torch.randn(256, 256)}, "/dev/null")
    dist.barrier()
    return "done"


def every_rank_busy(seconds: float) -> str:
    """Healthy: every rank works alone in its own code (preprocessing its shard, an
    evaluation without a DataLoader) for ``seconds``, then they meet in a collective."""
    _steps(1)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        sum(i * i for i in range(10_000))
    dist.barrier()
    return "done"


def slow_steps(steps: int, step_s: float) -> int:
    """Healthy: steps a little slower than hang_timeout / 10, each with an optimizer step."""
    net = ddp.wrap_model(nn.Linear(4, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for _ in range(steps):
        time.sleep(step_s)
        net(torch.ones(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    return steps


def long_compile(compile_for: Callable[[float], None], seconds: float) -> str:
    """Healthy: every rank spends ``seconds`` in (what looks like) torch.compile's compiler,
    then runs a collective."""
    _steps(1)
    compile_for(seconds)
    _steps(1)
    return "compiled"


def _compiled_step(x: torch.Tensor) -> torch.Tensor:
    x = x + 1
    torch._dynamo.graph_break()
    if ddp.rank() == 0:
        time.sleep(1e9)  # CAUSE stuck_in_compiled_code (in a compiled function)
    return x


def stuck_in_compiled_code() -> str:
    """Rank 0 is stuck in code that ``torch.compile`` compiled (after a graph break: under
    dynamo's runtime wrapper, not its compiler); rank 1 waits in all_reduce."""
    dist.all_reduce(torch.ones(2))
    if ddp.rank() == 0:
        torch.compile(_compiled_step, backend="eager")(torch.ones(2))
    dist.all_reduce(torch.ones(2))
    return "done"


CASES = {
    f.__name__: f
    for f in (
        busy_loop,
        skips_collective,
        different_collective,
        ddp_unused_layer,
        stuck_dataloader,
        own_lock,
        busy_after_return,
        stuck_custom_backward,
        slow_model_build,
        slow_before_new_group,
    )
}


CASES["different_shape"] = different_shape
# Healthy jobs under torchrun, given the timeout.
HEALTHY: dict[str, Callable[[float], object]] = {"busy_save": lambda t: busy_save(3 * t)}


if __name__ == "__main__":
    case, timeout, report = sys.argv[1], float(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo")
    with ddp.watchdog(timeout, report_path=report):
        if case in HEALTHY:
            HEALTHY[case](timeout)
        else:
            CASES[case]()
    dist.destroy_process_group()
