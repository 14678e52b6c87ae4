"""Save a checkpoint from a wrapped model on one device, load it into a plain model on another.

    python examples/checkpoint_across_devices.py               # train on the best device
    python examples/checkpoint_across_devices.py --steps 50 --out runs/ckpt

The model is trained inside ``torch.compile`` and ``nn.DataParallel`` (keys
``module._orig_mod.*``) on ``trainperf.best_device()``; ``trainperf.save_checkpoint`` saves the
plain keys, atomically. The file is then loaded onto the other device (the CPU after a GPU
run, a GPU after a CPU run when there is one) into a plain, unwrapped model, whose weights and
outputs are compared with the trained model's. Last, the file is damaged in the usual ways
(truncated, emptied, replaced, deleted) to show what ``load_checkpoint`` says about each.
"""

from __future__ import annotations

import argparse
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

import trainperf
import trainperf.ddp as ddp


def small_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
    )


def wrap(model: nn.Module, device: torch.device) -> nn.Module:
    """torch.compile inside DataParallel, as many training scripts have it."""
    # backend="eager" traces with TorchDynamo but needs no C++ compiler: a quick, CPU-safe demo.
    compiled = torch.compile(model, backend="eager")
    if device.type == "cuda":
        with warnings.catch_warnings():  # its advice (use DDP) is not the point here
            warnings.simplefilter("ignore")
            return ddp.data_parallel(compiled, device_ids=[device.index or 0])
    compiled.to(device)
    return nn.DataParallel(compiled)  # without GPUs, DataParallel just calls the module


def other_device(device: torch.device) -> torch.device:
    if device.type != "cpu":
        return torch.device("cpu")
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def train(model: nn.Module, device: torch.device, steps: int) -> None:
    g = torch.Generator().manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model.train()
    for _ in range(steps):
        x = torch.randn(16, 3, 16, 16, generator=g)
        y = torch.randint(0, 4, (16,), generator=g)
        x, y = trainperf.to_device((x, y), device)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    print(f"trained {steps} steps on {device}, last loss {loss.item():.4f}")


def show_load_errors(good: Path, scratch: Path) -> None:
    """What load_checkpoint says about the files a crash, a copy or a typo leaves behind."""
    data = good.read_bytes()
    cases = {
        "truncated (save or copy interrupted)": data[: len(data) // 2],
        "empty": b"",
        "not a checkpoint (an HTML error page)": b"<!DOCTYPE html><html>404</html>\n",
    }
    truncated = scratch / "truncated.pt"
    truncated.write_bytes(cases["truncated (save or copy interrupted)"])
    try:
        torch.load(truncated, map_location="cpu", weights_only=True)
    except Exception as e:  # torch's own words, for comparison: one zip-reader sentence
        print(f"  plain torch.load, truncated: {type(e).__name__}: {str(e).split('. ')[0]}")
    for what, content in cases.items():
        path = scratch / "damaged.pt"
        path.write_bytes(content)
        try:
            trainperf.load_checkpoint(path)
        except trainperf.CheckpointError as e:
            print(f"  {what}: {type(e).__name__}: {e}")
        else:
            raise SystemExit(f"load_checkpoint accepted a {what} file")
    try:
        trainperf.load_checkpoint(scratch / "typo.pt")
    except trainperf.CheckpointNotFoundError as e:
        print(f"  missing: {type(e).__name__}: {e}")


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``minimum``, refused with the value otherwise."""

    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    parse.__name__ = f"integer >= {minimum}"  # argparse's word for a non-integer
    return parse


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=at_least(1), default=20, help="training steps")
    parser.add_argument("--out", type=Path, default=None, help="default: a temporary directory")
    args = parser.parse_args()

    trainperf.seed_everything(0)
    device = trainperf.best_device()
    model = wrap(small_cnn(), device)
    train(model, device, args.steps)
    wrapped_keys = list(model.state_dict())
    print(f"the wrapped model's keys look like {wrapped_keys[0]!r}")

    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp)
        path = trainperf.save_checkpoint({"model": model, "steps": args.steps}, out / "model.pt")
        print(f"saved {path} ({path.stat().st_size:,} bytes)")

        target = other_device(device)
        state = trainperf.load_checkpoint(path, target)
        print(f"loaded onto {target}; saved keys look like {next(iter(state['model']))!r}")
        if target == device:
            print("  (no second device here: on a GPU machine the GPU-saved file loads on the CPU)")
        plain = small_cnn()
        result = trainperf.load_state_dict(plain, state["model"])
        plain.to(target).eval()
        model.eval()

        trained = trainperf.unwrap_model(model).state_dict()
        same_weights = all(
            torch.equal(trained[k].cpu(), v.cpu()) for k, v in plain.state_dict().items()
        )
        print(f"every key loaded: {result.complete}; weights identical: {same_weights}")
        x = torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            before = model(x.to(device)).cpu()
            after = plain(x.to(target)).cpu()
        if device.type == target.type:
            print(f"outputs identical to the trained model: {torch.equal(before, after)}")
        else:  # other kernels on another device: equal up to rounding, not bit for bit
            diff = (before - after).abs().max().item()
            print(
                f"outputs match the trained model ({device} vs {target}): max difference {diff:.1e}"
            )
        if not (result.complete and same_weights and torch.allclose(before, after, atol=1e-4)):
            raise SystemExit("the reloaded model differs from the trained one")

        print("what load_checkpoint says about damaged files:")
        show_load_errors(path, Path(tmp))


if __name__ == "__main__":
    main()
