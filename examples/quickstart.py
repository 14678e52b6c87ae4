"""trainperf quick start: everything the library does, in one short run.

``make demo`` runs this on an embedded default (no GPU and no data set needed):

1. ``trainperf doctor``'s summary of this machine;
2. a small image-classification set of real JPEG files, generated in a temp folder;
3. the DataLoader autotuner's report on it;
4. a few epochs of a small CNN with ``MixedPrecision`` (auto) under ``trainperf.watch``,
   ending in a verdict on what limits the loop;
5. an atomic ``save_checkpoint``, a reload with ``load_checkpoint`` onto the other available
   device, and a check that the reloaded model gives identical outputs;
6. the same training with ``trainperf.ddp.launch``: one rank per GPU with NCCL, or 2 ranks
   with gloo on the CPU.

Plots (tuning curve, watch timeline) go to the output folder when matplotlib is installed.
On a GPU machine the same command uses the GPU(s) without flags.
"""

from __future__ import annotations

import argparse
import io
import math
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import trainperf as tp
import trainperf.ddp
from trainperf._utils import imports as _imports
from trainperf.loader import tune_loader

CLASSES = ("circle", "square", "stripes", "noise")


# ----------------------------------------------------------------------------- data


def _draw(kind: int, size: int, rng: np.random.Generator) -> np.ndarray:
    """One RGB image of class ``kind``: shapes and textures a small CNN can tell apart."""
    y, x = np.mgrid[0:size, 0:size] / size
    base = rng.uniform(0.1, 0.4, size=3)
    img = np.ones((size, size, 3)) * base
    cx, cy, r = rng.uniform(0.3, 0.7), rng.uniform(0.3, 0.7), rng.uniform(0.15, 0.3)
    colour = rng.uniform(0.6, 1.0, size=3)
    if kind == 0:
        mask = (x - cx) ** 2 + (y - cy) ** 2 < r**2
    elif kind == 1:
        mask = (abs(x - cx) < r) & (abs(y - cy) < r)
    elif kind == 2:
        mask = np.sin(x * rng.uniform(20, 30)) > 0
    else:
        mask = rng.random((size, size)) > 0.5
    img[mask] = colour
    img += rng.normal(0, 0.05, img.shape)
    return (np.clip(img, 0, 1) * 255).astype(np.uint8)


def make_image_folder(root: Path, per_class: int, size: int, seed: int = 0) -> Path:
    """Write an ImageFolder-style tree of real JPEG files under ``root``."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    for label, name in enumerate(CLASSES):
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            Image.fromarray(_draw(label, size, rng)).save(folder / f"{i:04d}.jpg", quality=90)
    return root


class JpegFolder(Dataset[tuple[torch.Tensor, int]]):
    """Decodes JPEGs with PIL in the worker processes, as a typical training script does."""

    def __init__(self, root: Path) -> None:
        self.items = [
            (path, label)
            for label, name in enumerate(CLASSES)
            for path in sorted((root / name).glob("*.jpg"))
        ]
        # Bytes are read once: the demo measures decode + augment, not the temp disk.
        self.blobs = [path.read_bytes() for path, _ in self.items]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        from PIL import Image

        img = np.asarray(Image.open(io.BytesIO(self.blobs[index])).convert("RGB"))
        if torch.rand(()) < 0.5:  # horizontal flip
            img = img[:, ::-1]
        x = torch.from_numpy(img.copy()).permute(2, 0, 1).float().div_(255).sub_(0.5)
        return x, self.items[index][1]


# ----------------------------------------------------------------------------- model


def small_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, len(CLASSES)),
    )


@dataclass
class EpochStats:
    loss: float
    accuracy: float
    samples_per_s: float


def train_epoch(
    model: nn.Module,
    batches: Any,
    mp: tp.MixedPrecision,
    optimizer: torch.optim.Optimizer,
    on_step: Any = None,
) -> EpochStats:
    loss_fn = nn.CrossEntropyLoss()
    model.train()
    start, seen, correct, total = time.perf_counter(), 0, 0, 0.0
    for batch in batches:
        images, labels = mp.prepare_batch(batch)
        with mp.autocast():
            logits = model(images)
            loss = loss_fn(logits, labels)
        mp.backward(loss)
        mp.step(optimizer)
        mp.zero_grad(optimizer)
        seen += labels.numel()
        correct += int((logits.argmax(1) == labels).sum())
        total += float(loss.detach()) * labels.numel()
        if on_step is not None:
            on_step(labels.numel())
    elapsed = time.perf_counter() - start
    return EpochStats(total / max(seen, 1), correct / max(seen, 1), seen / max(elapsed, 1e-9))


# ----------------------------------------------------------------------------- stages


def section(title: str) -> None:
    print(f"\n== {title} " + "=" * max(0, 70 - len(title)), flush=True)


def stage_doctor() -> None:
    section("1. trainperf doctor (summary)")
    report = tp.diagnose()
    counts = {v: sum(c.verdict == v for c in report.checks) for v in ("ok", "warn", "fail", "skip")}
    print(", ".join(f"{n} {v}" for v, n in counts.items()))
    for check in report.checks:
        if check.verdict in ("warn", "fail"):
            print(f"  {check.verdict}: {check.name}: {check.value}")
            if check.fix:
                print(f"        fix: {check.fix}")
    print("(run `trainperf doctor` for the full table)")


def stage_loader(
    data: JpegFolder, args: argparse.Namespace, out: Path, device: torch.device
) -> dict[str, Any]:
    section("3. DataLoader autotuner")
    report = tune_loader(
        data,
        args.batch_size,
        device=device,
        budget_s=args.tune_budget,
        epochs_hint=args.epochs,
        cache=False,
        progress=True,
        shuffle=True,
        drop_last=True,
    )
    print(report)
    if _imports.is_available("matplotlib"):
        print(f"tuning curve: {report.plot(out / 'loader_tuning.png')}")
    else:
        print("(install matplotlib to get the tuning curve as a PNG)")
    return dict(report.best_kwargs)


def stage_train(
    data: JpegFolder,
    loader_kwargs: dict[str, Any],
    args: argparse.Namespace,
    out: Path,
    device: torch.device,
) -> tuple[nn.Module, tp.MixedPrecision]:
    section("4. training with MixedPrecision under trainperf.watch")
    mp = tp.MixedPrecision(device)
    model = mp.prepare(small_cnn())
    print(repr(mp))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = DataLoader(data, **loader_kwargs)
    with tp.watch() as w:
        for epoch in range(args.epochs):
            stats = train_epoch(
                model, w.iter(loader), mp, optimizer, on_step=lambda n: w.step(samples=n)
            )
            print(
                f"epoch {epoch + 1}/{args.epochs}: loss {stats.loss:.3f}, "
                f"accuracy {stats.accuracy:.1%}, {stats.samples_per_s:,.0f} samples/s"
            )
    report = w.report()
    print(report)
    if _imports.is_available("matplotlib"):
        print(f"watch timeline: {report.plot(out / 'watch_timeline.png')}")
    return model, mp


def stage_checkpoint(model: nn.Module, mp: tp.MixedPrecision, data: JpegFolder, out: Path) -> bool:
    section("5. atomic checkpoint, reload on the other device")
    path = tp.save_checkpoint({"model": model, "mp": mp.state_dict()}, out / "model.pt")
    print(f"saved atomically to {path} ({path.stat().st_size / 1024:.0f} KiB)")
    trained_on = next(model.parameters()).device
    # Reload where the model was not trained when there is such a device: a GPU-trained model
    # comes back on the CPU, the way a checkpoint from a rented GPU is used on a laptop.
    target = torch.device("cpu")
    state = tp.load_checkpoint(path, device=target)
    reloaded = small_cnn().to(target)
    tp.load_state_dict(reloaded, state["model"])
    model.eval()
    reloaded.eval()
    probe = torch.stack([data[i][0] for i in range(8)])
    with torch.no_grad():
        expected = model(tp.to_device(probe, trained_on)).float().cpu()
        got = reloaded(probe.to(target)).float().cpu()
    where = "the same device (no other is available)" if trained_on == target else str(target)
    same = bool(torch.allclose(expected, got, rtol=0, atol=1e-5 if trained_on.type != "cpu" else 0))
    print(f"trained on {trained_on}, reloaded on {where}: outputs identical: {same}")
    return same


def ddp_main(data_root: str, epochs: int, batch_size: int) -> float:
    """What each rank runs: the same training, wrapped in DDP with a distributed sampler."""
    device = (
        torch.device("cuda", trainperf.ddp.local_rank())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    data = JpegFolder(Path(data_root))
    mp = tp.MixedPrecision(device)
    model = trainperf.ddp.wrap_model(mp.prepare(small_cnn()))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = trainperf.ddp.distributed_loader(
        data, batch_size, shuffle=True, seed=0, drop_last=True
    )
    stats = EpochStats(0.0, 0.0, 0.0)
    for epoch in range(epochs):
        stats = train_epoch(model, loader, mp, optimizer)
        loss = trainperf.ddp.all_reduce_mean(torch.tensor(stats.loss, device=device))
        trainperf.ddp.print0(
            f"  epoch {epoch + 1}/{epochs}: mean loss over ranks {float(loss):.3f}"
        )
    return stats.loss


def ddp_ranks() -> int:
    """The processes the DDP stage starts: one per GPU, or 2 on the CPU."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def ddp_batch_size(batch_size: int, nprocs: int) -> int:
    """Each rank's batch in the DDP stage: ``batch_size`` split over the ranks, so the global
    batch stays ``batch_size`` whatever the GPU count (at least 1 a rank)."""
    return max(1, batch_size // nprocs)


def stage_ddp(data_root: Path, args: argparse.Namespace) -> None:
    section("6. the same training on several processes: trainperf.ddp.launch")
    nprocs = ddp_ranks()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    print(f"{nprocs} rank(s), {backend}")
    start = time.perf_counter()
    losses = trainperf.ddp.launch_all(
        ddp_main,
        str(data_root),
        args.ddp_epochs,
        ddp_batch_size(args.batch_size, nprocs),
        nprocs=nprocs,
    )
    print(
        f"final loss per rank: {', '.join(f'{x:.3f}' for x in losses)} "
        f"({time.perf_counter() - start:.1f} s including start-up)"
    )


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``minimum``, refused with the value otherwise."""

    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    parse.__name__ = f"integer >= {minimum}"  # argparse's word for a non-integer
    return parse


def positive_seconds(text: str) -> float:
    """An argparse type: a finite number of seconds > 0."""
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, got {text}")
    return value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="trainperf quick start")
    parser.add_argument("--per-class", type=at_least(1), default=160, help="JPEGs per class")
    parser.add_argument(
        "--image-size",
        type=at_least(4),  # halved once: 2x2 maps, so BatchNorm has 4 values at a batch of 1
        default=64,
        help="pixels (the CNN halves it once)",
    )
    parser.add_argument("--epochs", type=at_least(1), default=3)
    parser.add_argument("--ddp-epochs", type=at_least(1), default=1)
    parser.add_argument("--batch-size", type=at_least(1), default=32)
    parser.add_argument(
        "--tune-budget", type=positive_seconds, default=20.0, help="autotuner seconds"
    )
    parser.add_argument("--skip-ddp", action="store_true")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default: temp)")
    args = parser.parse_args(argv)
    images = args.per_class * len(CLASSES)
    needed = max(args.batch_size, 8)  # every stage drops a partial batch; stage 5 checks 8
    if images < needed:
        fewer = (
            f"fewer than one batch of {args.batch_size} (and the 8 that stage 5 checks)"
            if args.batch_size > 8
            else "fewer than the 8 that stage 5 checks"
        )
        smaller = ", or a smaller --batch-size" if args.batch_size > 8 else ""
        parser.error(
            f"--per-class {args.per_class} makes {images} images, {fewer}: pass --per-class "
            f"{math.ceil(needed / len(CLASSES))} or more{smaller}"
        )
    if not args.skip_ddp:
        check_ddp_stage(parser, args, images)
    return args


def check_ddp_stage(parser: argparse.ArgumentParser, args: argparse.Namespace, images: int) -> None:
    """Refuse options that give a rank of the DDP stage no batch: each gets its share of
    --batch-size, and its share of the images (a partial batch is dropped)."""
    nprocs = ddp_ranks()
    per_rank = ddp_batch_size(args.batch_size, nprocs)
    if images // nprocs < per_rank:
        parser.error(
            f"--per-class {args.per_class} makes {images} images, {images // nprocs} for each "
            f"of the DDP stage's {nprocs} ranks: fewer than its batch of {per_rank} "
            f"(--batch-size {args.batch_size} split over {nprocs} ranks, at least 1 each): "
            f"pass --per-class {math.ceil(per_rank * nprocs / len(CLASSES))} or more, or "
            f"--skip-ddp"
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="trainperf-demo-"))
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    stage_doctor()

    section("2. data: a small image-classification set of real JPEGs")
    root = make_image_folder(out / "images", args.per_class, args.image_size)
    data = JpegFolder(root)
    device = tp.best_device()
    tp.seed_everything(0)
    print(f"{len(data)} JPEGs in {len(CLASSES)} classes under {root}; training on {device}")

    loader_kwargs = stage_loader(data, args, out, device)
    model, mp = stage_train(data, loader_kwargs, args, out, device)
    same = stage_checkpoint(model, mp, data, out)
    if not args.skip_ddp:
        stage_ddp(root, args)

    section("done")
    print(f"{time.perf_counter() - started:.0f} s in all; outputs (checkpoint, plots) are in {out}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
