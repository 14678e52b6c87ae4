"""Train a small CNN on an image folder, fed by ``image_loader``, under ``MixedPrecision``.

    python examples/train_imagefolder.py                          # a generated folder, any device
    python examples/train_imagefolder.py --backend torchvision    # or dali, nvjpeg (CUDA), auto
    python examples/train_imagefolder.py --data ~/imagenette2-160/train --size 128 --epochs 5

``--data`` is an ImageFolder-style directory (``root/<class>/<image>``). Without it, a tiny
folder of red-, green- and blue-ish JPEGs of assorted sizes is generated in a temporary
directory, so the model should reach ~100 % accuracy in a few epochs. The backend that was
chosen, and why, is printed; so are the loss, the eval accuracy and the images/s.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import nn

from trainperf.amp import MixedPrecision
from trainperf.pipelines import image_loader

COLOURS = {"red": (200, 50, 40), "green": (50, 180, 60), "blue": (40, 60, 200)}


def make_folder(root: Path, per_class: int, seed: int = 0) -> Path:
    """Write ``per_class`` textured JPEGs of 48-160 px for each colour class."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    for name, colour in COLOURS.items():
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            w, h = (int(v) for v in rng.integers(48, 161, size=2))
            pixels = np.array(colour, dtype=np.float32) + rng.normal(0, 30, size=(h, w, 3))
            image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))
            image.save(root / name / f"{i:03d}.jpg", quality=90)
    return root


def small_cnn(classes: int) -> nn.Module:
    def block(cin: int, cout: int) -> nn.Sequential:
        return nn.Sequential(
            nn.Conv2d(cin, cout, 3, stride=2, padding=1, bias=False),
            nn.BatchNorm2d(cout),
            nn.ReLU(inplace=True),
        )

    return nn.Sequential(
        block(3, 16),
        block(16, 32),
        block(32, 64),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(64, classes),
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


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=None, help="ImageFolder directory")
    parser.add_argument(
        "--backend", default="auto", choices=("auto", "dali", "nvjpeg", "torchvision")
    )
    parser.add_argument("--device", default="auto")
    parser.add_argument("--epochs", type=at_least(1), default=3)
    parser.add_argument(
        "--batch-size", type=at_least(2), default=16, help="2 or more: BatchNorm trains on 2+"
    )
    parser.add_argument("--size", type=at_least(1), default=64)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--images-per-class", type=at_least(1), default=40)
    parser.add_argument(
        "--tune-budget",
        type=positive_seconds,
        default=5.0,
        help="seconds for the DataLoader autotuner",
    )
    args = parser.parse_args(argv)
    generated = len(COLOURS) * args.images_per_class
    if args.data is None and generated < args.batch_size:
        parser.error(
            f"--images-per-class {args.images_per_class} makes {generated} images, fewer than "
            f"one batch of --batch-size {args.batch_size}: pass --images-per-class "
            f"{-(-args.batch_size // len(COLOURS))} or more, or a smaller --batch-size"
        )

    with tempfile.TemporaryDirectory(prefix="train_imagefolder_") as tmp:
        data = args.data or make_folder(Path(tmp) / "images", args.images_per_class)
        mp = MixedPrecision(None if args.device == "auto" else args.device)
        common = {"size": args.size, "backend": args.backend, "device": mp.device}
        if args.backend in ("auto", "torchvision"):  # used only if the torchvision backend runs
            common["loader_kwargs"] = {"budget_s": args.tune_budget, "progress": False}
        train = image_loader(data, args.batch_size, train=True, **common)  # type: ignore[arg-type]
        evaluate = image_loader(  # type: ignore[arg-type]
            data, args.batch_size, train=False, last_batch="keep", **common
        )
        print(f"{train!r}\n{mp!r}")

        torch.manual_seed(0)
        model = mp.prepare(small_cnn(len(train.classes)))
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
        loss_fn = nn.CrossEntropyLoss()
        accuracy = 0.0
        for epoch in range(args.epochs):
            model.train()
            start, seen, total = time.perf_counter(), 0, torch.zeros((), device=mp.device)
            for images, labels in train:  # a new, reshuffled epoch each time
                images, labels = mp.prepare_batch((images, labels))
                with mp.autocast():
                    loss = loss_fn(model(images), labels)
                mp.backward(loss)
                mp.step(opt)
                mp.zero_grad(opt)
                total += loss.detach().float()
                seen += labels.numel()
            rate = seen / (time.perf_counter() - start)

            model.eval()
            correct = count = 0
            with torch.no_grad(), mp.autocast():
                for images, labels in evaluate:
                    images, labels = mp.prepare_batch((images, labels))
                    correct += (model(images).argmax(1) == labels).sum().item()
                    count += labels.numel()
            accuracy = correct / count
            print(
                f"epoch {epoch}: loss {(total / len(train)).item():.3f}, "
                f"eval accuracy {accuracy:.1%}, {rate:,.0f} training images/s"
            )
        train.close()
        evaluate.close()
    return accuracy


if __name__ == "__main__":
    main()
