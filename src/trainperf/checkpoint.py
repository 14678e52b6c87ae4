"""Save and load checkpoints safely: atomic writes, cross-device loads, wrapper prefixes.

``save_checkpoint`` never leaves a half-written file under the final name (temp file, fsync,
``os.replace``); ``load_checkpoint`` maps GPU-saved tensors to any device, refuses pickled code
unless told to trust the file, and names the cause when a file is missing, damaged or not a
checkpoint; ``load_state_dict`` fits state dicts with or without the ``module.`` (DataParallel,
DDP) and ``_orig_mod.`` (``torch.compile``) prefixes into wrapped or plain models.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pickle
import re
import secrets
import socket
import struct
import sys
import zipfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, TypeVar

import torch
from torch import nn

from trainperf._imports import require
from trainperf.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    DeviceError,
    NotACheckpointError,
    StateDictMismatchError,
    UnsafeCheckpointError,
)

__all__ = [
    "DEFAULT_PREFIXES",
    "LoadResult",
    "load_checkpoint",
    "load_state_dict",
    "save_checkpoint",
    "strip_prefix",
    "unwrap_model",
]

DEFAULT_PREFIXES: tuple[str, ...] = ("module.", "_orig_mod.")
M = TypeVar("M", bound=Mapping[str, Any])
Mismatch = tuple[str, tuple[int, ...], tuple[int, ...]]

# torch.save's legacy (non-zip) format starts with this pickled long (torch/serialization.py).
_LEGACY_MAGIC = (0x1950A86A20F9469CFC6C).to_bytes(10, "little")
_TEMP_SUFFIX = re.compile(r"(?P<host>.*)-(?P<pid>\d+)-[0-9a-f]{8}")


def unwrap_model(model: nn.Module) -> nn.Module:
    """Peel DataParallel, DistributedDataParallel and ``torch.compile`` layers off ``model``.

    Wrappers share their parameters with the module inside, so loading into the result
    loads into the wrapped model too.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.

    Example:
        >>> net = nn.Linear(2, 2)
        >>> unwrap_model(nn.DataParallel(net)) is net
        True
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"unwrap_model expects an nn.Module, got {type(model).__name__}")
    # OptimizedModule can only exist once torch._dynamo is imported; importing it here would
    # cost a second on every call.
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    optimized = getattr(eval_frame, "OptimizedModule", None)
    parallel = (nn.DataParallel, nn.parallel.DistributedDataParallel)
    while True:
        if isinstance(model, parallel):
            model = model.module
        elif optimized is not None and isinstance(model, optimized):
            model = model._orig_mod
        else:
            return model


def _strip_key(
    key: str, prefixes: tuple[str, ...], rounds: int | None, meta: bool = False
) -> tuple[str, int]:
    done = 0
    while rounds is None or done < rounds:
        for p in prefixes:
            if key.startswith(p) and len(key) > len(p):
                key = key[len(p) :]
                done += 1
                break
            # `_metadata` keys are module paths without the trailing dot: "module" is the root.
            if meta and p.endswith(".") and key == p[:-1]:
                key = ""
                done += 1
                break
        else:
            break
    return key, done


def _same_type(template: Mapping[str, Any], items: Iterable[tuple[str, Any]]) -> Any:
    pairs = list(items)
    try:
        out: Any = type(template)()
        for k, v in pairs:
            out[k] = v
    except Exception:  # a read-only or oddly constructed Mapping: a plain dict will do
        out = dict(pairs)
    return out


def _strip(state_dict: M, prefixes: tuple[str, ...], rounds: int | None) -> M:
    origin: dict[str, str] = {}
    pairs = []
    for key, value in state_dict.items():
        new = _strip_key(key, prefixes, rounds)[0] if isinstance(key, str) else key
        if new in origin:
            raise ValueError(
                f"strip_prefix: keys {origin[new]!r} and {key!r} both become {new!r} after "
                f"removing {prefixes}; the state dict mixes wrapped and unwrapped copies of "
                "one parameter: keep one of them before loading"
            )
        origin[new] = key
        pairs.append((new, value))
    out: M = _same_type(state_dict, pairs)
    meta = getattr(state_dict, "_metadata", None)
    if meta is not None:
        # Wrappers add their own metadata entries; the innermost module's (most stripped) wins.
        depth: dict[str, int] = {}
        new_meta: dict[str, Any] = {}
        for key, value in dict(meta).items():
            new, done = _strip_key(key, prefixes, rounds, meta=True)
            if done >= depth.get(new, -1):
                depth[new], new_meta[new] = done, value
        with contextlib.suppress(AttributeError, TypeError):
            out._metadata = _same_type(meta, new_meta.items())  # type: ignore[attr-defined]
    return out


def _check_prefixes(prefixes: str | Iterable[str]) -> tuple[str, ...]:
    result = (prefixes,) if isinstance(prefixes, str) else tuple(prefixes)
    if not result or any(not isinstance(p, str) or not p for p in result):
        raise ValueError(f"prefixes must be non-empty strings such as 'module.', got {prefixes!r}")
    return result


def strip_prefix(state_dict: M, prefixes: str | Iterable[str] = DEFAULT_PREFIXES) -> M:
    """Return a copy of ``state_dict`` with wrapper prefixes removed from the front of each key.

    Prefixes are removed repeatedly in any order, so ``module._orig_mod.fc.weight`` (DDP around
    a compiled model) and ``_orig_mod.module.fc.weight`` both become ``fc.weight``. The result
    has the input's mapping type (an ``OrderedDict`` stays one) and keeps torch's ``_metadata``
    attribute, with its keys stripped too.

    Args:
        state_dict: A mapping from parameter names to values.
        prefixes: Prefixes to remove; each must be non-empty.

    Returns:
        A new mapping; the input is not changed.

    Raises:
        ValueError: A prefix is empty, or two keys become the same key.

    Example:
        >>> strip_prefix({"module._orig_mod.fc.weight": 1, "step": 2})
        {'fc.weight': 1, 'step': 2}
    """
    return _strip(state_dict, _check_prefixes(prefixes), None)


@dataclass(frozen=True)
class LoadResult:
    """What ``load_state_dict`` left out.

    Attributes:
        missing: Model keys the state dict lacks (left at their current values).
        unexpected: State-dict keys the model has no place for (ignored).
        mismatched: ``(key, checkpoint_shape, model_shape)`` for keys whose shapes differ
            (not loaded).
    """

    missing: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()
    mismatched: tuple[Mismatch, ...] = ()

    @property
    def complete(self) -> bool:
        """True when every key was loaded and nothing was left over."""
        return not (self.missing or self.unexpected or self.mismatched)


def _names(names: list[str], limit: int = 10) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ...and {len(names) - limit} more" if len(names) > limit else "")


def _mismatch_message(model: nn.Module, sd: Mapping[str, Any], result: LoadResult) -> str:
    lines = [f"state dict does not fit {type(model).__name__}:"]
    if result.missing:
        n = len(result.missing)
        lines.append(f"  {n} missing key(s) (in the model, not the state dict): ")
        lines[-1] += _names(list(result.missing))
    if result.unexpected:
        n = len(result.unexpected)
        lines.append(f"  {n} unexpected key(s) (in the state dict, not the model): ")
        lines[-1] += _names(list(result.unexpected))
    if result.mismatched:
        shapes = [f"{k} checkpoint {tuple(a)} vs model {tuple(b)}" for k, a, b in result.mismatched]
        lines.append(f"  {len(shapes)} shape mismatch(es): {_names(shapes)}")
    nested = [k for k, v in sd.items() if isinstance(v, Mapping)]
    if nested:
        lines.append(
            f"  The state dict holds nested dicts under {_names(nested)}: it looks like a whole "
            f"checkpoint; pass checkpoint[{nested[0]!r}] instead."
        )
    lines.append(
        "  Check that the checkpoint was saved from this architecture with the same sizes, "
        "or pass strict=False to load only the keys that fit."
    )
    return "\n".join(lines)


def load_state_dict(
    model: nn.Module, state_dict: Mapping[str, Any], *, strict: bool = True
) -> LoadResult:
    """Load ``state_dict`` into ``model``, whichever of them carries wrapper prefixes.

    The state dict's ``module.`` / ``_orig_mod.`` prefixes are removed as far as that makes
    its keys match, and it is loaded into ``unwrap_model(model)``, which shares parameters
    with every wrapper around it. Shapes are checked before anything is copied, so one error
    lists missing, unexpected and shape-mismatched keys together.

    Args:
        model: A plain, DataParallel, DDP or ``torch.compile``-d module (any nesting).
        state_dict: Parameters and buffers, e.g. ``load_checkpoint(path)["model"]``.
        strict: If True, any difference raises and nothing is loaded. If False, the keys
            that fit are loaded and the rest are reported in the result.

    Returns:
        A ``LoadResult``; with ``strict=True`` it is always complete.

    Raises:
        TypeError: ``state_dict`` is not a mapping.
        StateDictMismatchError: ``strict=True`` and keys or shapes differ; the model is
            unchanged.

    Example:
        >>> net = nn.Linear(2, 2)
        >>> load_state_dict(net, nn.DataParallel(nn.Linear(2, 2)).state_dict()).complete
        True
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            f"state_dict must be a mapping of names to tensors, got {type(state_dict).__name__}"
        )
    inner = unwrap_model(model)
    target = inner.state_dict()
    # Candidates strip one more layer of prefixes each; the one matching most model keys wins,
    # so a model with a submodule that really is called "module" is not over-stripped.
    best, best_score = state_dict, sum(k in target for k in state_dict)
    candidate: Mapping[str, Any] = state_dict
    while True:
        try:
            nxt = _strip(candidate, DEFAULT_PREFIXES, 1)
        except ValueError:
            break
        if list(nxt) == list(candidate):
            break
        candidate = nxt
        score = sum(k in target for k in candidate)
        if score >= best_score:
            best, best_score = candidate, score
    unexpected = [k for k in best if k not in target]
    missing = [k for k in target if k not in best]
    mismatched: list[Mismatch] = []
    for key, value in best.items():
        want = target.get(key)
        if (
            isinstance(value, torch.Tensor)
            and isinstance(want, torch.Tensor)
            and not nn.parameter.is_lazy(want)
            and value.shape != want.shape
        ):
            mismatched.append((key, tuple(value.shape), tuple(want.shape)))
    result = LoadResult(tuple(missing), tuple(unexpected), tuple(mismatched))
    if strict:
        if not result.complete:
            raise StateDictMismatchError(
                _mismatch_message(inner, best, result),
                missing=missing,
                unexpected=unexpected,
                mismatched=mismatched,
            )
        inner.load_state_dict(best, strict=True)
        return result
    skip = set(unexpected) | {k for k, _, _ in mismatched}
    keep = _same_type(best, ((k, v) for k, v in best.items() if k not in skip))
    if hasattr(best, "_metadata"):
        keep._metadata = best._metadata
    torch_result = inner.load_state_dict(keep, strict=False)
    bad = {k for k, _, _ in mismatched}
    # torch's own list accounts for load hooks (e.g. BatchNorm filling in old checkpoints).
    missing = [k for k in torch_result.missing_keys if k not in bad]
    unexpected += [k for k in torch_result.unexpected_keys if k not in unexpected]
    return LoadResult(tuple(missing), tuple(unexpected), tuple(mismatched))


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


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        # Some filesystems cannot fsync a directory; the rename is still atomic there.
        if e.errno not in (errno.EINVAL, errno.EBADF, errno.ENOTSUP, errno.EISDIR):
            raise
    finally:
        os.close(fd)


def _make_parents(directory: Path) -> None:
    created = []
    d = directory
    while not d.exists():
        created.append(d)
        d = d.parent
    directory.mkdir(parents=True, exist_ok=True)
    for d in reversed(created):
        _fsync_dir(d.parent)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale_temps(path: Path, host: str) -> None:
    lead = f".{path.name}.tmp-"
    with contextlib.suppress(OSError):
        for entry in path.parent.iterdir():
            m = _TEMP_SUFFIX.fullmatch(entry.name[len(lead) :])
            if not entry.name.startswith(lead) or m is None or m["host"] != host:
                continue
            pid = int(m["pid"])
            if pid != os.getpid() and not _pid_alive(pid):
                with contextlib.suppress(OSError):
                    entry.unlink()


def _os_error(e: BaseException) -> OSError | None:
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, OSError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def _write_atomically(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    if path.is_dir():
        raise CheckpointError(
            f"cannot save checkpoint to {path}: it is a directory; give a file path such as "
            f"{path / 'checkpoint.pt'}",
            path,
        )
    host = re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname())
    tmp = path.parent / f".{path.name}.tmp-{host}-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        _make_parents(path.parent)
        _remove_stale_temps(path, host)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if not isinstance(e, Exception):
            raise
        os_err = _os_error(e)
        if os_err is not None:
            reason = os_err.strerror or str(os_err)
            hint = {
                errno.ENOSPC: "the disk is full: free space or save to another disk",
                errno.EDQUOT: "the disk quota is exhausted: free space or save elsewhere",
                errno.EACCES: "no permission to write there: pick a writable directory",
                errno.EROFS: "the filesystem is read-only: save to a writable disk",
            }.get(os_err.errno or 0, "")
            reason += f" ({hint})" if hint else ""
        else:
            reason = f"the object could not be serialised: {type(e).__name__}: {e}"
        raise CheckpointError(
            f"could not save checkpoint {path}: {reason}; any previous file there is unchanged",
            path,
        ) from e
    try:
        _fsync_dir(path.parent)
    except OSError as e:
        raise CheckpointError(
            f"saved checkpoint {path}, but could not flush its directory to disk "
            f"({e.strerror or e}): after a power loss the old file may reappear",
            path,
        ) from e


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
    return bytes(save({k: v.contiguous() for k, v in obj.items()}))


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

                _write_atomically(path, write_bytes)
            else:
                prepared = _prepare(obj)
                _write_atomically(path, lambda f: torch.save(prepared, f))
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


def _resolve_device(device: str | torch.device) -> torch.device:
    if isinstance(device, torch.device):
        dev = device
    elif device == "auto":
        from trainperf.device import best_device

        dev = best_device()
    elif isinstance(device, str) and re.fullmatch(r"cpu|cuda(:\d+)?", device):
        dev = torch.device(device)
    else:
        raise ValueError(
            f"device must be 'auto', 'cpu', 'cuda', 'cuda:N' or a torch.device, got {device!r}"
        )
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(
                f"load_checkpoint(device={device!r}) needs CUDA, but torch.cuda.is_available() "
                "is False on this machine; load with device='cpu' (or 'auto') instead"
            )
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise DeviceError(
                f"load_checkpoint(device={device!r}): only {count} GPU(s) are visible "
                f"(cuda:0 to cuda:{count - 1}; CUDA_VISIBLE_DEVICES renumbers them from 0)"
            )
    return dev


def _describe(head: bytes) -> str:
    text = head.lstrip()
    kinds = [
        (b"\x89PNG", "a PNG image"),
        (b"\xff\xd8\xff", "a JPEG image"),
        (b"\x93NUMPY", "a NumPy .npy array (use numpy.load)"),
        (b"\x89HDF", "an HDF5 file (Keras/h5py)"),
        (b"\x1f\x8b", "gzip-compressed data (decompress it first)"),
        (b"version https://git-lfs", "a Git LFS pointer: fetch the real file with git lfs pull"),
        (b"<", "an HTML/XML page: the download probably returned an error or login page"),
        (b"{", "JSON text"),
        (b"[", "JSON text"),
    ]
    for magic, what in kinds:
        if (text if magic[:1] in b"<{[v" else head).startswith(magic):
            return what
    try:
        head.decode("utf-8")
    except UnicodeDecodeError:
        return "unrecognised binary data"
    return "a text file"


def _is_safetensors(head: bytes) -> bool:
    if len(head) < 9:
        return False
    (n,) = struct.unpack("<Q", head[:8])
    return 0 < n < 100_000_000 and head[8:9] == b"{"


def _open_zip(path: Path, verify: bool) -> None:
    """Check the zip structure (and CRC-32s) in Python first: torch only says 'miniz error'."""
    try:
        with zipfile.ZipFile(path) as zf:
            names = zf.namelist()
            if not any(n.endswith("/data.pkl") and n.count("/") == 1 for n in names):
                raise NotACheckpointError(
                    f"{path} is a zip archive but not one torch.save writes (no data.pkl); "
                    "unpack it or point to the .pt file inside",
                    path,
                )
            for info in zf.infolist() if verify else []:
                if info.CRC == 0:  # saved with compute_crc32=False: nothing to compare
                    continue
                with zf.open(info) as member:
                    while member.read(1 << 24):
                        pass
    except (zipfile.BadZipFile, EOFError, OSError, ValueError) as e:
        with open(path, "rb") as f:
            f.seek(max(0, path.stat().st_size - (1 << 16) - 22))
            has_end = b"PK\x05\x06" in f.read()
        cause = (
            "truncated: the end-of-archive record is missing, so the file was cut short "
            "(an interrupted save, copy or download)"
            if not has_end
            else f"damaged ({e}): bytes were changed after saving (bad disk or transfer)"
        )
        raise CheckpointCorruptError(
            f"checkpoint {path} is {cause}; re-copy it or use an earlier checkpoint", path
        ) from e


def _refusal_reason(msg: str) -> str:
    """The specific reason inside torch's long weights_only message (its layout varies)."""
    msg = re.sub(r"\x1b\[[0-9;]*m", "", msg)
    m = re.search(r"WeightsUnpickler error:\s*(.*?)(?:\n\n|$)", msg, re.S)
    if m:
        return m.group(1).strip()
    skip = ("Weights only load failed", "Check the documentation")
    middle = [p.strip() for p in msg.split("\n\n") if p.strip() and not p.strip().startswith(skip)]
    return " ".join(middle) or "see the chained error"


def _torch_load(path: Path, dev: torch.device, weights_only: bool) -> Any:
    try:
        return torch.load(path, map_location=dev, weights_only=weights_only)
    except torch.OutOfMemoryError:
        raise
    except Exception as e:
        msg = str(e)
        if isinstance(e, pickle.UnpicklingError) and "Weights only load failed" in msg:
            reason = _refusal_reason(msg)
            raise UnsafeCheckpointError(
                f"{path} contains objects that weights_only=True refuses to unpickle "
                f"({reason}). Unpickling can run arbitrary code. If you trust the file, "
                "allow its classes with torch.serialization.add_safe_globals([...]), or "
                "load it with weights_only=False (only for files you trust)",
                path,
            ) from e
        if isinstance(e, (RuntimeError, EOFError, pickle.UnpicklingError, KeyError, ValueError)):
            raise CheckpointCorruptError(
                f"checkpoint {path} is damaged or truncated ({type(e).__name__}: "
                f"{msg.splitlines()[0] if msg else 'no detail'}); re-copy it or use an "
                "earlier checkpoint",
                path,
            ) from e
        raise CheckpointError(
            f"could not load checkpoint {path}: {type(e).__name__}: {e}", path
        ) from e


def load_checkpoint(
    path: str | os.PathLike[str],
    device: str | torch.device = "cpu",
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
        device: ``"cpu"``, ``"cuda"``, ``"cuda:N"``, a ``torch.device``, or ``"auto"``
            (``trainperf.device.best_device()``). CUDA is checked before the file is read.
        weights_only: Refuse pickled code (the default). ``False`` runs whatever the file
            contains: only for files you trust.
        verify: Check every CRC-32 of a torch zip file first, so flipped bytes in tensor
            data are reported instead of loaded (one extra read of the file).

    Returns:
        The saved object, with every tensor on ``device``.

    Raises:
        ValueError: ``device`` is not one of the forms above.
        DeviceError: CUDA asked for but not available, or fewer GPUs than the index.
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
    dev = _resolve_device(device)
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
