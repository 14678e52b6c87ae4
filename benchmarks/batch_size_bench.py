"""Batch-size tuner against the exhaustive sweep (powers of two and their midpoints).

For each model ``tune_batch_size`` runs from scratch (no cache), then every size of the
sweep (``2**k`` and ``3 * 2**(k-1)`` in ``[1, max]``) is measured with the tuner's own probe
(the same warm-up, timed windows and peak memory, :class:`trainperf.batchsize._probe.Prober`)
and the sweep's fastest sizes are measured against each other in alternating windows, as the
tuner's are (:meth:`trainperf.batchsize._search.Search.final`): sweep and tuner measure the
same way. On CUDA the sweep stops at the first size that runs out of memory (every larger
one would too), and after tuning 200 training steps run at the chosen size, which must not
run out of memory.

**Scoring.** On a shared host the load changes between measurements by more than sizes
differ (a 2-core machine shared with other jobs measured the same size at 15 and 47
samples/s minutes apart), so the tuner's choice is not scored by a figure taken at another
moment: it is measured against the sweep's best in alternating windows of at least a second
(``--score-rounds`` rounds, order reversed every other round; :func:`score`), and "vs best"
is the median over the rounds of their ratio, so host drift hits both alike. ``--sweeps N``
repeats the sweep to show how far its own best moves.

Targets (issue 17): the choice reaches >= 97 % of the sweep's best samples/s, the tuner
takes <= 20 % of the sweep's time and <= 60 s, and (CUDA) the 200 steps after it never run
out of memory.

Models:
    CPU:  resnet18  torchvision ResNet-18, 64 px, 10 classes, SGD with momentum
          mlp       4 linear layers (784-1024-1024-1024-10), Adam
          encoder   4-layer transformer encoder (d=256, 4 heads, 64 tokens), AdamW
    CUDA: resnet50  torchvision ResNet-50, 224 px, bf16 (MixedPrecision), SGD
          vit_b_16  torchvision ViT-B/16, 224 px, bf16, AdamW
          gpt2      a GPT-2-small-sized decoder (12 layers, d=768, 1024 tokens, 50257
                    words), bf16, AdamW

Lightning's ``BatchSizeFinder`` (``Tuner.scale_batch_size``, power mode, its defaults of 3
steps per trial) on the same models runs only with ``--lightning SWEEP_JSON``, in an
environment that has ``lightning`` (it is never a trainperf dependency); its choice is
alternated with the sweep's best from ``SWEEP_JSON`` (written by an earlier run) as the
tuner's is, and its samples/s is the sweep's figure for that size.

Usage:
    python benchmarks/batch_size_bench.py --device cpu --threads 1 --json bs.json
    python benchmarks/batch_size_bench.py --device cuda --json bs-gpu.json     # GPU step
    python benchmarks/batch_size_bench.py --quick --models mlp                 # smoke run
    PYTHONPATH=<venv site-packages>:src /tmp/peers/bin/python \\
        benchmarks/batch_size_bench.py --lightning bs.json --threads 1
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from trainperf import tune_batch_size
from trainperf.amp import MixedPrecision
from trainperf.batchsize import BatchSizeCandidate, _tune
from trainperf.batchsize._agree import Agreement
from trainperf.batchsize._compare import Comparison
from trainperf.batchsize._memory import reader_for
from trainperf.batchsize._probe import ProbePolicy, Prober, is_out_of_memory
from trainperf.batchsize._search import Search, choose
from trainperf.batchsize._sizes import SizeSpace
from trainperf.batchsize._state import SavedState

CPU_MODELS = ("resnet18", "mlp", "encoder")
CUDA_MODELS = ("resnet50", "vit_b_16", "gpt2")
# The sweep's upper end on the CPU: about where a step takes seconds on one core.
CPU_MAX = {"resnet18": 64, "mlp": 2048, "encoder": 64}
QUICK_MAX = {"resnet18": 4, "mlp": 16, "encoder": 4}

# --------------------------------------------------------------------------- models


class Encoder(nn.Module):
    """A transformer encoder classifier; with ``causal`` and ``vocab``, a decoder-only LM."""

    def __init__(
        self, d: int, heads: int, layers: int, classes: int, vocab: int | None = None
    ) -> None:
        super().__init__()
        self.embed = None if vocab is None else nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, batch_first=True, norm_first=True)
        self.body = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, classes, bias=vocab is None)
        if self.embed is not None and classes == vocab:
            self.head.weight = self.embed.weight  # tied, as GPT-2's: 124 M parameters

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is None:
            return self.head(self.body(x).mean(dim=1))
        h = self.embed(x)
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device)
        return self.head(self.body(h, mask=mask, is_causal=True))


@dataclass
class Workload:
    """A model, its optimizer, its training step and its batches."""

    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    step: Callable[[Any], object]
    sample: Callable[[int], Any]
    mp: MixedPrecision | None = None


def _net(name: str) -> tuple[nn.Module, Callable[[int], Any], str]:
    """(model, sample(n) on the CPU, optimizer kind)."""
    import torchvision

    if name in ("resnet18", "resnet50"):
        px, classes = (64, 10) if name == "resnet18" else (224, 1000)
        model = getattr(torchvision.models, name)(num_classes=classes)
        return model, lambda n: (torch.randn(n, 3, px, px), torch.randint(0, classes, (n,))), "sgd"
    if name == "vit_b_16":
        model = torchvision.models.vit_b_16(num_classes=1000)
        return model, lambda n: (torch.randn(n, 3, 224, 224), torch.randint(0, 1000, (n,))), "adamw"
    if name == "mlp":
        dims = (784, 1024, 1024, 1024)
        layers: list[nn.Module] = []
        for a, b in itertools.pairwise(dims):
            layers += [nn.Linear(a, b), nn.ReLU()]
        model = nn.Sequential(*layers, nn.Linear(1024, 10))
        return model, lambda n: (torch.randn(n, 784), torch.randint(0, 10, (n,))), "adam"
    if name == "encoder":
        model = Encoder(256, 4, 4, 10)
        return model, lambda n: (torch.randn(n, 64, 256), torch.randint(0, 10, (n,))), "adamw"
    if name == "gpt2":
        model = Encoder(768, 12, 12, 50257, vocab=50257)
        return model, lambda n: torch.randint(0, 50257, (n, 1025)), "adamw"
    raise ValueError(f"unknown model {name!r}; choices: {CPU_MODELS + CUDA_MODELS}")


def build(name: str, device: torch.device) -> Workload:
    """The workload ``name`` on ``device`` (bf16 MixedPrecision on CUDA, fp32 on the CPU)."""
    torch.manual_seed(0)
    model, sample, kind = _net(name)
    mp = MixedPrecision(device, precision="bf16") if device.type == "cuda" else None
    model = mp.prepare(model) if mp is not None else model.to(device)
    params = model.parameters()
    opt: torch.optim.Optimizer
    if kind == "sgd":
        opt = torch.optim.SGD(params, lr=0.01, momentum=0.9)
    elif kind == "adam":
        opt = torch.optim.Adam(params, lr=1e-3)
    else:
        opt = torch.optim.AdamW(params, lr=1e-4)
    lm = name == "gpt2"

    def step(batch: Any) -> None:
        if lm:
            x, y = batch[:, :-1], batch[:, 1:]
        else:
            x, y = mp.prepare_batch(batch) if mp is not None else batch
        opt.zero_grad(set_to_none=True)
        with mp.autocast() if mp is not None else torch.autocast("cpu", enabled=False):
            out = model(x)
            loss = nn.functional.cross_entropy(
                out.reshape(-1, out.shape[-1]).float(), y.reshape(-1)
            )
        if mp is not None:
            mp.backward(loss)
            mp.step(opt)
        else:
            loss.backward()
            opt.step()

    model.train()
    return Workload(name, model, opt, step, sample, mp)


# --------------------------------------------------------------------------- runs


def sweep_sizes(top: int) -> list[int]:
    """Powers of two and their midpoints up to ``top``: 1, 2, 3, 4, 6, 8, 12, ...

    >>> sweep_sizes(16)
    [1, 2, 3, 4, 6, 8, 12, 16]
    """
    sizes = {1}
    k = 1
    while 2**k <= top:
        sizes.update({2**k, 3 * 2 ** (k - 1)})
        k += 1
    return sorted(n for n in sizes if n <= top)


def _prober(
    w: Workload, device: torch.device, policy: ProbePolicy | None = None
) -> tuple[Prober, SavedState]:
    """The tuner's own probe (the same warm-up, windows, peak memory and alternation)."""
    state = SavedState.save([w.model, w.optimizer])
    probe = Prober(
        w.step, w.sample, device, reader_for(device), state, Agreement(), math.inf,
        usable=lambda: None, policy=policy or _tune.DEFAULT_PROBE,
    )  # fmt: skip
    return probe, state


def run_sweep(
    w: Workload, device: torch.device, top: int
) -> tuple[list[BatchSizeCandidate], float, list[str]]:
    """Every sweep size measured with the tuner's probe (on CUDA up to the first OOM), then
    its fastest sizes measured against each other in alternation, as the tuner's are
    (:meth:`Search.final`): the rows, the seconds, and the alternation's note."""
    started = time.perf_counter()
    probe, state = _prober(w, device)
    rows = []
    for n in sweep_sizes(top):
        c = probe(n)
        rows.append(c)
        rate = "-" if c.samples_per_s is None else f"{c.samples_per_s:,.1f}"
        print(f"    sweep {n:>6} {rate:>12} samples/s  {c.elapsed_s:6.1f} s  {c.status}",
              file=sys.stderr)  # fmt: skip
        if c.status == "oom":
            break
    final = Search(
        SizeSpace(1, top), probe, time_left=lambda: math.inf, usable=lambda: None,
        compare=probe.compare, results=rows,
    )  # fmt: skip
    final.final()
    state.restore()
    return final.results, time.perf_counter() - started, final.notes


def score(
    w: Workload,
    device: torch.device,
    best: BatchSizeCandidate,
    tuned: BatchSizeCandidate,
    rounds: int,
) -> tuple[float, Comparison | None]:
    """The tuner's choice against the sweep's best, measured in alternation (``rounds``
    rounds of windows of at least a second, four times the tuner's: a referee's figure,
    timed by neither side): the median over rounds of tuned / best."""
    if tuned.batch_size == best.batch_size:
        return 1.0, None
    base = _tune.DEFAULT_PROBE
    long_windows = dataclasses.replace(
        base, windows=dataclasses.replace(base.windows, min_window_s=4 * base.windows.min_window_s)
    )
    probe, state = _prober(w, device, long_windows)
    cmp = probe.compare([best, tuned], rounds)
    state.restore()
    return (math.nan if cmp is None else cmp.ratio(tuned.batch_size)), cmp


def steps_after(w: Workload, device: torch.device, size: int, steps: int) -> str:
    """Train ``steps`` steps at ``size``, each batch copied to the device as a loader's
    would be (two host batches, built once and alternated: building a thousand 224 px
    images takes longer than the step); "ok" or the step that ran out of memory."""
    host = [w.sample(size), w.sample(size)]
    for i in range(steps):
        try:
            batch = host[i % 2]
            if device.type == "cuda":
                batch = batch.to(device) if isinstance(batch, torch.Tensor) else batch
            w.step(batch)
        except Exception as e:
            if is_out_of_memory(e):
                return f"OOM at step {i}"
            raise
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return "ok"


def lookup(rows: list[dict[str, Any]], size: int) -> float | None:
    for r in rows:
        if r["batch_size"] == size and r["status"] == "ok":
            return float(r["samples_per_s"])
    return None


def run_one(name: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    w = build(name, device)
    top = (QUICK_MAX if args.quick else CPU_MAX).get(name, args.max_size or 1 << 16)
    top = args.max_size or top
    print(f"[{name}] sweep 1..{top} on {device}", file=sys.stderr)
    t0 = time.perf_counter()
    report = tune_batch_size(
        w.step, w.sample, model=w.model, optimizer=(w.optimizer, *([w.mp] if w.mp else [])),
        device=device, max_size=None if device.type == "cuda" else top,
        budget_s=args.budget, cache=False, progress=False,
    )  # fmt: skip
    tune_s = time.perf_counter() - t0
    print(f"    tuner chose {report.batch_size} in {tune_s:.1f} s", file=sys.stderr)
    after = steps_after(w, device, report.batch_size, args.steps_after) if args.steps_after else "-"
    sweeps = [run_sweep(w, device, top if device.type != "cuda" else 1 << 16)]
    for _ in range(args.sweeps - 1):  # repeated: how far the sweep's own best moves
        sweeps.append(run_sweep(w, device, top if device.type != "cuda" else 1 << 16))
    rows, sweep_s, sweep_notes = sweeps[0]
    best = choose(rows)
    if best is None:
        raise RuntimeError(f"[{name}] no sweep size ran: {[str(c) for c in rows]}")
    by_size = {c.batch_size: c for c in rows if c.ok}
    tuned_c = by_size.get(report.batch_size) or report.chosen()
    if tuned_c is None:  # tune_batch_size raises rather than return without a choice
        raise RuntimeError(f"[{name}] the tuner's report has no chosen candidate")
    ratio, cmp = score(w, device, best, tuned_c, args.score_rounds)
    print(f"    alternated {report.batch_size} with the sweep's best {best.batch_size}: "
          f"{100 * ratio:.1f} %", file=sys.stderr)  # fmt: skip
    return {
        "model": name,
        "sweep_top": max(c.batch_size for c in rows),
        "sweep_sizes": len(rows),
        "sweep_s": sweep_s,
        "sweep_best": best.batch_size,
        "sweep_best_samples_per_s": best.samples_per_s,
        "sweep_notes": sweep_notes,
        "repeat_sweeps": [
            {
                "best": (choose(r) or best).batch_size,
                "seconds": t,
                "rates": {c.batch_size: c.samples_per_s for c in r},
            }
            for r, t, _ in sweeps
        ],
        "tuned": report.batch_size,
        "tuned_samples_per_s": tuned_c.samples_per_s,
        "tuner_own_samples_per_s": report.samples_per_s,
        "tuner_s": tune_s,
        "tuner_sizes": sum(1 for c in report.candidates if c.probed),
        "ratio_to_sweep_best": ratio,
        "score_rounds": None if cmp is None else [list(r) for r in cmp.rounds],
        "time_fraction": tune_s / sweep_s,
        "steps_after": after,
        "sweep": [c.to_dict() for c in rows],
        "tuner_report": str(report),
        "tuner": report.to_dict(),
    }


def table(results: list[dict[str, Any]]) -> str:
    head = (
        f"{'model':<9} {'range':>8} {'sweep best':>10} {'samples/s':>10} {'sweep s':>8} "
        f"{'tuned':>6} {'samples/s':>10} {'tune s':>7} {'sizes':>5} {'vs best':>8} "
        f"{'time':>6} {'after':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        tuned = r["tuned_samples_per_s"]
        lines.append(
            f"{r['model']:<9} {'1..' + str(r['sweep_top']):>8} {r['sweep_best']:>10} "
            f"{r['sweep_best_samples_per_s']:>10,.1f} {r['sweep_s']:>8.1f} {r['tuned']:>6} "
            f"{(tuned or math.nan):>10,.1f} {r['tuner_s']:>7.1f} "
            f"{r['tuner_sizes']:>2}/{r['sweep_sizes']:<2} {100 * r['ratio_to_sweep_best']:>7.1f}% "
            f"{100 * r['time_fraction']:>5.1f}% {r['steps_after']:>8}"
        )
    lines.append(
        "samples/s: the sweep's measurement of each size (its fastest alternated with each "
        "other); vs best: the tuner's choice alternated with the sweep's best, median ratio "
        "over the rounds; sweep s includes its alternation; sizes: sizes the tuner ran / in "
        "the sweep"
    )
    lines.append("targets: vs best >= 97 %, time <= 20 % and tune s <= 60, after: ok (CUDA)")
    return "\n".join(lines)


# --------------------------------------------------------------------------- Lightning


def lightning_one(
    name: str, saved: dict[str, Any], device: torch.device, rounds: int
) -> dict[str, Any]:
    """Lightning's BatchSizeFinder (power mode) on the same workload; its choice alternated
    with the sweep's best as the tuner's is (:func:`score`)."""
    rows = saved["sweep"]
    import lightning.pytorch as pl
    from lightning.pytorch.tuner import Tuner
    from torch.utils.data import DataLoader, Dataset

    w = build(name, device)
    top = max(r["batch_size"] for r in rows)

    class Synthetic(Dataset[Any]):
        def __len__(self) -> int:
            return 4 * top

        def __getitem__(self, i: int) -> Any:
            return tuple(t[0] for t in w.sample(1)) if name != "gpt2" else w.sample(1)[0]

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = w.model
            self.batch_size = 1

        def training_step(self, batch: Any, _: int) -> torch.Tensor:
            x, y = batch if name != "gpt2" else (batch[:, :-1], batch[:, 1:])
            out = self.net(x)
            return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return w.optimizer

        def train_dataloader(self) -> DataLoader[Any]:
            return DataLoader(Synthetic(), batch_size=self.batch_size)

    module = Module()
    trainer = pl.Trainer(
        accelerator="gpu" if device.type == "cuda" else "cpu", devices=1, max_epochs=1,
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        default_root_dir=tempfile.mkdtemp(prefix="bs-lightning-"),  # its checkpoint
        enable_model_summary=False,
        precision="bf16-mixed" if device.type == "cuda" else "32-true",
    )  # fmt: skip
    t0 = time.perf_counter()
    # Power mode doubles from 1: log2(top) + 1 trials reach the sweep's top on the CPU
    # (nothing runs out of memory there); on CUDA it doubles until an OOM.
    trials = int(math.log2(top)) + 1 if device.type != "cuda" else 25
    found = Tuner(trainer).scale_batch_size(module, mode="power", init_val=1, max_trials=trials)
    elapsed = time.perf_counter() - t0
    size = int(found or module.batch_size)
    by_size = {r["batch_size"]: BatchSizeCandidate(**r) for r in rows if r["status"] == "ok"}
    best, chosen = by_size.get(saved["sweep_best"]), by_size.get(size)
    ratio = math.nan
    if best is not None and chosen is not None:
        ratio, _ = score(build(name, device), device, best, chosen, rounds)
    return {
        "model": name,
        "lightning_batch_size": size,
        "lightning_s": elapsed,
        "sweep_samples_per_s_at_choice": lookup(rows, size),
        "lightning_ratio_to_sweep_best": ratio,
    }


def lightning_main(path: str, device: torch.device, rounds: int) -> int:
    with open(path) as f:
        saved = json.load(f)
    out = []
    for r in saved["results"]:
        lr = lightning_one(r["model"], r, device, rounds)
        lr.update(
            tuned=r["tuned"],
            tuned_samples_per_s=r["tuned_samples_per_s"],
            tuner_s=r["tuner_s"],
            sweep_best_samples_per_s=r["sweep_best_samples_per_s"],
            tuned_ratio=r["ratio_to_sweep_best"],
        )
        out.append(lr)
    head = (
        f"{'model':<9} {'trainperf':>9} {'samples/s':>10} {'vs best':>8} {'s':>6}  "
        f"{'Lightning':>9} {'samples/s':>10} {'vs best':>8} {'s':>6}  {'sweep best':>10}"
    )
    print(head + "\n" + "-" * len(head))
    for r in out:
        lrate = r["sweep_samples_per_s_at_choice"]
        print(
            f"{r['model']:<9} {r['tuned']:>9} {r['tuned_samples_per_s'] or math.nan:>10,.1f} "
            f"{100 * r['tuned_ratio']:>7.1f}% {r['tuner_s']:>6.1f}  "
            f"{r['lightning_batch_size']:>9} {lrate if lrate is not None else math.nan:>10,.1f} "
            f"{100 * r['lightning_ratio_to_sweep_best']:>7.1f}% {r['lightning_s']:>6.1f}  "
            f"{r['sweep_best_samples_per_s']:>10,.1f}"
        )
    print(
        "samples/s: the sweep's measurement at each tool's choice (nan: Lightning chose a "
        "size the sweep did not reach); vs best: that choice alternated with the sweep's best "
        "(median ratio); Lightning: BatchSizeFinder power mode, 3 steps per trial"
    )
    return 0


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=None, help="comma-separated (default: the device's three)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--budget", type=float, default=60.0, help="tune_batch_size budget_s")
    p.add_argument("--max-size", type=int, default=None, help="the sweep's (and tuner's) top")
    p.add_argument("--steps-after", type=int, default=None, help="steps at the chosen size "
                   "after tuning (default 200 on CUDA, 0 elsewhere)")  # fmt: skip
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--quick", action="store_true", help="smoke run: tiny sweeps")
    p.add_argument("--sweeps", type=int, default=1, help="sweeps per model (more: how far "
                   "the sweep's best moves between repeats)")  # fmt: skip
    p.add_argument("--score-rounds", type=int, default=5, help="alternating rounds of the "
                   "tuner's choice against the sweep's best")  # fmt: skip
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument("--lightning", metavar="SWEEP_JSON", help="compare with Lightning's finder")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.lightning:
        return lightning_main(args.lightning, device, args.score_rounds)
    if args.steps_after is None:
        args.steps_after = 200 if device.type == "cuda" else 0
    if args.quick:
        args.budget = min(args.budget, 10.0)
    default = CUDA_MODELS if device.type == "cuda" else CPU_MODELS
    names = [n.strip() for n in (args.models or ",".join(default)).split(",") if n.strip()]
    unknown = [n for n in names if n not in CPU_MODELS + CUDA_MODELS]
    if unknown:  # before any runs, rather than after the ones before it
        p.error(f"unknown models {unknown}; choose from {', '.join(CPU_MODELS + CUDA_MODELS)}")
    env = {
        "host": platform.node(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "load_average": os.getloadavg(),
        "probe": asdict(_tune.DEFAULT_PROBE),
    }
    print(f"device {device}, {env['threads']} threads, load average {env['load_average']}",
          file=sys.stderr)  # fmt: skip
    results = [run_one(name, args, device) for name in names]
    env["load_average_after"] = os.getloadavg()
    print(table(results))
    if args.sweeps > 1:
        print("\nrepeated sweeps (best size: samples/s of each size, pass by pass)")
        for r in results:
            passes = "; ".join(f"{p['best']} in {p['seconds']:.0f} s" for p in r["repeat_sweeps"])
            print(f"{r['model']}: best {passes}")
    for r in results:
        print(f"\n[{r['model']}] tuner report:\n{r['tuner_report']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": env, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
