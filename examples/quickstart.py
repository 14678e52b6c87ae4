"""trainperf quick start: a short CPU-friendly run through what the library does.

Run it with ``make demo`` (which creates the environment) or ``python examples/quickstart.py``.
It trains a small CNN on a synthetic image-classification set, with the device utilities,
mixed precision and atomic checkpoints, and checks that a reloaded model gives identical outputs.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import trainperf as tp


def small_cnn(classes: int) -> nn.Module:
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
        nn.Linear(32, classes),
    )


def synthetic_images(n: int, size: int, classes: int, seed: int) -> TensorDataset:
    """Class k is a noisy image whose mean colour depends on k, so the task is learnable."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, classes, (n,), generator=g)
    colours = torch.linspace(-1, 1, classes)[labels].view(n, 1, 1, 1)
    images = colours + 0.5 * torch.randn(n, 3, size, size, generator=g)
    return TensorDataset(images, labels)


def section(title: str) -> None:
    print(f"\n== {title} " + "=" * max(0, 66 - len(title)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--out", type=Path, default=None, help="output folder (default: temp)")
    args = parser.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="trainperf-demo-"))
    out.mkdir(parents=True, exist_ok=True)

    section("devices")
    cards = tp.gpus()
    for card in cards:
        print(f"cuda:{card.index} {card.name}  free {(card.memory_free or 0) / 2**30:.1f} GiB")
    device = tp.best_device()
    limits = tp.host_limits()
    print(f"GPUs visible: {len(cards)}; training on {device}; usable CPUs {limits.cpus}")
    tp.seed_everything(0)

    section("mixed precision")
    classes = 4
    mp = tp.MixedPrecision(device)
    model = mp.prepare(small_cnn(classes))
    print(repr(mp))

    section("training")
    data = synthetic_images(args.samples, args.image_size, classes, seed=0)
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    for epoch in range(args.epochs):
        start, seen, correct, total_loss = time.perf_counter(), 0, 0, 0.0
        for batch in loader:
            images, labels = mp.prepare_batch(batch)
            with mp.autocast():
                logits = model(images)
                loss = loss_fn(logits, labels)
            mp.backward(loss)
            mp.step(optimizer)
            mp.zero_grad(optimizer)
            seen += labels.numel()
            correct += int((logits.argmax(1) == labels).sum())
            total_loss += float(loss.detach()) * labels.numel()
        rate = seen / (time.perf_counter() - start)
        print(
            f"epoch {epoch + 1}/{args.epochs}: loss {total_loss / seen:.3f}, "
            f"accuracy {correct / seen:.1%}, {rate:,.0f} samples/s"
        )

    section("checkpoint")
    path = tp.save_checkpoint({"model": model, "mp": mp.state_dict()}, out / "model.pt")
    print(f"saved atomically to {path} ({path.stat().st_size / 1024:.0f} KiB)")
    state = tp.load_checkpoint(path, device="cpu")
    reloaded = small_cnn(classes)
    tp.load_state_dict(reloaded, state["model"])
    model.eval()
    reloaded.eval()
    probe = data.tensors[0][:8]
    with torch.no_grad():
        expected = model.float()(tp.to_device(probe, device)).cpu()
        got = reloaded(probe)
    same = torch.equal(expected, got)
    print(f"reloaded on cpu: outputs identical to the trained model: {same}")
    if not same:
        print(f"max difference {float((expected - got).abs().max()):.3g}")
        return 1
    print(f"\noutputs are in {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
