"""Exceptions that trainperf callers may want to catch, and which condition raises which type.

trainperf defines its own classes only where callers need to catch them; everything else is a
built-in exception whose message names the value and the fix. The tree::

    TrainperfError
    ├── DeviceError                  (also RuntimeError) a device cannot be selected or used
    │   └── DeviceMismatchError      tensors/parameters on different devices
    ├── CheckpointError              a checkpoint cannot be saved or loaded; .path names it
    │   ├── CheckpointNotFoundError  (also FileNotFoundError) no file at the path
    │   ├── CheckpointCorruptError   empty, truncated or damaged file
    │   ├── NotACheckpointError      a file (or directory) that is not a checkpoint at all
    │   ├── UnsafeCheckpointError    weights_only=True refused the file
    │   └── StateDictMismatchError   keys or shapes differ from the model
    └── LaunchError                  (also RuntimeError) a multi-process launch failed
        └── HangError                no rank made progress for hang_timeout; .report

Which condition maps to which type, everywhere in the package:

- ``DeviceError``: CUDA or MPS asked for but not available (or ``resolve_device(None,
  allowed=...)`` finding no allowed device where the CPU is not allowed), a CUDA index past
  the visible GPUs, fewer GPUs than asked for (``select_gpus``), CUDA or its driver already
  started where it must not be (``select_gpus`` after ``torch.cuda.is_available()`` too,
  ``launch(start_method="fork")``), ranks of one node sharing the single GPU each sees under
  torchrun/SLURM with NCCL, NVML refusing access or failing, a function that needs a CUDA GPU
  run without one (``bench_h2d``, ``bench_matmul(dtype="tf32")``), bf16 on a GPU below
  compute capability 8.0 (``MixedPrecision``, ``bench_matmul``), a precision the device
  cannot run (``bench_model``).
- ``DeviceMismatchError``: ``check_same_device`` found more than one device.
- ``CheckpointError``: a save failed (the object cannot be serialised, disk full, no
  permission, ``path`` is a directory, a path component is a file or a dangling link, a loop
  of symbolic links, the directory cannot be flushed), a ``Checkpointer``'s background write
  failed (raised by the next ``save``/``wait``/``restore``), rank 0 failed a
  ``distributed=True`` save or a rank never joined one, a load failed in a way none of the
  subclasses names (the cause is chained), or, under a process group, ``Checkpointer.restore``
  on every other rank when one rank cannot list, read or load the agreed step (naming that
  rank and its error), or on some ranks only once the group's timeout passes.
- ``LaunchError``: a worker raised, exited non-zero or died by a signal (the first failing
  rank and its traceback; ranks that called different collectives are named), the explicit
  ``MASTER_PORT`` cannot be bound, the rendezvous store cannot start, or, under spawn, a
  worker could not start (no ``if __name__ == "__main__":`` guard, the script's top level
  failing when a worker imports it again, ``main``'s module not importable in a new
  interpreter, or calling ``launch()`` at its top level: the worker's own traceback is in
  the message); under torchrun/SLURM, ``launch_all`` waited ``timeout`` for another rank to
  return from ``main`` (the message names it) or lost the store that gathers the values.
- ``HangError``: ``launch(hang_timeout=...)`` saw no progress on any rank for
  ``hang_timeout`` seconds; the message names the rank(s) that caused it, their file:line,
  and what the others wait in (``.report`` holds it all; its ``to_dict()`` is JSON).
- ``ValueError``: an argument's value is out of range or not one of the choices (every
  "must be an int >= 1" check, device strings, option names); a launcher environment variable
  that is malformed or contradicts another (``RANK`` >= ``WORLD_SIZE``, ``SLURM_NODEID`` past
  ``SLURM_TASKS_PER_NODE``); inputs that do not fit together (a ``.safetensors`` path with
  non-tensor values, state-dict keys that collide once prefixes are removed, no tensor to
  check, a ``main`` that spawned workers cannot import, a ``tune_batch_size`` step that trains
  nothing or a ``batch_dim`` no tensor in the batch has, a loss ``mp.backward`` cannot take, a
  saved fp16 loss scale that is 0, negative, inf or NaN, at load or, unpickled, at
  ``mp.backward``/``mp.step``, loss-scaler settings ``GradScaler`` cannot use, a
  ``tune_batch_size`` model on the meta device or ``sample`` that returns None,
  ``analyse()`` figures no watch records: not Python numbers, NaN, infinite or negative); a
  benchmark run estimated to take longer than ``max_seconds``; an ``nprocs`` the host cannot
  hold (more than 4 gloo ranks per usable CPU, or ranks whose projected memory does not fit;
  under torchrun/SLURM with NCCL, more ranks on a node than visible GPUs); a signal name
  ``preemption()`` does not know or cannot catch.
- ``TypeError``: an argument of the wrong type (``device=None`` where there is no default
  device, a non-module to ``unwrap_model``, a non-callable ``main``, arguments ``main``'s
  signature cannot take in ``launch``, an ``async def`` or generator ``main``, a
  non-iterable ``w.iter()``, a flag that is not True or False: ``MixedPrecision``'s
  ``strict`` and ``set_to_none``), or a container holding tensors to move that
  ``to_device`` cannot rebuild.
- ``AttributeError``: ``trainperf.<name>`` for a name the package does not export (as for
  any module; each name it does export loads its subpackage on first use).
- ``ModuleNotFoundError``: an optional extra is not installed; the message names the function
  and the ``pip install`` that fixes it. ``ImportError``: it is installed but cannot be used
  (DALI that fails to import or is too old).
- ``RuntimeError``: an object used out of order (a ``Watch`` entered twice or used outside its
  ``with``, a closed image loader, ``MixedPrecision.step()`` or ``unscale_()`` without
  ``mp.backward``, ``MixedPrecision.load_state_dict`` of another fp16 loss scale between
  ``mp.backward`` and ``mp.step``, ``ddp.watchdog()`` before ``init_process_group``,
  ``Checkpointer.preemption()`` entered twice or outside the main thread), or the user's data
  or code failing inside a trainperf run (the dataset or ``step_fn`` raising in
  ``tune_loader``, an image that cannot be decoded, a DALI pipeline that failed).
- ``NotImplementedError``: this PyTorch build lacks a kernel ``bench_model`` needs (a
  half-precision kernel on the CPU in some builds); the abstract methods of the image-loader
  base class.
- ``FileNotFoundError`` / ``NotADirectoryError``: ``image_loader``'s folder is missing / is a
  file. ``OSError`` (``IsADirectoryError`` and ``FileExistsError`` included): a
  file-system failure outside checkpoints (the tuning cache: a write-protected cache file is
  ``PermissionError``, not replaced; a named pipe or device at its path is
  ``FileExistsError``), a checkpoint file that cannot be read (EIO, EACCES: the file may be
  fine; ``Checkpointer.restore`` stops rather than fall back), a ``Checkpointer`` directory
  that cannot be listed (EACCES, EMFILE, EIO; the message names it and what to check), or the
  OS refusing to start a worker process.
- ``MemoryError``: host memory ran out while ``load_checkpoint`` (or ``Checkpointer.restore``)
  read a file: not the file's fault, so not a ``CheckpointCorruptError``; the message gives
  the file's size and what to try.
- ``torch.OutOfMemoryError``: GPU memory ran out while ``load_checkpoint`` (or
  ``Checkpointer.restore``) loaded a file onto a GPU: not the file's fault, so not a
  ``CheckpointCorruptError``; the message names the file, its size and the fix
  (``device="cpu"``, or free GPU memory).
- ``KeyboardInterrupt`` / ``SystemExit``: SIGINT / SIGTERM reached ``launch`` (re-raised after
  every worker was stopped; ``SystemExit(143)`` for SIGTERM, once the ranks exited within
  ``grace_s`` or were killed). The CLI exits with ``SystemExit`` (status 2 for a bad command
  line, as argparse does); Ctrl-C in the CLI is one line and status 130, a closed output pipe
  status 141, not a traceback.

The list is checked against the source by ``tests/test_errors.py``; ``docs/errors.md`` holds
the same table.
"""

from __future__ import annotations

__all__ = [
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointNotFoundError",
    "DeviceError",
    "DeviceMismatchError",
    "HangError",
    "LaunchError",
    "NotACheckpointError",
    "StateDictMismatchError",
    "TrainperfError",
    "UnsafeCheckpointError",
]


class TrainperfError(Exception):
    """Base class of every exception trainperf defines."""


class DeviceError(TrainperfError, RuntimeError):
    """A device could not be selected or used as asked (no CUDA, too few GPUs, CUDA already
    initialised)."""


class DeviceMismatchError(DeviceError):
    """A module and its inputs live on more than one device."""


class CheckpointError(TrainperfError):
    """A checkpoint could not be saved or loaded. ``path`` names the file."""

    def __init__(self, message: str, path: object = None) -> None:
        super().__init__(message)
        self.path = path


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The checkpoint file does not exist."""

    def __str__(self) -> str:
        # FileNotFoundError's own __str__ would print "[Errno None]" for a one-argument error.
        return str(self.args[0]) if self.args else ""


class CheckpointCorruptError(CheckpointError):
    """The file is empty, truncated or damaged (an interrupted copy or write)."""


class NotACheckpointError(CheckpointError):
    """The file exists and is readable, but is not a PyTorch or safetensors checkpoint."""


class UnsafeCheckpointError(CheckpointError):
    """``weights_only=True`` refused an object in the file; loading it needs explicit trust."""


class StateDictMismatchError(CheckpointError):
    """A state dict does not fit a model: missing, unexpected or shape-mismatched keys."""

    def __init__(
        self,
        message: str,
        *,
        missing: list[str],
        unexpected: list[str],
        mismatched: list[tuple[str, tuple[int, ...], tuple[int, ...]]],
    ) -> None:
        super().__init__(message)
        self.missing = missing
        self.unexpected = unexpected
        self.mismatched = mismatched


class LaunchError(TrainperfError, RuntimeError):
    """A worker of a multi-process launch failed; the message names the rank and cause."""


class HangError(LaunchError):
    """No rank made progress for ``hang_timeout`` seconds; the message names the cause.

    ``report`` is the :class:`trainperf.ddp.HangReport` (verdict, every rank's state and
    stack; ``report.to_dict()`` is JSON-safe).
    """

    def __init__(self, message: str, report: object = None) -> None:
        super().__init__(message)
        self.report = report
