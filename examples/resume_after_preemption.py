"""A run that survives preemption: killed twice, resumed twice, and still the same run.

    python examples/resume_after_preemption.py                 # 60 steps, stops at 25 and 45
    python examples/resume_after_preemption.py --steps 100 --term-at 30 --kill-at 70

The training loop (``train`` below) is what a real script looks like with
``trainperf.Checkpointer``: restore, then train with background saves every 10 steps inside
``ckpt.preemption()``, and a blocking save when a stop is requested. This script runs it
four times:

1. straight through, in this process, for the reference weights;
2. in a child process that is sent SIGTERM at step ``--term-at`` (as ``scancel``, a spot
   reclaim or torchrun would): the handler only sets a flag, the loop saves that step and
   exits cleanly;
3. resumed in a new child, which is killed with SIGKILL at step ``--kill-at`` (no handler
   runs: an OOM kill, a node failure): only the background saves it had completed remain;
4. resumed again from the newest complete checkpoint, to the end.

The weights and Adam state of run 4 are compared with run 1's, bit for bit: the random
states (dropout) and the DataLoader's position mid-epoch (2 workers, shuffling) were saved
and restored, and the batches already used were skipped without loading them.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import trainperf


def build() -> dict[str, Any]:
    """Model, optimizer, scheduler and a shuffling loader, seeded: the same every run."""
    trainperf.seed_everything(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=20, gamma=0.5)
    x = torch.randn(200, 8, generator=torch.Generator().manual_seed(1))
    data = TensorDataset(x, x.sum(1, keepdim=True))
    loader = DataLoader(
        data,
        batch_size=16,  # 13 batches an epoch: the stops fall mid-epoch
        shuffle=True,
        num_workers=2,
        worker_init_fn=trainperf.DieWithParent(None),  # workers die with a killed run
    )
    return {"model": model, "optimizer": opt, "scheduler": sched, "loader": loader}


def train(directory: Path, steps: int, hold_at: int = -1) -> dict[str, Any]:
    state = build()
    model, opt, sched, loader = (state[k] for k in ("model", "optimizer", "scheduler", "loader"))
    ckpt = trainperf.Checkpointer(directory, keep=2)
    step = ckpt.restore(state)  # 0 the first time; also starts tracking the loader
    print(f"  starting at step {step}", flush=True)
    with ckpt.preemption(("SIGTERM", "SIGUSR1"), grace_s=25) as stop:
        while step < steps:
            for x, y in loader:
                opt.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                sched.step()
                step += 1
                if step % 10 == 0:
                    ckpt.save(state, step=step, blocking=False)  # returns at once
                if step == hold_at:  # only for the demo: wait here for the signal
                    ckpt.wait()
                    print(f"  at step {step}", flush=True)
                    while not stop.requested:
                        time.sleep(0.01)
                if stop.requested:  # the same step on every rank under DDP
                    ckpt.save(state, step=step)  # blocking, inside the grace period
                    print(f"  {stop.signal}: saved step {step}, {stop.deadline_s:.0f} s to spare")
                    return {}
                if step == steps:
                    break
    ckpt.wait()  # raises here if a background write failed
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}


def child(directory: Path, steps: int, hold_at: int) -> subprocess.Popen[str]:
    cmd = [sys.executable, __file__, "--child", str(directory), str(steps), str(hold_at)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)


def run_until(proc: subprocess.Popen[str], line: str) -> None:
    assert proc.stdout is not None
    for got in proc.stdout:
        print(got, end="")
        if got.startswith(line):
            return
    raise RuntimeError(f"the run ended before printing {line!r}")


def steps_in(directory: Path) -> list[int]:
    return trainperf.Checkpointer(directory).steps()


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    params = all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    moments = all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i])
    return params and moments


# Everything the script makes goes in this folder of --out, which it owns: the marker inside
# tells a rerun that the folder is its own. Nothing else in --out is read or removed.
OWN = "resume_after_preemption"
MARKER = ".made_by_resume_after_preemption"


def own_directory(out: Path, parser: argparse.ArgumentParser) -> Path:
    """``out/resume_after_preemption/``, cleared of an earlier run's reference/ and run/: run/
    still holds that run's final checkpoint, which would be resumed at the last step instead
    of stopped on the way. A folder of that name the script did not make is refused."""
    directory = out / OWN
    made_here = (directory / MARKER).is_file()
    if (
        directory.exists()
        and not made_here
        and (not directory.is_dir() or any(directory.iterdir()))
    ):
        parser.error(
            f"--out {out} already holds {OWN}/, which this script did not make: pass "
            f"another --out, or move {directory} away"
        )
    for name in ("reference", "run"):
        if made_here and (directory / name).exists():
            shutil.rmtree(directory / name)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / MARKER).write_text("reference/ and run/ here are cleared on a rerun\n")
    return directory


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _, _, child_directory, steps, hold_at = sys.argv
        result = train(Path(child_directory), int(steps), int(hold_at))
        if result:
            torch.save(result, Path(child_directory) / "final.pt")
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--term-at", type=int, default=25, help="step of the SIGTERM")
    p.add_argument("--kill-at", type=int, default=45, help="step of the SIGKILL, after --term-at")
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"default: a temporary directory; all goes in its {OWN}/, which a rerun clears",
    )
    args = p.parse_args()
    if not 1 <= args.term_at < args.kill_at <= args.steps:
        p.error(
            "need 1 <= --term-at < --kill-at <= --steps, got --term-at "
            f"{args.term_at}, --kill-at {args.kill_at}, --steps {args.steps}: the run is "
            "stopped at --term-at, resumed, and killed at a later step before the end"
        )
    directory = own_directory(args.out or Path(tempfile.mkdtemp(prefix="resume-demo-")), p)

    print("1. straight through (the reference):")
    reference = train(directory / "reference", args.steps)

    print(f"2. a run sent SIGTERM at step {args.term_at}:")
    run = child(directory / "run", args.steps, args.term_at)
    run_until(run, f"  at step {args.term_at}")
    run.send_signal(signal.SIGTERM)
    print(run.communicate(timeout=300)[0], end="")
    print(f"  exit code {run.returncode}; checkpoints: {steps_in(directory / 'run')}")

    print(f"3. resumed, then killed with SIGKILL at step {args.kill_at}:")
    run = child(directory / "run", args.steps, args.kill_at)
    run_until(run, f"  at step {args.kill_at}")
    run.send_signal(signal.SIGKILL)
    run.communicate(timeout=300)
    print(f"  exit code {run.returncode}; checkpoints: {steps_in(directory / 'run')}")

    print("4. resumed again, to the end:")
    run = child(directory / "run", args.steps, -1)
    print(run.communicate(timeout=300)[0], end="")
    resumed = torch.load(directory / "run" / "final.pt")
    identical = same(reference, resumed)
    print(f"weights and optimizer state identical to the uninterrupted run: {identical}")


if __name__ == "__main__":
    main()
