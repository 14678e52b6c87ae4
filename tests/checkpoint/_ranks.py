"""Functions the checkpoint tests run on every rank of a 2-rank gloo group (module level, so
spawned workers can import them): saving from rank 0 only, from every rank, and the
``distributed=True`` collective; ``Checkpointer.restore``'s agreement between the ranks."""

from __future__ import annotations

import errno
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import trainperf.checkpoint._checkpointer_restore as restore
import trainperf.checkpoint._files as files
from trainperf.checkpoint import Checkpointer, load_checkpoint, save_checkpoint
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


def _saved_steps_1_and_2(tmp: Path) -> Checkpointer:
    """Steps 1 and 2 saved by both ranks (rank 0's main files, rank 1's own files)."""
    ckpt = Checkpointer(tmp, keep=5)
    for step in (1, 2):
        ckpt.save({"w": torch.full((2,), float(step))}, step=step)
    dist.barrier()  # every file is durable before anyone touches or reads one
    return ckpt


def _restored(ckpt: Checkpointer) -> str:
    """What ``restore`` gave this rank: the step, or the error it raised."""
    try:
        return f"step {ckpt.restore({'w': torch.zeros(2)})}"
    except CheckpointError as e:
        return f"{type(e).__name__}: {e} [path {Path(str(e.path)).name}]"


def restore_with_rank1_file_copied_from_step_1(tmp: Path) -> str:
    """Rank 1's file of step 2 is a copy of its file of step 1: both ranks restore."""
    ckpt = _saved_steps_1_and_2(tmp)
    if dist.get_rank() == 0:
        shutil.copyfile(tmp / "step-000000001.rank-00001.pt", tmp / "step-000000002.rank-00001.pt")
    dist.barrier()
    return _restored(ckpt)


def restore_from_directories_with_other_steps(tmp: Path) -> str:
    """Rank 1 restores from a directory holding only step 1 (not the one rank 0 sees)."""
    ckpt = _saved_steps_1_and_2(tmp / "shared")
    if dist.get_rank() == 1:
        (tmp / "own").mkdir()
        for name in ("step-000000001.pt", "step-000000001.rank-00001.pt"):
            shutil.copyfile(tmp / "shared" / name, tmp / "own" / name)
        ckpt = Checkpointer(tmp / "own")
    return _restored(ckpt)


def restore_on_rank0_only(tmp: Path) -> str:
    """``restore`` inside ``if rank == 0:``: a clear error once the group's timeout passes."""
    ckpt = _saved_steps_1_and_2(tmp)
    if dist.get_rank() == 0:
        return _restored(ckpt)
    try:
        dist.barrier()  # where the other rank's training loop has got to
    except Exception as e:  # the barrier fails once rank 0 gives up: expected here
        return type(e).__name__
    return "barrier returned"


def restore_with_rank1_directory_unlistable(tmp: Path) -> str:
    """Rank 1 cannot list the directory (no permission there): it fails before the ranks
    agree on a step. What ``restore`` gave each rank: the step, or any error it raised."""
    ckpt = _saved_steps_1_and_2(tmp)
    with pytest.MonkeyPatch.context() as mp:
        if dist.get_rank() == 1:
            real = os.listdir

            def refused(path: Any = ".") -> list[str]:
                if Path(path) == tmp:
                    raise PermissionError(errno.EACCES, "Permission denied", str(path))
                return real(path)

            mp.setattr(os, "listdir", refused)
        try:
            return f"step {ckpt.restore({'w': torch.zeros(2)})}"
        except Exception as e:
            return f"{type(e).__name__}: {e} [path {Path(str(getattr(e, 'path', ''))).name}]"


def _saved_model_steps_1_and_2(tmp: Path) -> Checkpointer:
    """Steps 1 and 2 of a ``torch.nn.Linear(2, 2)`` saved by both ranks."""
    ckpt = Checkpointer(tmp, keep=5)
    model = torch.nn.Linear(2, 2)
    for step in (1, 2):
        ckpt.save({"model": model}, step=step)
    dist.barrier()  # every file is durable before anyone reads one
    return ckpt


def _restored_any(ckpt: Checkpointer, state: dict[str, Any]) -> str:
    """What ``restore`` gave this rank: the step, or any error it raised (with its path)."""
    try:
        return f"step {ckpt.restore(state)}"
    except Exception as e:
        return f"{type(e).__name__}: {e} [path {Path(str(getattr(e, 'path', ''))).name}]"


def restore_with_rank1_model_of_another_shape(tmp: Path) -> str:
    """Rank 1's model is built with another shape than the saved one: it cannot load step 2,
    after the ranks agreed on it."""
    ckpt = _saved_model_steps_1_and_2(tmp)
    model = torch.nn.Linear(2, 2) if dist.get_rank() == 0 else torch.nn.Linear(3, 2)
    return _restored_any(ckpt, {"model": model})


def restore_with_rank1_stuck_loading(tmp: Path) -> str:
    """Rank 1 takes longer to load its objects than the group's timeout (3 s): rank 0 must
    not return as if the ranks were in step."""
    ckpt = _saved_model_steps_1_and_2(tmp)
    with pytest.MonkeyPatch.context() as mp:
        if dist.get_rank() == 1:
            real = restore.restore_into

            def slow(*args: Any) -> None:
                time.sleep(6.0)
                real(*args)

            mp.setattr(restore, "restore_into", slow)
        return _restored_any(ckpt, {"model": torch.nn.Linear(2, 2)})
