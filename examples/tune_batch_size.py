"""Find the fastest batch size for a training step, keep the effective batch, then train.

    python examples/tune_batch_size.py                        # a small CNN, any device
    python examples/tune_batch_size.py --global-batch 128 --budget 30 --plot bs.png

The three tuners work together:

1. ``MixedPrecision`` picks the precision for this device (bf16 on Ampere and later) and the
   training step uses it;
2. ``tune_batch_size`` runs that step at a few batch sizes and picks the fastest one that
   fits the memory, with the gradient accumulation that keeps ``--global-batch`` samples
   per optimizer update; the model, the optimizer and every random generator are left
   exactly as they were (the script checks);
3. ``autotune_loader`` then chooses the DataLoader settings for that batch size, and the
   report says what its batches in flight cost in memory.

Training then steps the optimizer every ``accumulation_steps`` batches; an epoch's last
batches that do not fill an update are left out, as ``drop_last`` leaves out a partial batch.
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.data import TensorDataset

import trainperf as tp


def small_cnn(classes: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, classes),
    )  # fmt: skip


def make_data(n: int, size: int, classes: int) -> TensorDataset:
    """Images whose mean colour tells the class: learnable in an epoch."""
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, classes, (n,), generator=g)
    images = torch.randn(n, 3, size, size, generator=g) * 0.5
    images[:, 0] += labels.float()[:, None, None] / classes
    return TensorDataset(images, labels)


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="auto")
    p.add_argument("--samples", type=at_least(2), default=1024)
    p.add_argument("--size", type=at_least(2), default=32, help="image side in pixels")
    p.add_argument(
        "--global-batch", type=at_least(2), default=64, help="samples per optimizer update"
    )
    p.add_argument("--max-size", type=at_least(2), default=None, help="largest batch size to try")
    p.add_argument("--budget", type=positive_seconds, default=12.0, help="tune_batch_size seconds")
    p.add_argument(
        "--loader-budget", type=positive_seconds, default=4.0, help="autotune_loader seconds"
    )
    p.add_argument("--epochs", type=at_least(1), default=1)
    p.add_argument("--plot", default=None, help="save the batch-size chart here")
    args = p.parse_args(argv)

    mp = tp.MixedPrecision(None if args.device == "auto" else args.device)
    print(repr(mp))
    data = make_data(args.samples, args.size, classes=4)
    torch.manual_seed(0)
    model = mp.prepare(small_cnn(4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        """One training step: what tune_batch_size times at each size."""
        images, labels = mp.prepare_batch(batch)
        with mp.autocast():
            loss = loss_fn(model(images), labels)
        mp.backward(loss)
        mp.step(opt)
        mp.zero_grad(opt)

    before = [t.clone() for t in model.state_dict().values()]
    rng = torch.get_rng_state()
    # min_size=2: BatchNorm cannot train on a batch of one sample.
    report = tp.tune_batch_size(
        step, tp.batches_from(data), model=model, optimizer=(opt, mp),
        global_batch=args.global_batch, min_size=2, max_size=args.max_size,
        budget_s=args.budget, progress=False, cache=False,
    )  # fmt: skip
    print(report)
    same = all(torch.equal(a, b) for a, b in zip(before, model.state_dict().values(), strict=True))
    print(f"model and RNG left as they were: {same and torch.equal(rng, torch.get_rng_state())}")
    if args.plot:
        try:
            print(f"chart: {report.plot(args.plot)}")
        except ModuleNotFoundError as e:
            print(f"no chart: {e}")

    loader = tp.autotune_loader(
        data, report.batch_size, device=mp.device, budget_s=args.loader_budget,
        shuffle=True, drop_last=True, progress=False, cache=False,
    )  # fmt: skip
    kw = loader.tuning_report.best_kwargs
    print(
        f"DataLoader: num_workers={kw['num_workers']}, prefetch_factor={kw.get('prefetch_factor')}"
    )
    print(report.input_pipeline(kw["num_workers"], kw.get("prefetch_factor")))

    accum = report.accumulation_steps
    # An epoch's last len(loader) % accum batches would leave gradients that the next epoch's
    # first update adds to its own: they are not trained on, as drop_last drops a partial
    # batch, so that every update averages exactly --global-batch samples.
    per_epoch = len(loader) // accum * accum
    if per_epoch == 0:
        raise SystemExit(
            f"--samples {args.samples} gives {len(loader)} batches of {report.batch_size} an "
            f"epoch, fewer than the {accum} accumulated per update: raise --samples to at "
            f"least {report.effective_batch} or lower --global-batch"
        )
    for epoch in range(args.epochs):
        model.train()
        start, seen, correct = time.perf_counter(), 0, 0
        for i, (images, labels) in enumerate(itertools.islice(loader, per_epoch)):
            images, labels = mp.prepare_batch((images, labels))
            with mp.autocast():
                out = model(images)
                loss = loss_fn(out, labels) / accum  # the mean over the effective batch
            mp.backward(loss)
            if (i + 1) % accum == 0:
                mp.step(opt)
                mp.zero_grad(opt)
            seen += labels.numel()
            correct += int((out.argmax(1) == labels).sum())
        rate = seen / (time.perf_counter() - start)
        print(
            f"epoch {epoch}: batch {report.batch_size} x {accum} accumulated = "
            f"{report.effective_batch} per update, train accuracy {correct / seen:.1%}, "
            f"{rate:,.0f} samples/s"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
