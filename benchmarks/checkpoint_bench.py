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
- **steps/s**: the rate of a real training step while a background write is in flight,
  against the mean rate of a window just before and one just after it, each about as long as
  the last write took (at least ``--seconds``, at most a minute: other load on the machine
  moves the rate), over ``--rate-rounds`` writes (the median ratio is the
  figure). The step trains the state's MLP (forward, backward, Adam), its batch sized to about
  ``--step-ms`` (default 10 ms), so every step writes the model's parameters, gradients and
  Adam moments, which are part of the saved state: under the process writer each page of them
  is copied once (copy-on-write) after the fork. The 1 GB of other tensors is not trained
  (frozen weights, say); ``--touch-mb`` makes each step also write that many MB of them. For
  each write it records where the loop's time went: its CPU share (CPU seconds per second:
  below the windows' share, the writer or other jobs took its CPU), its CPU time per step
  (above the windows': page faults, cache misses), its page faults per step, and the
  writer's CPU seconds.
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
        [--step-ms 10] [--seconds 3] [--rate-rounds 3] [--touch-mb 0] [--threads 1]
        [--writers process,thread]
        [--skip sigterm,agree] [--agree-steps 300] [--dir DIR] [--json results.json]
        [--dry-run]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
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
from functools import partial
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
SKIPPABLE = ("sigterm", "agree")  # the parts --skip can leave out


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


WIDTH = 512  # the trained MLP: 3 layers of 512 x 512, 3 MB of parameters, 6 MB of Adam state


def make_state(size_mb: int, device: torch.device) -> dict[str, Any]:
    """A trained MLP with Adam, and ``size_mb`` MB of float32 in 64 MB tensors."""
    layers: list[nn.Module] = []
    for i in range(3):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()] if i < 2 else [nn.Linear(WIDTH, WIDTH)]
    model = nn.Sequential(*layers).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    model(torch.randn(8, WIDTH, device=device)).sum().backward()
    opt.step()
    floats = size_mb * (1 << 20) // 4
    chunk = 16 << 20  # 64 MB
    big = {
        f"w{i}": torch.randn(min(chunk, floats - i * chunk), device=device)
        for i in range((floats + chunk - 1) // chunk)
    }
    return {"model": model, "optimizer": opt, "big": big}


def make_step(state: dict[str, Any], device: torch.device, step_ms: float) -> Callable[[], None]:
    """One real training step of ``state``'s model (forward, backward, Adam: it writes the
    parameters, gradients and moments), the batch sized to take about ``step_ms``."""
    model, opt = state["model"], state["optimizer"]
    gen = torch.Generator(device=device).manual_seed(0)

    def train(x: torch.Tensor) -> None:
        opt.zero_grad(set_to_none=False)
        model(x).square().mean().backward()
        opt.step()
        _sync(device)

    def timed(batch: int) -> float:
        x = torch.randn(batch, WIDTH, device=device, generator=gen)
        train(x)
        start = time.perf_counter()
        for _ in range(3):
            train(x)
        return (time.perf_counter() - start) / 3

    batch, most = 8, 8192 if device.type == "cpu" else 1 << 16
    while batch < most and timed(batch) < step_ms / 1000:
        batch *= 2
    x = torch.randn(batch, WIDTH, device=device, generator=gen)
    return partial(train, x)


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
        if kind == "process" and args.device != "cpu":
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


@dataclass
class Window:
    """Steps and where their time went in one stretch of the loop."""

    steps: int
    wall_s: float
    cpu_s: float  # the loop's process (its threads; not the writer)
    faults: int  # minor page faults of the loop's process (copy-on-write copies among them)

    @property
    def rate(self) -> float:
        return self.steps / max(self.wall_s, 1e-9)

    @property
    def cpu_share(self) -> float:
        return self.cpu_s / max(self.wall_s, 1e-9)

    @property
    def cpu_ms_per_step(self) -> float:
        return 1e3 * self.cpu_s / max(self.steps, 1)


def window(step: Callable[[], None], until: Callable[[], bool], max_s: float) -> Window:
    """Run ``step`` until ``until()`` or ``max_s`` seconds; what it cost."""
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.process_time()
    n, start = 0, time.perf_counter()
    while not until() and time.perf_counter() - start < max_s:
        step()
        n += 1
    wall = time.perf_counter() - start
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    return Window(n, wall, time.process_time() - t0, r1.ru_minflt - r0.ru_minflt)


def _children_cpu() -> float:
    t = os.times()
    return t.children_user + t.children_system  # reaped children: the forked writers


def rate_round(
    ckpt: Checkpointer, state: dict[str, Any], train: Callable[[], None], i: int, seconds: float
) -> dict[str, Any]:
    """One write bracketed by a window without one just before and just after it, each
    ``seconds`` long (the write's length, ideally: other jobs' load changes over time)."""
    before = window(train, lambda: False, seconds)
    child0 = _children_cpu()
    handle = ckpt.save(state, step=i, blocking=False)
    during = window(train, handle.done, 600.0)
    ckpt.wait()
    writer_cpu = _children_cpu() - child0
    after = window(train, lambda: False, seconds)
    base = (before.rate + after.rate) / 2
    around = [before, after]
    return {
        "writer": handle.writer,
        "ratio": during.rate / base,
        "base_steps_per_s": base,
        "steps_per_s": during.rate,
        "write_s": during.wall_s,
        "cpu_share": during.cpu_share,
        "base_cpu_share": statistics.mean(w.cpu_share for w in around),
        "cpu_ms_per_step": during.cpu_ms_per_step,
        "base_cpu_ms_per_step": statistics.mean(w.cpu_ms_per_step for w in around),
        "faults_per_step": during.faults / max(during.steps, 1),
        "base_faults_per_step": sum(w.faults for w in around) / max(before.steps + after.steps, 1),
        "writer_cpu_s": writer_cpu if handle.writer == "process" else None,
        "windows": {"before": asdict(before), "during": asdict(during), "after": asdict(after)},
    }


def rate_rows(
    state: dict[str, Any], directory: Path, args: argparse.Namespace, device: torch.device
) -> list[dict[str, Any]]:
    step = make_step(state, device, args.step_ms)
    big = list(state["big"].values())
    touch = args.touch_mb * (1 << 20) // 4

    def train() -> None:
        step()
        if touch:
            big[0][:touch].add_(1.0)

    for _ in range(5):
        train()
    # Other load on the machine moves the rate: each write is bracketed by a window without
    # one just before and just after, and compared with their mean; the median of the rounds.
    out = []
    for kind in args.writers:
        if kind == "process" and args.device != "cpu":
            continue
        ckpt = Checkpointer(directory / f"rate-{kind}", keep=1)
        with writer(kind):
            start = time.perf_counter()
            ckpt.save(state, step=0, blocking=False)  # buffers allocated, file written
            ckpt.wait()
            last_write_s = time.perf_counter() - start
            rounds = []
            for i in range(1, args.rate_rounds + 1):
                # The windows around a write last about as long as the last write did (at
                # least --seconds, at most a minute), so the load they see is the write's.
                seconds = min(max(args.seconds, last_write_s), max(args.seconds, 60.0))
                rounds.append(rate_round(ckpt, state, train, i, seconds))
                last_write_s = rounds[-1]["write_s"]
        ratios = [r["ratio"] for r in rounds]
        out.append(
            {
                "what": f"during a {rounds[0]['writer']} write",
                "writer": rounds[0]["writer"],
                "ratio": statistics.median(ratios),
                "ratios": ratios,
                "rounds": rounds,
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
    step = make_step(state, device, 10)
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
            str(tensor_device(args)),
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


def rate_lines(rates: list[dict[str, Any]], step_ms: float) -> list[str]:
    """The steps/s table, then where the loop's time went in each round."""
    lines = [
        "",
        f"training steps/s during a write vs around it (a {step_ms:g} ms training step)",
        f"{'':<24} {'ratio (median)':>14}   rounds",
    ]
    for r in rates:
        rounds = " ".join(f"{x:.1%}" for x in r["ratios"])
        lines.append(f"{r['what']:<24} {r['ratio']:>14.1%}   {rounds}")
    lines += [
        "",
        "where the loop's time went, during the write / around it:",
        f"{'writer':<9} {'steps/s':>13} {'CPU share':>11} {'CPU ms/step':>13} "
        f"{'faults/step':>13} {'write':>7} {'writer CPU':>10}",
    ]
    for r in rates:
        for x in r["rounds"]:
            cpu = "-" if x["writer_cpu_s"] is None else f"{x['writer_cpu_s']:.2f} s"
            lines.append(
                f"{r['writer']:<9} {x['steps_per_s']:>6.1f}/{x['base_steps_per_s']:<6.1f} "
                f"{x['cpu_share']:>5.2f}/{x['base_cpu_share']:<5.2f} "
                f"{x['cpu_ms_per_step']:>6.1f}/{x['base_cpu_ms_per_step']:<6.1f} "
                f"{x['faults_per_step']:>6.0f}/{x['base_faults_per_step']:<6.0f} "
                f"{x['write_s']:>5.1f} s {cpu:>10}"
            )
    return lines


def report(result: dict[str, Any]) -> str:
    lines = [
        f"checkpoint_bench: {result['size_mb']} MB state on {result['device']}, "
        f"{result['repeats']} repeats, same directory ({result['directory']})"
        + (
            f" -- DRY RUN of the --device {result['device_type']} plan on the CPU: the "
            "figures mean nothing"
            if result.get("dry_run")
            else ""
        ),
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
    lines += rate_lines(result["rates"], result["settings"].get("step_ms", 10.0))
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
    p.add_argument("--rate-rounds", type=int, default=3)
    p.add_argument("--touch-mb", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--writers", default="process,thread")
    p.add_argument(
        "--skip",
        default="",
        metavar="PARTS",
        help=f"parts not to run, comma-separated: {', '.join(SKIPPABLE)}",
    )
    p.add_argument("--agree-steps", type=int, default=300)
    p.add_argument("--dir", type=Path, default=None)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="seconds, on the CPU: the --device run's plan (writers, targets, report) on a "
        "4 MB CPU state, so a test checks the CUDA run's code without a GPU",
    )
    args = p.parse_args(argv)
    if args.dry_run:
        args.size_mb, args.repeats, args.rate_rounds = min(args.size_mb, 4), 1, 1
        args.seconds, args.step_ms, args.agree_steps = 0.2, 2.0, 20
    args.writers = [w for w in args.writers.split(",") if w]
    bad = [w for w in args.writers if w not in WRITERS]
    if bad or min(args.size_mb, args.repeats, args.rate_rounds) < 1:
        p.error(f"--writers takes {WRITERS}; --size-mb, --repeats and --rate-rounds must be >= 1")
    args.skip = {s for s in args.skip.split(",") if s}
    unknown = sorted(args.skip - set(SKIPPABLE))
    if unknown:
        p.error(f"--skip takes {', '.join(SKIPPABLE)}; got {', '.join(map(repr, unknown))}")
    return args


def tensor_device(args: argparse.Namespace) -> torch.device:
    """Where the state lives: ``--device``, or the CPU in a ``--dry-run``."""
    return torch.device("cpu" if args.dry_run else args.device)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    device = tensor_device(args)
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
        "device_type": args.device,  # the plan's (a --dry-run's tensors are on the CPU)
        "dry_run": args.dry_run,
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
