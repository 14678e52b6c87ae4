"""Functions the ddp tests run on every rank (module level, so spawned workers import them)."""

from __future__ import annotations

import functools
import os
import signal
import sys
import time
import types
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset

import trainperf.ddp as ddp

N_SAMPLES = 48
BATCH = 3
EPOCHS = 2
LR = 0.1
SEED = 7


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def make_dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N_SAMPLES, 4, generator=g)
    y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(N_SAMPLES, 1, generator=g)
    return TensorDataset(x, y)


def reference_training(world: int) -> dict[str, torch.Tensor]:
    """Single-process SGD on the concatenation of every rank's batch, step by step."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = make_dataset().tensors
    global_batch = BATCH * world
    for epoch in range(EPOCHS):
        perm = torch.randperm(N_SAMPLES, generator=torch.Generator().manual_seed(SEED + epoch))
        for start in range(0, N_SAMPLES, global_batch):
            idx = perm[start : start + global_batch]
            opt.zero_grad()
            nn.functional.mse_loss(model(x[idx]), y[idx]).backward()
            opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train_and_reduce() -> dict[str, Any]:
    """DDP training with wrap_model + distributed_loader, plus collective checks."""
    model = make_model()
    net = ddp.wrap_model(model)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    loader = ddp.distributed_loader(make_dataset(), BATCH, shuffle=True, seed=SEED)
    device = next(net.parameters()).device
    steps = 0
    for _ in range(EPOCHS):  # no set_epoch: the loader advances the epoch itself
        for x_cpu, y_cpu in loader:
            x, y = x_cpu.to(device), y_cpu.to(device)
            opt.zero_grad()
            nn.functional.mse_loss(net(x), y).backward()
            opt.step()
            steps += 1
    summed = torch.tensor([float(ddp.rank() + 1)], device=device)
    dist.all_reduce(summed)
    mean = ddp.all_reduce_mean(torch.tensor([ddp.rank(), 10 * ddp.rank()]))
    ddp.barrier()
    return {
        "rank": ddp.rank(),
        "local_rank": ddp.local_rank(),
        "world_size": ddp.world_size(),
        "is_main": ddp.is_main_process(),
        "wrapped": type(net).__name__,
        "env": {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR")},
        "master_port": os.environ.get("MASTER_PORT"),
        "pid": os.getpid(),
        "threads": torch.get_num_threads(),
        "steps": steps,
        "next_epoch": loader.epoch,
        "sum": summed.item(),
        "mean": mean.tolist(),
        "params": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
    }


def add(a: int, b: int, *, scale: int = 1) -> int:
    return (a + b) * scale * (ddp.rank() + 1)


def change_on_rank0(copied: torch.Tensor, shared: torch.Tensor) -> list[list[float]]:
    """Rank 0 adds 100 to both arguments; every rank returns what it then sees of them."""
    if dist.get_rank() == 0:
        copied.add_(100)
        shared.add_(100)
    dist.barrier()
    return [copied.tolist(), shared.tolist()]


def backend_and_group() -> tuple[str, int]:
    return str(dist.get_backend()), dist.get_world_size()


# ------------------------------------------------------------------------------ faults


def _all_reduce() -> None:
    dist.all_reduce(torch.zeros(1))


def raise_on_rank(bad_rank: int, delay_s: float = 0.0) -> int:
    if ddp.rank() == bad_rank:
        time.sleep(delay_s)
        raise ValueError(f"deliberate failure on rank {bad_rank}")
    _all_reduce()  # the healthy ranks wait here for the one that never comes
    return ddp.rank()


def exit_on_rank(bad_rank: int, code: int) -> None:
    if ddp.rank() == bad_rank:
        sys.stdout.flush()
        os._exit(code)
    _all_reduce()


def _keep_pipes_without_sockets(ready: int) -> None:
    """In a forked child: close every socket (the rank's gloo connections), keep the pipes
    (the launcher's view of the rank's exit), say so on ``ready``, then wait to be stopped."""
    import stat

    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if stat.S_ISSOCK(os.fstat(fd).st_mode):
                os.close(fd)
        except OSError:
            continue
    os.write(ready, b"x")
    time.sleep(60)
    os._exit(0)


def exit_on_rank_seen_late(bad_rank: int, code: int) -> None:
    """Rank ``bad_rank`` calls ``os._exit(code)``, but a child it forked keeps its end of
    the launcher's pipes open: the peers lose it at once, while the launcher sees the exit
    only from its exit status (a process tears down slowly, or a helper holds the pipes)."""
    if ddp.rank() == bad_rank:
        r, w = os.pipe()
        if os.fork() == 0:
            _keep_pipes_without_sockets(w)
        os.read(r, 1)
        os._exit(code)
    _all_reduce()


def sys_exit_on_rank(bad_rank: int, code: int) -> int:
    if ddp.rank() == bad_rank:
        sys.exit(code)
    return ddp.rank()


def sys_exit_early_on_rank(bad_rank: int) -> str:
    """``bad_rank`` calls ``sys.exit(0)`` while the others wait in a collective for it."""
    if ddp.rank() == bad_rank:
        sys.exit(0)
    _all_reduce()
    return "stayed"


def _supplies_the_rank(fn: Any) -> Any:
    """A decorator that passes ``fn`` what its caller does not (as Hydra's passes the
    config): the wrapper's signature, not ``fn``'s, is what callers must match."""

    @functools.wraps(fn)
    def wrapper() -> Any:
        return fn(ddp.rank())

    return wrapper


@_supplies_the_rank
def decorated_rank(rank: int) -> int:
    return rank


def sys_exit_with_a_save_running(outdir: str) -> None:
    """Leave a background checkpoint write unfinished and call ``sys.exit(0)``: a stand-in
    for trainperf.checkpoint's wait at exit writes this rank's file when it is called."""

    def wait_at_exit() -> None:
        time.sleep(0.2)
        (Path(outdir) / f"saved{ddp.rank()}").write_text("saved")

    stand_in = types.ModuleType("trainperf.checkpoint._checkpointer")
    stand_in._wait_at_exit = wait_at_exit  # type: ignore[attr-defined]
    sys.modules[stand_in.__name__] = stand_in
    sys.exit(0)


def signal_on_rank(bad_rank: int, signum: int) -> None:
    if ddp.rank() == bad_rank:
        os.kill(os.getpid(), signum)
        time.sleep(30)
    _all_reduce()


def stuck_on_rank(bad_rank: int) -> None:
    """The bad rank stays alive but never joins the collective."""
    if ddp.rank() == bad_rank:
        time.sleep(120)
    _all_reduce()


def return_early_on_rank(bad_rank: int) -> str:
    if ddp.rank() == bad_rank:
        return "left"
    _all_reduce()
    return "stayed"


def raise_after_peer_returned(bad_rank: int) -> str:
    """The other ranks return at once; ``bad_rank`` then raises an error of its own."""
    if ddp.rank() == bad_rank:
        time.sleep(1.0)
        raise ValueError("its own failure")
    return "left"


def fail_first_attempt(marker: str) -> int:
    """Rank 1 fails the first time (no marker file yet); every rank succeeds the second."""
    path = Path(marker)
    if ddp.rank() == 1 and not path.exists():
        path.write_text("failed once")
        raise RuntimeError("first attempt fails")
    t = torch.tensor([1.0])
    dist.all_reduce(t)
    return int(t.item())


def always_fail() -> None:
    raise KeyError("always")


class UnprintableError(Exception):
    """An exception whose ``__str__`` raises."""

    def __str__(self) -> str:
        raise RuntimeError("str fails")


def raise_unprintable_on_rank(bad_rank: int) -> None:
    if ddp.rank() == bad_rank:
        raise UnprintableError()
    time.sleep(2)


class TwoPartError(Exception):
    """Pickles, but does not unpickle: ``__init__`` takes other arguments than ``args``."""

    def __init__(self, a: int, b: int) -> None:
        super().__init__(f"{a}/{b}")


def put_rank(queue: Any) -> str:
    queue.put(ddp.rank())
    return "put"


def unpicklable_result() -> Any:
    return lambda: None


def raise_while_peer_ignores_sigterm(bad_rank: int) -> None:
    """The other ranks ignore SIGTERM and sleep: the launcher must escalate to SIGKILL."""
    if ddp.rank() == bad_rank:
        time.sleep(0.5)
        raise ValueError("deliberate failure")
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(120)


def finish_after_sigterm(outdir: str, work_s: float) -> int:
    """Catch SIGTERM, then keep working for ``work_s`` seconds (reading batches from a
    DataLoader worker, as a final step before a checkpoint would), write a file and return."""
    import threading

    from torch.utils.data import DataLoader

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    batches = iter(DataLoader(range(1000), batch_size=1, num_workers=1))
    next(batches)
    Path(outdir, f"ready{ddp.rank()}").write_text("")
    while not stop.wait(0.05):
        pass
    deadline = time.monotonic() + work_s
    seen = 0
    while time.monotonic() < deadline:
        next(batches)  # the loader must still serve this rank during the grace period
        seen += 1
        time.sleep(0.05)
    Path(outdir, f"saved{ddp.rank()}").write_text(str(seen))
    return ddp.rank()


def local_dataset_in_workers() -> tuple[str, list[int]]:
    """A DataLoader with workers over a dataset class defined here (not picklable): what
    the rank's children start with, and what they yield."""
    import multiprocessing

    from torch.utils.data import DataLoader, Dataset

    class Local(Dataset[int]):
        def __len__(self) -> int:
            return 4

        def __getitem__(self, i: int) -> int:
            return i

    loader = DataLoader(Local(), batch_size=2, num_workers=1)
    return multiprocessing.get_start_method(), [int(x) for b in loader for x in b.tolist()]


def start_method_here() -> str | None:
    """This rank's default start method, as its own children would use it."""
    import multiprocessing

    return multiprocessing.get_start_method(allow_none=True)


def samples_of(loader: Any) -> tuple[int, list[int]]:
    """``(len(loader), its samples)`` in this rank."""
    return len(loader), [int(x) for batch in loader for x in batch.tolist()]


def ready_then_sleep(outdir: str) -> None:
    """Say it is ready, then sleep without handling SIGTERM: the signal ends the rank."""
    Path(outdir, f"ready{ddp.rank()}").write_text("")
    time.sleep(60)


def exit_on_sigterm(outdir: str, bad_rank: int, code: int) -> int:
    """Wait for SIGTERM: ``bad_rank`` then exits with ``code`` (a save that failed), the
    others finish cleanly."""
    import threading

    stop = threading.Event()
    if ddp.rank() == bad_rank:
        signal.signal(signal.SIGTERM, lambda signum, frame: os._exit(code))
    else:
        signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    Path(outdir, f"ready{ddp.rank()}").write_text("")
    while not stop.wait(0.05):
        pass
    return ddp.rank()


def raise_while_peer_exits_on_sigterm(bad_rank: int, code: int) -> None:
    """``bad_rank`` raises; the others' SIGTERM handler exits with ``code`` (a failed save)."""
    if ddp.rank() == bad_rank:
        time.sleep(0.5)
        raise ValueError("deliberate failure")
    signal.signal(signal.SIGTERM, lambda signum, frame: os._exit(code))
    time.sleep(120)


def close_stderr_and_break_teardown(value: int) -> int:
    """Return ``value`` after closing ``sys.stderr``, with the rank's own
    ``destroy_process_group`` made to fail once ``main`` has returned."""
    from trainperf.ddp import _worker

    def broken() -> None:
        raise RuntimeError("destroy_process_group broke")

    _worker._destroy = broken
    sys.stderr.close()
    return value


def raise_then_peers_exit_cleanly(bad_rank: int) -> None:
    """``bad_rank`` raises; the others see their collective break and call ``os._exit(0)``
    (a script that treats a broken collective as the end of the job)."""
    if ddp.rank() == bad_rank:
        raise ValueError("its own failure")
    try:
        _all_reduce()
    except RuntimeError:
        os._exit(0)


def raise_while_a_child_exits_during_the_report() -> None:
    """Raise, with a SIGCHLD handler that raises installed (as a DataLoader with workers
    installs one) and a child process that exits while the rank reports the failure."""
    from trainperf.ddp import _worker

    def child_failed(signum: int, frame: Any) -> None:
        raise RuntimeError("DataLoader worker exited unexpectedly")

    report = _worker._report_failure

    def report_while_a_child_exits(conn: Any, failure: Any) -> None:
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        report(conn, failure)

    signal.signal(signal.SIGCHLD, child_failed)
    _worker._report_failure = report_while_a_child_exits
    raise ValueError("its own failure")
