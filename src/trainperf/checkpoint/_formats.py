"""Checkpoint file formats: recognising a file from its first bytes and explaining failed loads.

Turns torch's terse errors ("miniz error", "Weights only load failed") into ones that say
whether a file is truncated, damaged, of another kind, or refused as unsafe.
"""

from __future__ import annotations

import codecs
import contextlib
import errno
import pickle
import re
import shlex
import struct
import zipfile
from pathlib import Path
from typing import IO, Any, TypeAlias, TypeGuard

import torch

from trainperf._utils.atomic import special_kind
from trainperf._utils.format import format_bytes
from trainperf._utils.oom import oom_kind
from trainperf.checkpoint._allow import (
    allow_data_only,
    allow_line,
    blocked_globals,
    holds_whole_module,
)
from trainperf.errors import (
    CheckpointCorruptError,
    CheckpointError,
    NotACheckpointError,
    UnsafeCheckpointError,
)

# torch.save's legacy (non-zip) format starts with this pickled long (torch/serialization.py).
_LEGACY_MAGIC = (0x1950A86A20F9469CFC6C).to_bytes(10, "little")

# Where a checkpoint is read from: a file, or the seekable binary file object given to
# load_checkpoint (positioned at the checkpoint's first byte).
Source: TypeAlias = Path | IO[bytes]


def shown(src: Source) -> str:
    """``src`` as error messages name it: the path, or what the file object is.

    Example:
        >>> import io
        >>> shown(Path("runs/c.pt")), shown(io.BytesIO())
        ('runs/c.pt', 'the BytesIO object given')
    """
    if isinstance(src, Path):
        return str(src)
    name = getattr(src, "name", None)
    return (
        f"{name} (the file object given)"
        if isinstance(name, str)
        else (f"the {type(src).__name__} object given")
    )


def _size(src: Source) -> int:
    """The file's size in bytes (a file object's: from its current position to its end)."""
    if isinstance(src, Path):
        return src.stat().st_size
    at = src.tell()
    try:
        return src.seek(0, 2) - at
    finally:
        src.seek(at)


# How many first bytes are read to recognise a file: a tar header's "ustar" is at 257.
HEAD_BYTES = 512

# Compressed files: what they are, the tool, its suffix, and the command that gives the
# checkpoint back from a name with that suffix (stripping it).
_PACKED = [
    (b"\x1f\x8b", "gzip-compressed data", "gzip", ".gz", "gunzip -k"),
    (b"BZh", "bzip2-compressed data", "bzip2", ".bz2", "bunzip2 -k"),
    (b"\xfd7zXZ\x00", "xz-compressed data", "xz", ".xz", "unxz -k"),
    (b"\x28\xb5\x2f\xfd", "zstd-compressed data", "zstd", ".zst", "zstd -d"),
]


def _unpack_command(name: str, tool: str, suffix: str, keep: str) -> str:
    """The shell command that decompresses ``name``: ``keep`` when it ends with the tool's
    ``suffix``, otherwise ``tool -dc`` into ``NAME.unpacked`` (``gunzip -k c.pt`` fails:
    "unknown suffix"; ``zstd -d c.pt``: "can't derive the output file name").

    Example:
        >>> _unpack_command("c.pt", "gzip", ".gz", "gunzip -k")
        'gzip -dc c.pt > c.pt.unpacked'
        >>> _unpack_command("c.pt.gz", "gzip", ".gz", "gunzip -k")
        'gunzip -k c.pt.gz'
    """
    if name.endswith(suffix) and len(Path(name).name) > len(suffix):
        return f"{keep} {shlex.quote(name)}"
    return f"{tool} -dc {shlex.quote(name)} > {shlex.quote(name + '.unpacked')}"


def _describe(head: bytes, name: str = "FILE") -> str:
    """What a file starting with ``head`` looks like, with the fix when it is a packed
    checkpoint (``name``: the file, as the shell command in the fix names it).

    Example:
        >>> _describe(b"\\x1f\\x8b\\x08\\x00", "c.pt.gz")
        'gzip-compressed data: decompress it first (gunzip -k c.pt.gz) and load the file that gives'
        >>> _describe(b"abc\\x00\\x01")
        'unrecognised binary data'
    """
    for magic, what, tool, suffix, keep in _PACKED:
        if head.startswith(magic):
            return (
                f"{what}: decompress it first ({_unpack_command(name, tool, suffix, keep)}) "
                "and load the file that gives"
            )
    if head[257:262] == b"ustar":
        return (
            f"a tar archive: unpack it (tar -xf {shlex.quote(name)}) and load the checkpoint inside"
        )
    text = head.lstrip()
    kinds = [
        (b"\x89PNG", "a PNG image"),
        (b"\xff\xd8\xff", "a JPEG image"),
        (b"\x93NUMPY", "a NumPy .npy array (use numpy.load)"),
        (b"\x89HDF", "an HDF5 file (Keras/h5py)"),
        (b"version https://git-lfs", "a Git LFS pointer: fetch the real file with git lfs pull"),
        (b"<", "an HTML/XML page: the download probably returned an error or login page"),
        (b"{", "JSON text"),
        (b"[", "JSON text"),
    ]
    for magic, what in kinds:
        if (text if magic[:1] in b"<{[v" else head).startswith(magic):
            return what
    try:  # incremental: a character cut at the end of ``head`` is still text
        codecs.getincrementaldecoder("utf-8")().decode(head)
    except UnicodeDecodeError:
        return "unrecognised binary data"
    return "unrecognised binary data" if b"\x00" in head else "a text file"


def special_file(mode: int) -> str | None:
    """What a file of ``st_mode`` ``mode`` is, when opening it to read a checkpoint would
    wait for a writer (a named pipe) or read a device: never a checkpoint. None for a
    regular file, a directory or a link.

    Example:
        >>> import stat
        >>> special_file(stat.S_IFIFO | 0o644), special_file(stat.S_IFREG | 0o644)
        ('a named pipe (FIFO)', None)
    """
    return special_kind(mode)


def _is_safetensors(head: bytes) -> bool:
    if len(head) < 9:
        return False
    (n,) = struct.unpack("<Q", head[:8])
    return 0 < n < 100_000_000 and head[8:9] == b"{"


def _is_torchscript(names: list[str]) -> bool:
    """torch.jit.save's zip: the data.pkl of torch.save plus the program's ``code/`` and
    ``constants.pkl``, which torch.save never writes."""
    return any(n.split("/")[1:2] in (["code"], ["constants.pkl"]) for n in names)


def _has_whole_end_record(tail: bytes) -> bool:
    """Whether ``tail``, a zip file's last bytes, ends with its whole end-of-archive record
    (22 bytes from ``PK\\x05\\x06``, then its comment): a file cut inside it still holds
    the signature, and is truncated, not damaged.

    Example:
        >>> end = b"PK\\x05\\x06" + bytes(18)
        >>> _has_whole_end_record(b"data" + end), _has_whole_end_record(b"data" + end[:-1])
        (True, False)
    """
    at = tail.rfind(b"PK\x05\x06")
    if at < 0 or len(tail) < at + 22:
        return False
    comment = int.from_bytes(tail[at + 20 : at + 22], "little")
    return len(tail) >= at + 22 + comment


# What to check when reading a file failed for a reason that is not its content.
_READ_FIXES = {
    errno.EACCES: "check its permissions (ls -l) and the user the run is started as",
    errno.EPERM: "check its permissions (ls -l) and the user the run is started as",
    errno.EMFILE: "too many files are open in this process: close some, or raise the limit "
    "(ulimit -n)",
    errno.ENFILE: "the system's open-file table is full: close files, or raise fs.file-max",
}


def read_failure(e: BaseException) -> TypeGuard[OSError]:
    """Whether ``e`` is the system failing to read a file (EIO, EACCES, EMFILE, a stale
    network mount), not a sign of what the file holds. EINVAL is what zipfile's seek gets
    in a file too short for its end record: that one is the file's."""
    return (
        isinstance(e, OSError)
        and e.errno is not None
        and e.errno != errno.EINVAL
        and not isinstance(e, (FileNotFoundError, NotADirectoryError))
    )


def read_error(path: Source, e: OSError) -> OSError:
    """The error to raise (from ``e``) when ``path`` could not be read: an ``OSError`` of
    the same errno (so the same subclass, ``PermissionError`` for EACCES), not a
    ``CheckpointError``: the file may well be fine, and a caller that skips damaged files
    (``Checkpointer.restore``) must not skip it."""
    fix = _READ_FIXES.get(
        e.errno or 0,
        "a disk or filesystem error (a network mount that went away): check the storage and retry",
    )
    return OSError(
        e.errno,
        f"cannot read checkpoint {shown(path)}: {e.strerror or e}. The file itself may be "
        f"fine: {fix}",
    )


def _has_end_record(path: Source) -> bool:
    """Whether ``path`` ends in a whole zip end-of-archive record."""
    try:
        with open(path, "rb") if isinstance(path, Path) else contextlib.nullcontext(path) as f:
            f.seek(max(0, f.seek(0, 2) - (1 << 16) - 22))
            return _has_whole_end_record(f.read())
    except OSError as e:
        raise read_error(path, e) from e


def _open_zip(path: Source, verify: bool) -> None:
    """Check the zip structure (and CRC-32s) in Python first: torch only says 'miniz error'."""
    name = shown(path)
    arg = repr(str(path)) if isinstance(path, Path) else "f"
    try:
        with zipfile.ZipFile(path) as zf:
            names = zf.namelist()
            if _is_torchscript(names):
                raise NotACheckpointError(
                    f"{name} is a TorchScript program (saved with torch.jit.save), not a "
                    f"checkpoint: load it with torch.jit.load({arg}), and its weights "
                    "with torch.jit.load(...).state_dict()",
                    path,
                )
            if names and all(n.endswith(".npy") for n in names):
                raise NotACheckpointError(
                    f"{name} is a NumPy .npz archive, not a checkpoint: load it with "
                    f"numpy.load({arg})",
                    path,
                )
            if not any(n.endswith("/data.pkl") and n.count("/") == 1 for n in names):
                raise NotACheckpointError(
                    f"{name} is a zip archive but not one torch.save writes (no data.pkl); "
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
        if read_failure(e):  # EIO, EACCES, EMFILE: the file was not read, not found damaged
            raise read_error(path, e) from e
        cause = (
            "truncated: the end-of-archive record is missing, so the file was cut short "
            "(an interrupted save, copy or download)"
            if not _has_end_record(path)
            else f"damaged ({e}): bytes were changed after saving (bad disk or transfer)"
        )
        raise CheckpointCorruptError(
            f"checkpoint {name} is {cause}; re-copy it or use an earlier checkpoint", path
        ) from e


def refusal_reason(msg: str) -> str:
    """The specific reason inside torch's long weights_only message (its layout varies)."""
    msg = re.sub(r"\x1b\[[0-9;]*m", "", msg)
    m = re.search(r"WeightsUnpickler error:\s*(.*?)(?:\n\n|$)", msg, re.S)
    if m:
        return m.group(1).strip()
    skip = ("Weights only load failed", "Check the documentation")
    middle = [p.strip() for p in msg.split("\n\n") if p.strip() and not p.strip().startswith(skip)]
    return " ".join(middle) or "see the chained error"


def _unsafe_message(path: Source, reason: str) -> str:
    """Every global the file needs beyond the allowed ones, at once, and the line that allows
    them (torch's own error names only the first); for a pickled model, how to get its
    weights out instead."""
    names = blocked_globals(path)
    name = shown(path)
    if not names and "Unsupported operand" in reason:  # no global: the pickle's own opcodes
        return (
            f"{name} was pickled with an opcode that weights_only=True cannot read ({reason}),"
            " whatever is allowed: torch.save(..., pickle_protocol=4) or higher writes such "
            "files. If you trust the file, load it with weights_only=False and save it again "
            "with save_checkpoint (the default protocol), which loads with weights_only=True"
        )
    listed = f"{len(names)} global(s) not allowed: {', '.join(names)}" if names else reason
    head = (
        f"{name} contains objects that weights_only=True refuses to unpickle ({listed}). "
        "Unpickling can run arbitrary code."
    )
    if holds_whole_module(path, names):
        return (
            f"{head} It holds a whole pickled model (torch.save(model)), not a state dict: "
            "if you trust the file, load it once with weights_only=False and save its "
            "weights, model.state_dict() (save_checkpoint(model, path) does that), then "
            "rebuild the model in code and load_state_dict the weights into it"
        )
    allow = allow_line(names) if names else "torch.serialization.add_safe_globals([...])"
    return (
        f"{head} If you trust the file, allow exactly these with `{allow}` (or the same list "
        "in a `with torch.serialization.safe_globals([...]):` block around this load), or "
        "load it with weights_only=False (only for files you trust). numpy arrays, scalars "
        "and dtypes, argparse.Namespace, pathlib paths and datetime values are allowed "
        "already"
    )


def out_of_memory(e: BaseException) -> bool:
    """Host memory ran out: a ``MemoryError``, or torch's allocator failing (a RuntimeError,
    which would otherwise read as a damaged file)."""
    return oom_kind(e) == "host"


def device_out_of_memory(e: BaseException) -> bool:
    """GPU memory ran out: ``torch.OutOfMemoryError``, or a RuntimeError saying "CUDA out of
    memory" (which would otherwise read as a damaged file).

    Example:
        >>> device_out_of_memory(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
        True
        >>> device_out_of_memory(RuntimeError("PytorchStreamReader failed reading zip archive"))
        False
    """
    return oom_kind(e) == "device"


def _file_size(path: Source) -> str:
    try:
        return format_bytes(_size(path))
    except OSError:
        return "size unknown"


def _allocation(msg: str) -> str | None:
    """What an allocator's message says failed, in a few words, or None."""
    asked = re.search(r"tried to allocate (\d+) bytes", msg, re.IGNORECASE)
    if asked:  # torch's CPU allocator wraps this in "[enforce fail at alloc_cpu.cpp:...]" noise
        return f"allocating {format_bytes(int(asked.group(1)))} for a tensor failed"
    asked = re.search(r"tried to allocate ([\d.]+ [KMGT]?i?B)", msg, re.IGNORECASE)
    if asked:  # the CUDA caching allocator: sizes already in words, then a page of advice
        free = re.search(r"of which ([\d.]+ [KMGT]?i?B) (?:is )?free", msg, re.IGNORECASE)
        left = f" ({free.group(1)} was free)" if free else ""
        return f"allocating {asked.group(1)} for a tensor failed{left}"
    return None


def memory_error(path: Source, dev: torch.device, e: BaseException, mmap_hint: str) -> MemoryError:
    """The error to raise (from ``e``) when loading ``path`` ran out of host memory: its
    size, that the file is fine, and what to try instead (``mmap_hint``: a format's own way
    to read it piecemeal, or "")."""
    msg = str(e).strip()
    detail = _allocation(msg) or (msg.splitlines()[-1] if msg else type(e).__name__)
    to_gpu = (
        "load it straight onto the GPU with device='cuda' (tensors then pass through host "
        "memory one at a time), "
        if dev.type == "cpu"
        else ""
    )
    return MemoryError(
        f"not enough memory to load checkpoint {shown(path)} ({_file_size(path)}): {detail}. The "
        "file is not damaged: free memory (stop other processes, drop references to "
        f"checkpoints loaded earlier: del ckpt), {to_gpu}"
        f"{mmap_hint or 'or load it on a machine with more memory'}"
    )


def device_memory_error(
    path: Source, dev: torch.device, e: BaseException
) -> torch.OutOfMemoryError:
    """The error to raise (from ``e``) when loading ``path`` onto ``dev`` ran out of GPU
    memory: still a ``torch.OutOfMemoryError`` (code that catches it keeps working), now
    naming the file, its size, that the file is fine, and the fix."""
    msg = str(e).strip()
    detail = _allocation(msg) or (msg.splitlines()[0] if msg else type(e).__name__)
    onto = f" onto {dev}" if dev.type != "cpu" else ""
    return torch.cuda.OutOfMemoryError(
        f"out of GPU memory loading checkpoint {shown(path)} ({_file_size(path)}){onto}: {detail}. "
        "The file is not damaged: load it with device='cpu' (load_state_dict then copies "
        "each tensor into the model on its GPU, without a second copy of the weights "
        "there), or free GPU memory first (drop references to tensors and checkpoints "
        "loaded earlier: del ckpt; torch.cuda.empty_cache())"
    )


def raise_resource_error(path: Source, dev: torch.device, e: Exception, mmap_hint: str) -> None:
    """Raise the clear error for a load that failed for want of a resource (the file could
    not be read, device or host memory ran out); return when ``e`` is none of those."""
    if read_failure(e):
        raise read_error(path, e) from e
    if device_out_of_memory(e):
        raise device_memory_error(path, dev, e) from e
    if out_of_memory(e):
        raise memory_error(path, dev, e, mmap_hint) from e


def _torch_load(path: Source, dev: torch.device, weights_only: bool) -> Any:
    start = 0 if isinstance(path, Path) else path.tell()
    try:
        with allow_data_only() if weights_only else contextlib.nullcontext():
            return torch.load(path, map_location=dev, weights_only=weights_only)
    except Exception as e:
        raise_resource_error(path, dev, e, _torch_mmap_hint(path))
        msg = str(e)
        if not isinstance(path, Path):  # torch read part of it: the refusal reads it again
            path.seek(start)
        if isinstance(e, pickle.UnpicklingError) and "Weights only load failed" in msg:
            raise UnsafeCheckpointError(_unsafe_message(path, refusal_reason(msg)), path) from e
        newer = newer_format(e)
        if newer is not None:
            raise CheckpointError(_newer_message(path, *newer), path) from e
        if isinstance(e, (RuntimeError, EOFError, pickle.UnpicklingError, KeyError, ValueError)):
            raise CheckpointCorruptError(
                f"checkpoint {shown(path)} is damaged or truncated ({type(e).__name__}: "
                f"{msg.splitlines()[0] if msg else 'no detail'}); re-copy it or use an "
                "earlier checkpoint",
                path,
            ) from e
        raise CheckpointError(
            f"could not load checkpoint {shown(path)}: {type(e).__name__}: {e}", path
        ) from e


def newer_format(e: BaseException | None) -> tuple[int, int] | None:
    """``(the file's format version, the newest this torch reads)`` when ``e`` is torch
    refusing a file saved by a newer PyTorch; else None.

    Example:
        >>> newer_format(RuntimeError("[enforce fail at inline_container.cc:230] . Attempted "
        ...     "to read a PyTorch file with version 11, but the maximum supported version "
        ...     "for reading is 10."))
        (11, 10)
        >>> newer_format(RuntimeError("PytorchStreamReader failed reading zip archive"))
    """
    m = _NEWER.search(str(e)) if isinstance(e, RuntimeError) else None
    return None if m is None else (int(m[1]), int(m[2]))


_NEWER = re.compile(
    r"PyTorch file with version (\d+), but the maximum supported version for reading is (\d+)"
)


def _newer_message(path: Source, found: int, newest: int) -> str:
    return (
        f"checkpoint {shown(path)} was saved by a newer PyTorch: it is file format version "
        f"{found}, and torch {torch.__version__} here reads versions up to {newest}. The file "
        "is not damaged: load it with a newer torch (pip install -U torch), or where it was "
        "saved"
    )


def _torch_mmap_hint(path: Source) -> str:
    """For a torch zip file (not the legacy format, which torch cannot map): map it."""
    if not isinstance(path, Path):  # only a file on disk can be mapped
        return ""
    try:
        with open(path, "rb") as f:
            zipped = f.read(4) == b"PK\x03\x04"
    except OSError:
        zipped = False
    return (
        "or memory-map it, so tensors are read from the file as they are used: "
        f"torch.load({str(path)!r}, mmap=True, weights_only=True, map_location='cpu')"
        if zipped
        else ""
    )
