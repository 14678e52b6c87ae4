"""The tuners' JSON cache: one file of keyed entries under the user cache directory.

Each tuner keeps its choices in its own file in :func:`cache_dir`
(``$XDG_CACHE_HOME/trainperf/``, ``~/.cache/trainperf/`` when the variable is unset): the
``loader`` tuner in ``loader.json`` (:mod:`trainperf.loader._cache`), the ``batchsize``
tuner in ``batch_size.json`` (:mod:`trainperf.batchsize._cache`). Entries are keyed by a
hash of what decides the answer (:func:`make_key`; a batch's shape and types by
:func:`sample_signature`). Writes are atomic (:func:`trainperf._utils.atomic.write_atomically`:
a temporary file fsynced and renamed over the old one, then the directory fsynced), so an
interrupted run or two ranks writing at once never leave half a file, and temp files of
killed writers are cleaned up; the read-add-write of an entry holds a lock on the
directory so concurrent writers do not drop each other's entries; a file that does not
parse is ignored and replaced on the next write; old entries are dropped past
:data:`MAX_ENTRIES`.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

from trainperf._utils.atomic import write_atomically

__all__ = ["MAX_ENTRIES", "cache_dir", "make_key", "read_entry", "sample_signature", "write_entry"]

_VERSION = 1
MAX_ENTRIES = 256
"""Old entries are dropped beyond this many, so a file cannot grow without bound."""


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/trainperf``, or ``~/.cache/trainperf`` when the variable is unset
    (or, as the XDG spec has it, not an absolute path).

    Example:
        >>> import os
        >>> os.environ["XDG_CACHE_HOME"] = "/tmp/xdg"
        >>> str(cache_dir())
        '/tmp/xdg/trainperf'
    """
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "trainperf"


def sample_signature(x: Any, depth: int = 0) -> Any:
    """Shape-and-type description of a sample (or a batch), for a cache key.

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
    except (OSError, ValueError, RecursionError):  # RecursionError: nested past the limit
        return {}
    if not isinstance(data, dict) or data.get("version") != _VERSION:
        return {}
    entries = data.get("entries")
    return entries if isinstance(entries, dict) else {}


def read_entry(key: str, path: Path) -> dict[str, Any] | None:
    """The entry stored under ``key`` in ``path``, or None (missing, unreadable or corrupt
    file, another version).

    Example:
        >>> import tempfile, pathlib
        >>> p = pathlib.Path(tempfile.mkdtemp()) / "tuner.json"
        >>> read_entry("k", p) is None
        True
        >>> write_entry("k", {"num_workers": 3}, p)
        >>> read_entry("k", p)["num_workers"]
        3
    """
    entry = _load(path).get(key)
    return entry if isinstance(entry, dict) else None


def write_entry(key: str, entry: dict[str, Any], path: Path) -> None:
    """Store ``entry`` under ``key`` in ``path`` atomically, with its creation time; a
    corrupt existing file is replaced, the oldest entries past :data:`MAX_ENTRIES` dropped.

    Raises:
        OSError: the cache directory cannot be created or written.

    Example:
        >>> import tempfile, pathlib
        >>> p = pathlib.Path(tempfile.mkdtemp()) / "tuner.json"
        >>> _ = p.write_text("{not json")
        >>> write_entry("k", {"num_workers": 1}, p)
        >>> read_entry("k", p)["num_workers"]
        1
    """
    with _locked(path):
        entries = _load(path)
        entries[key] = {**entry, "created": time.time()}
        if len(entries) > MAX_ENTRIES:
            newest = sorted(entries.items(), key=lambda kv: kv[1].get("created", 0), reverse=True)
            entries = dict(newest[:MAX_ENTRIES])
        data = json.dumps({"version": _VERSION, "entries": entries}, indent=1, sort_keys=True)

        def write(f: IO[bytes]) -> None:
            f.write(data.encode())

        write_atomically(path, write, keep_write_protected=False)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``path``'s directory while it is held, so that writers (the
    ranks of one job, two jobs on one host) each add their entry to what the last one wrote
    instead of all but one being lost. Where the directory cannot be made or opened, or the
    filesystem refuses ``flock`` (some network filesystems), the write goes ahead unlocked
    (still atomic; :func:`write_atomically` reports a directory it cannot make). The lock
    is released explicitly: a process forked meanwhile holds the descriptor too."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        yield
        return
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
