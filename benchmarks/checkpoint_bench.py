"""Benchmark: how long a checkpoint blocks the training loop, and what it costs while it writes.

For one state of ``--size-mb`` (default 1024 MB of float32 tensors, plus a small trained MLP
and its Adam state), all saved to the same directory:

- **blocked**: seconds the loop waits in ``torch.save(state, path)``, in
  ``trainperf.save_checkpoint(state, path)`` (atomic: temp file, fsync, rename) and in
  ``Checkpointer.save(state, step=..., blocking=False)`` for each background writer asked
  for (``process``: a forked copy-on-write snapshot, CPU tensors only; ``thread``: tensors
  copied into reused host buffers, pinned for GPU tensors, written by a thread). The median of
  ``--repeats`` saves (the first background save allocates the staging buffers; it is in the
  JSON); the background write's own duration is recorded too.
- **steps/s**: the rate of a training step (a matmul chain sized to ``--step-ms``, default
  10 ms) while a background write is in flight, against the mean rate of a ``--seconds``
  window just before and one just after it (other load on the machine moves the rate). The
  step does not touch the big tensors (frozen weights, say); ``--touch-mb`` makes each step
  write that many MB of them, which costs copy-on-write page copies under the process
  writer.
- **SIGTERM to exit**: a child process trains inside ``Checkpointer.preemption()``; it is
  sent SIGTERM and saves the whole state (blocking) before it exits; the seconds from the
  signal to its exit.
- **agreement**: two gloo ranks run ``--agree-steps`` 10 ms steps (a sleep, as a CPU
  waiting for its GPU, then a small all-reduce, as DDP's gradients), each with one read of
  ``stop.requested``; the time spent in those reads per step (every ``check_every``-th
  read is an ``all_reduce``), against the 10 ms step.

Targets (issue #15): blocked <= 5 % of the synchronous ``save_checkpoint`` on CPU (<= 2 %
on CUDA with pinned staging), steps/s during a write >= 90 % of the rate without one,
SIGTERM to exit <= 20 s with a 1 GB final save, agreement < 1 % of a 10 ms step.

Usage::

    python benchmarks/checkpoint_bench.py [--device cpu|cuda] [--size-mb 1024] [--repeats 3]
        [--step-ms 10] [--seconds 3] [--touch-mb 0] [--threads 1] [--writers process,thread]
        [--skip sigterm,agree] [--agree-steps 300] [--dir DIR] [--json results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

import trainperf.checkpoint._checkpointer as checkpointer_module
from trainperf import Checkpointer, host_limits, save_checkpoint

TARGET_BLOCKED = {"cpu": 0.05, "cuda": 0.02}
TARGET_RATE = 0.90
TARGET_SIGTERM_S = 20.0
TARGET_AGREE = 0.01
WRITERS = ("process", "thread")


@dataclass
class Row:
    what: str
    blocked_s: float | None = None
    write_s: float | None = None
    first_blocked_s: float | None = None
    note: str = ""
    samples: list[float] = field(default_factory=list)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_state(size_mb: int, device: torch.device) -> dict[str, Any]:
    """A small trained MLP with Adam, and ``size_mb`` MB of float32 in 64 MB tensors."""
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256)).to(device)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(8, 256, device=device)).sum().backward()
    opt.step()
    floats = size_mb * (1 << 20) // 4
    chunk = 16 << 20  # 64 MB
    big = {
        f"w{i}": torch.randn(min(chunk, floats - i * chunk), device=device)
        for i in range((floats + chunk - 1) // chunk)
    }
    return {"model": model, "optimizer": opt, "big": big}


def make_step(device: torch.device, step_ms: float) -> Callable[[], None]:
    """A training-like step (matmuls on ``device``) calibrated to about ``step_ms``."""
    n = 512 if device.type == "cpu" else 4096
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)

    def one() -> None:
        torch.mm(a, b, out=a).div_(n)

    one()
    _sync(device)
    start = time.perf_counter()
    for _ in range(5):
        one()
    _sync(device)
    per = (time.perf_counter() - start) / 5
    reps = max(1, round(step_ms / 1000 / max(per, 1e-6)))

    def step() -> None:
        for _ in range(reps):
            one()
        _sync(device)

    return step


def steps_per_s(step: Callable[[], None], until: Callable[[], bool], max_s: float) -> float:
    n, start = 0, time.perf_counter()
    while not until() and time.perf_counter() - start < max_s:
        step()
        n += 1
    return n / max(time.perf_counter() - start, 1e-9)


@contextmanager
def writer(kind: str) -> Iterator[None]:
    """Force the background writer ``kind`` ("process" or "thread")."""
    real = checkpointer_module.fork_writes
    if kind == "thread":
        checkpointer_module.fork_writes = lambda: False  # type: ignore[assignment]
    try:
        yield
    finally:
        checkpointer_module.fork_writes = real  # type: ignore[assignment]


def _timed(fn: Callable[[], Any], device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def blocked_rows(
    state: dict[str, Any], directory: Path, args: argparse.Namespace, device: torch.device
) -> list[Row]:
    rows = []
    for what, fn in (
        ("torch.save", lambda: torch.save(state, directory / "torch_save.pt")),
        ("save_checkpoint", lambda: save_checkpoint(state, directory / "save_checkpoint.pt")),
    ):
        times = [_timed(fn, device) for _ in range(args.repeats)]
        rows.append(Row(what, statistics.median(times), samples=times))
    for kind in args.writers:
        if kind == "process" and device.type != "cpu":
            continue  # GPU tensors always go through staged buffers and a thread
        ckpt = Checkpointer(directory / kind, keep=1)
        blocked, writes = [], []
        with writer(kind):
            for i in range(args.repeats + 1):  # the first allocates the staging buffers
                start = time.perf_counter()
                handle = ckpt.save(state, step=i, blocking=False)
                blocked.append(time.perf_counter() - start)
                ckpt.wait()
                writes.append(time.perf_counter() - start)
        rows.append(
            Row(
                f"Checkpointer.save(blocking=False) [{handle.writer}]",
                statistics.median(blocked[1:]),
                statistics.median(writes[1:]),
                blocked[0],
                samples=blocked,
            )
        )
    return rows


def rate_rows(
    state: dict[str, Any], directory: Path, args: argparse.Namespace, device: torch.device
) -> list[dict[str, Any]]:
    step = make_step(device, args.step_ms)
    big = list(state["big"].values())
    touch = args.touch_mb * (1 << 20) // 4

    def train() -> None:
        step()
        if touch:
            big[0][:touch].add_(1.0)

    for _ in range(5):
        train()
    # Other load on the machine moves the rate: each write is bracketed by a window without
    # one just before and just after, and compared with their mean.
    out = []
    for kind in args.writers:
        if kind == "process" and device.type != "cpu":
            continue
        ckpt = Checkpointer(directory / f"rate-{kind}", keep=1)
        with writer(kind):
            ckpt.save(state, step=0, blocking=False)  # buffers allocated, file written
            ckpt.wait()
            before = steps_per_s(train, lambda: False, args.seconds)
            handle = ckpt.save(state, step=1, blocking=False)
            during = steps_per_s(train, handle.done, 600.0)
            ckpt.wait()
            after = steps_per_s(train, lambda: False, args.seconds)
        base = (before + after) / 2
        out.append(
            {"what": f"no save (around the {kind} write)", "steps_per_s": base, "ratio": 1.0}
        )
        out.append(
            {
                "what": f"during a {handle.writer} write",
                "steps_per_s": during,
                "ratio": during / base,
                "before": before,
                "after": after,
            }
        )
    return out


_SIGTERM_CHILD = textwrap.dedent(
    """
    import sys, time, torch
    sys.path.insert(0, sys.argv[3])
    from checkpoint_bench import make_state, make_step
    from trainperf import Checkpointer
    device = torch.device(sys.argv[2])
    state = make_state(int(sys.argv[1]), device)
    step = make_step(device, 10)
    ckpt = Checkpointer(sys.argv[4])
    with ckpt.preemption(("SIGTERM",)) as stop:
        print("ready", flush=True)
        n = 0
        while not stop.requested:
            step()
            n += 1
        ckpt.save(state, step=n)   # the final save, blocking, inside the grace period
    print(f"saved {n} with {stop.deadline_s:.1f} s of grace left", flush=True)
    """
)


def sigterm_to_exit(args: argparse.Namespace, directory: Path) -> dict[str, Any]:
    script = directory / "sigterm_child.py"
    script.write_text(_SIGTERM_CHILD)
    here = str(Path(__file__).resolve().parent)
    proc = subprocess.Popen(
        [
            sys.executable,
            str(script),
            str(args.size_mb),
            args.device,
            here,
            str(directory / "term"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        if line != "ready":
            raise RuntimeError(f"the child did not start: {line!r}")
        time.sleep(1.0)  # a few steps in
        start = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=600)
        seconds = time.perf_counter() - start
    finally:
        proc.kill()
        proc.wait()
    return {"seconds": seconds, "exit_code": proc.returncode, "child": out.strip()}


def _agree_rank(steps: int) -> dict[str, Any]:
    """``steps`` 10 ms steps (a sleep: the GPU works, the CPU waits; then a gradient
    all-reduce, which keeps the ranks in step as DDP does), each with one read of
    ``stop.requested``; the time spent in those reads, per step."""
    import torch.distributed as dist

    from trainperf.checkpoint import Preemption

    grad = torch.zeros(1024)
    spent = 0.0
    with Preemption(("SIGUSR1",)) as stop:
        start = time.perf_counter()
        for _ in range(steps):
            time.sleep(0.010)
            dist.all_reduce(grad)
            before = time.perf_counter()
            _ = stop.requested
            spent += time.perf_counter() - before
        step_s = (time.perf_counter() - start) / steps
    return {
        "step_s": step_s,
        "per_step_s": spent / steps,
        "check_every": stop.check_every,
        "all_reduce_s": stop.agree_cost_s,
    }


def agreement(steps: int) -> dict[str, Any]:
    from trainperf.ddp import launch_all

    results = launch_all(_agree_rank, steps, nprocs=2, backend="gloo", start_method="fork")
    worst = max(r["per_step_s"] for r in results)
    return {**results[0], "per_step_s": worst, "of_10ms_step": worst / 0.010}


def _fmt(v: float | None, unit: str = "s") -> str:
    return "-" if v is None else f"{v:.3f} {unit}"


def report(result: dict[str, Any]) -> str:
    lines = [
        f"checkpoint_bench: {result['size_mb']} MB state on {result['device']}, "
        f"{result['repeats']} repeats, same directory ({result['directory']})",
        "",
        f"{'save':<46} {'blocked':>10} {'of sync':>8} {'write':>10} {'1st':>10}",
    ]
    sync = next(r["blocked_s"] for r in result["blocked"] if r["what"] == "save_checkpoint")
    for r in result["blocked"]:
        ratio = f"{r['blocked_s'] / sync:7.1%}" if sync else "-"
        lines.append(
            f"{r['what']:<46} {_fmt(r['blocked_s']):>10} {ratio:>8} "
            f"{_fmt(r['write_s']):>10} {_fmt(r['first_blocked_s']):>10}"
        )
    lines += ["", f"{'training steps/s':<46} {'steps/s':>10} {'ratio':>8}"]
    for r in result["rates"]:
        lines.append(f"{r['what']:<46} {r['steps_per_s']:>10.1f} {r['ratio']:>8.1%}")
    if result.get("sigterm"):
        s = result["sigterm"]
        lines += [
            "",
            f"SIGTERM to exit with a {result['size_mb']} MB final save: {s['seconds']:.1f} s "
            f"(target <= {TARGET_SIGTERM_S:g} s; exit {s['exit_code']}; {s['child']})",
        ]
    if result.get("agreement"):
        a = result["agreement"]
        lines += [
            "",
            f"agreement on 2 gloo ranks: {a['per_step_s'] * 1e6:.1f} us per step "
            f"({a['of_10ms_step']:.2%} of a 10 ms step, {a['per_step_s'] / a['step_s']:.2%} of "
            f"the {a['step_s'] * 1e3:.1f} ms steps measured; last all_reduce "
            f"{a['all_reduce_s'] * 1e6:.0f} us, check_every={a['check_every']})",
        ]
    lines += [
        "",
        f"targets: blocked <= {TARGET_BLOCKED[result['device_type']]:.0%} of sync, "
        f"steps/s during a write >= {TARGET_RATE:.0%}, SIGTERM <= {TARGET_SIGTERM_S:g} s, "
        f"agreement < {TARGET_AGREE:.0%}",
    ]
    return "\n".join(lines)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--size-mb", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--step-ms", type=float, default=10.0)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--touch-mb", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--writers", default="process,thread")
    p.add_argument("--skip", default="")
    p.add_argument("--agree-steps", type=int, default=300)
    p.add_argument("--dir", type=Path, default=None)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    args.writers = [w for w in args.writers.split(",") if w]
    bad = [w for w in args.writers if w not in WRITERS]
    if bad or args.size_mb < 1 or args.repeats < 1:
        p.error(f"--writers takes {WRITERS}; --size-mb and --repeats must be >= 1")
    args.skip = {s for s in args.skip.split(",") if s}
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    device = torch.device(args.device)
    # The training step's intra-op threads: 1 leaves a core of a 2-core machine to the
    # writer and the OS, as a GPU loop's mostly idle CPU would.
    torch.set_num_threads(args.threads)
    directory = args.dir or Path(tempfile.mkdtemp(prefix="checkpoint_bench-"))
    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    state = make_state(args.size_mb, device)
    result: dict[str, Any] = {
        "size_mb": args.size_mb,
        "device": str(
            torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu"
        ),
        "device_type": device.type,
        "repeats": args.repeats,
        "directory": str(directory),
        "settings": vars(args)
        | {"dir": str(directory), "json": str(args.json), "skip": sorted(args.skip)},
        "torch": torch.__version__,
        "host": str(host_limits()).replace("\n", "; "),
        "cpus": os.cpu_count(),
    }
    try:
        result["blocked"] = [asdict(r) for r in blocked_rows(state, directory, args, device)]
        result["rates"] = rate_rows(state, directory, args, device)
        del state
        if "sigterm" not in args.skip:
            result["sigterm"] = sigterm_to_exit(args, directory)
        if "agree" not in args.skip:
            result["agreement"] = agreement(args.agree_steps)
    finally:
        if args.dir is None:
            shutil.rmtree(directory, ignore_errors=True)
    print(report(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
