"""Reading what a torch.save file holds without loading it: its pickle with every class and
tensor left out, so nothing the file names is imported or run and no tensor data is read.

:mod:`._steps` uses it to tell a Checkpointer step file (one with the ``"trainperf"`` entry
that ``Checkpointer.restore`` needs) from a foreign file that only has a step file's name.
"""

from __future__ import annotations

import os
import pickle
import zipfile
from pathlib import Path
from typing import IO, Any

from trainperf.checkpoint._formats import _LEGACY_MAGIC, special_file

__all__ = ["skim"]

_LEGACY_NUMBER = int.from_bytes(_LEGACY_MAGIC, "little")


class _Stub:
    """Stands for every class, function and tensor storage the pickle names: it takes any
    arguments and state and keeps none of them."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def __call__(self, *args: object, **kwargs: object) -> _Stub:
        return _Stub()

    def __setstate__(self, state: object) -> None:
        pass

    def __setitem__(self, key: object, value: object) -> None:
        pass

    def append(self, value: object) -> None:
        pass

    def extend(self, values: object) -> None:
        pass


class _Skimmer(pickle.Unpickler):
    """An unpickler that imports nothing: every global is :class:`_Stub` (so a ``REDUCE``
    calls nothing the file names) and every persistent id (a tensor's storage) a stub."""

    def find_class(self, module: str, name: str) -> Any:
        return _Stub

    def persistent_load(self, pid: Any) -> Any:
        return _Stub()


def _skim_stream(f: IO[bytes]) -> Any:
    return _Skimmer(f).load()


def skim(path: Path) -> Any:
    """The object a torch.save file holds, its containers and plain values as saved and every
    tensor or other class instance a stub; only the pickle is read (a zip file's
    ``data.pkl``; a legacy file up to the end of its object pickle).

    Raises:
        OSError: the file could not be read.
        zipfile.BadZipFile: a zip file whose directory is missing or damaged.
        ValueError: not a torch.save file (the message says why: empty, a named pipe,
            socket or device, refused before it is opened, or another kind of file).
        pickle.UnpicklingError, EOFError: its pickle is cut short or damaged.

    Example:
        >>> import tempfile, torch
        >>> with tempfile.TemporaryDirectory() as d:
        ...     torch.save({"w": torch.ones(2), "step": 3}, Path(d, "c.pt"))
        ...     held = skim(Path(d, "c.pt"))
        >>> held["step"], type(held["w"]).__name__
        (3, '_Stub')
    """
    special = special_file(os.stat(path).st_mode)
    if special is not None:  # open() would wait for a writer, or read a device
        raise ValueError(f"{path} is {special}, not a checkpoint file")
    with open(path, "rb") as f:
        head = f.read(4)
        if not head:
            raise ValueError(
                "empty (0 bytes): a save or copy that was cut off before it wrote anything"
            )
        f.seek(0)
        if head == b"PK\x03\x04":
            with zipfile.ZipFile(f) as zf:
                pkl = [n for n in zf.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
                if not pkl:
                    raise ValueError("a zip archive without data.pkl, not a torch.save file")
                with zf.open(pkl[0]) as member:
                    return _skim_stream(member)
        if head[:1] != b"\x80" or _skim_stream(f) != _LEGACY_NUMBER:
            raise ValueError("neither a torch zip archive nor a legacy torch.save file")
        _skim_stream(f)  # the protocol version
        _skim_stream(f)  # the saving system's byte order and type sizes
        return _skim_stream(f)
