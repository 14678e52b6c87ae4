"""Saving and loading checkpoint files: :func:`save_checkpoint` and :func:`load_checkpoint`."""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

import torch
from torch import nn

from trainperf._utils.imports import require
from trainperf._utils.stack import user_stacklevel
from trainperf._utils.validate import choice
from trainperf.checkpoint._dirs import INDEX_SUFFIXES, directory_weights, load_sharded
from trainperf.checkpoint._keys import (
    _same_type,
    drop_compile_layers,
    is_extra_state,
    strip_wrapper_layers,
)
from trainperf.checkpoint._prefix import unwrap_model
from trainperf.checkpoint._rank_gpu import load_device, on_rank_gpu
from trainperf.checkpoint._read import load_file, load_stream
from trainperf.checkpoint._refusal import weights_only_refusal
from trainperf.checkpoint._write import write_checkpoint_file
from trainperf.errors import CheckpointError


def _is_tensor_state_dict(obj: object) -> bool:
    return (
        isinstance(obj, Mapping)
        and len(obj) > 0
        and all(
            isinstance(k, str) and (isinstance(v, torch.Tensor) or is_extra_state(k))
            for k, v in obj.items()
        )
    )


def _has_state(value: object) -> bool:
    """An instance with a ``state_dict()`` method: optimizers, LR schedulers, GradScaler, ..."""
    return not isinstance(value, type) and callable(getattr(value, "state_dict", None))


def _stateless(value: Any, active: set[int]) -> Any:
    """``value`` with every module (unwrapped) and stateful object inside it, at any depth of
    dicts, lists and tuples, replaced by its state dict; containers without one are kept as
    they are (same object), so a file of plain data is saved exactly as given."""
    if isinstance(value, nn.Module):
        return drop_compile_layers(unwrap_model(value).state_dict())
    if _has_state(value):
        return value.state_dict()
    if not isinstance(value, (Mapping, list, tuple)) or id(value) in active:
        return value  # a container that holds itself is left to pickle's memo
    active.add(id(value))
    try:
        items: list[tuple[Any, Any]] = (
            list(value.items()) if isinstance(value, Mapping) else list(enumerate(value))
        )
        new = [(k, _stateless(v, active)) for k, v in items]
    finally:
        active.discard(id(value))
    if all(a is b for (_, a), (_, b) in zip(items, new, strict=True)):
        return value
    if isinstance(value, Mapping):
        return _same_type(value, new)
    values = [v for _, v in new]
    if isinstance(value, list):
        return values
    try:  # a namedtuple takes its fields as arguments, other tuples an iterable
        return type(value)(*values) if hasattr(value, "_fields") else type(value)(values)
    except Exception:  # a tuple subclass built some other way: a plain tuple will do
        return tuple(values)


def _plain(value: Any) -> Any:
    if _is_tensor_state_dict(value):
        return strip_wrapper_layers(value)
    return _stateless(value, set())


def _prepare(obj: Any) -> Any:
    if isinstance(obj, Mapping) and not _is_tensor_state_dict(obj) and not _has_state(obj):
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
    _refuse_unstorable(obj)
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


def _unstorable(tensor: torch.Tensor) -> str | None:
    """Why safetensors cannot store ``tensor`` (it holds plain dense arrays), with the fix."""
    if tensor.is_meta:
        return (
            "a meta tensor, which holds no data: save the model after its weights are "
            "materialised (model.to_empty(device=...) and initialised, or loaded)"
        )
    if tensor.is_nested:
        return "a nested tensor: save its parts (tensor.unbind()) under keys of their own"
    if tensor.layout != torch.strided:
        return f"a tensor of layout {tensor.layout}: save tensor.to_dense() instead"
    if tensor.is_quantized:
        return (
            f"a quantized tensor ({tensor.dtype}): save tensor.dequantize() instead, or save "
            "to a .pt file, which keeps the quantization"
        )
    return None


def _refuse_unstorable(state: Mapping[str, torch.Tensor]) -> None:
    """Name the first tensor safetensors cannot store, before its own bare error would."""
    for key, tensor in state.items():
        why = _unstorable(tensor)
        if why is not None:
            raise ValueError(f"a .safetensors file cannot hold key {key!r}: it is {why}")


def saving(path: Path | None) -> contextlib.AbstractContextManager[None]:
    """Tell trainperf's hang detection that this rank is saving ``path``: known slow work,
    not a hang (the other ranks may wait in a collective meanwhile). Nothing when no hang
    detection runs in this process: its module is then not even imported, so this costs one
    dict lookup and imports nothing (no torch.distributed, no CUDA)."""
    progress = sys.modules.get("trainperf.ddp._progress")
    if progress is None:
        return contextlib.nullcontext()
    busy: contextlib.AbstractContextManager[None] = progress.busy(f"saving checkpoint {path}")
    return busy


def _write(obj: Any, path: Path) -> None:
    with saving(path):
        prepared = _prepare(obj)
        if path.suffix.lower() == ".safetensors":
            data = _safetensors_bytes(prepared)

            def write_bytes(f: IO[bytes]) -> None:
                f.write(data)

            write_checkpoint_file(path, write_bytes)
        else:
            write_checkpoint_file(path, lambda f: torch.save(prepared, f))
            _warn_if_refused(prepared, path)


def _warn_if_refused(prepared: Any, path: Path) -> None:
    """Warn when ``load_checkpoint``'s default (``weights_only=True``) will refuse the file
    just written: a class of the user's, a ``defaultdict``."""
    why = weights_only_refusal(prepared)
    if why is not None:
        warnings.warn(
            f"saved {path}, but load_checkpoint (weights_only=True) will refuse it: {why} "
            "Save plain data instead (dict(history), a dataclass as asdict(...)), or load it "
            "with load_checkpoint(path, weights_only=False) if you trust the file",
            UserWarning,
            stacklevel=user_stacklevel(),
        )


def _group_rank() -> int | None:
    """This process's rank in the default process group; None without one."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return int(torch.distributed.get_rank())
    return None


def _write_collectively(obj: Any, path: Path, rank: int) -> None:
    """Rank 0 writes, then broadcasts success or its error (under NCCL on each rank's GPU:
    :func:`~._rank_gpu.on_rank_gpu`), so every rank returns or raises."""
    failure: Exception | None = None
    if rank == 0:
        try:
            _write(obj, path)
        except Exception as e:
            failure = e
    status = [None if failure is None else f"{type(failure).__name__}: {failure}"]
    try:
        with on_rank_gpu():
            torch.distributed.broadcast_object_list(status, src=0)
    except Exception as e:
        done = f"{path} was written" if rank == 0 and failure is None else f"{path} may not exist"
        raise CheckpointError(
            f"save_checkpoint(..., distributed=True) is a collective, but rank {rank} waited "
            f"for the other ranks in vain ({type(e).__name__}: {e}); {done}. Call it on every "
            "rank, or to save inside `if rank == 0:` leave distributed at its default",
            path,
        ) from e
    if failure is not None:
        raise failure
    if status[0] is not None:
        raise CheckpointError(f"rank 0 could not save checkpoint {path}: {status[0]}", path)


def _file_target(path: str | os.PathLike[str]) -> Path:
    """``path`` as the file ``save_checkpoint`` writes, ``~`` expanded.

    Raises:
        ValueError: ``path`` ends in a separator (or ``.``/``..``): it names a directory,
            and ``Path`` would drop the separator and write a file of that name.
    """
    raw = os.fspath(path)
    seps = os.sep + (os.altsep or "")
    tail = raw.rstrip(seps)
    ending = raw[len(tail) :] or tail.rsplit(os.sep, 1)[-1]
    if raw and (ending[:1] in tuple(seps) or ending in (".", "..")):
        example = Path(raw).expanduser() / "checkpoint.pt"
        raise ValueError(
            f"save_checkpoint needs a file path, but {raw!r} ends with {ending!r}, so it names "
            f"a directory; give a file name: save_checkpoint(obj, {str(example)!r})"
        )
    return Path(raw).expanduser()


def save_checkpoint(
    obj: Any, path: str | os.PathLike[str], *, distributed: bool | None = None
) -> Path:
    """Save ``obj`` atomically: a crash, kill or full disk never leaves a partial file at ``path``.

    The object goes to a hidden temp file in the same directory (``.NAME.tmp-HOST-N``, locked
    while written), which is flushed, fsynced and renamed over ``path`` with ``os.replace``;
    then the directory is fsynced. Missing parent directories are created. Temp files left by
    killed writers on this host are reused or removed by the next save to the same path.

    Modules are saved as their state dict, after unwrapping DataParallel, DDP and
    ``torch.compile`` (so ``{"model": model, "optimizer": opt}`` works), and so is anything
    else with a ``state_dict()`` method (optimizers, LR schedulers, ``torch.amp.GradScaler``,
    ``trainperf.MixedPrecision``), at any depth of dicts, lists and tuples, so the file loads
    with ``weights_only=True``; state dicts (top level, or values of a top-level dict) lose
    the ``module.`` / ``_orig_mod.`` layers that a wrapper puts before every key, and keep
    a real submodule's name (``AveragedModel``'s ``module.`` beside its ``n_averaged``).
    Paths ending in ``.safetensors`` are written with safetensors and take a flat dict of
    str -> tensor (or a module). A symbolic link is written through: the file it points to
    is replaced and the link stays a link (a dangling link creates that file).

    Args:
        obj: A module, a state dict, or a dict of them and other picklable values.
        path: Destination file (``str`` or path-like); a leading ``~`` is the home
            directory.
        distributed: What to do under an initialised ``torch.distributed`` process group.
            None (the default): rank 0 writes and every other rank returns at once without
            writing or serialising anything; no collective is involved, so calling it on
            every rank and calling it inside ``if rank == 0:`` both work (other ranks that
            must read the file wait for it themselves, e.g. with a barrier). True: a
            collective, to be called on every rank: rank 0 writes and every rank returns
            once the file exists, or raises if rank 0 failed (under NCCL the broadcast
            runs on the rank's own GPU, even when ``torch.cuda.set_device`` was never
            called; the current device is put back after). False: ignore the process
            group and write from this process (per-rank files). Without a process group
            every value writes.

    Returns:
        ``path`` as a ``Path``, ``~`` expanded (on ranks other than 0 with the default,
        the file rank 0 is writing, which may not exist yet).

    Raises:
        CheckpointError: The object could not be serialised or the file not written (disk
            full, no permission, ``path`` is a directory, a named pipe, socket or device, or
            an existing write-protected file (``chmod 444``: not replaced), a parent path is
            a file), or with
            ``distributed=True`` rank 0 failed or another rank never joined; the cause is
            chained and any earlier file at ``path`` is left intact.
        ValueError: ``path`` ends in a separator (``"ckpts/"``: a directory, not a file
            name), a ``.safetensors`` path with something other than str -> tensor (or
            tensors that share memory, or a meta, sparse, nested or quantized tensor: the
            message names the key and the fix), or ``distributed`` not None, True or False.
        ModuleNotFoundError: A ``.safetensors`` path without safetensors installed.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     p = save_checkpoint({"model": nn.DataParallel(nn.Linear(2, 1))}, Path(d, "c.pt"))
        ...     sorted(load_checkpoint(p)["model"])
        ['bias', 'weight']
    """
    choice("distributed", distributed, (None, True, False))
    # choice() compares with ==: 0 or numpy's False pass it and must mean False below.
    distributed = None if distributed is None else bool(distributed)
    path = _file_target(path)
    rank = None if distributed is False else _group_rank()
    if rank is None:
        _write(obj, path)
    elif distributed:
        _write_collectively(obj, path, rank)
    elif rank == 0:
        _write(obj, path)
    return path


def load_checkpoint(
    path: str | os.PathLike[str] | IO[bytes],
    device: str | int | torch.device | None = "cpu",
    *,
    weights_only: bool = True,
    verify: bool = True,
) -> Any:
    """Load a checkpoint onto ``device``, safely, wherever it was saved.

    Tensors saved on a GPU load on a CPU-only machine (``map_location``). ``weights_only=True``
    never falls back to unsafe unpickling, but allows a fixed set of data-only types
    (numpy arrays, scalars and dtypes, ``argparse.Namespace``, ``pathlib`` paths,
    ``datetime`` values) for this load only. The file type is read from its first bytes
    (torch zip, legacy torch pickle, safetensors), not its name.

    A directory is read as what other tools write: a sharded checkpoint with its
    ``*.safetensors.index.json`` or ``pytorch_model.bin.index.json`` (Accelerate
    ``save_model``, transformers ``save_pretrained``; or that index file given itself)
    is loaded as one state dict (each
    shard with the same ``weights_only`` and ``verify``); otherwise ``model.safetensors``, else
    ``pytorch_model.bin`` (Accelerate ``save_state``: the model only, not its
    ``optimizer.bin`` or random states).

    An open binary file object (``open(path, "rb")``, ``io.BytesIO``), as ``torch.load``
    takes, is read from its current position, with the same checks and the same
    ``weights_only`` load.

    Args:
        path: The file or directory (``str`` or path-like; a leading ``~`` is the home
            directory), or a seekable binary file object open for reading.
        device: ``"cpu"``, ``"cuda"``, ``"cuda:N"`` (or the int ``N``), ``"mps"``, a
            ``torch.device`` of those types, or None / ``"auto"`` for
            ``trainperf.device.best_device()`` (as ``device=None`` means elsewhere in
            trainperf), parsed by :func:`trainperf.device.resolve_device`. Under a process
            group, a GPU without an index (``"cuda"``, ``"auto"``) is the rank's own
            (``LOCAL_RANK``'s, as DDP has it), not the current device; ``"cuda:N"`` stays
            GPU ``N``. The device is checked before the file is read. The default is
            ``"cpu"``, not the best device, because ``model.load_state_dict`` copies the
            tensors into the model wherever its parameters live: loading onto a GPU first
            would hold a second copy of the weights (and optimizer state) in GPU memory, and
            the load works the same on a machine without the GPU the file was saved on.
        weights_only: Refuse pickled code (the default). ``False`` runs whatever the file
            contains: only for files you trust.
        verify: Check every CRC-32 of a torch zip file first, so flipped bytes in tensor
            data are reported instead of loaded (one extra read of the file).

    Returns:
        The saved object, with every tensor on ``device``.

    Raises:
        ValueError: ``device`` is not one of the forms above, or a file object given is
            closed, not open for reading, or cannot seek (read it into ``io.BytesIO``).
        TypeError: ``device`` is not a str, int or torch.device (a ``torch.load``
            ``map_location`` dict or function included), or ``path`` is not a path
            or binary file object (``bytes`` holding a checkpoint: pass
            ``io.BytesIO(data)``; a file opened in text mode: open it with ``"rb"``).
        DeviceError: CUDA or MPS asked for but not available, or fewer GPUs than the index.
        CheckpointNotFoundError: No file at ``path``.
        NotACheckpointError: A directory without weights trainperf recognises (or a
            ``torch.distributed.checkpoint`` one: the message names the converter), a file
            of another kind (text, JSON, image, ...), or a named pipe, socket or device
            (refused before it is opened: reading a pipe would wait for a writer).
        CheckpointCorruptError: An empty, truncated or damaged checkpoint.
        MemoryError: Host memory ran out while loading (not a ``CheckpointError``: the file
            is fine); the message gives the file's size and what to try instead.
        torch.OutOfMemoryError: GPU memory ran out while loading onto ``device`` (not a
            ``CheckpointError``: the file is fine); the message names the file, its size
            and the fix (``device="cpu"``, or free GPU memory).
        OSError: The file (or a directory's listing, or its shard index) could not be
            read (no permission, too many open files, a disk or network-filesystem error;
            ``PermissionError`` for EACCES): not a
            ``CheckpointError``, the file may be fine; the message names it and what to check.
        UnsafeCheckpointError: ``weights_only=True`` refused an object in the file.
        CheckpointError: A file saved by a newer PyTorch than this one (the message says
            to upgrade torch; the file is not damaged), or any other failure while loading
            (cause chained).

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     p = save_checkpoint({"step": 3, "w": torch.ones(2)}, Path(d, "c.pt"))
        ...     load_checkpoint(p, "cpu")
        ...     with open(p, "rb") as f:
        ...         load_checkpoint(f)["step"]
        {'step': 3, 'w': tensor([1., 1.])}
        3
    """
    _refuse_map_location(device)
    dev = load_device(device)
    if not isinstance(path, (str, os.PathLike)):
        return load_stream(_file_object(path), dev, weights_only, verify)
    path = Path(os.fspath(path)).expanduser()
    if path.is_dir():
        kind, path = directory_weights(path)
    elif path.name.endswith(INDEX_SUFFIXES) and path.exists():
        kind = "index"  # the index file itself: its directory's shards (a missing one: not found)
    else:
        kind = "file"
    if kind == "index":
        return load_sharded(path, lambda shard: load_file(shard, dev, weights_only, verify))
    return load_file(path, dev, weights_only, verify)


def _refuse_map_location(device: object) -> None:
    """Refuse a ``torch.load`` ``map_location`` dict or function given as ``device``.

    Raises:
        TypeError: ``device`` is a dict or callable: the message says to name one device.
    """
    if isinstance(device, Mapping) or (callable(device) and not isinstance(device, str)):
        raise TypeError(
            "load_checkpoint maps every tensor onto one device, so device takes a device "
            f"(str, int or torch.device), not a torch.load map_location {type(device).__name__} "
            f"({device!r}); pass device='cpu' (or 'cuda', 'cuda:N', 'auto') and move tensors "
            "yourself after loading, or call torch.load(path, map_location=..., "
            "weights_only=True) directly"
        )


def _file_object(path: object) -> IO[Any]:
    """``path``, given to ``load_checkpoint`` as neither a str nor path-like, as the file
    object it must then be.

    Raises:
        TypeError: it is not one (``bytes`` holding the checkpoint itself: the message says
            to wrap them in ``io.BytesIO``).
    """
    if isinstance(path, (bytes, bytearray, memoryview)):
        raise TypeError(
            f"load_checkpoint takes a path or a binary file object, got {type(path).__name__} "
            f"({len(path)} bytes): for a checkpoint's contents, pass io.BytesIO(data); for "
            "a path held as bytes, pass os.fsdecode(path)"
        )
    if not callable(getattr(path, "read", None)):
        raise TypeError(
            "load_checkpoint takes a path (str or os.PathLike) or a binary file object open "
            f"for reading, got {type(path).__name__}: pass the checkpoint's path"
        )
    return path  # type: ignore[return-value]
