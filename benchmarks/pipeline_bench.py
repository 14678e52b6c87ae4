"""Benchmark: images/s of each image_loader backend on one generated folder of JPEGs.

The folder: ``--images`` JPEGs of 500x375 (the ImageNet-like size of the H200 anchors),
textured colour fields saved at quality 90, in 4 classes; or ``--data DIR``. Every backend
runs the *training* transform (random resized crop to 224, flip, normalise) on the same
files, with the same CPU budget (``--threads``, default: this process's usable CPUs):

- ``dali``: ``num_threads = --threads`` (CPU-only mode without a GPU);
- ``nvjpeg``: ``--threads`` reader threads, decode and augment on the GPU (CUDA only);
- ``torchvision``: the DataLoader from ``trainperf.loader.autotune_loader`` with
  ``max_workers = --threads`` (the baseline);
- ``torchvision-wN`` (``--fixed-workers N``): the same DataLoader with ``num_workers=N``
  and persistent workers, untuned, for reference.

Every backend does the same work: the train resize is bilinear and antialiased everywhere (on
DALI's CPU path torch does the resize, see ``trainperf.pipelines._dali``).

Timing: the first epoch is warm-up (pipelines fill, workers start, the autotuner runs
before it); then whole epochs are timed until ``--seconds`` have passed (at least
``--epochs``), between ``torch.cuda.synchronize()`` calls on CUDA. Two per-core figures:
images/s divided by ``--threads``, and images per CPU-second (the CPU time of this process,
all its threads, and its DataLoader workers over the timed epochs), which is the cost per
image and still holds on a machine that other jobs share.

``--train-resnet``: ResNet-50 (``--model``) training, bf16 autocast + channels_last through
``trainperf.amp.MixedPrecision``, SGD, batch ``--batch-size``, fed by the nvjpeg backend
(``--feed-backend``), against the same model on a synthetic batch already on the device.
Target: >= 90 % (on CUDA). With ``--feed-backend torchvision`` (or dali) it also runs on the
CPU, which the test suite uses to check this code path before it spends GPU time; the JSON
records the precision and memory format ``MixedPrecision`` actually chose.

Targets: DALI on the CPU >= 1.5x the autotuned DataLoader per core; nvjpeg-fed ResNet-50 >=
90 % of its synthetic-data images/s.

Usage::

    python benchmarks/pipeline_bench.py [--images 512] [--data DIR] [--threads N]
        [--batch-size 64] [--size 224] [--backends dali,torchvision] [--seconds 10]
        [--tune-budget 30] [--train-resnet] [--feed-backend nvjpeg]
        [--model resnet50] [--warmup 10] [--steps 30] [--json results.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import statistics
import tempfile
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import torch

from trainperf._utils.imports import is_available
from trainperf.limits import usable_cpus
from trainperf.pipelines import ImageLoader, image_loader

TARGET_DALI_VS_LOADER = 1.5
TARGET_FED_VS_SYNTHETIC = 0.90
CLASSES = 4
BACKENDS = ("dali", "nvjpeg", "torchvision")  # the rows; --fixed-workers adds torchvision-wN


@dataclass
class Row:
    backend: str
    device: str
    status: str = "ok"  # ok | skipped | failed
    note: str = ""
    threads: int = 0
    workers: int | None = None
    images_per_s: float | None = None
    per_core: float | None = None
    per_cpu_second: float | None = None
    epochs_timed: int = 0
    setup_s: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------- the folder


def _write_one(args: tuple[str, int, int, int]) -> int:
    from PIL import Image

    path, seed, width, height = args
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = rng.uniform(40, 215, size=3).astype(np.float32)
    waves = [
        40 * np.sin(x / width * rng.uniform(2, 12) + rng.uniform(0, 6))
        + 30 * np.cos(y / height * rng.uniform(2, 12) + rng.uniform(0, 6))
        for _ in range(3)
    ]
    pixels = base[None, None, :] + np.stack(waves, axis=-1)
    # Grain makes the files about 100 KiB, like the photos the H200 anchors were measured on.
    pixels += rng.normal(0, 25, size=pixels.shape).astype(np.float32)
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(path, quality=90)
    return os.path.getsize(path)


def make_folder(root: Path, images: int, *, width: int = 500, height: int = 375) -> int:
    """Write ``images`` JPEGs under ``root/<class>/``; return their total size in bytes."""
    jobs = []
    for i in range(images):
        d = root / f"class{i % CLASSES}"
        d.mkdir(parents=True, exist_ok=True)
        jobs.append((str(d / f"{i:06d}.jpg"), i, width, height))
    with ProcessPoolExecutor(max_workers=max(1, usable_cpus())) as pool:
        return sum(pool.map(_write_one, jobs, chunksize=16))


# --------------------------------------------------------------------------- timing


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cpu_seconds() -> float:
    """CPU time of this process (all threads) and its children, live and reaped."""
    me = psutil.Process()
    total = sum(me.cpu_times()[:4])  # user, system, children_user, children_system
    for child in me.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            total += sum(child.cpu_times()[:2])
    return total


def time_loader(loader: ImageLoader, *, epochs: int, seconds: float) -> tuple[float, float, int]:
    """After a warm-up epoch, whole epochs until enough time has passed.

    Returns:
        (images/s, images per CPU-second of this process and its workers, epochs timed).
        The second is the per-core efficiency, and holds up on a shared, busy machine.
    """
    device = loader.device
    for _ in loader:  # warm-up epoch
        pass
    synchronize(device)
    images, timed = 0, 0
    cpu0, start = cpu_seconds(), time.perf_counter()
    short = False
    while timed < epochs or time.perf_counter() - start < seconds or short:
        for batch, _ in loader:
            images += batch.shape[0]
        timed += 1
        if timed & (timed - 1) == 0:  # after 1, 2, 4, 8, ... epochs
            short = _too_little(cpu0, start)
    synchronize(device)
    wall, cpu = time.perf_counter() - start, cpu_seconds() - cpu0
    if cpu <= 0:
        raise RuntimeError(f"no CPU time measured in {wall:.1f} s ({timed} epochs)")
    return images / wall, images / cpu, timed


# CPU time is counted in clock ticks (10 ms): a tiny epoch can measure none at all (a
# ZeroDivisionError in a smoke run). Epochs go on until this much was measured, checked
# after 1, 2, 4, ... epochs (cpu_seconds() scans every process: checked after each tiny
# epoch, it measured mostly itself), until MAX_TIMING_S after the timing began.
MIN_CPU_S = 0.1
MAX_TIMING_S = 10.0


def _too_little(cpu0: float, start: float) -> bool:
    """Fewer than MIN_CPU_S CPU seconds measured since ``cpu0``, and time left for more."""
    return time.perf_counter() - start < MAX_TIMING_S and cpu_seconds() - cpu0 < MIN_CPU_S


def _feed_kwargs(backend: str, args: argparse.Namespace) -> dict[str, Any]:
    if backend != "torchvision":
        return {}
    return {
        "loader_kwargs": {
            "budget_s": args.tune_budget,
            "progress": False,
            "cache": False,
            "max_workers": args.threads,
        }
    }


def bench_backend(backend: str, args: argparse.Namespace, device: torch.device) -> Row:
    row = Row(backend, str(device), threads=args.threads)
    if backend == "dali" and not is_available("nvidia.dali"):
        row.status, row.note = "skipped", "nvidia-dali is not installed"
        return row
    if backend == "nvjpeg" and device.type != "cuda":
        row.status, row.note = "skipped", "needs a CUDA device"
        return row
    kwargs = _feed_kwargs(backend, args)
    if backend.startswith("torchvision-w"):
        workers = int(backend.removeprefix("torchvision-w"))
        kwargs["loader_kwargs"] = {"num_workers": workers, "persistent_workers": workers > 0}
        backend = "torchvision"
    try:
        start = time.perf_counter()
        loader = image_loader(
            args.data,
            args.batch_size,
            size=args.size,
            backend=backend,  # type: ignore[arg-type]
            device=device,
            num_threads=args.threads,
            shard=None,
            **kwargs,
        )
        row.setup_s = time.perf_counter() - start
        if loader.backend == "torchvision":
            dl = loader.dataloader  # type: ignore[attr-defined]
            row.workers = dl.num_workers
            report = getattr(dl, "tuning_report", None)
            if report is not None:
                row.extra["tuned_kwargs"] = {
                    k: v
                    for k, v in report.best_kwargs.items()
                    if k in ("num_workers", "prefetch_factor", "pin_memory", "persistent_workers")
                }
        ips, per_cpu_s, timed = time_loader(loader, epochs=args.epochs, seconds=args.seconds)
        loader.close()
        row.images_per_s, row.per_cpu_second, row.epochs_timed = ips, per_cpu_s, timed
        row.per_core = ips / args.threads
    except Exception as e:  # a failed backend is a row, not the end of the benchmark
        row.status, row.note = "failed", f"{type(e).__name__}: {e}"[:300]
        traceback.print_exc()
    return row


# --------------------------------------------------------------------------- ResNet-50 training


def train_resnet(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """ResNet bf16 + channels_last images/s: fed by ``--feed-backend`` vs a synthetic batch."""
    import torchvision

    from trainperf.amp import MixedPrecision

    torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    feed = args.feed_backend
    loader = image_loader(
        args.data, args.batch_size, size=args.size, backend=feed, device=device,
        num_threads=args.threads, shard=None, **_feed_kwargs(feed, args),
    )  # fmt: skip
    classes = len(loader.classes)  # --data may hold any number of classes
    mp = MixedPrecision(device, precision="bf16", channels_last=True)
    model = mp.prepare(getattr(torchvision.models, args.model)(weights=None, num_classes=classes))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        x, y = mp.prepare_batch((x, y))
        with mp.autocast():
            loss = loss_fn(model(x), y)
        mp.backward(loss)
        mp.step(opt)
        mp.zero_grad(opt)

    b = args.batch_size
    x = torch.randn(b, 3, args.size, args.size, device=device)
    y = torch.randint(0, classes, (b,), device=device)
    for _ in range(args.warmup):
        step(x, y)
    synchronize(device)
    rounds = []
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(args.steps):
            step(x, y)
        synchronize(device)
        rounds.append(b * args.steps / (time.perf_counter() - start))
    synthetic = statistics.median(rounds)

    for done, (images, labels) in enumerate(loader, start=1):  # warm-up on real batches
        step(images, labels)
        if done >= args.warmup:
            break
    synchronize(device)
    images_seen, steps, start = 0, 0, time.perf_counter()
    while steps < 3 * args.steps:
        for images, labels in loader:
            step(images, labels)
            images_seen += images.shape[0]
            steps += 1
    synchronize(device)
    fed = images_seen / (time.perf_counter() - start)
    loader.close()
    return {
        "model": args.model,
        "precision": "bf16 autocast + channels_last (trainperf.amp.MixedPrecision)",
        # What MixedPrecision really did, not only what was asked for.
        "dtype": str(mp.dtype).removeprefix("torch."),
        "channels_last": mp.uses_channels_last,
        "mixed_precision": repr(mp),
        "batch_size": b,
        "size": args.size,
        "feed_backend": loader.backend,
        "synthetic_images_per_s": synthetic,
        "synthetic_rounds": rounds,
        "fed_images_per_s": fed,
        "fed_steps": steps,
        "ratio": fed / synthetic,
        "target": TARGET_FED_VS_SYNTHETIC,
    }


# --------------------------------------------------------------------------- report


def print_table(rows: list[Row], baseline: Row | None) -> None:
    print(
        f"{'backend':<15} {'device':<7} {'threads':>7} {'workers':>7} {'images/s':>9} "
        f"{'per core':>8} {'per CPU-s':>9} {'vs DataLoader':>13}  note"
    )
    for r in rows:
        ips = f"{r.images_per_s:,.0f}" if r.images_per_s else "-"
        per_core = f"{r.per_core:,.1f}" if r.per_core else "-"
        per_cpu = f"{r.per_cpu_second:,.1f}" if r.per_cpu_second else "-"
        ratio = "-"
        if r.images_per_s and baseline and baseline.images_per_s and baseline.per_cpu_second:
            ratio = (
                f"{r.images_per_s / baseline.images_per_s:.2f}x/"
                f"{(r.per_cpu_second or 0) / baseline.per_cpu_second:.2f}x"
            )
        workers = "-" if r.workers is None else str(r.workers)
        note = r.note if r.status != "ok" else ""
        print(
            f"{r.backend:<15} {r.device:<7} {r.threads:>7} {workers:>7} {ips:>9} "
            f"{per_core:>8} {per_cpu:>9} {ratio:>13}  {note}"
        )
    print("(vs DataLoader: images/s ratio / per-CPU-second ratio)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=512)
    parser.add_argument("--data", type=Path, default=None, help="an existing image folder")
    parser.add_argument("--threads", type=int, default=usable_cpus())
    parser.add_argument("--device", default="auto")
    parser.add_argument("--batch-size", type=int, default=None, help="64 on CPU, 128 on CUDA")
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument(
        "--backends",
        default="dali,nvjpeg,torchvision",
        help=f"comma-separated: {', '.join(BACKENDS)} or torchvision-wN (N workers, untuned)",
    )
    parser.add_argument("--epochs", type=int, default=2, help="timed epochs, at least")
    parser.add_argument("--seconds", type=float, default=10.0, help="timed seconds, at least")
    parser.add_argument("--tune-budget", type=float, default=30.0)
    parser.add_argument("--fixed-workers", type=int, default=None, help="add an untuned row")
    parser.add_argument("--train-resnet", action="store_true")
    parser.add_argument(
        "--feed-backend",
        default="nvjpeg",
        choices=("nvjpeg", "dali", "torchvision"),
        help="the image_loader backend feeding --train-resnet (nvjpeg needs CUDA)",
    )
    parser.add_argument(
        "--model", default="resnet50", choices=("resnet50", "resnet18"), help="--train-resnet"
    )
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    names = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = [n for n in names if n not in BACKENDS and not re.fullmatch(r"torchvision-w\d+", n)]
    if unknown:  # before the images are generated: a typo costs nothing
        parser.error(
            f"--backends takes {', '.join(BACKENDS)} or torchvision-wN (N workers), "
            f"comma-separated; got {', '.join(map(repr, unknown))}"
        )

    from trainperf.device import best_device

    device = best_device() if args.device == "auto" else torch.device(args.device)
    if args.batch_size is None:
        args.batch_size = 128 if device.type == "cuda" else 64
    tmp = None
    if args.data is None:
        tmp = tempfile.TemporaryDirectory(prefix="pipeline_bench_")
        args.data = Path(tmp.name) / "images"
        start = time.perf_counter()
        total = make_folder(args.data, args.images)
        print(
            f"wrote {args.images} JPEGs of 500x375 ({total / args.images / 1024:.0f} KiB each) "
            f"in {time.perf_counter() - start:.1f} s"
        )
    print(
        f"device {device}, {args.threads} threads, batch {args.batch_size}, size {args.size}, "
        f"torch {torch.__version__}"
    )
    if args.fixed_workers is not None:
        names.append(f"torchvision-w{args.fixed_workers}")
    rows = [bench_backend(name, args, device) for name in names]
    baseline = next((r for r in rows if r.backend == "torchvision" and r.images_per_s), None)
    print()
    print_table(rows, baseline)
    dali = next((r for r in rows if r.backend == "dali" and r.images_per_s), None)
    dali_ratio = None
    if dali and baseline and dali.per_cpu_second and baseline.per_cpu_second:
        dali_ratio = dali.per_cpu_second / baseline.per_cpu_second
        verdict = "met" if dali_ratio >= TARGET_DALI_VS_LOADER else "NOT met"
        print(
            f"\nDALI vs autotuned DataLoader, images per CPU-second: {dali_ratio:.2f}x; "
            f"images/s on the same {args.threads} cores: "
            f"{(dali.images_per_s or 0) / (baseline.images_per_s or 1):.2f}x "
            f"(target >= {TARGET_DALI_VS_LOADER}x per core: {verdict})"
        )
    training = None
    if args.train_resnet:
        if args.feed_backend == "nvjpeg" and device.type != "cuda":
            print("\n--train-resnet with --feed-backend nvjpeg needs a CUDA device; skipped")
        else:
            training = train_resnet(args, device)
            verdict = "met" if training["ratio"] >= TARGET_FED_VS_SYNTHETIC else "NOT met"
            layout = "channels_last" if training["channels_last"] else "NOT channels_last"
            print(
                f"\n{args.model} {training['dtype']} {layout} training on {device}, batch "
                f"{args.batch_size}: synthetic {training['synthetic_images_per_s']:,.0f} "
                f"images/s, {training['feed_backend']}-fed "
                f"{training['fed_images_per_s']:,.0f} images/s = "
                f"{training['ratio']:.0%} (target >= {TARGET_FED_VS_SYNTHETIC:.0%}: {verdict})"
            )
    if args.json:
        versions = {"torch": torch.__version__, "python": platform.python_version()}
        for name in ("torchvision", "nvidia.dali"):
            if is_available(name):
                mod = __import__(name, fromlist=["__version__"])
                versions[name] = getattr(mod, "__version__", "?")
        out = {
            "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "device": str(device),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "versions": versions,
            "rows": [asdict(r) for r in rows],
            "dali_vs_dataloader_per_cpu_second": dali_ratio,
            "training": training,
        }
        args.json.write_text(json.dumps(out, indent=2))
        print(f"wrote {args.json}")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
