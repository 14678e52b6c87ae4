"""Benchmark: does ``trainperf.bench.bench_model`` cost throughput against a bare loop?

Both sides do the same work: the same torchvision model (random init) cast to the
precision, the same synthetic batch already on the device, inference under
``torch.inference_mode()``, the same warm-up batches, then timed iterations of several
batches, each between two ``torch.cuda.synchronize()`` calls. The bare loop is written
out by hand below; the harness is ``bench_model``. Rounds alternate harness and bare loop
so that clock and thermal drift hit both alike; each side's figure is the median of its
rounds' median-iteration throughput.

Target (on a GPU): the harness within 3 % of the bare loop.

Defaults: on CUDA, ResNet-50 fp16, batch 128 at 224 px, 15 batches per iteration (the
seed's 1,920 images), 5 iterations, 3 rounds (about half a minute on an H200); elsewhere a
smoke test at 32 px, batch 2.

Usage::

    python benchmarks/bench_overhead.py [--model resnet50] [--precision fp16] [--device cuda]
        [--batch-size 128] [--image-size 224] [--iterations 5] [--batches-per-iteration 15]
        [--rounds 3] [--json results.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from typing import Any

import torch

from trainperf.bench import bench_model
from trainperf.bench._model import PRECISIONS

TARGET = 0.03


def bare_loop(
    model_name: str,
    precision: str,
    device: torch.device,
    batch_size: int,
    image_size: int,
    iterations: int,
    batches_per_iteration: int,
    warmup_batches: int,
) -> float:
    """The same measurement as bench_model, by hand: median images/s of the iterations."""
    import torchvision

    dtype = PRECISIONS[precision]
    if model_name == "resnet50":
        net = torchvision.models.resnet50(weights=None)
    else:
        net = torchvision.models.vit_b_16(weights=None, image_size=image_size)
    net = net.to(device, dtype).eval()
    x = torch.randn(batch_size, 3, image_size, image_size, device=device, dtype=dtype)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    rates = []
    with torch.inference_mode():
        for _ in range(warmup_batches):
            net(x)
        sync()
        for _ in range(iterations):
            start = time.perf_counter()
            for _ in range(batches_per_iteration):
                net(x)
            sync()
            rates.append(batch_size * batches_per_iteration / (time.perf_counter() - start))
    return statistics.median(rates)


def at_least_one(text: str) -> int:
    """An argparse type: a count >= 1 (0 rounds leaves no median to take)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def main(argv: list[str] | None = None) -> None:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["resnet50", "vit_b_16"], default="resnet50")
    parser.add_argument("--precision", choices=list(PRECISIONS), default="fp16" if cuda else "fp32")
    parser.add_argument("--device", default="cuda" if cuda else "cpu")
    parser.add_argument("--batch-size", type=at_least_one, default=128 if cuda else 2)
    parser.add_argument("--image-size", type=at_least_one, default=224 if cuda else 32)
    parser.add_argument("--iterations", type=at_least_one, default=5 if cuda else 2)
    parser.add_argument("--batches-per-iteration", type=at_least_one, default=15 if cuda else 1)
    parser.add_argument("--rounds", type=at_least_one, default=3 if cuda else 2)
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    warmup = max(2, args.batches_per_iteration)
    common = {
        "batch_size": args.batch_size,
        "image_size": args.image_size,
        "iterations": args.iterations,
        "batches_per_iteration": args.batches_per_iteration,
    }

    harness: list[float] = []
    bare: list[float] = []
    # One untimed round of each first: library loading, cuDNN heuristics, allocator growth.
    bench_model(args.model, args.precision, device=device, warmup_batches=warmup, compare=False,
                **{**common, "iterations": 1})  # fmt: skip
    bare_loop(args.model, args.precision, device, warmup_batches=warmup,
              **{**common, "iterations": 1})  # fmt: skip
    for _ in range(args.rounds):
        result = bench_model(
            args.model, args.precision, device=device, warmup_batches=warmup, compare=False,
            **common,
        )  # fmt: skip
        harness.append(result.images_per_s)
        bare.append(bare_loop(args.model, args.precision, device, warmup_batches=warmup, **common))
    h, b = statistics.median(harness), statistics.median(bare)
    overhead = (b - h) / b
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    print(f"bench_model vs bare loop: {args.model} {args.precision}, batch {args.batch_size} "
          f"at {args.image_size}px, {args.iterations} x {args.batches_per_iteration} batches, "
          f"{args.rounds} rounds, on {name or device}")  # fmt: skip
    print(f"{'side':<12} {'images/s (median)':>18}   rounds")
    print(f"{'harness':<12} {h:>18.1f}   " + ", ".join(f"{r:.1f}" for r in harness))
    print(f"{'bare loop':<12} {b:>18.1f}   " + ", ".join(f"{r:.1f}" for r in bare))
    verdict = "PASS" if overhead <= TARGET else "FAIL"
    note = "" if device.type == "cuda" else " (target applies on a GPU; CPU timings are noisy)"
    print(f"harness overhead: {overhead:+.2%} (target <= {TARGET:.0%}): {verdict}{note}")
    if args.json:
        settings = {**common, "model": args.model, "precision": args.precision}
        settings.update(rounds=args.rounds, warmup_batches=warmup)
        document: dict[str, Any] = {
            "benchmark": "bench_overhead",
            "device": str(device),
            "gpu_name": name if device.type == "cuda" else None,
            "torch": torch.__version__,
            "settings": settings,
            "harness_images_per_s": harness,
            "bare_images_per_s": bare,
            "overhead": overhead,
            "target": TARGET,
            "pass": overhead <= TARGET,
        }
        with open(args.json, "w") as f:
            json.dump(document, f, indent=2)


if __name__ == "__main__":
    main()
