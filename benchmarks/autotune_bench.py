"""DataLoader autotuner against the exhaustive grid, on four synthetic datasets.

For each dataset: every configuration of the grid (num_workers x prefetch_factor x
pin_memory) is measured with the tuner's own steady-state method (``trainperf.loader.measure``),
then ``tune_loader`` runs from scratch (no cache), twice: with its defaults (no ``step_fn``:
the training step is unknown, so one core is kept for the main process) and told that the
main process only takes batches (``step_fn=lambda batch: None``), which is the situation the
loader-alone grid measures. Each choice is scored with the grid's measurement of the same
configuration, so both sides are timed the same way.

Targets (issue 4): the choice reaches >= 95 % of the grid best, the tuner uses <= 20 % of the
grid's time, and the choice is never slower than ``num_workers=0``.

Datasets:
    jpeg    in-memory JPEGs (~100 KB, 500x375) decoded with PIL, RandomResizedCrop(224) + flip
            + normalise (torchvision transforms v2): CPU-bound, workers pay up to the cores.
    light   in-memory tensors (CIFAR-sized): num_workers=0 should win.
    io      2 ms of simulated read latency per sample (sleep): more workers than cores pay.
    memory  3 MiB float samples built from a shared base: memory-bandwidth and /dev/shm heavy.

Usage:
    python benchmarks/autotune_bench.py                      # all four, grid 0..8 workers
    python benchmarks/autotune_bench.py --quick              # smoke run (about a minute)
    python benchmarks/autotune_bench.py --datasets jpeg --batch-size 128 \\
        --workers 0,8,12,14,15,16,24 --prefetch 2 --pin true --json out.json
                                      # 16-core GPU host, about 3 minutes (reduced grid)
    python benchmarks/autotune_bench.py --adapt [adapt_bench options]
                                      # the adaptive loader (adapt=True) against fixed
                                      # settings: from num_workers=0, CPUs halved, a CPU
                                      # hog (benchmarks/adapt_bench.py; about 8 minutes)
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import math
import os
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from trainperf.limits import host_limits, usable_cpus
from trainperf.loader import CandidateResult, TuningReport, measure, tune_loader

# --------------------------------------------------------------------------- datasets


def make_jpegs(count: int, seed: int = 0) -> list[bytes]:
    """ImageNet-like JPEGs: 500x375, smooth structure plus texture, about 100 KB each."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        small = rng.integers(0, 256, (63, 84, 3), dtype=np.uint8)
        img = Image.fromarray(small).resize((500, 375), Image.BICUBIC)
        pixels = np.asarray(img).astype(np.float32) + rng.normal(0, 10, (375, 500, 3))
        buf = io.BytesIO()
        Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(buf, "JPEG", quality=92)
        out.append(buf.getvalue())
    return out


class JpegDataset(Dataset[tuple[torch.Tensor, int]]):
    def __init__(self, length: int, unique: int = 64) -> None:
        import torchvision.transforms.v2 as T

        self.jpegs = make_jpegs(unique)
        self.length = length
        self.transform = T.Compose(
            [
                T.RandomResizedCrop(224, antialias=True),
                T.RandomHorizontalFlip(),
                T.ToImage(),
                T.ToDtype(torch.float32, scale=True),
                T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
            ]
        )

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        from PIL import Image

        img = Image.open(io.BytesIO(self.jpegs[i % len(self.jpegs)])).convert("RGB")
        return self.transform(img), i % 1000


class LightDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, length: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(length, 3, 32, 32, generator=g)
        self.y = torch.randint(0, 10, (length,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class IoDataset(Dataset[tuple[torch.Tensor, int]]):
    def __init__(self, length: int, latency_s: float = 0.002) -> None:
        self.length = length
        self.latency_s = latency_s

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        time.sleep(self.latency_s)  # a network or disk read
        return torch.full((256,), float(i)), i % 10


class MemoryDataset(Dataset[torch.Tensor]):
    def __init__(self, length: int, side: int = 512) -> None:
        self.length = length
        self.base = torch.rand(3, side, side)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.base * (1.0 + (i % 7) / 100)


DATASETS = ("jpeg", "light", "io", "memory")


def build(name: str, quick: bool) -> tuple[Dataset[Any], int]:
    """(dataset, default batch size)."""
    if name == "jpeg":
        return JpegDataset(256 if quick else 1024), 16
    if name == "light":
        return LightDataset(5000 if quick else 20000), 64
    if name == "io":
        return IoDataset(512 if quick else 2048), 32
    if name == "memory":
        return MemoryDataset(128 if quick else 512), 16
    raise ValueError(f"unknown dataset {name!r}; choices: {', '.join(DATASETS)}")


# --------------------------------------------------------------------------- runs


def measure_grid(
    ds: Any, bs: int, workers: list[int], prefetch: list[int], pins: list[bool], device: Any
) -> tuple[list[CandidateResult], float]:
    start = time.perf_counter()
    rows = []
    for pin in pins:
        for n in workers:
            for pf in [None] if n == 0 else prefetch:
                r = measure(
                    ds,
                    bs,
                    {},
                    num_workers=n,
                    prefetch_factor=pf,
                    pin_memory=pin,
                    deadline=math.inf,
                    hang_timeout_s=120.0,
                    device=device,
                )
                rows.append(r)
                rate = "-" if r.samples_per_s is None else f"{r.samples_per_s:,.0f}"
                print(
                    f"    grid {r.label():<32} {rate:>10} samples/s  {r.elapsed_s:5.1f} s",
                    file=sys.stderr,
                )
    return rows, time.perf_counter() - start


def lookup(
    rows: list[CandidateResult], n: int, pf: int | None, pin: bool
) -> CandidateResult | None:
    for r in rows:
        if (r.num_workers, r.prefetch_factor, r.pin_memory) == (n, pf, pin) and r.ok:
            return r
    return None


def idle_step(batch: Any) -> None:
    """The grid's own training step: none. The main process only takes batches."""


MODES = {
    # No step_fn: the training step is unknown, so one core is kept for the main process.
    "default": None,
    # step_fn that does nothing: the situation the loader-alone grid measures.
    "loader alone": idle_step,
}


def tune_once(
    ds: Any, bs: int, args: argparse.Namespace, device: torch.device, step_fn: Any
) -> tuple[TuningReport, float]:
    t0 = time.perf_counter()
    report = tune_loader(
        ds,
        bs,
        device=device,
        max_workers=max(args.workers),
        cache=False,
        progress=False,
        budget_s=args.budget,
        step_fn=step_fn,
    )
    return report, time.perf_counter() - t0


def run_one(name: str, args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    ds, default_bs = build(name, args.quick)
    bs = args.batch_size or default_bs
    cuda = device.type == "cuda"
    pins = {"both": [True, False], "true": [True], "false": [False]}[args.pin] if cuda else [False]
    print(f"[{name}] batch_size={bs}", file=sys.stderr)

    tuned_runs = {}
    for mode, step_fn in MODES.items():
        report, tune_s = tune_once(ds, bs, args, device, step_fn)
        kw = report.best_kwargs
        choice = (kw["num_workers"], kw.get("prefetch_factor"), kw["pin_memory"])
        print(f"    tuner ({mode}) chose {choice} in {tune_s:.1f} s", file=sys.stderr)
        tuned_runs[mode] = (report, tune_s, choice)

    rows, grid_s = measure_grid(ds, bs, args.workers, args.prefetch, pins, device)
    ok = [r for r in rows if r.ok]
    best = max(ok, key=lambda r: r.samples_per_s or 0.0)
    zero = lookup(rows, 0, None, pins[0]) or lookup(rows, 0, None, False)
    best_rate = best.samples_per_s or math.nan
    zero_rate = (zero.samples_per_s if zero else None) or math.nan
    out = []
    for mode, (report, tune_s, choice) in tuned_runs.items():
        # Grid configurations whose workers demanded more cores than the tuner left them
        # (after the main process's share) are outside its space.
        budget = report.worker_cpus + 0.5
        allowed = [r for r in ok if r.num_workers == 0 or (r.worker_cpu or 0.0) <= budget]
        best_in = max(allowed, key=lambda r: r.samples_per_s or 0.0)
        tuned = lookup(rows, *choice)
        if tuned is None:  # the tuner chose something outside the grid: measure it the same way
            tuned = measure(
                ds,
                bs,
                {},
                num_workers=choice[0],
                prefetch_factor=choice[1],
                pin_memory=choice[2],
                deadline=math.inf,
                device=device,
            )
        tuned_rate = tuned.samples_per_s or math.nan
        out.append(
            {
                "dataset": name,
                "mode": mode,
                "batch_size": bs,
                "grid_best": best.label(),
                "grid_best_samples_per_s": best_rate,
                "grid_best_in_cpu_budget": best_in.label(),
                "grid_best_in_cpu_budget_samples_per_s": best_in.samples_per_s,
                "ratio_to_grid_best_in_cpu_budget": tuned_rate
                / (best_in.samples_per_s or math.nan),
                "worker_cpus": report.worker_cpus,
                "main_cores": report.main_cores,
                "grid_s": grid_s,
                "grid_workers": args.workers,
                "grid_prefetch": args.prefetch,
                "grid_pins": pins,
                "grid_configs": len(rows),
                "tuned": tuned.label(),
                "tuned_persistent_workers": report.best_kwargs.get("persistent_workers"),
                "tuned_samples_per_s": tuned_rate,
                "tuner_own_samples_per_s": report.samples_per_s,
                "tuner_s": tune_s,
                "tuner_candidates": len(report.candidates),
                "zero_workers_samples_per_s": zero_rate,
                "ratio_to_grid_best": tuned_rate / best_rate,
                "time_fraction": tune_s / grid_s,
                "ratio_to_zero_workers": tuned_rate / zero_rate,
                "grid": [asdict(r) for r in rows],
                "tuner_report": str(report),
            }
        )
    return out


def table(results: list[dict[str, Any]]) -> str:
    head = (
        f"{'dataset':<7} {'bs':>4} {'grid best':<30} {'samples/s':>10} {'grid s':>7} "
        f"{'tuner':<12} {'tuned':<30} {'samples/s':>10} {'tune s':>7} {'vs best':>7} "
        f"{'vs best*':>8} {'time':>6} {'vs nw=0':>7}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(
            f"{r['dataset']:<7} {r['batch_size']:>4} {r['grid_best']:<30} "
            f"{r['grid_best_samples_per_s']:>10,.0f} {r['grid_s']:>7.1f} {r['mode']:<12} "
            f"{r['tuned']:<30} {r['tuned_samples_per_s']:>10,.0f} {r['tuner_s']:>7.1f} "
            f"{100 * r['ratio_to_grid_best']:>6.1f}% "
            f"{100 * r['ratio_to_grid_best_in_cpu_budget']:>7.1f}% "
            f"{100 * r['time_fraction']:>5.1f}% {r['ratio_to_zero_workers']:>6.2f}x"
        )
    lines.append(
        "tuner default: no step_fn, one core kept for the main process; loader alone: "
        "step_fn=lambda batch: None, the grid's own situation (the main process only takes "
        "batches)"
    )
    lines.append(
        "vs best*: against the best grid configuration whose workers stay within the "
        "cores the tuner left them (its space)"
    )
    lines.append("targets: vs best >= 95 %, time <= 20 %, vs nw=0 >= 1.00x")
    return "\n".join(lines)


def parse_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def adapt_main(argv: list[str]) -> int:
    """``--adapt``: the adaptive loader's scenarios, run by ``benchmarks/adapt_bench.py``'s
    own code (its options follow ``--adapt``)."""
    path = Path(__file__).with_name("adapt_bench.py")
    spec = importlib.util.spec_from_file_location("adapt_bench", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules["adapt_bench"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return int(module.main(argv))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--adapt" in argv:
        return adapt_main([a for a in argv if a != "--adapt"])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--adapt",
        action="store_true",
        help="benchmark the adaptive loader instead (benchmarks/adapt_bench.py; its "
        "options, e.g. --scenarios warmup --duration 60, follow)",
    )
    p.add_argument(
        "--datasets",
        default="jpeg,light,io,memory",
        help="comma-separated subset of jpeg,light,io,memory",
    )
    p.add_argument(
        "--workers",
        type=parse_list,
        default=None,
        help="grid worker counts, e.g. 0,1,2,4,8 (default 0..min(4 x usable CPUs, 8))",
    )
    p.add_argument("--prefetch", type=parse_list, default=[2, 4], help="grid prefetch factors")
    p.add_argument(
        "--pin",
        choices=["both", "true", "false"],
        default="both",
        help="grid pin_memory settings on CUDA (ignored elsewhere)",
    )
    p.add_argument("--batch-size", type=int, default=None, help="override every dataset's")
    p.add_argument("--budget", type=float, default=60.0, help="tuner budget_s")
    p.add_argument("--device", default=None, help="cpu, cuda, ... (default: best_device())")
    p.add_argument("--quick", action="store_true", help="smoke run: small grid and datasets")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.datasets.split(",") if n.strip()]
    unknown = [n for n in names if n not in DATASETS]
    if unknown:  # before any runs, rather than after the ones before it
        p.error(f"unknown datasets {unknown}; choose from {', '.join(DATASETS)}")

    from trainperf.device import best_device

    device = torch.device(args.device) if args.device else best_device()
    cpus = usable_cpus(int(os.environ.get("LOCAL_WORLD_SIZE") or 1))
    if args.workers is None:
        args.workers = list(range(0, 3)) if args.quick else list(range(0, min(4 * cpus, 8) + 1))
    if args.quick:
        args.prefetch = args.prefetch[:1]
    if 0 not in args.workers:
        args.workers = [0, *args.workers]
    env = {
        "host": platform.node(),
        "cpus": cpus,
        "limits": asdict(host_limits()),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
        "load_average": os.getloadavg(),
        "workers": args.workers,
        "prefetch": args.prefetch,
    }
    print(
        f"usable CPUs {cpus}, device {device}, grid workers {args.workers} x prefetch "
        f"{args.prefetch}, load average {env['load_average']}",
        file=sys.stderr,
    )
    results = [row for name in names for row in run_one(name, args, device)]
    env["load_average_after"] = os.getloadavg()
    print(table(results))
    for r in results:
        print(f"\n[{r['dataset']}, tuner {r['mode']}] report:\n{r['tuner_report']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": env, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
