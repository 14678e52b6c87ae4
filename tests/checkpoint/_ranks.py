"""Functions the checkpoint tests run on every rank of a 2-rank gloo group (module level, so
spawned workers can import them): saving from rank 0 only, from every rank, and the
``distributed=True`` collective."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import trainperf.checkpoint._files as files
from trainperf.checkpoint import load_checkpoint, save_checkpoint
from trainperf.errors import CheckpointError


def _count_writes(delay_s: float = 0.0) -> list[Path]:
    """Record every file this rank writes (after ``delay_s``: a slow disk on rank 0)."""
    written: list[Path] = []
    real = files.write_checkpoint_file

    def counting(path: Path, write: Any) -> None:
        time.sleep(delay_s)
        written.append(path)
        real(path, write)

    files.write_checkpoint_file = counting  # type: ignore[assignment]
    return written


def save_on_rank0_only(tmp: Path) -> dict[str, Any]:
    """The tutorial pattern: ``if rank == 0: save_checkpoint(...)``, then a collective."""
    rank = dist.get_rank()
    written = _count_writes()
    if rank == 0:
        save_checkpoint({"w": torch.full((3,), 7.0), "step": 5}, tmp / "r0.pt")
    # The next collective of the training loop: the other rank reaches it while rank 0 saves.
    dist.barrier()
    loaded = load_checkpoint(tmp / "r0.pt")
    return {"written": [p.name for p in written], "w": loaded["w"].tolist(), "step": loaded["step"]}


def save_on_every_rank(tmp: Path) -> dict[str, Any]:
    """Every rank calls it (the default, no collective): only rank 0 writes; the rest return."""
    rank = dist.get_rank()
    written = _count_writes()
    # Rank 1's object cannot be pickled: if rank 1 tried to write, it would raise.
    obj = {"w": torch.full((3,), 7.0)} if rank == 0 else {"f": lambda: 0}
    returned = save_checkpoint(obj, tmp / "all.pt")
    dist.barrier()
    return {
        "written": [p.name for p in written],
        "returned": returned.name,
        "w": load_checkpoint(tmp / "all.pt")["w"].tolist(),
    }


def save_collectively(tmp: Path) -> dict[str, Any]:
    """``distributed=True`` on every rank: every rank returns once the file exists, and rank 0's
    failure reaches every rank."""
    rank = dist.get_rank()
    written = _count_writes(delay_s=0.5 if rank == 0 else 0.0)
    good = {"w": torch.full((3,), 7.0)} if rank == 0 else {"f": lambda: 0}
    save_checkpoint(good, tmp / "dist.pt", distributed=True)
    out: dict[str, Any] = {"exists_on_return": (tmp / "dist.pt").exists()}
    out["loaded"] = load_checkpoint(tmp / "dist.pt")["w"].tolist()
    bad = {"f": lambda: 0} if rank == 0 else {"w": torch.ones(1)}
    pattern = "could not be serialised" if rank == 0 else r"rank 0 could not save .*lambda"
    with pytest.raises(CheckpointError, match=pattern):
        save_checkpoint(bad, tmp / "bad.pt", distributed=True)
    out["bad_exists"] = (tmp / "bad.pt").exists()
    # distributed=False: no process-group logic at all, this process writes (per-rank files).
    save_checkpoint({"rank": rank}, tmp / f"own{rank}.pt", distributed=False)
    out["written"] = [p.name for p in written]
    return out


def collective_on_rank0_only(tmp: Path) -> str:
    """``distributed=True`` inside ``if rank == 0:``: a clear error after the group timeout."""
    if dist.get_rank() == 0:
        with pytest.raises(CheckpointError, match=r"distributed=True.*every rank") as e:
            save_checkpoint({"w": torch.ones(1)}, tmp / "lone.pt", distributed=True)
        return str(e.value)
    try:
        dist.barrier()  # where the other rank's training loop has got to
    except Exception as e:  # the barrier fails once rank 0 gives up: expected here
        return type(e).__name__
    return "barrier returned"
