"""The data-only types ``load_checkpoint`` allows under ``weights_only=True``, and the refusal
message that lists every other global a file needs.

Checkpoints written by common tools hold harmless metadata that torch's restricted unpickler
refuses: timm's ``train.py`` saves its ``argparse.Namespace``, research scripts save numpy
scalars and arrays and ``pathlib`` paths. Each type allowed here only rebuilds a value from
data; none runs a function named by the file, touches the filesystem or imports anything.
They are allowed for the one load, through ``torch.serialization.safe_globals`` (a context
manager), so the process-wide allow-list the user controls is left as it was.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import inspect
import pathlib
import sys
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch


def _numpy_globals() -> list[Any]:
    """numpy arrays, scalars and dtypes, as ``torch.save`` pickles them (protocol 2).

    - ``_reconstruct(ndarray, shape, dtype)`` makes an empty array of an allowed subtype (only
      ``ndarray`` is allowed); ``ndarray.__setstate__`` then fills it from raw bytes, or for an
      object array from a list that the same restricted unpickler has built.
    - ``dtype(code, align, copy)`` builds a dtype from a type code; its ``__setstate__`` (the
      dtype classes such as ``Float64DType``, the type of a dtype instance) sets byte order and
      fields.
    - ``scalar(dtype, bytes)`` makes a numpy scalar (``np.float64(0.9)``) from its raw bytes.
    """
    multiarray: Any = getattr(np, "_core", None) or np.core  # numpy 2 renamed numpy.core
    multiarray = multiarray.multiarray
    dtype_classes = {type(np.dtype(code)) for code in np.typecodes["All"]}
    dtypes_module = getattr(np, "dtypes", None)
    for name in dir(dtypes_module) if dtypes_module is not None else []:
        cls = getattr(dtypes_module, name)
        if name.endswith("DType") and isinstance(cls, type) and issubclass(cls, np.dtype):
            dtype_classes.add(cls)
    found: list[Any] = [multiarray._reconstruct, multiarray.scalar, np.ndarray, np.dtype]
    return found + sorted(dtype_classes, key=lambda c: c.__qualname__)


def _other_globals() -> list[Any]:
    """Standard-library value types that scripts keep in checkpoints.

    - ``argparse.Namespace``: an attribute bag (timm's ``args``); its state is a dict of
      values the restricted unpickler has already built.
    - ``pathlib`` paths (``PosixPath``, ``WindowsPath`` and the pure ones): building one joins
      strings and never touches the filesystem.
    - ``datetime`` dates, times, datetimes, timedeltas and timezones: built from bytes and
      numbers (timestamps of a run).
    """
    paths = [pathlib.PosixPath, pathlib.WindowsPath, pathlib.PurePosixPath, pathlib.PureWindowsPath]
    dates = [datetime.date, datetime.time, datetime.datetime, datetime.timedelta]
    return [argparse.Namespace, *paths, *dates, datetime.timezone]


def _aliases() -> list[tuple[Any, str]]:
    """Other names the same objects are pickled under: numpy 1 files name ``numpy.core``
    (numpy 2 renamed it ``numpy._core``), Python 3.13 names ``pathlib._local``."""
    out: list[tuple[Any, str]] = []
    if hasattr(np, "_core"):
        core = np._core.multiarray
        out += [(core._reconstruct, "numpy.core.multiarray._reconstruct")]
        out += [(core.scalar, "numpy.core.multiarray.scalar")]
    for cls in (pathlib.PosixPath, pathlib.WindowsPath, pathlib.PurePosixPath):
        for module in ("pathlib", "pathlib._local"):
            if cls.__module__ != module:
                out.append((cls, f"{module}.{cls.__qualname__}"))
    return out


def _takes_aliases() -> bool:
    # torch accepts (object, "module.name") pairs from 2.6 on; the annotation says so.
    params = inspect.signature(torch.serialization.add_safe_globals).parameters
    return any("tuple" in str(p.annotation).lower() for p in params.values())


def data_only_globals() -> list[Any]:
    """Every object :func:`allow_data_only` allows (with name aliases where torch takes them).

    Example:
        >>> import argparse
        >>> argparse.Namespace in data_only_globals()
        True
    """
    found: list[Any] = [*_numpy_globals(), *_other_globals()]
    return found + (_aliases() if _takes_aliases() else [])


_lock = threading.Lock()
_holders = 0  # blocks inside allow_data_only() now, in every thread
_added: Any = None  # the safe_globals block that added what the user had not allowed


@contextlib.contextmanager
def allow_data_only() -> Iterator[None]:
    """Allow :func:`data_only_globals` for the duration of the block, and only then.

    Only entries not already in torch's allow-list are added, because leaving
    ``safe_globals`` removes what it added: an entry the user had allowed before would be
    removed from their list on the way out. The list is process-wide: blocks in several
    threads (a thread pool loading checkpoints) share one addition, made by the first to
    enter and taken back by the last to leave, so none removes what another still loads
    with.
    """
    if not hasattr(torch.serialization, "safe_globals"):  # torch < 2.5: nothing to add to
        yield
        return
    _enter()
    try:
        yield
    finally:
        _leave()


def _enter() -> None:
    global _holders, _added
    with _lock:
        if _holders == 0:
            present = set(torch.serialization.get_safe_globals())
            _added = torch.serialization.safe_globals(
                [g for g in data_only_globals() if g not in present]
            )
            _added.__enter__()
        _holders += 1


def _leave() -> None:
    global _holders, _added
    with _lock:
        _holders -= 1
        if _holders == 0:
            _added.__exit__(None, None, None)
            _added = None


def blocked_globals(path: Path | IO[bytes]) -> list[str]:
    """Every global in the file that ``weights_only=True`` refuses (the ones allowed here and
    by the user excepted); empty when torch cannot say (legacy files, torch < 2.5)."""
    find = getattr(torch.serialization, "get_unsafe_globals_in_checkpoint", None)
    if find is None:
        return []
    try:
        with allow_data_only():
            return sorted(find(path))
    except Exception:  # not a zip checkpoint: torch's own reason will have to do
        return []


def _import_path(name: str) -> tuple[str, str]:
    """``(module, expression)`` for a global ``a.b.C``: the longest already imported module
    prefix (nothing is imported to find it), else everything before the last dot."""
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        module = ".".join(parts[:i])
        if module in sys.modules:
            return module, name
    return ".".join(parts[:-1]), name


def allow_line(names: list[str]) -> str:
    """One line of Python that allows exactly ``names`` for the rest of the process.

    Example:
        >>> allow_line(["os.system", "pkg.Cfg"])
        'import os, pkg; torch.serialization.add_safe_globals([os.system, pkg.Cfg])'
    """
    modules: set[str] = set()
    exprs = []
    for name in names:
        module, expr = _import_path(name)
        if module in ("", "__main__"):
            exprs.append(name.split(".", 1)[-1])  # defined in the script itself
            continue
        modules.add(module)
        exprs.append(expr)
    imports = f"import {', '.join(sorted(modules))}; " if modules else ""
    return f"{imports}torch.serialization.add_safe_globals([{', '.join(exprs)}])"


def holds_whole_module(path: Path | IO[bytes], names: list[str]) -> bool:
    """The file is a pickled ``nn.Module`` (``torch.save(model)``), not a state dict: it names
    a torch.nn module class, or its pickle holds a module's ``_parameters`` and ``_modules``."""
    if any(n.startswith("torch.nn.modules.") for n in names):
        return True
    try:
        with zipfile.ZipFile(path) as zf:
            pkl = next(n for n in zf.namelist() if n.endswith("/data.pkl"))
            data = zf.read(pkl)
    except Exception:  # legacy or unreadable file: no evidence
        return False
    return b"_parameters" in data and b"_modules" in data
