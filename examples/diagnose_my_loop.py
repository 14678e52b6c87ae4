"""Find out why a training loop is slow: add ``trainperf.watch`` to the loop you already have.

    python examples/diagnose_my_loop.py                      # a loop with a slow loader
    python examples/diagnose_my_loop.py --plot timeline.png  # also the timeline (matplotlib)
    python examples/diagnose_my_loop.py --fix                # the same loop, autotuned loader

The loader here is deliberately slow, as a loader reading JPEGs from a network disk in the
main process is: every sample waits a couple of milliseconds. The watch's verdict says the
loop is input-bound, with the numbers behind it and the tool that fixes it. ``--fix`` runs
the loop again with ``trainperf.autotune_loader``, which measures how many workers this
machine needs for that dataset.

The only changes to the original loop are the three lines marked ``# trainperf``.
"""

from __future__ import annotations

import argparse
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import trainperf


class SlowImages(Dataset[tuple[torch.Tensor, int]]):
    """Small random images that each take ``delay_s`` to "read", like files on a slow disk."""

    def __init__(self, n: int, delay_s: float) -> None:
        self.n = n
        self.delay_s = delay_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        time.sleep(self.delay_s)  # waiting on I/O: no CPU used, the GPU (or the step) idles
        g = torch.Generator().manual_seed(i)
        return torch.randn(3, 32, 32, generator=g), i % 10


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(4),
        nn.Flatten(),
        nn.Linear(16 * 16, 10),
    )


def train(loader: DataLoader[tuple[torch.Tensor, int]], device: torch.device) -> trainperf.Watch:
    torch.manual_seed(0)
    model = make_model().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model.train()
    with trainperf.watch() as w:  # trainperf
        for images, labels in w.iter(loader):  # trainperf: was `for ... in loader:`
            images, labels = images.to(device), labels.to(device)
            loss = nn.functional.cross_entropy(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            w.step()  # trainperf
    return w


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``minimum``, refused with the value otherwise."""

    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    parse.__name__ = f"integer >= {minimum}"  # argparse's word for a non-integer
    return parse


def milliseconds(text: str) -> float:
    """An argparse type: a finite number of milliseconds >= 0."""
    value = float(text)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of ms >= 0, got {text}")
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=at_least(1), default=30, help="batches in the epoch")
    parser.add_argument("--batch-size", type=at_least(1), default=32)
    parser.add_argument(
        "--delay-ms", type=milliseconds, default=3.0, help="time to read one sample"
    )
    parser.add_argument("--plot", type=Path, default=None, help="write the timeline PNG here")
    parser.add_argument("--fix", action="store_true", help="also run with autotune_loader")
    args = parser.parse_args()

    device = trainperf.best_device()
    dataset = SlowImages(args.steps * args.batch_size, args.delay_ms / 1000)
    print(f"training on {device}: {len(dataset)} samples, {args.delay_ms:g} ms to read each")

    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True)  # num_workers=0
    report = train(loader, device).report()
    print(report)

    if args.plot is not None:
        try:
            report.plot(args.plot)
        except ModuleNotFoundError as e:  # matplotlib is optional: say how to get it
            print(f"no plot: {e}")
        else:
            print(f"timeline written to {args.plot}")

    if args.fix:
        print("\nthe same loop with trainperf.autotune_loader:")
        from trainperf.loader import autotune_loader

        # torch warns about more workers than cores; these mostly wait on I/O, as measured.
        warnings.filterwarnings("ignore", message="This DataLoader will create")
        tuned = autotune_loader(
            dataset, args.batch_size, shuffle=True, budget_s=15, cache=False, progress=False
        )
        print(f"autotune_loader chose num_workers={tuned.num_workers}")
        fixed = train(tuned, device).report()
        print(fixed)
        print(f"steps/s: {report.steps_per_s:.1f} before, {fixed.steps_per_s:.1f} after")


if __name__ == "__main__":
    main()
