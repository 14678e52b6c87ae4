"""Benchmark: ``trainperf.to_device`` against a hand-written move of the same nested batch.

The batch holds 100 tensors of mixed sizes and dtypes (float images and features, int64
labels and indices, bool masks) in a dict of lists, tuples and a nested dict, plus a few
non-tensor leaves. The hand-written baseline knows the batch's layout, so it does no type
checks at all: the ratio is the whole price of to_device's generic traversal.

Configurations (median of several rounds, each timing many calls):

- ``cpu, bf16 cast``: floats cast to bfloat16 on the CPU, ints and bools kept: real work.
- ``meta``: a device change that copies no data: almost pure per-tensor overhead.
- ``cpu, no-op``: everything already in place, so ``.to`` returns its input: the traversal
  alone, to_device's worst case.
- with CUDA: pinned CPU tensors to the GPU with ``non_blocking=True`` (with and without a
  bf16 cast), synchronised at the end of each round.

Usage::

    python benchmarks/to_device_bench.py [--device cuda:0] [--reps 200] [--rounds 9]
                                         [--json results.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from trainperf.device import to_device

TARGET = 1.2  # to_device may take at most this many times the hand-written move


def make_batch(pin: bool = False) -> dict[str, Any]:
    """100 tensors: 32 + 16 + 16 + 16 + 8 + 8 + 4."""
    g = torch.Generator().manual_seed(0)

    def f(*shape: int) -> torch.Tensor:
        t = torch.randn(*shape, generator=g)
        return t.pin_memory() if pin else t

    def i(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        t = torch.randint(0, 1000, shape, generator=g).to(dtype)
        return t.pin_memory() if pin else t

    return {
        "images": [f(3, 32, 32) for _ in range(32)],
        "labels": [i(1) for _ in range(16)],
        "masks": tuple(i(64, dtype=torch.bool) for _ in range(16)),
        "features": {
            "dense": [f(256) for _ in range(16)],
            "indices": tuple(i(32) for _ in range(8)),
            "embeddings": tuple(f(16, 16) for _ in range(8)),
        },
        "pairs": [(f(128), i(1)), (f(128), i(1))],
        "info": {"ids": [f"sample-{k}" for k in range(8)], "epoch": 3},
    }


def count_tensors(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return 1
    if isinstance(obj, dict):
        return sum(count_tensors(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(count_tensors(v) for v in obj)
    return 0


def hand_written(
    batch: dict[str, Any], dev: torch.device, dtype: torch.dtype | None, nb: bool
) -> dict[str, Any]:
    """What a user writes for this exact batch: no type checks, floats cast, ints kept."""
    feats = batch["features"]
    if dtype is None:
        return {
            "images": [t.to(dev, non_blocking=nb) for t in batch["images"]],
            "labels": [t.to(dev, non_blocking=nb) for t in batch["labels"]],
            "masks": tuple([t.to(dev, non_blocking=nb) for t in batch["masks"]]),
            "features": {
                "dense": [t.to(dev, non_blocking=nb) for t in feats["dense"]],
                "indices": tuple([t.to(dev, non_blocking=nb) for t in feats["indices"]]),
                "embeddings": tuple([t.to(dev, non_blocking=nb) for t in feats["embeddings"]]),
            },
            "pairs": [
                (x.to(dev, non_blocking=nb), y.to(dev, non_blocking=nb)) for x, y in batch["pairs"]
            ],
            "info": {"ids": list(batch["info"]["ids"]), "epoch": batch["info"]["epoch"]},
        }
    return {
        "images": [t.to(dev, dtype, non_blocking=nb) for t in batch["images"]],
        "labels": [t.to(dev, non_blocking=nb) for t in batch["labels"]],
        "masks": tuple([t.to(dev, non_blocking=nb) for t in batch["masks"]]),
        "features": {
            "dense": [t.to(dev, dtype, non_blocking=nb) for t in feats["dense"]],
            "indices": tuple([t.to(dev, non_blocking=nb) for t in feats["indices"]]),
            "embeddings": tuple([t.to(dev, dtype, non_blocking=nb) for t in feats["embeddings"]]),
        },
        "pairs": [
            (x.to(dev, dtype, non_blocking=nb), y.to(dev, non_blocking=nb))
            for x, y in batch["pairs"]
        ],
        "info": {"ids": list(batch["info"]["ids"]), "epoch": batch["info"]["epoch"]},
    }


def same_result(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or (a.device, a.dtype) != (b.device, b.dtype):
            return False
        return a.device.type == "meta" or bool(torch.equal(a.cpu(), b.cpu()))
    if isinstance(a, dict):
        return (
            type(a) is type(b) and a.keys() == b.keys() and all(same_result(a[k], b[k]) for k in a)
        )
    if isinstance(a, (list, tuple)):
        return (
            type(a) is type(b)
            and len(a) == len(b)
            and all(same_result(x, y) for x, y in zip(a, b, strict=True))
        )
    return bool(a == b)


def time_round(fn: Callable[[], Any], reps: int, sync: Callable[[], None]) -> float:
    sync()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - start) / reps


def bench(
    label: str, device: str, dtype: torch.dtype | None, reps: int, rounds: int
) -> dict[str, Any]:
    dev = torch.device(device)
    pin = dev.type == "cuda"
    batch = make_batch(pin=pin)
    assert count_tensors(batch) == 100
    sync: Callable[[], None] = torch.cuda.synchronize if dev.type == "cuda" else lambda: None

    def ours() -> Any:
        return to_device(batch, dev, non_blocking=True, dtype=dtype)

    def theirs() -> Any:
        return hand_written(batch, dev, dtype, True)

    got, want = ours(), theirs()
    sync()
    if not same_result(got, want):
        raise SystemExit(f"{label}: to_device and the hand-written move disagree")
    for _ in range(max(3, reps // 10)):  # warm-up: allocator, caches, lazy init
        ours()
        theirs()
    t_ours: list[float] = []
    t_hand: list[float] = []
    for _ in range(rounds):  # interleaved, so drift hits both alike
        t_ours.append(time_round(ours, reps, sync))
        t_hand.append(time_round(theirs, reps, sync))
    ours_us = statistics.median(t_ours) * 1e6
    hand_us = statistics.median(t_hand) * 1e6
    return {
        "config": label,
        "device": str(dev),
        "dtype": None if dtype is None else str(dtype),
        "pinned_source": pin,
        "to_device_us": round(ours_us, 2),
        "hand_written_us": round(hand_us, 2),
        "ratio": round(ours_us / hand_us, 3),
        "within_target": ours_us / hand_us <= TARGET,
    }


def configurations(device: str | None) -> list[tuple[str, str, torch.dtype | None]]:
    if device is not None:
        return [
            (f"{device}, bf16 cast", device, torch.bfloat16),
            (f"{device}, as is", device, None),
        ]
    configs: list[tuple[str, str, torch.dtype | None]] = [
        ("cpu, bf16 cast", "cpu", torch.bfloat16),
        ("meta", "meta", None),
        ("cpu, no-op", "cpu", None),
    ]
    if torch.cuda.is_available():
        configs += [
            ("cuda, pinned", "cuda", None),
            ("cuda, pinned + bf16", "cuda", torch.bfloat16),
        ]
    return configs


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default=None, help="benchmark only this device (e.g. cuda:0)")
    parser.add_argument("--reps", type=int, default=200, help="calls per timed round")
    parser.add_argument("--rounds", type=int, default=9, help="timed rounds; the median is shown")
    parser.add_argument("--json", metavar="PATH", help="also write the results here")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.reps < 1 or args.rounds < 1:
        raise SystemExit(f"--reps and --rounds must be >= 1, got {args.reps} and {args.rounds}")
    rows = [bench(*cfg, args.reps, args.rounds) for cfg in configurations(args.device)]
    header = f"{'config':<22} {'to_device us':>13} {'hand us':>10} {'ratio':>7}  target <= {TARGET}"
    print(header)
    print("-" * len(header))
    for r in rows:
        verdict = "ok" if r["within_target"] else "OVER"
        print(
            f"{r['config']:<22} {r['to_device_us']:>13.1f} {r['hand_written_us']:>10.1f} "
            f"{r['ratio']:>7.3f}  {verdict}"
        )
    settings = {
        "tensors_per_batch": 100,
        "reps": args.reps,
        "rounds": args.rounds,
        "statistic": "median per-call time over rounds",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "torch_threads": torch.get_num_threads(),
        "cuda_device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    print(
        f"\n{args.rounds} rounds x {args.reps} calls, median; torch {settings['torch']}, "
        f"{settings['torch_threads']} threads"
        + (f", {settings['cuda_device']}" if settings["cuda_device"] else "")
    )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"settings": settings, "results": rows}, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
