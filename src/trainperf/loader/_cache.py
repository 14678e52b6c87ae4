"""The tuner's cache: chosen DataLoader settings in one JSON file under the user cache dir.

``$XDG_CACHE_HOME/trainperf/loader.json`` (``~/.cache/trainperf/loader.json`` when the
variable is unset or not an absolute path). Entries are keyed by a hash of what decides the
answer (dataset type, length and sample shape, batch size, usable CPUs, host, device type
and the relevant loader arguments). The file itself is the tuners' shared store
(:mod:`trainperf._utils.cache`): writes are atomic (a temporary file fsynced and renamed
over the old one, then the directory fsynced), so an interrupted run or two ranks writing at
once never leave half a file, and temp files of killed writers are cleaned up; a file that
does not parse is ignored and replaced on the next write.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from torch.utils.data import IterableDataset

from trainperf._utils import cache
from trainperf._utils.cache import make_key, sample_signature
from trainperf._utils.lifetime import DieWithParent
from trainperf._utils.qualname import qualname

__all__ = [
    "cache_file",
    "key_fields",
    "length",
    "make_key",
    "read_entry",
    "sample_signature",
    "write_entry",
]

_VERSION = 3  # 2: a dataset with set_epoch() gets no persistent workers; 3: a wrapped one too
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


def cache_file() -> Path:
    """The cache file: ``$XDG_CACHE_HOME/trainperf/loader.json`` or under ``~/.cache``.

    Example:
        >>> import os
        >>> from unittest import mock
        >>> with mock.patch.dict(os.environ, {"XDG_CACHE_HOME": "/tmp/xdg"}):  # then restored
        ...     str(cache_file())
        '/tmp/xdg/trainperf/loader.json'
    """
    return cache.cache_dir() / "loader.json"


def _unwrapped(value: Any) -> Any:
    """The caller's own function inside :class:`trainperf.DieWithParent`, which does not
    change the answer (every worker the tuner starts has it)."""
    return value.user_fn if isinstance(value, DieWithParent) else value


def _describe(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if hasattr(value, "get_start_method"):
        return str(value.get_start_method())
    desc = qualname(value)
    if hasattr(value, "__len__") and not callable(value):
        with contextlib.suppress(TypeError):
            desc += f"[{len(value)}]"
    return desc


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


def dataset_kind(dataset: Any, depth: int = 0) -> Any:
    """The dataset's type, with those of the datasets it wraps (``Subset`` and
    ``random_split``'s ``.dataset``, ``ConcatDataset``'s ``.datasets``): two ``Subset`` s
    of different datasets are different loaders to tune.

    Example:
        >>> import torch
        >>> from torch.utils.data import Subset, TensorDataset
        >>> dataset_kind(Subset(TensorDataset(torch.zeros(4)), [0, 1]))
        ['torch.utils.data.dataset.Subset', 'torch.utils.data.dataset.TensorDataset']
    """
    name = qualname(dataset)
    if depth >= 4:
        return name
    inner = getattr(dataset, "dataset", None)
    if inner is not None and not isinstance(inner, (str, bytes)):
        return [name, dataset_kind(inner, depth + 1)]
    parts = getattr(dataset, "datasets", None)
    if isinstance(parts, (list, tuple)):
        return [name, [dataset_kind(d, depth + 1) for d in parts[:16]]]
    return name


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
        >>> import torch
        >>> from torch.utils.data import TensorDataset
        >>> f = key_fields(TensorDataset(torch.zeros(10, 2)), 4, cpus=2, device_type="cpu",
        ...                max_workers=8, epochs_hint=None, step_fn=None,
        ...                loader_kwargs={"shuffle": True, "timeout": 5})
        >>> f["len"], f["sample"], f["loader"]
        (10, ['tuple', [['tensor', [2], 'torch.float32']]], {'shuffle': True})
    """
    return {
        "v": _VERSION,
        "dataset": dataset_kind(dataset),
        "len": length(dataset),
        "sample": sample_signature(_first_sample(dataset)),
        "batch_size": batch_size,
        "cpus": cpus,
        "host": socket.gethostname(),
        "device": device_type,
        "max_workers": max_workers,
        "epochs_hint": epochs_hint,
        "step_fn": None if step_fn is None else qualname(step_fn),
        "loader": {
            k: _describe(_unwrapped(loader_kwargs[k])) for k in _KEY_KWARGS if k in loader_kwargs
        },
    }


def read_entry(key: str, path: Path | None = None) -> dict[str, Any] | None:
    """The entry stored under ``key`` in ``path`` (default :func:`cache_file`), or None
    (missing, unreadable or corrupt file): :func:`trainperf._utils.cache.read_entry`.

    Example:
        >>> import tempfile, pathlib
        >>> p = pathlib.Path(tempfile.mkdtemp()) / "loader.json"
        >>> read_entry("k", p) is None
        True
        >>> write_entry("k", {"num_workers": 3}, p)
        >>> read_entry("k", p)["num_workers"]
        3
    """
    return cache.read_entry(key, path or cache_file())


def write_entry(key: str, entry: dict[str, Any], path: Path | None = None) -> None:
    """Store ``entry`` under ``key`` in ``path`` (default :func:`cache_file`) atomically; a
    corrupt existing file is replaced: :func:`trainperf._utils.cache.write_entry`.

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
    cache.write_entry(key, entry, path or cache_file())
