"""How fast does trainperf.ddp.launch start a job, and what does wrap_model cost per step?

1. Start-up: wall time from the call to the first completed all_reduce on every rank, and
   until the call returns (teardown included), for ``launch`` (spawn and fork) and for
   ``torchrun --standalone`` running a plain ``init_process_group`` script, on the same
   job. Each is repeated; the table shows the median and the minimum.
2. Per-step time of a model wrapped by ``wrap_model`` versus hand-written
   ``DistributedDataParallel(model.to(device), device_ids=...)``: same model, same data,
   timed in alternating rounds inside one launch (CUDA synchronised around each round).
3. What hang detection (``hang_timeout``) costs a training step of about 10 ms: a DDP step
   (forward, backward, optimizer step) plus ``--collectives`` Python collectives, timed in
   alternating rounds with the rank's instrumentation installed and removed, inside one
   launch; and the instrumentation's own cost per wrapped collective and per optimizer step.

    python benchmarks/launch_bench.py                     # CPU: 2 gloo ranks
    python benchmarks/launch_bench.py --backend nccl      # GPU: one rank per GPU
    python benchmarks/launch_bench.py --json out.json
    python benchmarks/launch_bench.py --only-detection    # just part 3

Prints a table and records the settings it ran with.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# Spawned workers re-import this file as __mp_main__: keep the top level light and guarded.


def _first_all_reduce() -> float:
    import torch
    import torch.distributed as dist

    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    t = torch.ones(1, device=device)
    dist.all_reduce(t)
    if device == "cuda":
        torch.cuda.synchronize()
    return time.time()


def _torchrun_worker(out_dir: str, backend: str) -> None:
    """What a plain torchrun script does: init from the environment, one all_reduce."""
    import torch
    import torch.distributed as dist

    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend)
    try:
        done = _first_all_reduce()
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{os.environ['RANK']}.txt").write_text(repr(done))


def _time_launch(nprocs: int, backend: str, start_method: str) -> tuple[float, float]:
    from trainperf.ddp import launch_all

    t0 = time.time()
    done = launch_all(_first_all_reduce, nprocs=nprocs, backend=backend, start_method=start_method)
    return max(done) - t0, time.time() - t0


def _time_torchrun(nprocs: int, backend: str) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as out:
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
        env["OMP_NUM_THREADS"] = env.get("OMP_NUM_THREADS", "1")  # silence torchrun's banner
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(nprocs),
            __file__, "--torchrun-worker", out, "--backend", backend,
        ]  # fmt: skip
        t0 = time.time()
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, timeout=300)
        total = time.time() - t0
        done = [float(p.read_text()) for p in Path(out).glob("rank*.txt")]
    if len(done) != nprocs:
        raise RuntimeError(f"torchrun finished but {len(done)} of {nprocs} ranks reported")
    return max(done) - t0, total


def _make_model(width: int, depth: int) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 1))


def _step_times(width: int, depth: int, batch: int, steps: int, rounds: int) -> dict[str, Any]:
    """Runs on every rank: alternate rounds of wrap_model and hand-written DDP steps."""
    import torch
    import torch.distributed as dist
    from torch import nn

    import trainperf.ddp as ddp

    cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    wrapped = ddp.wrap_model(_make_model(width, depth))
    by_hand = nn.parallel.DistributedDataParallel(
        _make_model(width, depth).to(device), device_ids=[device.index] if cuda else None
    )
    g = torch.Generator().manual_seed(ddp.rank())
    x = torch.randn(batch, width, generator=g).to(device)
    y = torch.randn(batch, 1, generator=g).to(device)
    models = {"wrap_model": wrapped, "hand-written DDP": by_hand}
    optims = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in models.items()}

    def run(name: str, n: int) -> float:
        model, opt = models[name], optims[name]
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            opt.zero_grad(set_to_none=True)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        if cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) / n

    for name in models:  # warm-up, not recorded
        run(name, max(3, steps // 4))
    per_step: dict[str, list[float]] = {name: [] for name in models}
    for r in range(rounds):
        order = list(models) if r % 2 == 0 else list(reversed(models))
        for name in order:
            per_step[name].append(run(name, steps))
    return {"per_step_s": per_step, "type": type(wrapped).__name__}


def _instrumentation_cost(calls: int) -> dict[str, float]:
    """Seconds per call of a wrapped collective's bookkeeping and of the step hook."""
    import torch

    from trainperf.ddp import _progress

    tracker = _progress._installed[0]
    t = torch.ones(1)

    def nothing(tensor: Any) -> None:
        return None

    wrapped = _progress._wrap("all_reduce", nothing)
    results = {}
    for name, fn in (("plain", nothing), ("wrapped", wrapped)):
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn(t)
            best = min(best, (time.perf_counter() - t0) / calls)
        results[name] = best
    t0 = time.perf_counter()
    for _ in range(calls):
        tracker.step()
    results["step_hook"] = (time.perf_counter() - t0) / calls
    return {
        "collective_s": results["wrapped"] - results["plain"],
        "step_hook_s": results["step_hook"],
    }


def _detection_overhead(
    step_ms: float, collectives: int, steps: int, rounds: int
) -> dict[str, Any]:
    """Runs on every rank (launched with hang_timeout on): alternate rounds with the rank's
    instrumentation installed and removed, on a step calibrated to about ``step_ms``."""
    import torch
    import torch.distributed as dist
    from torch import nn

    import trainperf.ddp as ddp
    from trainperf.ddp import _progress

    tracker = _progress._installed[0]
    torch.manual_seed(0)
    model = ddp.wrap_model(_make_model(256, 2))
    device = next(model.parameters()).device
    cuda = device.type == "cuda"
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(32, 256, device=device), torch.randn(32, 1, device=device)
    a = torch.randn(128 if not cuda else 2048, 128 if not cuda else 2048, device=device)

    def step(work: int) -> None:
        for _ in range(work):
            torch.mm(a, a)
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        for _ in range(collectives):
            dist.all_reduce(loss.detach())

    def timed(work: int, n: int) -> float:
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            step(work)
        if cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) / n

    work = 0
    for _ in range(8):  # calibrate the compute so one step takes about step_ms
        per = timed(max(work, 1), 5)
        work = max(1, round(max(work, 1) * step_ms / 1e3 / per))
    agreed = torch.tensor([work], device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    work = int(agreed.item())
    per_step: dict[str, list[float]] = {"off": [], "on": []}
    for r in range(rounds):
        for mode in ("on", "off") if r % 2 else ("off", "on"):
            if mode == "off":
                _progress.uninstall()
            dist.barrier()
            per_step[mode].append(timed(work, steps))
            if mode == "off":
                _progress.install(tracker)
    cost = _instrumentation_cost(20000)
    return {"per_step_s": per_step, "work": work, **cost}


def _report_detection(results: list[dict[str, Any]], collectives: int) -> dict[str, Any]:
    off = statistics.median(t for r in results for t in r["per_step_s"]["off"])
    on = statistics.median(t for r in results for t in r["per_step_s"]["on"])
    # Each round times both, back to back: the paired ratio cancels the host's drift.
    ratios = sorted(
        b / a
        for r in results
        for a, b in zip(r["per_step_s"]["off"], r["per_step_s"]["on"], strict=True)
    )
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    paired = statistics.median(ratios)
    collective_s = statistics.median(r["collective_s"] for r in results)
    hook_s = statistics.median(r["step_hook_s"] for r in results)
    accounted = (collectives * collective_s + hook_s) / off
    print(
        f"\nHang detection on a {off * 1e3:.1f} ms DDP step with {collectives} Python "
        f"collectives, {len(ratios)} alternating rounds per rank"
    )
    print(f"{'instrumentation':24} {'ms/step median':>15}")
    print(f"{'removed':24} {_fmt_ms(off):>15}")
    print(f"{'installed':24} {_fmt_ms(on):>15}")
    print(
        f"measured: {(paired - 1) * 100:+.2f} % (median of paired per-round ratios; quartiles "
        f"{(quartiles[0] - 1) * 100:+.1f} .. {(quartiles[2] - 1) * 100:+.1f} %; ratio of "
        f"medians {(on / off - 1) * 100:+.2f} %)"
    )
    print(
        f"bookkeeping: {collective_s * 1e6:.2f} us per collective, {hook_s * 1e6:.2f} us per "
        f"optimizer step = {accounted * 100:.3f} % of the step"
    )
    return {
        "step_s": {"off": off, "on": on},
        "measured_overhead": paired - 1,
        "ratio_of_medians": on / off - 1,
        "per_round_ratios": ratios,
        "collective_s": collective_s,
        "step_hook_s": hook_s,
        "accounted_overhead": accounted,
    }


def _fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:9.1f}"


def _settings(args: argparse.Namespace, nprocs: int) -> dict[str, Any]:
    return {**vars(args), "json": str(args.json), "nprocs": nprocs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    parser.add_argument("--nprocs", type=int, default=None, help="default: 2 (gloo), GPUs (nccl)")
    parser.add_argument("--repeats", type=int, default=5, help="start-ups per launcher")
    parser.add_argument("--steps", type=int, default=30, help="steps per timed round")
    parser.add_argument("--rounds", type=int, default=6, help="alternating timed rounds")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--skip-torchrun", action="store_true")
    parser.add_argument("--only-detection", action="store_true", help="only part 3")
    parser.add_argument("--step-ms", type=float, default=10.0, help="part 3's step time")
    parser.add_argument("--collectives", type=int, default=4, help="per step, in part 3")
    parser.add_argument("--detection-rounds", type=int, default=40)
    parser.add_argument("--detection-steps", type=int, default=10, help="steps per round")
    parser.add_argument("--json", type=Path, default=None, help="also write results here")
    parser.add_argument("--torchrun-worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.torchrun_worker is not None:
        _torchrun_worker(args.torchrun_worker, args.backend)
        return 0

    import torch

    import trainperf.ddp as ddp

    nprocs = args.nprocs or (torch.cuda.device_count() if args.backend == "nccl" else 2)
    detection_results = ddp.launch_all(
        _detection_overhead,
        args.step_ms,
        args.collectives,
        args.detection_steps,
        args.detection_rounds,
        nprocs=nprocs,
        backend=args.backend,
        hang_timeout=300.0,
    )
    detection = _report_detection(detection_results, args.collectives)
    if args.only_detection:
        if args.json is not None:
            args.json.write_text(
                json.dumps({"settings": _settings(args, nprocs), "detection": detection}, indent=2)
            )
        return 0
    launchers: dict[str, Any] = {
        "launch (spawn)": lambda: _time_launch(nprocs, args.backend, "spawn"),
    }
    if args.backend == "gloo":  # fork is for notebooks; CUDA is not initialised here yet
        launchers["launch (fork)"] = lambda: _time_launch(nprocs, args.backend, "fork")
    if not args.skip_torchrun:
        launchers["torchrun --standalone"] = lambda: _time_torchrun(nprocs, args.backend)

    startup: dict[str, dict[str, list[float]]] = {}
    for r in range(args.repeats):  # interleaved, so drift hits every launcher alike
        for name, measure in launchers.items():
            first, total = measure()
            startup.setdefault(name, {"first_all_reduce_s": [], "total_s": []})
            startup[name]["first_all_reduce_s"].append(first)
            startup[name]["total_s"].append(total)
            print(f"  [{r + 1}/{args.repeats}] {name}: {first:.2f} s", file=sys.stderr)

    steps = ddp.launch_all(
        _step_times,
        args.width,
        args.depth,
        args.batch,
        args.steps,
        args.rounds,
        nprocs=nprocs,
        backend=args.backend,
    )
    per_rank = [s["per_step_s"] for s in steps]
    step_median = {
        name: statistics.median(t for rank in per_rank for t in rank[name]) for name in per_rank[0]
    }
    overhead = step_median["wrap_model"] / step_median["hand-written DDP"] - 1
    # Rounds alternate between the two models; per-round ratios show how noisy the host is.
    ratios = sorted(
        w / h
        for rank in per_rank
        for w, h in zip(rank["wrap_model"], rank["hand-written DDP"], strict=True)
    )
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3

    print(f"\nStart-up, {nprocs} rank(s), {args.backend}: seconds from the call to the first")
    print("completed all_reduce on every rank, and until the call returned")
    print(f"{'launcher':24} {'first median':>13} {'first min':>10} {'total median':>13}")
    for name, rec in startup.items():
        first, total = rec["first_all_reduce_s"], rec["total_s"]
        print(
            f"{name:24} {statistics.median(first):13.2f} {min(first):10.2f} "
            f"{statistics.median(total):13.2f}"
        )
    print(
        f"\nPer-step time, MLP {args.depth}x{args.width}, batch {args.batch}/rank, "
        f"{args.rounds} rounds x {args.steps} steps per rank"
    )
    print(f"{'model':24} {'ms/step median':>15}")
    for name, value in step_median.items():
        print(f"{name:24} {_fmt_ms(value):>15}")
    print(
        f"wrap_model overhead: {overhead * 100:+.2f} % (ratio of medians; per-round ratios "
        f"{(quartiles[0] - 1) * 100:+.1f} .. {(quartiles[2] - 1) * 100:+.1f} % between "
        f"quartiles). wrap_model returns a plain {steps[0]['type']}."
    )

    if args.json is not None:
        record = {
            "settings": _settings(args, nprocs),
            "machine": {
                "python": platform.python_version(),
                "torch": torch.__version__,
                "cpus": os.cpu_count(),
                "gpu": torch.cuda.get_device_name(0) if args.backend == "nccl" else None,
            },
            "startup": startup,
            "per_step_s": {"median": step_median, "per_rank": per_rank},
            "wrap_model_overhead": overhead,
            "per_round_ratios": ratios,
            "detection": detection,
        }
        args.json.write_text(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
