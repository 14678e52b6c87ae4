"""Benchmark: what ``trainperf.watch`` costs a training loop.

The loop is an MLP training step (bf16 autocast on CUDA, fp32 on the CPU, SGD) fed from a
list of batches already on the device, so the step is pure GPU work plus the Python that
launches it. The same loop runs bare and inside ``with trainperf.watch() as w`` with
``w.iter`` and ``w.step()``; rounds alternate the two so that drift hits both alike. Each
round's time is the wall time of all its steps, started after a
``torch.cuda.synchronize()`` and ended by one; each side's figure is its median round. The
watched round's clock runs inside the ``with`` only: entering and leaving it (sampler
thread start and join, NVML start-up, reading the host limits) is a fixed cost per
``with``, measured and reported on its own. The watch's per-step cost is also shown in
microseconds, which is what matters for loops with very short steps.

Two step sizes run by default: ``typical`` (about 10 ms per step on an H200) and ``short``
(about 1 ms: a launch-bound loop, the watch's worst case).

Target (on a GPU, the ``typical`` step): overhead <= 2 %.

Usage::

    python benchmarks/watch_overhead.py [--device cuda] [--steps 300] [--rounds 5]
        [--configs typical,short] [--json results.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from trainperf import watch

TARGET = 0.02
# name -> (batch, width, layers) on CUDA; the CPU gets a token model whatever the name.
CONFIGS = {"typical": (4096, 8192, 6), "short": (256, 4096, 4)}
CPU_SHAPE = (64, 256, 2)


def make_loop(
    device: torch.device, batch: int, width: int, layers: int
) -> tuple[Callable[[torch.Tensor], None], list[torch.Tensor]]:
    model = nn.Sequential(
        *[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(layers)]
    )
    model = model.to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    batches = [torch.randn(batch, width, device=device) for _ in range(4)]
    amp = device.type == "cuda"

    def step(x: torch.Tensor) -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            loss = model(x).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, batches


def cycle(batches: list[torch.Tensor], steps: int) -> Iterable[torch.Tensor]:
    return (batches[i % len(batches)] for i in range(steps))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_bare(step: Callable[[torch.Tensor], None], batches: list[torch.Tensor], steps: int,
              device: torch.device) -> float:  # fmt: skip
    sync(device)
    start = time.perf_counter()
    for x in cycle(batches, steps):
        step(x)
    sync(device)
    return time.perf_counter() - start


def time_watched(step: Callable[[torch.Tensor], None], batches: list[torch.Tensor], steps: int,
                 device: torch.device) -> tuple[float, str]:  # fmt: skip
    with watch(device=device) as w:
        # The clock starts inside the `with`: enter and exit are timed apart (main()).
        sync(device)
        start = time.perf_counter()
        for x in w.iter(cycle(batches, steps)):
            step(x)
            w.step()
        sync(device)
        elapsed = time.perf_counter() - start
    return elapsed, w.report().verdict.kind


def main() -> None:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if cuda else "cpu")
    parser.add_argument("--steps", type=int, default=300 if cuda else 60)
    parser.add_argument("--rounds", type=int, default=5 if cuda else 3)
    parser.add_argument("--configs", default="typical,short")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args()
    configs = [name for name in args.configs.split(",") if name]
    unknown = [name for name in configs if name not in CONFIGS]
    if unknown:
        parser.error(f"unknown configs {unknown}; choose from {', '.join(CONFIGS)}")
    if min(args.steps, args.rounds) < 1:
        parser.error(f"--steps and --rounds must be >= 1, got {args.steps} and {args.rounds}")
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())

    # A watch's fixed cost (sampler thread start and join, reading the host limits) is paid
    # once per `with`, not per step; shown apart from the per-step figures.
    enter_exit = []
    for _ in range(5):
        start = time.perf_counter()
        with watch(device=device):
            pass
        enter_exit.append(time.perf_counter() - start)
    fixed_ms = statistics.median(enter_exit) * 1e3
    rows: list[dict[str, Any]] = []
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"trainperf.watch overhead on {name}: {args.steps} steps x {args.rounds} rounds")
    print(f"{'config':<8} {'step ms':>8} {'bare s':>8} {'watched s':>10} {'overhead':>9} "
          f"{'us/step':>8}  verdict")  # fmt: skip
    for name in configs:
        shape = CONFIGS[name] if device.type == "cuda" else CPU_SHAPE
        step, batches = make_loop(device, *shape)
        time_bare(step, batches, 10, device)  # warm-up: kernels, allocator, autotuning
        bare: list[float] = []
        watched: list[float] = []
        kinds: list[str] = []
        for _ in range(args.rounds):
            bare.append(time_bare(step, batches, args.steps, device))
            seconds, kind = time_watched(step, batches, args.steps, device)
            watched.append(seconds)
            kinds.append(kind)
        b, w = statistics.median(bare), statistics.median(watched)
        overhead = (w - b) / b
        per_step_us = (w - b) / args.steps * 1e6
        print(f"{name:<8} {b / args.steps * 1e3:>8.2f} {b:>8.3f} {w:>10.3f} {overhead:>+9.2%} "
              f"{per_step_us:>8.1f}  {kinds[-1]}")  # fmt: skip
        rows.append({
            "config": name, "shape": {"batch": shape[0], "width": shape[1], "layers": shape[2]},
            "bare_s": bare, "watched_s": watched, "overhead": overhead,
            "per_step_us": per_step_us, "verdicts": kinds,
        })  # fmt: skip
        del step, batches
    print(f"fixed cost of one `with watch()` (enter + exit): {fixed_ms:.1f} ms, not included "
          "above")  # fmt: skip
    typical = next((r for r in rows if r["config"] == "typical"), None)
    if typical is not None:
        verdict = "PASS" if typical["overhead"] <= TARGET else "FAIL"
        note = "" if device.type == "cuda" else " (target applies on a GPU)"
        print(f"typical-step overhead {typical['overhead']:+.2%} (target <= {TARGET:.0%}): "
              f"{verdict}{note}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "watch_overhead", "device": str(device),
                       "torch": torch.__version__, "steps": args.steps, "rounds": args.rounds,
                       "enter_exit_ms": fixed_ms,
                       "target": TARGET, "rows": rows}, f, indent=2)  # fmt: skip


if __name__ == "__main__":
    main()
