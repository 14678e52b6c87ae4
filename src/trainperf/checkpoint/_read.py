"""Reading one checkpoint, from a file or from an open binary file object: its format from
its first bytes (torch zip, legacy torch pickle, safetensors), then the load
:func:`~trainperf.checkpoint.load_checkpoint` makes of it (:mod:`._formats` names what went
wrong).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import IO, Any, cast

import torch

from trainperf._utils.imports import require
from trainperf.checkpoint._formats import (
    _LEGACY_MAGIC,
    HEAD_BYTES,
    Source,
    _describe,
    _is_safetensors,
    _open_zip,
    _size,
    _torch_load,
    raise_resource_error,
    read_error,
    shown,
    special_file,
)
from trainperf.errors import CheckpointCorruptError, CheckpointNotFoundError, NotACheckpointError

__all__ = ["load_file", "load_stream"]


def load_file(path: Path, dev: torch.device, weights_only: bool, verify: bool) -> Any:
    """One checkpoint file, whatever its format (read from its first bytes)."""
    try:
        st = path.stat()
        special = special_file(st.st_mode)
        if special is not None:  # open() would wait for a writer, or read a device
            raise NotACheckpointError(f"{path} is {special}, not a checkpoint file", path)
        _refuse_dcp_file(path)
        size = st.st_size
        with open(path, "rb") as f:
            head = f.read(HEAD_BYTES)
    except FileNotFoundError as e:
        raise CheckpointNotFoundError(
            f"checkpoint {path} does not exist (looked in {path.resolve().parent})", path
        ) from e
    except NotADirectoryError as e:
        file = next((p for p in path.parents if p.is_file()), path.parent)
        raise CheckpointNotFoundError(
            f"checkpoint {path} does not exist: {file} is a file, not a directory", path
        ) from e
    except OSError as e:  # no permission, a device error: the file may be fine
        raise read_error(path, e) from e
    return _load(path, head, size, dev, weights_only, verify)


def _refuse_dcp_file(path: Path) -> None:
    """Refuse one file of a ``torch.distributed.checkpoint`` directory (a ``.distcp`` shard,
    whose torch-like records torch cannot read alone, or its ``.metadata`` pickle).

    Raises:
        NotACheckpointError: ``path`` is one (the message names the converter).
    """
    if path.suffix != ".distcp" and not (
        path.name == ".metadata" and any(path.parent.glob("*.distcp"))
    ):
        return
    raise NotACheckpointError(
        f"{path} is one file of a torch.distributed.checkpoint (DCP) directory, not a "
        "checkpoint by itself; convert the whole directory to one file first: "
        "torch.distributed.checkpoint.format_utils.dcp_to_torch_save("
        f"'{path.parent}', 'model.pt'), then load_checkpoint('model.pt')",
        path,
    )


def load_stream(f: IO[Any], dev: torch.device, weights_only: bool, verify: bool) -> Any:
    """A checkpoint read from ``f``, an open binary file object, from its current position:
    the same checks and the same safe load as a file's.

    Raises:
        TypeError: ``f`` is open in text mode.
        ValueError: ``f`` is closed, not open for reading, cannot seek, or is at its end.
    """
    if not callable(getattr(f, "seekable", None)) and callable(getattr(f, "read", None)):
        f = io.BytesIO(f.read())  # a bare file-like object: zipfile asks seekable()
    _check_stream(f)
    try:
        start = f.tell()
        head = f.read(HEAD_BYTES)
        if isinstance(head, str):
            raise TypeError(
                f"load_checkpoint needs a binary file object, but {shown(f)} gives text: "
                "open the file with open(path, 'rb')"
            )
        f.seek(start)
        size = _size(f)
    except OSError as e:
        raise read_error(f, e) from e
    if size == 0 and start > 0:
        raise ValueError(
            f"load_checkpoint was given a file object at its end ({shown(f)}, position "
            f"{start}): nothing is left to read; rewind it first, f.seek(0) (torch.save(obj, "
            "buffer) leaves the buffer at its end)"
        )
    return _load(f, head, size, dev, weights_only, verify)


def _check_stream(f: IO[Any]) -> None:
    """Refuse a file object that cannot be read from as a checkpoint, with the fix."""
    # Before any read: a text file's read() would fail decoding a checkpoint's bytes.
    if isinstance(cast(object, f), io.TextIOBase):
        raise TypeError(
            f"load_checkpoint needs a binary file object, got a text one ({shown(f)}): "
            "open the file with open(path, 'rb')"
        )
    if getattr(f, "closed", False):
        raise ValueError(f"load_checkpoint was given a closed file ({shown(f)}): open it again")
    if callable(getattr(f, "readable", None)) and not f.readable():
        raise ValueError(
            f"load_checkpoint was given a file object not open for reading ({shown(f)}): "
            "open the file with open(path, 'rb')"
        )
    if not callable(getattr(f, "seek", None)) or not f.seekable():
        raise ValueError(
            f"load_checkpoint needs to seek in the file object it reads, and {shown(f)} "
            "cannot (a pipe, a socket, an HTTP response): read it into memory first, "
            "load_checkpoint(io.BytesIO(f.read())), or save it to a file and pass the path"
        )


def _load(
    src: Source, head: bytes, size: int, dev: torch.device, weights_only: bool, verify: bool
) -> Any:
    """The checkpoint in ``src``, whose first bytes are ``head``, by its format."""
    name = shown(src)
    if size == 0:
        raise CheckpointCorruptError(
            f"checkpoint {name} is empty (0 bytes): the save or copy that made it was "
            "interrupted; use an earlier checkpoint",
            src,
        )
    if not head.strip(b"\x00"):
        raise CheckpointCorruptError(
            f"checkpoint {name} starts with zero bytes where its header should be (the first "
            f"{len(head)} of its {size} bytes are all zero): its data never reached the disk "
            "(a crash or power loss during a save that was not atomic) or was overwritten; "
            "use an earlier checkpoint (save_checkpoint writes atomically)",
            src,
        )
    if head.startswith(b"PK\x03\x04"):
        start = 0 if isinstance(src, Path) else src.tell()
        _open_zip(src, verify)
        if not isinstance(src, Path):  # the check read it through: torch reads it again
            src.seek(start)
        return _torch_load(src, dev, weights_only)
    if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        if _LEGACY_MAGIC not in head[:32]:
            raise NotACheckpointError(
                f"{name} is a Python pickle but not a torch.save file; if you trust it, "
                "read it with pickle.load",
                src,
            )
        return _torch_load(src, dev, weights_only)
    if _is_safetensors(head):
        return _load_safetensors(src, dev)
    raise NotACheckpointError(
        f"{name} is not a checkpoint: it looks like {_describe(head, _command_name(src))} (a "
        "checkpoint starts like a zip archive, a torch pickle or a safetensors header)",
        src,
    )


def _load_safetensors(src: Source, dev: torch.device) -> Any:
    require("safetensors", "load_checkpoint(... .safetensors)")
    from safetensors.torch import load, load_file

    try:
        if isinstance(src, Path):
            return load_file(src, device=str(dev))
        return {k: v.to(dev) for k, v in load(src.read()).items()}
    except Exception as e:
        hint = "or read a few tensors at a time with safetensors.safe_open(path, 'pt')"
        raise_resource_error(src, dev, e, hint)
        raise CheckpointCorruptError(
            f"safetensors checkpoint {shown(src)} is truncated or damaged ({e}); re-copy it "
            "or use an earlier checkpoint",
            src,
        ) from e


def _command_name(src: Source) -> str:
    """``src`` as a shell command in a fix names it: the path, or FILE for a file object."""
    return str(src) if isinstance(src, Path) else "FILE"
