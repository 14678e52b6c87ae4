"""Reading a :class:`~trainperf.checkpoint.Checkpointer`'s directory back: the newest complete
step file (:func:`newest_complete`, what ``latest`` returns) and loading it into the live
objects (:func:`restore_newest`, what ``restore`` does), a damaged file skipped for an older
one, a misnamed one refused before it is loaded, and one this process cannot load though it
is complete (``weights_only`` refuses it, a newer PyTorch wrote it) stopping the restore.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader

from trainperf._utils.stack import user_stacklevel
from trainperf.checkpoint._checkpointer_ranks import (
    _group,
    agree,
    agree_loaded,
    agreed_own_part,
)
from trainperf.checkpoint._checkpointer_wait import settle_directory, wait_directory
from trainperf.checkpoint._checkpointer_warn import _stops_at, stop_at
from trainperf.checkpoint._files import load_checkpoint
from trainperf.checkpoint._held import held_step, version
from trainperf.checkpoint._loader_state import track
from trainperf.checkpoint._payload import restore_into, saved_step
from trainperf.checkpoint._rank_gpu import load_device
from trainperf.checkpoint._steps import main_file, refuse_misnamed
from trainperf.errors import CheckpointError

if TYPE_CHECKING:
    from trainperf.checkpoint._checkpointer import Checkpointer

__all__ = ["newest_complete", "restore_newest"]


def newest_complete(ckpt: Checkpointer) -> Path | None:
    """:meth:`Checkpointer.latest <trainperf.checkpoint.Checkpointer.latest>`: the newest
    step file whose pickle holds its step, the others (and those ``restore`` found damaged)
    skipped with a warning, once this
    process's writes into the directory have ended (a failed one is not raised here)."""
    wait_directory(ckpt)
    for step in reversed(ckpt.steps()):
        path = main_file(ckpt.directory, step)
        try:
            held = held_step(path, raise_read_errors=True)
        except OSError as e:
            raise _stops_at("latest", step, e) from e
        if isinstance(held, int):
            refuse_misnamed("latest", path, step, held)
            if step not in ckpt._damaged:
                return path
            # Its pickle is fine, its data is not (a CRC mismatch): restore skips it.
            held = "restore found it damaged and loaded an older step"
        warnings.warn(f"skipping checkpoint {path}: {held}", UserWarning, stacklevel=3)
    return None


def restore_newest(
    ckpt: Checkpointer, state: Mapping[str, Any], device: str | int | torch.device | None
) -> int:
    """:meth:`Checkpointer.restore <trainperf.checkpoint.Checkpointer.restore>`: the newest
    file that loads, put into ``state``; its step, or 0.

    Under a process group every rank reaches :func:`agree`, even one that failed before it
    (the directory cannot be listed, a file is unreadable or from a newer PyTorch): that
    rank raises its own error, the others one naming it, instead of their waiting out the
    group's timeout. Every rank reaches :func:`agree_loaded` too, once it has loaded the
    agreed step or failed to (its objects do not match the file's): a rank that failed
    raises its own error, the others one naming it, instead of their going on to wait for it
    in their next collective."""
    rank, _ = _group()
    try:
        found = _newest_loaded(ckpt, state, device)
    except Exception as e:
        agree(ckpt.directory, None, failure=e)
        raise
    if found is None:
        agree(ckpt.directory, 0)
        return 0
    step, saved, path = found
    own = agreed_own_part(ckpt, step, rank)
    try:
        restore_into(state, saved, own, str(path), step)
    except Exception as e:
        agree_loaded(ckpt.directory, step, failure=e)
        raise
    agree_loaded(ckpt.directory, step)
    return step


def _newest_loaded(
    ckpt: Checkpointer, state: Mapping[str, Any], device: str | int | torch.device | None
) -> tuple[int, Any, Path] | None:
    """``(step, saved object, path)`` of the newest step file that loads, or None; the
    checks before any file is read (the writes in flight, ``state``, ``device``) first."""
    settle_directory(ckpt)
    if not isinstance(state, Mapping):
        raise TypeError(
            "Checkpointer.restore takes a dict of the live objects, such as {'model': "
            f"model, 'optimizer': opt}}, got {type(state).__name__}"
        )
    # Checked once, before any file: a bad device is the caller's error, not a file's
    # (skipping every file for it would restart the run from step 0).
    # The user's argument, not a device resolved here: "auto" under a group is the rank's
    # own GPU, which load_checkpoint could no longer tell from an explicit "cuda:N".
    dev = load_device("cpu" if device is None else device)
    for value in state.values():
        if isinstance(value, DataLoader):
            track(value)
    for step in reversed(ckpt.steps()):
        path = main_file(ckpt.directory, step)
        _refuse_misnamed_unloaded(path, step)
        seen = version(path)  # before the read: a file changed since is read again
        try:
            saved = load_checkpoint(path, dev)
            found = saved_step(saved, str(path))
        except (CheckpointError, ValueError) as e:
            stop = stop_at(e, step, path, instead="an older checkpoint")
            if stop is not None:
                raise stop from e
            warnings.warn(
                f"skipping checkpoint {path}: {e}", UserWarning, stacklevel=user_stacklevel()
            )
            ckpt._damaged.add(step, path, seen)  # kept, but not one of the ``keep`` newest
            continue
        except OSError as e:
            raise _stops_at("restore", step, e) from e
        refuse_misnamed("restore", path, step, found)
        ckpt._damaged.discard(step)  # it loads: put right since it was found damaged
        return step, saved, path
    return None


def _refuse_misnamed_unloaded(path: Path, step: int) -> None:
    """Refuse the step file ``path`` when its pickle alone shows it holds another step than
    ``step`` (its name), before a full load that may fill host or GPU memory for nothing.
    Only the pickle is read, once per version of the file; a file it cannot tell about (cut
    short, unreadable) is left to the full load, which skips or raises as it should."""
    held = held_step(path)
    if isinstance(held, int):
        refuse_misnamed("restore", path, step, held)
