"""Saving and loading checkpoint files: :func:`save_checkpoint` and :func:`load_checkpoint`."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

import torch
from torch import nn

from trainperf._utils.imports import require
from trainperf.checkpoint._formats import (
    _LEGACY_MAGIC,
    _describe,
    _is_safetensors,
    _open_zip,
    _torch_load,
)
from trainperf.checkpoint._prefix import _same_type, strip_prefix, unwrap_model
from trainperf.checkpoint._write import write_checkpoint_file
from trainperf.device import resolve_device
from trainperf.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    NotACheckpointError,
)


def _is_tensor_state_dict(obj: object) -> bool:
    return (
        isinstance(obj, Mapping)
        and len(obj) > 0
        and all(
            isinstance(k, str) and (isinstance(v, torch.Tensor) or k.endswith("_extra_state"))
            for k, v in obj.items()
        )
    )


def _plain(value: Any) -> Any:
    if isinstance(value, nn.Module):
        return unwrap_model(value).state_dict()
    if isinstance(value, torch.optim.Optimizer):
        return value.state_dict()
    if _is_tensor_state_dict(value):
        return strip_prefix(value)
    return value


def _prepare(obj: Any) -> Any:
    if isinstance(obj, Mapping) and not _is_tensor_state_dict(obj):
        return _same_type(obj, ((k, _plain(v)) for k, v in obj.items()))
    return _plain(obj)


def _safetensors_bytes(obj: Any) -> bytes:
    require("safetensors", "save_checkpoint(... .safetensors)")
    from safetensors.torch import save

    bad = (
        "the whole object"
        if not isinstance(obj, Mapping)
        else next(
            (
                f"key {k!r} ({type(v).__name__})"
                for k, v in obj.items()
                if not isinstance(k, str) or not isinstance(v, torch.Tensor)
            ),
            None,
        )
    )
    if bad is not None:
        raise ValueError(
            "a .safetensors file holds one flat dict of str -> torch.Tensor, but "
            f"{bad} is not a tensor ({type(obj).__name__} given); save the model (or its "
            "state dict) alone to .safetensors and everything else (optimizer, epoch, ...) "
            "to a .pt file"
        )
    tensors = {k: v.contiguous() for k, v in obj.items()}
    try:
        return bytes(save(tensors))
    except RuntimeError as e:
        # Tied weights (an embedding shared with the output layer) share one storage, which
        # safetensors refuses; name them instead of passing its bare RuntimeError on.
        by_storage: dict[tuple[str, int], list[str]] = {}
        for key, tensor in tensors.items():
            if tensor.numel():
                where = (str(tensor.device), tensor.untyped_storage().data_ptr())
                by_storage.setdefault(where, []).append(key)
        shared = [sorted(keys) for keys in by_storage.values() if len(keys) > 1]
        if not shared:
            raise
        raise ValueError(
            f"a .safetensors file cannot hold tensors that share memory (tied weights), but "
            f"these do: {shared}; save to a .pt file instead, or clone the tied tensors first "
            "({k: v.clone() for k, v in state_dict.items()})"
        ) from e


def save_checkpoint(obj: Any, path: str | os.PathLike[str], *, distributed: bool = True) -> Path:
    """Save ``obj`` atomically: a crash, kill or full disk never leaves a partial file at ``path``.

    The object goes to a hidden temp file in the same directory (``.NAME.tmp-HOST-PID-XXXX``),
    which is flushed, fsynced and renamed over ``path`` with ``os.replace``; then the directory
    is fsynced. Missing parent directories are created. Temp files left by killed writers on
    this host are removed on the next save to the same path.

    Modules are saved as their state dict, after unwrapping DataParallel, DDP and
    ``torch.compile`` (so ``{"model": model, "optimizer": opt}`` works, and optimizers are
    saved as their state dicts); state dicts (top level, or values of a top-level dict) lose
    their ``module.`` / ``_orig_mod.`` prefixes. Paths ending in ``.safetensors`` are written
    with safetensors and take a flat dict of str -> tensor (or a module).

    Args:
        obj: A module, a state dict, or a dict of them and other picklable values.
        path: Destination file (``str`` or path-like).
        distributed: With a ``torch.distributed`` process group initialised and
            ``distributed=True``, this is a collective: call it on every rank; rank 0
            writes and all ranks return once the file exists (or all raise). Pass False
            when calling it from one rank only (inside ``if rank == 0:``).

    Returns:
        ``path`` as a ``Path``.

    Raises:
        CheckpointError: The object could not be serialised or the file not written (disk
            full, no permission, ``path`` is a directory), or rank 0 failed; the cause is
            chained and any earlier file at ``path`` is left intact.
        ValueError: A ``.safetensors`` path with something other than str -> tensor, or a
            state dict whose keys collide once prefixes are removed.
        ModuleNotFoundError: A ``.safetensors`` path without safetensors installed.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     p = save_checkpoint({"model": nn.DataParallel(nn.Linear(2, 1))}, Path(d, "c.pt"))
        ...     sorted(load_checkpoint(p)["model"])
        ['bias', 'weight']
    """
    path = Path(os.fspath(path))
    rank = None
    if distributed and torch.distributed.is_available() and torch.distributed.is_initialized():
        rank = torch.distributed.get_rank()
    failure: Exception | None = None
    if rank in (None, 0):
        try:
            if path.suffix.lower() == ".safetensors":
                data = _safetensors_bytes(_prepare(obj))

                def write_bytes(f: IO[bytes]) -> None:
                    f.write(data)

                write_checkpoint_file(path, write_bytes)
            else:
                prepared = _prepare(obj)
                write_checkpoint_file(path, lambda f: torch.save(prepared, f))
        except Exception as e:
            failure = e
    if rank is not None:
        # Rank 0 reports success or its error, so no rank waits forever on a failed write.
        status = [None if failure is None else f"{type(failure).__name__}: {failure}"]
        torch.distributed.broadcast_object_list(status, src=0)
        if status[0] is not None and failure is None:
            raise CheckpointError(f"rank 0 could not save checkpoint {path}: {status[0]}", path)
    if failure is not None:
        raise failure
    return path


def load_checkpoint(
    path: str | os.PathLike[str],
    device: str | int | torch.device | None = "cpu",
    *,
    weights_only: bool = True,
    verify: bool = True,
) -> Any:
    """Load a checkpoint onto ``device``, safely, wherever it was saved.

    Tensors saved on a GPU load on a CPU-only machine (``map_location``). ``weights_only=True``
    never falls back to unsafe unpickling. The file type is read from its first bytes (torch
    zip, legacy torch pickle, safetensors), not its name.

    Args:
        path: The file (``str`` or path-like).
        device: ``"cpu"``, ``"cuda"``, ``"cuda:N"`` (or the int ``N``), ``"mps"``, a
            ``torch.device`` of those types, or None / ``"auto"`` for
            ``trainperf.device.best_device()`` (as ``device=None`` means elsewhere in
            trainperf), parsed by :func:`trainperf.device.resolve_device`. The device is
            checked before the file is read. The default is ``"cpu"``, not the best device,
            because ``model.load_state_dict`` copies the tensors into the model wherever its
            parameters live: loading onto a GPU first would hold a second copy of the weights
            (and optimizer state) in GPU memory, and the load works the same on a machine
            without the GPU the file was saved on.
        weights_only: Refuse pickled code (the default). ``False`` runs whatever the file
            contains: only for files you trust.
        verify: Check every CRC-32 of a torch zip file first, so flipped bytes in tensor
            data are reported instead of loaded (one extra read of the file).

    Returns:
        The saved object, with every tensor on ``device``.

    Raises:
        ValueError: ``device`` is not one of the forms above.
        TypeError: ``device`` is not a str, int or torch.device.
        DeviceError: CUDA or MPS asked for but not available, or fewer GPUs than the index.
        CheckpointNotFoundError: No file at ``path``.
        NotACheckpointError: A directory, or a file of another kind (text, JSON, image, ...).
        CheckpointCorruptError: An empty, truncated or damaged checkpoint.
        UnsafeCheckpointError: ``weights_only=True`` refused an object in the file.
        CheckpointError: Any other failure while loading (cause chained).

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     p = save_checkpoint({"step": 3, "w": torch.ones(2)}, Path(d, "c.pt"))
        ...     load_checkpoint(p, "cpu")
        {'step': 3, 'w': tensor([1., 1.])}
    """
    dev = resolve_device(device, allowed=("cpu", "cuda", "mps"))
    path = Path(os.fspath(path))
    if path.is_dir():
        hint = (
            "a torch.distributed.checkpoint directory: load it with torch.distributed.checkpoint"
            if (path / ".metadata").exists()
            else "give the checkpoint file inside it"
        )
        raise NotACheckpointError(f"{path} is a directory, not a checkpoint file; {hint}", path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(64)
    except FileNotFoundError as e:
        raise CheckpointNotFoundError(
            f"checkpoint {path} does not exist (looked in {path.resolve().parent})", path
        ) from e
    if size == 0:
        raise CheckpointCorruptError(
            f"checkpoint {path} is empty (0 bytes): the save or copy that made it was "
            "interrupted; use an earlier checkpoint",
            path,
        )
    if head.startswith(b"PK\x03\x04"):
        _open_zip(path, verify)
        return _torch_load(path, dev, weights_only)
    if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        if _LEGACY_MAGIC not in head[:32]:
            raise NotACheckpointError(
                f"{path} is a Python pickle but not a torch.save file; if you trust it, "
                "read it with pickle.load",
                path,
            )
        return _torch_load(path, dev, weights_only)
    if _is_safetensors(head):
        require("safetensors", "load_checkpoint(... .safetensors)")
        from safetensors.torch import load_file

        try:
            return load_file(path, device=str(dev))
        except Exception as e:
            raise CheckpointCorruptError(
                f"safetensors checkpoint {path} is truncated or damaged ({e}); re-copy it "
                "or use an earlier checkpoint",
                path,
            ) from e
    raise NotACheckpointError(
        f"{path} is not a checkpoint: it looks like {_describe(head)} (a checkpoint starts "
        "like a zip archive, a torch pickle or a safetensors header)",
        path,
    )
