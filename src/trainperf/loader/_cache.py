"""The tuner's cache: chosen DataLoader settings in one JSON file under the user cache dir.

``$XDG_CACHE_HOME/trainperf/loader.json`` (``~/.cache/trainperf/loader.json`` when the
variable is unset). Entries are keyed by a hash of what decides the answer (dataset type,
length and sample shape, batch size, usable CPUs, host, device type and the relevant loader
arguments). Writes are atomic (:func:`trainperf._utils.atomic.write_atomically`: a temporary file
fsynced and renamed over the old one, then the directory fsynced), so an interrupted run or
two ranks writing at once never leave half a file, and temp files of killed writers are
cleaned up; a file that does not parse is ignored and replaced on the next write.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import socket
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch
from torch.utils.data import IterableDataset

from trainperf._utils.atomic import write_atomically
from trainperf._utils.lifetime import DieWithParent

__all__ = [
    "cache_file",
    "key_fields",
    "length",
    "make_key",
    "read_entry",
    "sample_signature",
    "write_entry",
]

_VERSION = 1
# Arguments that change the work per batch or the answer; the rest (timeout, generator)
# do not belong in the key. Callables count by name: their identity changes every run. The
# caller's own num_workers and prefetch_factor are in it: that setting is measured as one
# candidate and judged in the report, so it changes the answer.
_KEY_KWARGS = (
    "num_workers",
    "prefetch_factor",
    "shuffle",
    "sampler",
    "collate_fn",
    "pin_memory",
    "drop_last",
    "worker_init_fn",
    "multiprocessing_context",
    "persistent_workers",
    "in_order",
)
# Old entries are dropped beyond this many so the file cannot grow without bound.
_MAX_ENTRIES = 256


def cache_file() -> Path:
    """The cache file: ``$XDG_CACHE_HOME/trainperf/loader.json`` or under ``~/.cache``.

    Example:
        >>> import os
        >>> os.environ["XDG_CACHE_HOME"] = "/tmp/xdg"
        >>> str(cache_file())
        '/tmp/xdg/trainperf/loader.json'
    """
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "trainperf" / "loader.json"


def _qualname(obj: Any) -> str:
    """``module.qualname`` of a class or function (of the object's type otherwise); lambdas and
    nested functions, whose names are not unique, add where they are defined, and a
    ``functools.partial`` names its function.

    Example:
        >>> _qualname(len), _qualname(3)
        ('builtins.len', 'builtins.int')
        >>> f, g = (lambda b: None), (lambda b: b)
        >>> _qualname(f) == _qualname(g), _qualname(f).split("@")[0].endswith(".<lambda>")
        (False, True)
    """
    if isinstance(obj, functools.partial):
        return f"functools.partial({_qualname(obj.func)})"
    target = (
        obj
        if isinstance(obj, type) or (callable(obj) and hasattr(obj, "__qualname__"))
        else type(obj)
    )
    name = f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', repr(target))}"
    code = getattr(target, "__code__", None)
    if code is not None and ("<lambda>" in name or "<locals>" in name):
        name += f"@{code.co_filename}:{code.co_firstlineno}:{code.co_code.hex()[:32]}"
    return name


def _unwrapped(value: Any) -> Any:
    """The caller's own function inside :class:`trainperf.DieWithParent`, which does not
    change the answer (every worker the tuner starts has it)."""
    return value.user_fn if isinstance(value, DieWithParent) else value


def _describe(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if hasattr(value, "get_start_method"):
        return str(value.get_start_method())
    desc = _qualname(value)
    if hasattr(value, "__len__") and not callable(value):
        with contextlib.suppress(TypeError):
            desc += f"[{len(value)}]"
    return desc


def sample_signature(x: Any, depth: int = 0) -> Any:
    """Shape-and-type description of a sample, for the cache key.

    Example:
        >>> sample_signature((torch.zeros(3, 8, 8), 7))
        ['tuple', [['tensor', [3, 8, 8], 'torch.float32'], 'int']]
    """
    if isinstance(x, torch.Tensor):
        return ["tensor", list(x.shape), str(x.dtype)]
    if isinstance(x, np.ndarray):
        return ["ndarray", list(x.shape), str(x.dtype)]
    if depth > 4:
        return type(x).__qualname__
    if isinstance(x, Mapping):
        return {str(k): sample_signature(v, depth + 1) for k, v in list(x.items())[:32]}
    if isinstance(x, (list, tuple)):
        return [type(x).__qualname__, [sample_signature(v, depth + 1) for v in x[:32]]]
    if hasattr(x, "size") and hasattr(x, "mode"):  # PIL images
        return ["image", list(x.size), str(x.mode)]
    return type(x).__qualname__


def _first_sample(dataset: Any) -> Any:
    try:
        if isinstance(dataset, IterableDataset):
            return next(iter(dataset))
        return dataset[0]
    except Exception as e:
        raise RuntimeError(
            f"reading the first sample of the dataset failed in the main process, so there "
            f"is nothing to tune: {e!r}"
        ) from e


def length(obj: Any) -> int | None:
    """``len(obj)``, or None when it has no length (an iterable dataset, or a ``__len__``
    that raises ``NotImplementedError``)."""
    try:
        return len(obj)
    except (TypeError, NotImplementedError):
        return None


def key_fields(
    dataset: Any,
    batch_size: int,
    *,
    cpus: int,
    device_type: str,
    max_workers: int,
    epochs_hint: int | None,
    step_fn: Callable[[Any], Any] | None,
    loader_kwargs: Mapping[str, Any],
) -> dict[str, Any]:
    """What decides the tuner's answer: dataset type, length and first sample's shape,
    batch size, usable CPUs, host, device type and the relevant loader arguments.

    Raises:
        RuntimeError: reading the first sample fails.

    Example:
        >>> from torch.utils.data import TensorDataset
        >>> f = key_fields(TensorDataset(torch.zeros(10, 2)), 4, cpus=2, device_type="cpu",
        ...                max_workers=8, epochs_hint=None, step_fn=None,
        ...                loader_kwargs={"shuffle": True, "timeout": 5})
        >>> f["len"], f["sample"], f["loader"]
        (10, ['tuple', [['tensor', [2], 'torch.float32']]], {'shuffle': True})
    """
    return {
        "v": _VERSION,
        "dataset": _qualname(dataset),
        "len": length(dataset),
        "sample": sample_signature(_first_sample(dataset)),
        "batch_size": batch_size,
        "cpus": cpus,
        "host": socket.gethostname(),
        "device": device_type,
        "max_workers": max_workers,
        "epochs_hint": epochs_hint,
        "step_fn": None if step_fn is None else _qualname(step_fn),
        "loader": {
            k: _describe(_unwrapped(loader_kwargs[k])) for k in _KEY_KWARGS if k in loader_kwargs
        },
    }


def make_key(fields: dict[str, Any]) -> str:
    """A stable hash of ``fields`` (JSON-serialisable values), used as the entry key.

    Example:
        >>> make_key({"a": 1, "b": [2, 3]}) == make_key({"b": [2, 3], "a": 1})
        True
    """
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _load(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("version") != _VERSION:
        return {}
    entries = data.get("entries")
    return entries if isinstance(entries, dict) else {}


def read_entry(key: str, path: Path | None = None) -> dict[str, Any] | None:
    """The entry stored under ``key``, or None (missing, unreadable or corrupt file).

    Example:
        >>> import tempfile, pathlib
        >>> p = pathlib.Path(tempfile.mkdtemp()) / "loader.json"
        >>> read_entry("k", p) is None
        True
        >>> write_entry("k", {"num_workers": 3}, p)
        >>> read_entry("k", p)["num_workers"]
        3
    """
    entry = _load(path or cache_file()).get(key)
    return entry if isinstance(entry, dict) else None


def write_entry(key: str, entry: dict[str, Any], path: Path | None = None) -> None:
    """Store ``entry`` under ``key`` atomically; a corrupt existing file is replaced.

    Raises:
        OSError: the cache directory cannot be created or written.

    Example:
        >>> import tempfile, pathlib
        >>> p = pathlib.Path(tempfile.mkdtemp()) / "loader.json"
        >>> _ = p.write_text("{not json")
        >>> write_entry("k", {"num_workers": 1}, p)
        >>> read_entry("k", p)["num_workers"]
        1
    """
    path = path or cache_file()
    entries = _load(path)
    entries[key] = {**entry, "created": time.time()}
    if len(entries) > _MAX_ENTRIES:
        newest = sorted(entries.items(), key=lambda kv: kv[1].get("created", 0), reverse=True)
        entries = dict(newest[:_MAX_ENTRIES])
    data = json.dumps({"version": _VERSION, "entries": entries}, indent=1, sort_keys=True)

    def write(f: IO[bytes]) -> None:
        f.write(data.encode())

    write_atomically(path, write)
