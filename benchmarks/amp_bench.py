"""Benchmark: training images/s of a torchvision ResNet under each mixed-precision recipe.

One process, one row per configuration, each on the same model (random init,
``weights=None``), SGD with momentum, and synthetic data already on the device:

- ``fp32``: no autocast, TF32 off (matmuls and cuDNN).
- ``fp32+tf32``: no autocast, TF32 on (CUDA only).
- ``autocast-bf16``: raw ``torch.autocast(dtype=torch.bfloat16)``, torch's default flags.
- ``autocast-bf16+cl``: the same with model and inputs in channels_last.
- ``trainperf``: ``MixedPrecision(device)`` with its defaults (precision, channels_last and
  TF32 "auto"), through ``prepare``/``prepare_batch``/``autocast``/``backward``/``step``.
- ``accelerate``: Hugging Face Accelerate, ``Accelerator(mixed_precision="bf16")``.
- ``fabric``: Lightning Fabric, ``Fabric(precision="bf16-mixed")``.

The last two run when their package imports and are skipped with a note otherwise. Torch
global state that a recipe may change (TF32 flags, cuDNN flags, default dtype) is put back
to what the process started with before every row, and the flags each row really ran with
are read at the start of its timed region and recorded. Between rows the model, optimizer
and data are deleted and the CUDA cache is emptied; peak and left-over memory are recorded.

Timing: warm-up iterations first (cuDNN and allocator warm-up), then the timed iterations
in a few rounds (``--rounds``, default 3), each between two ``torch.cuda.synchronize()``
calls; a row's images/s is its median round (all rounds are in the JSON).

Defaults: on CUDA, ResNet-50, batch 128 at 224 px, 10 warm-up + 30 timed iterations (about
a minute on an H200); elsewhere a smoke test at 32 px, batch 4, 2 + 2 iterations.

Targets (on a GPU): ``trainperf`` >= 0.97x the best raw row and >= 1.7x Accelerate and Fabric.

Usage::

    python benchmarks/amp_bench.py [--device cuda:0] [--model resnet50] [--batch-size 128]
        [--image-size 224] [--warmup 10] [--iterations 30] [--rounds 3]
        [--configs fp32,trainperf]
        [--json results.json]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import importlib.metadata
import json
import platform
import statistics
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from trainperf._utils.imports import is_available, require
from trainperf.amp import MixedPrecision
from trainperf.device import best_device

RAW = ("fp32", "fp32+tf32", "autocast-bf16", "autocast-bf16+cl")
PEERS = ("accelerate", "fabric")
CONFIGS = (*RAW, "trainperf", *PEERS)
TARGET_VS_RAW = 0.97
TARGET_VS_PEERS = 1.7

Step = Callable[[], None]


@dataclass
class Row:
    config: str
    status: str = "ok"  # ok | skipped | failed
    note: str = ""
    images_per_s: float | None = None
    seconds: float | None = None
    settings: dict[str, Any] = field(default_factory=dict)


@dataclass
class Setup:
    """What a configuration builds: the step to time, what it chose, how to tear it down."""

    step: Step
    settings: dict[str, Any]
    cleanup: Callable[[], None] = lambda: None


# --------------------------------------------------------------------------- global torch state


def _read(fn: Callable[[], Any]) -> Any:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch 2.9-2.11 warn on legacy TF32 reads
            return fn()
    except RuntimeError as e:  # torch >= 2.9 refuses legacy reads after mixed TF32 APIs
        return f"unreadable ({str(e)[:60]}...)"


def torch_flags() -> dict[str, Any]:
    """The process-wide settings that change the speed of a training step."""
    flags: dict[str, Any] = {
        "float32_matmul_precision": _read(torch.get_float32_matmul_precision),
        "cudnn.allow_tf32": _read(lambda: torch.backends.cudnn.allow_tf32),
        "cudnn.benchmark": torch.backends.cudnn.benchmark,
        "cudnn.deterministic": torch.backends.cudnn.deterministic,
        "default_dtype": str(torch.get_default_dtype()),
        "num_threads": torch.get_num_threads(),
    }
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        flags["cuda.matmul.fp32_precision"] = _read(
            lambda: torch.backends.cuda.matmul.fp32_precision
        )
    conv = getattr(torch.backends.cudnn, "conv", None)
    if hasattr(conv, "fp32_precision"):
        flags["cudnn.conv.fp32_precision"] = _read(lambda: conv.fp32_precision)  # type: ignore[union-attr]
    return flags


@dataclass(frozen=True)
class InitialState:
    matmul_precision: str
    cudnn_tf32: bool
    cudnn_benchmark: bool
    cudnn_deterministic: bool
    default_dtype: torch.dtype


def capture_state() -> InitialState:
    return InitialState(
        torch.get_float32_matmul_precision(),
        torch.backends.cudnn.allow_tf32,
        torch.backends.cudnn.benchmark,
        torch.backends.cudnn.deterministic,
        torch.get_default_dtype(),
    )


def set_tf32(matmul: bool, cudnn: bool) -> None:
    # set_float32_matmul_precision and the cudnn legacy setter leave both the legacy and the
    # new (torch >= 2.9) TF32 APIs readable, whatever a previous recipe used; torch 2.9-2.11
    # may warn that the legacy setter is deprecated.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.set_float32_matmul_precision("high" if matmul else "highest")
        torch.backends.cudnn.allow_tf32 = cudnn


def restore_state(state: InitialState) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.set_float32_matmul_precision(state.matmul_precision)
        torch.backends.cudnn.allow_tf32 = state.cudnn_tf32
    torch.backends.cudnn.benchmark = state.cudnn_benchmark
    torch.backends.cudnn.deterministic = state.cudnn_deterministic
    torch.set_default_dtype(state.default_dtype)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------- the configurations


@dataclass(frozen=True)
class Job:
    device: torch.device
    model: str
    batch_size: int
    image_size: int

    def build(self) -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
        import torchvision

        torch.manual_seed(0)
        model = getattr(torchvision.models, self.model)(weights=None).to(self.device)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        x = torch.randn(self.batch_size, 3, self.image_size, self.image_size, device=self.device)
        y = torch.randint(0, 1000, (self.batch_size,), device=self.device)
        return model, opt, x, y


def raw(job: Job, *, autocast: bool, channels_last: bool, tf32: bool | None) -> Setup:
    if tf32 is not None:
        set_tf32(tf32, tf32)
    model, opt, x, y = job.build()
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    loss_fn = nn.CrossEntropyLoss()
    dev = job.device.type

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=autocast):
            loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()

    settings = {
        "autocast": "bf16" if autocast else "off",
        "channels_last": channels_last,
        "tf32": "torch defaults" if tf32 is None else tf32,
    }
    return Setup(step, settings)


def trainperf_defaults(job: Job) -> Setup:
    model, opt, x, y = job.build()
    mp = MixedPrecision(job.device)
    model = mp.prepare(model)
    # The data is already on the device, as in the raw rows: convert its layout once.
    xb, yb = mp.prepare_batch((x, y))
    loss_fn = nn.CrossEntropyLoss()

    def step() -> None:
        mp.zero_grad(opt)
        with mp.autocast():
            loss = loss_fn(model(xb), yb)
        mp.backward(loss)
        mp.step(opt)

    settings = {
        "dtype": str(mp.dtype),
        "uses_scaler": mp.uses_scaler,
        "channels_last": mp.uses_channels_last,
        "tf32": mp.tf32_enabled,
        "repr": repr(mp),
    }
    return Setup(step, settings)


def accelerate_bf16(job: Job) -> Setup:
    from accelerate import Accelerator

    if job.device.type == "cuda":
        torch.cuda.set_device(job.device)
    acc = Accelerator(mixed_precision="bf16", cpu=job.device.type == "cpu")
    model, opt, x, y = job.build()
    model, opt = acc.prepare(model, opt)  # wraps forward in autocast
    loss_fn = nn.CrossEntropyLoss()

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        acc.backward(loss)
        opt.step()

    def cleanup() -> None:
        acc.free_memory()
        with contextlib.suppress(Exception):  # private API: reset the singletons
            from accelerate.state import AcceleratorState, GradientState

            AcceleratorState._reset_state(reset_partial_state=True)
            GradientState._reset_state()

    settings = {"mixed_precision": "bf16", "accelerator.device": str(acc.device)}
    return Setup(step, settings, cleanup)


def _fabric_class() -> Any:
    for name in ("lightning.fabric", "lightning_fabric"):
        if is_available(name):
            return importlib.import_module(name).Fabric
    raise ModuleNotFoundError("neither lightning.fabric nor lightning_fabric is installed")


def fabric_bf16(job: Job) -> Setup:
    fabric_cls = _fabric_class()
    if job.device.type == "cuda":
        fabric = fabric_cls(
            accelerator="cuda", devices=[job.device.index or 0], precision="bf16-mixed"
        )
    else:
        fabric = fabric_cls(accelerator="cpu", devices=1, precision="bf16-mixed")
    model, opt, x, y = job.build()
    model, opt = fabric.setup(model, opt)  # wraps forward in autocast
    loss_fn = nn.CrossEntropyLoss()

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        fabric.backward(loss)
        opt.step()

    return Setup(step, {"precision": "bf16-mixed", "fabric.device": str(fabric.device)})


def peer_missing(config: str) -> str | None:
    if config == "accelerate" and not is_available("accelerate"):
        return "accelerate is not installed (pip install accelerate)"
    if config == "fabric" and not (
        is_available("lightning.fabric") or is_available("lightning_fabric")
    ):
        return "lightning is not installed (pip install lightning)"
    return None


def builder(config: str, job: Job) -> Callable[[], Setup]:
    table: dict[str, Callable[[], Setup]] = {
        "fp32": lambda: raw(job, autocast=False, channels_last=False, tf32=False),
        "fp32+tf32": lambda: raw(job, autocast=False, channels_last=False, tf32=True),
        "autocast-bf16": lambda: raw(job, autocast=True, channels_last=False, tf32=None),
        "autocast-bf16+cl": lambda: raw(job, autocast=True, channels_last=True, tf32=None),
        "trainperf": lambda: trainperf_defaults(job),
        "accelerate": lambda: accelerate_bf16(job),
        "fabric": lambda: fabric_bf16(job),
    }
    return table[config]


# --------------------------------------------------------------------------- running


@contextlib.contextmanager
def isolated(device: torch.device, initial: InitialState) -> Iterator[dict[str, Any]]:
    """Start a row from the initial torch state and leave no memory behind."""
    restore_state(initial)
    free_memory(device)
    info: dict[str, Any] = {}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        yield info
    finally:
        free_memory(device)
        if device.type == "cuda":
            info["peak_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
            info["memory_left_gib"] = round(torch.cuda.memory_allocated(device) / 2**30, 3)
        restore_state(initial)


def split(iterations: int, rounds: int) -> list[int]:
    """``iterations`` in ``rounds`` near-equal parts (each at least 1)."""
    rounds = max(1, min(rounds, iterations))
    base, extra = divmod(iterations, rounds)
    return [base + (i < extra) for i in range(rounds)]


def run_config(
    config: str, job: Job, warmup: int, iterations: int, rounds: int, initial: InitialState
) -> Row:
    row = Row(config)
    if config == "fp32+tf32" and job.device.type != "cuda":
        row.status, row.note = "skipped", "TF32 exists on CUDA only"
        return row
    missing = peer_missing(config)
    if missing:
        row.status, row.note = "skipped", missing
        return row
    with isolated(job.device, initial) as memory:
        setup: Setup | None = None
        try:
            setup = builder(config, job)()
            for _ in range(warmup):
                setup.step()
            synchronize(job.device)
            row.settings = {**setup.settings, "flags": torch_flags()}
            rates, total = [], 0.0
            for n in split(iterations, rounds):
                start = time.perf_counter()
                for _ in range(n):
                    setup.step()
                synchronize(job.device)
                elapsed = time.perf_counter() - start
                total += elapsed
                rates.append(job.batch_size * n / elapsed)
            row.seconds = total
            row.images_per_s = statistics.median(rates)
            row.settings["round_images_per_s"] = [round(r, 1) for r in rates]
        except Exception as e:
            row.status, row.note = "failed", f"{type(e).__name__}: {e}"[:300]
            traceback.print_exc()
        finally:
            if setup is not None:
                with contextlib.suppress(Exception):
                    setup.cleanup()
            del setup
    row.settings["memory"] = memory
    return row


def ratios(rows: list[Row]) -> dict[str, Any]:
    speed = {r.config: r.images_per_s for r in rows if r.images_per_s}
    best_raw_name = max((c for c in RAW if c in speed), key=lambda c: speed[c], default=None)
    out: dict[str, Any] = {"best_raw": best_raw_name}
    ours = speed.get("trainperf")
    if ours and best_raw_name:
        vs_raw = ours / speed[best_raw_name]
        out["trainperf_vs_best_raw"] = round(vs_raw, 3)
        out["target_vs_best_raw"] = TARGET_VS_RAW
        out["meets_target_vs_best_raw"] = vs_raw >= TARGET_VS_RAW
    for peer in PEERS:
        if ours and peer in speed:
            vs_peer = ours / speed[peer]
            out[f"trainperf_vs_{peer}"] = round(vs_peer, 3)
            out[f"meets_target_vs_{peer}"] = vs_peer >= TARGET_VS_PEERS
    out["target_vs_peers"] = TARGET_VS_PEERS
    return out


def fmt_ratio(num: float | None, den: float | None) -> str:
    return f"{num / den:.2f}x" if num and den else "-"


def print_table(rows: list[Row], summary: dict[str, Any], header: dict[str, Any]) -> None:
    speed = {r.config: r.images_per_s for r in rows if r.images_per_s}
    best_raw = speed.get(summary["best_raw"]) if summary["best_raw"] else None
    print(
        f"{header['model']} training, batch {header['batch_size']} @ {header['image_size']} px, "
        f"{header['warmup']} warm-up + {header['iterations']} timed iterations on "
        f"{header['device']} ({header['device_name']}), torch {header['torch']}"
    )
    cols = ("config", "images/s", "vs best raw", "vs accelerate", "vs fabric", "note")
    lines = []
    for r in rows:
        ips = r.images_per_s
        note = r.note if r.status != "ok" else _short_settings(r)
        lines.append(
            (
                r.config,
                f"{ips:,.1f}" if ips else r.status,
                fmt_ratio(ips, best_raw),
                fmt_ratio(ips, speed.get("accelerate")),
                fmt_ratio(ips, speed.get("fabric")),
                note,
            )
        )
    widths = [max(len(c), *(len(line[i]) for line in lines)) for i, c in enumerate(cols[:-1])]
    fmt = "  ".join(f"{{:<{w}}}" if i == 0 else f"{{:>{w}}}" for i, w in enumerate(widths))
    print(fmt.format(*cols[:-1]) + "  " + cols[-1])
    for line in lines:
        print(fmt.format(*line[:-1]) + "  " + line[-1])
    print(f"best raw: {summary['best_raw']}")
    if "trainperf_vs_best_raw" in summary:
        ok = "meets" if summary["meets_target_vs_best_raw"] else "MISSES"
        print(
            f"trainperf vs best raw: {summary['trainperf_vs_best_raw']:.2f}x "
            f"({ok} the >= {TARGET_VS_RAW}x target)"
        )
    for peer in PEERS:
        if f"trainperf_vs_{peer}" in summary:
            ok = "meets" if summary[f"meets_target_vs_{peer}"] else "MISSES"
            print(
                f"trainperf vs {peer}: {summary[f'trainperf_vs_{peer}']:.2f}x "
                f"({ok} the >= {TARGET_VS_PEERS}x target)"
            )
    if header["device"].split(":")[0] != "cuda":
        print("(not a CUDA device: a smoke test; the targets apply to GPUs)")


def _short_settings(r: Row) -> str:
    s = r.settings
    flags = s.get("flags", {})
    tf32 = (
        f"matmul={flags.get('float32_matmul_precision')} cudnn_tf32={flags.get('cudnn.allow_tf32')}"
    )
    if r.config == "trainperf":
        return f"{s['dtype']} scaler={s['uses_scaler']} cl={s['channels_last']} {tf32}"
    if r.config in RAW:
        return f"autocast={s['autocast']} cl={s['channels_last']} {tf32}"
    return tf32


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=None, help="default: trainperf.best_device()")
    parser.add_argument("--model", default="resnet50", help="a torchvision.models name")
    parser.add_argument("--batch-size", type=int, default=None, help="CUDA 128, else 4")
    parser.add_argument("--image-size", type=int, default=None, help="CUDA 224, else 32")
    parser.add_argument("--warmup", type=int, default=None, help="CUDA 10, else 2")
    parser.add_argument("--iterations", type=int, default=None, help="CUDA 30, else 2")
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="timed iterations are split into this many "
        "synchronised rounds; the median round's images/s is reported (default 3)",
    )
    parser.add_argument(
        "--configs", default=",".join(CONFIGS), help=f"comma-separated, from {','.join(CONFIGS)}"
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)

    require("torchvision", "benchmarks/amp_bench.py")
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        parser.error(f"unknown configs {unknown}; choose from {list(CONFIGS)}")
    device = torch.device(args.device) if args.device else best_device()
    on_cuda = device.type == "cuda"
    index: int | None = device.index
    if on_cuda and index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    batch = args.batch_size or (128 if on_cuda else 4)
    size = args.image_size or (224 if on_cuda else 32)
    warmup = args.warmup if args.warmup is not None else (10 if on_cuda else 2)
    iterations = args.iterations or (30 if on_cuda else 2)
    checks = (("batch-size", batch), ("image-size", size), ("iterations", iterations))
    for name, value in (*checks, ("rounds", args.rounds)):
        if value < 1:
            parser.error(f"--{name} must be >= 1, got {value}")
    if warmup < 0:
        parser.error(f"--warmup must be >= 0, got {warmup}")

    initial = capture_state()
    job = Job(device, args.model, batch, size)
    header: dict[str, Any] = {
        "model": args.model,
        "batch_size": batch,
        "image_size": size,
        "warmup": warmup,
        "iterations": iterations,
        "rounds": split(iterations, args.rounds),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device)
        if on_cuda
        else platform.processor() or platform.machine(),
        "capability": ".".join(map(str, torch.cuda.get_device_capability(device)))
        if on_cuda
        else None,
        "torch": torch.__version__,
        "torchvision": _version("torchvision"),
        "accelerate": _version("accelerate"),
        "lightning": _version("lightning") or _version("lightning-fabric"),
        "python": platform.python_version(),
        "initial_flags": torch_flags(),
        "data": "synthetic, on the device, created once (inputs converted to channels_last once"
        " where a row uses it); SGD momentum 0.9, CrossEntropyLoss",
    }
    rows: list[Row] = []
    wall = time.perf_counter()
    for config in configs:
        rows.append(run_config(config, job, warmup, iterations, args.rounds, initial))
    header["wall_seconds"] = round(time.perf_counter() - wall, 1)
    summary = ratios(rows)
    print_table(rows, summary, header)
    print(f"total wall time {header['wall_seconds']} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"settings": header, "results": [asdict(r) for r in rows], "summary": summary},
                f,
                indent=2,
                default=str,
            )
    return 0 if all(r.status != "failed" for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
