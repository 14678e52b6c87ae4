"""Adaptive loader vs fixed settings on an I/O-latency-bound dataset (CPU only).

python benchmarks/adapt_bench.py [--samples 1200] [--epochs 4]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.utils.data import DataLoader, Dataset

from trainperf.loader import AdaptiveDataLoader


class Latency(Dataset[torch.Tensor]):
    def __init__(self, n: int, latency_s: float) -> None:
        self.n, self.latency_s = n, latency_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(self.latency_s)
        return torch.full((64,), float(i))


def run(loader: DataLoader, epochs: int, step_s: float) -> list[float]:
    rates = []
    for _ in range(epochs):
        t, n = time.perf_counter(), 0
        for b in loader:
            time.sleep(step_s)
            n += len(b)
        rates.append(n / (time.perf_counter() - t))
    return rates


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--samples", type=int, default=1200)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--latency-ms", type=float, default=2.0)
    p.add_argument("--step-ms", type=float, default=1.0)
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    ds = Latency(a.samples, a.latency_ms / 1000)
    step = a.step_ms / 1000
    out: dict[str, object] = {}
    for n in (0, 2, 4, 8):
        kw = {"prefetch_factor": 2, "persistent_workers": True} if n else {}
        out[f"fixed workers={n}"] = run(DataLoader(ds, batch_size=16, num_workers=n, **kw), 2, step)
    t0 = time.perf_counter()
    loader = AdaptiveDataLoader(ds, batch_size=16, num_workers=0)
    out["adaptive"] = run(loader, a.epochs, step)
    wall = time.perf_counter() - t0
    best = max(max(v) for k, v in out.items() if k.startswith("fixed"))  # type: ignore[arg-type]
    print(f"{'loader':<18} samples/s per epoch")
    for k, v in out.items():
        print(f"{k:<18} " + "  ".join(f"{r:7,.0f}" for r in v))  # type: ignore[union-attr]
    last = out["adaptive"][-1]  # type: ignore[index]
    print(
        f"adaptive last epoch: {100 * last / best:.0f} % of the best fixed ({best:,.0f}/s), "
        f"{wall:.1f} s of training"
    )
    print("tuning_history:")
    for c in loader.tuning_history:
        print(" ", c)
    if a.json:
        print(json.dumps({"rates": out, "history": [c.to_dict() for c in loader.tuning_history]}))


if __name__ == "__main__":
    main()
