""":class:`Checkpointer`: a directory of step-numbered checkpoints for a plain training loop.

It ties the pieces together: the file names and retention (:mod:`._steps`), what a file holds
and how it is put back (:mod:`._payload`), the writers (:mod:`._writer`) and the stop flag
(:mod:`._preempt`). Waiting for its background writes, at the next save and at process exit,
is in :mod:`._checkpointer_wait`; its warnings in :mod:`._checkpointer_warn`; the rank and
world size, a rank's own file read back, and the ranks' agreement on restore, in
:mod:`._checkpointer_ranks`; finding the newest complete file and restoring it, in
:mod:`._checkpointer_restore`.
"""

from __future__ import annotations

import os
import warnings
import weakref
from collections.abc import Iterable, Mapping
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from trainperf._utils.format import format_bytes
from trainperf._utils.stack import user_stacklevel
from trainperf._utils.validate import choice, non_negative_int, positive_int
from trainperf.checkpoint._checkpointer_lock import DirectoryClaim
from trainperf.checkpoint._checkpointer_ranks import _group
from trainperf.checkpoint._checkpointer_restore import newest_complete, restore_newest
from trainperf.checkpoint._checkpointer_wait import (
    _finish,
    exiting,
    failure_of_pending,
    settle,
    tell_earlier,
)
from trainperf.checkpoint._checkpointer_wait import _wait_at_exit as _wait_at_exit
from trainperf.checkpoint._checkpointer_warn import (
    _warn_no_writer,
    warn_if_behind,
    warn_notes,
)
from trainperf.checkpoint._damaged import DamagedSteps
from trainperf.checkpoint._files import saving
from trainperf.checkpoint._held import vouch
from trainperf.checkpoint._payload import build_payload, rank_payload
from trainperf.checkpoint._preempt import Preemption
from trainperf.checkpoint._steps import (
    main_file,
    not_a_directory,
    rank_file,
    remove_dead_temps,
    retire,
    steps_on_disk,
)
from trainperf.checkpoint._writer import (
    SaveHandle,
    count_background_save,
    start_thread,
    write_now,
)
from trainperf.checkpoint._writer_fork import fork_writes, start_process
from trainperf.checkpoint._writer_snapshot import snapshot_safe, tensor_bytes
from trainperf.checkpoint._writer_staging import Staging, staging_fits
from trainperf.errors import CheckpointError
from trainperf.limits import host_limits

# _wait_at_exit: looked up here by trainperf.ddp._worker (sys.modules), so re-exported.
__all__ = ["Checkpointer"]


class Checkpointer:
    """A directory of step-numbered, atomic checkpoints: background saves, ``keep`` newest,
    exact resume (generators, DataLoader position), preemption.

    Each :meth:`save` writes ``directory/step-000000030.pt``, a file in
    :func:`save_checkpoint`'s format (``load_checkpoint`` and plain ``torch.load`` read
    it): every entry of ``state`` as ``save_checkpoint`` saves it (modules and objects with
    ``state_dict()`` as their state dicts), DataLoaders as their position, and under
    ``"trainperf"`` the step and the random states of Python, NumPy, torch and every
    initialised CUDA device. :meth:`restore` loads the newest complete one back into the
    live objects.

    Args:
        directory: where the files go (created on the first save); a leading ``~`` is the
            home directory, and a relative path is taken from the working directory now
            (an ``os.chdir`` later does not move the checkpoints).
        keep: how many of the newest checkpoints to keep; older ones are deleted only after
            a newer one is durable (fsynced and renamed), and the one just written never is.
        every: save only at steps that are multiples of ``every`` (other steps' ``save``
            calls return at once, with a handle whose ``path`` is None), except when
            ``force=True`` or once a :meth:`preemption` stop was requested; None saves
            whenever asked.

    Raises:
        ValueError: ``keep`` or ``every`` is not an int >= 1.
        CheckpointError: ``directory`` exists and is not a directory (or is under a file).
        OSError: ``directory`` exists but cannot be listed (no permission: a
            ``PermissionError``; a disk or network-filesystem error): the message names it
            and what to check. :meth:`save`, :meth:`steps`, :meth:`latest` and
            :meth:`restore` raise the same, and ``CheckpointError`` if it has become a file.

    Example:
        >>> import tempfile
        >>> from torch import nn
        >>> model = nn.Linear(2, 2)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> ckpt = Checkpointer(tempfile.mkdtemp(), keep=2)
        >>> ckpt.restore({"model": model, "optimizer": opt})  # nothing saved yet
        0
        >>> for step in (10, 20, 30):
        ...     _ = ckpt.save({"model": model, "optimizer": opt}, step=step, blocking=False)
        >>> ckpt.wait()
        >>> ckpt.steps(), ckpt.latest().name
        ([20, 30], 'step-000000030.pt')
        >>> ckpt.restore({"model": nn.Linear(2, 2), "optimizer": opt})
        30
    """

    def __init__(
        self, directory: str | os.PathLike[str], *, keep: int = 3, every: int | None = None
    ) -> None:
        # Absolute now: a later os.chdir must not send saves, the retention that deletes
        # old steps, or restore to another directory (nor split a background write).
        self.directory = Path(os.fspath(directory)).expanduser().absolute()
        self.keep = positive_int("keep", keep)
        self.every: int | None = positive_int("every", every, none_ok=True)
        in_the_way = not_a_directory(self.directory)
        if in_the_way is not None:
            raise in_the_way
        self.removed_temps = remove_dead_temps(self.directory)
        self._pending: SaveHandle | None = None
        self._staging = Staging()
        # A stop was agreed through one of its preemption() objects (told by the object:
        # keeping the objects would keep one per epoch of a loop that makes one per epoch).
        self._stop_requested = False
        self._damaged = DamagedSteps()  # steps whose file restore found corrupt, unchanged since
        self._behind_told = -1  # the highest later step on disk warned of so far
        self._unusable_told: set[tuple[object, ...]] = set()  # later files warned unusable
        self._notes_told: set[str] = set()  # retired files warned not deleted, and why
        self._highest = -1  # the highest step on disk or saved here, as far as seen
        self._claim = DirectoryClaim(self.directory)  # rank 0's writer lock, at its first save

    def __repr__(self) -> str:
        every = "" if self.every is None else f", every={self.every}"
        return f"Checkpointer({str(self.directory)!r}, keep={self.keep}{every})"

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        pending = self._pending
        # A signal handler that interrupted save(blocking=False) while it starts its writer:
        # that writer starts only once the handler returns, so no wait here could end.
        starting = pending is not None and pending._starting
        try:
            if exc_type is None:
                self.wait()  # raises settle's RuntimeError while the write is starting
            elif pending is not None and not starting:
                _finish(pending)  # the write finishes; its error is not the news
            # Starting, on an exception: not waited for (raising would replace the exception
            # on its way); the write stays pending for the next save, wait or the exit hook.
        finally:
            if not starting:  # a write still starting goes on, under the directory's claim
                self._claim.release()  # the block was the writer's life; a later save claims

    # ------------------------------------------------------------------ saving

    def _stopping(self) -> bool:
        """A stop was requested through any of this Checkpointer's :meth:`preemption`
        objects (it stays requested: the final save may come after the ``with`` block)."""
        return self._stop_requested

    def _skips(self, step: int, force: bool) -> bool:
        return (
            self.every is not None and step % self.every != 0 and not force and not self._stopping()
        )

    def _after(self, step: int) -> list[str]:
        self._damaged.discard(step)  # written again: the damaged file was replaced
        vouch(main_file(self.directory, step), step)  # retention need not read it back
        return retire(self.directory, self.keep, step, self._damaged)

    def save(
        self, state: Mapping[str, Any], *, step: int, blocking: bool = True, force: bool = False
    ) -> SaveHandle:
        """Save ``state`` as step ``step``.

        ``blocking=True`` returns once the file is durable. ``blocking=False`` returns once
        the state is captured, and the file is written in the background: on Linux with
        CPU tensors by a forked process (a copy-on-write snapshot: nothing is copied up
        front), otherwise by a thread from host buffers the tensors were copied into (pinned
        for GPU tensors, reused from save to save). Either way the training step may change
        the model right after ``save`` returns: the file holds step ``step``'s values. If
        the host's available memory (:func:`trainperf.host_limits`) cannot hold one more
        copy of the state, the save is made blocking, with a warning giving both figures.
        So is a save made while the process exits, once trainperf's exit hook has waited
        for the background writes: that hook runs from Python's thread shutdown, before
        every ``atexit`` handler, so this is any save from an ``atexit`` handler (whenever
        registered) or a finaliser at exit; the process would end under a background writer.

        One write is in flight at most: a ``save`` while one is pending first waits for it.
        If that write failed, this save is made (blocking) before the failure is raised, so
        a run that the error ends (a preemption's final save) still leaves its newest state
        on disk. Under a process group
        rank 0 writes the step file and every other rank writes only its own small file
        (``step-….rank-0000R.pt``: its generators and loader positions) and returns; no
        collective is involved, so calling it on every rank and inside ``if rank == 0:``
        both work.

        Args:
            state: what to save: ``{"model": model, "optimizer": opt, "loader": loader,
                "epoch": 3, ...}``; values with ``state_dict()`` are saved through it,
                DataLoaders as their position, plain values as they are.
            step: the step number (an int >= 0), which names the file.
            blocking: wait for the file (True) or write it in the background (False).
            force: save even if ``every`` would skip this step.

        Returns:
            A :class:`SaveHandle`.

        Raises:
            CheckpointError: the previous background write failed (its error, chained,
                with its path; this save is made first, blocking, even at a step
                ``every`` skips, and the message says where it went), or this blocking
                save failed (the message ends with the earlier failure, if any); a failed
                write deletes nothing (older files go only once a newer one is durable).
                Also, before anything is written: ``state`` holds a loader a checkpoint
                cannot hold (a ``trainperf.pipelines`` image loader, a DataLoader inside
                another entry), or (blocking) a value that cannot be pickled. A directory
                in the step file's place is refused, naming it (remove or rename it).
            TypeError: ``state`` is not a dict with string keys.
            ValueError: ``step`` is not an int >= 0, or ``state`` uses the key
                ``"trainperf"``.
            OSError: rank 0 cannot list the directory (as :meth:`steps`), before anything
                is written.
            RuntimeError: called from a signal handler that interrupted this
                Checkpointer's ``save(blocking=False)`` while it started its writer (waiting
                for that write would hang); likewise :meth:`wait` and :meth:`restore`.
        """
        step = non_negative_int("step", step)
        choice("blocking", blocking, (True, False))
        choice("force", force, (False, True))
        skipped = self._skips(step, bool(force))
        if skipped and (self._pending is None or not self._pending.done()):
            # A skipped step must not wait for the write in flight (the loop calls save on
            # every step), but reports it once it has failed (below).
            return SaveHandle.finished(step, None, "skipped")
        earlier = failure_of_pending(self)
        if earlier is None and skipped:
            return SaveHandle.finished(step, None, "skipped")
        if earlier is None:
            return self._save(state, step, blocking)
        # The earlier write failed: raising now could end the run with nothing saved since
        # the last good file (a preemption's final save), so this state is saved first,
        # blocking, even at a step ``every`` skips; then the failure is raised.
        try:
            handle = self._save(state, step, blocking=True)
        except BaseException as e:
            tell_earlier(e, earlier)
            raise
        raise CheckpointError(
            f"{earlier}; step {step} was saved to {handle.path} before this was raised",
            earlier.path,
        ) from earlier.__cause__

    def _save(self, state: Mapping[str, Any], step: int, blocking: bool) -> SaveHandle:
        """Make the save (after the previous write has settled)."""
        path = main_file(self.directory, step)
        rank, world = _group()
        if rank > 0:
            own = rank_file(self.directory, step, rank)
            with saving(own):
                write_now(rank_payload(state, step, rank, world), own)
            return SaveHandle.finished(step, path, "other rank")
        self._claim.claim()
        warn_if_behind(self, step)
        payload = build_payload(state, step, rank, world)
        if not blocking and not exiting():
            handle = self._start_background(payload, path, step)
            if handle is not None:
                return handle
        with saving(path):  # blocking: the other ranks may wait in a collective meanwhile
            write_now(payload, path)
        warn_notes(self._after(step), self._notes_told)
        return SaveHandle.finished(step, path, "blocking")

    def _start_background(self, payload: Any, path: Path, step: int) -> SaveHandle | None:
        """Start a background write; None when host memory cannot hold the snapshot."""
        total, on_cpu = tensor_bytes(payload)
        forked = on_cpu and fork_writes() and snapshot_safe(payload)
        needed = total if forked else self._staging.needed_bytes(payload)
        limits = host_limits()
        if needed and not staging_fits(needed, limits.memory_available, limits.memory_total):
            warnings.warn(
                f"Checkpointer.save(step={step}, blocking=False): a background save needs up "
                f"to {format_bytes(needed)} more host memory (one copy of the state), but "
                f"{format_bytes(limits.memory_available)} is available (of "
                f"{format_bytes(limits.memory_total)}, with a margin kept free): saving "
                "synchronously instead",
                UserWarning,
                stacklevel=user_stacklevel(),
            )
            return None
        handle = SaveHandle(step, path, "process" if forked else "thread")
        after = partial(self._after, step)
        staged = payload if forked else self._staging.stage(payload)
        handle._starting = True  # until the writer runs: no wait may wait for it before
        try:
            handle._track()
            # Pending before the writer starts: a Ctrl-C once it runs (Thread.start waits for
            # the thread) must leave it for the next save to wait for, or that save would
            # refill the staging buffers this writer still reads.
            self._pending = handle
            started = (start_process if forked else start_thread)(staged, path, after, handle)
        except OSError as e:  # fork or pipe refused: no writer started, the save still due
            self._pending = None
            handle._untrack()
            _warn_no_writer(step, "forked" if forked else "thread", e)
            return None
        except BaseException:
            # A thread writer takes the turn before it writes: taken here, none began and
            # none will, so there is nothing to wait for. start_process takes no turn: a
            # forked writer interrupted after its fork is forgotten here though it writes.
            if handle._take():
                self._pending = None
                handle._untrack()
            raise
        finally:
            handle._starting = False
        if started:  # not when the payload was refused before any writer started
            count_background_save()
        return handle

    def wait(self) -> None:
        """Wait until the background write (if any) is durable.

        Raises:
            CheckpointError: it failed (chained, with its path); nothing older was deleted.
            RuntimeError: called from a signal handler while that save starts its writer
                (as for :meth:`save`).
        """
        settle(self)

    # ----------------------------------------------------------------- reading

    def steps(self) -> list[int]:
        """The steps whose files are in the directory, oldest first: by name (a file cut
        short, or a foreign one, is listed; :meth:`latest` and :meth:`restore` skip it).

        Raises:
            CheckpointError: the directory has become a file.
            OSError: the directory cannot be listed (no permission, a disk error).
        """
        return steps_on_disk(self.directory)

    def latest(self) -> Path | None:
        """The newest complete checkpoint file, the one :meth:`restore` would load, or None
        when there is none.

        A file that is not a complete ``torch.save`` file (cut short, damaged), or holds no
        step (a foreign file with a step file's name), is skipped with a warning, as
        :meth:`restore` skips it; a legacy-format (non-zip) file counts, as it loads. This
        reads each file's pickle only, not its tensor data; :meth:`restore` also checks
        every byte's CRC and falls back to an older file, and a file it so found damaged
        is skipped here too, with a warning, while that file is unchanged (until it is put
        right, the step saved again, or ``restore`` loads it).

        It first waits for this process's background writes into the directory that are in
        flight (this Checkpointer's ``save(..., blocking=False)``, or another one's of the
        same directory), as :meth:`restore` does, so it names the step just saved; writes
        started meanwhile are not waited for, nor one whose ``save`` a signal handler
        calling ``latest`` interrupted while it started the writer (the older step is
        named). A write that failed is not raised here: the next :meth:`save` or
        :meth:`wait` raises it, and ``latest`` names the newest good file.

        Raises:
            OSError: a file it reaches could not be read (no permission, too many open
                files, a disk or network-filesystem error): raised, as :meth:`restore`
                raises it, not skipped for an older file, since the file may be fine; or
                the directory cannot be listed (as :meth:`steps`).
            CheckpointError: the newest step file holds another step than its name says
                (copied or renamed from another step's file), as :meth:`restore` raises;
                or the directory has become a file.
        """
        return newest_complete(self)

    def restore(
        self, state: Mapping[str, Any], *, device: str | int | torch.device | None = None
    ) -> int:
        """Load the newest complete checkpoint into the live objects of ``state``; return
        its step, or 0 when there is none.

        Each value with ``load_state_dict`` gets its saved state (modules through
        :func:`load_state_dict`, so wrapper prefixes fit either way, strictly; optimizers,
        schedulers, ``GradScaler``, ``MixedPrecision``), DataLoaders continue the pass they
        were saved in (the consumed batches are skipped at the sampler, never loaded),
        plain values are replaced in ``state`` (dicts, lists, sets, deques, tensors and NumPy
        arrays are updated in place where they can be, so other references to them see the
        saved values), and the random generators are set. A file that fails to load (cut
        short, damaged) is skipped with a warning for the next older one. Loaders in
        ``state`` are tracked from here on, even when there is no checkpoint yet, so that a
        later save knows their position: call it before the loop. Under a process group of
        two or more ranks it is a collective (two small ``all_gather_object`` calls, one
        before anything is loaded, one after; under NCCL on the rank's own GPU, even when
        ``torch.cuda.set_device`` was never called, the current device put back after):
        call it on every rank; a rank that fails before it (the directory cannot be
        listed, a file cannot be read), cannot restore its own part, or cannot load the
        step into its objects makes every rank raise.

        Args:
            state: the same keys ``save`` was given, holding the live objects.
            device: where the file's tensors are loaded before being copied into the live
                objects (which keep their own devices): None means the CPU; ``"cuda"``
                or ``"auto"`` under a process group, the rank's own GPU (as for
                :func:`load_checkpoint`).

        Returns:
            The restored step, or 0.

        Raises:
            CheckpointError: a background write of this Checkpointer failed (as for
                :meth:`wait`).
            RuntimeError: called from a signal handler while a save of this Checkpointer
                starts its writer (as for :meth:`save`).
            TypeError: ``state`` is not a dict with string keys, or ``device`` not a str,
                int or torch.device.
            ValueError: ``state`` has an entry the checkpoint lacks, or one whose saved value
                does not fit it (an optimizer with other parameter groups, an int where a
                module is), or ``device`` is not a device (``"gpu"``): checked before any
                file is read, the rest before anything is loaded.
            DeviceError: ``device`` is a GPU this machine does not have.
            StateDictMismatchError: a module's weights do not fit it (nothing is loaded).
            CheckpointError: an object's ``load_state_dict`` failed even so (the message
                names the entry, the file, the step and what was loaded before it).
            CheckpointError: the newest step file holds another step than its name says
                (copied or renamed from another step's file: ``step-000000200.pt`` holding
                step 100): not loaded, nor skipped for an older one; the message names the
                file, both steps and the fix.
            CheckpointError: the newest step file, or this rank's own file of that step,
                was saved by a newer PyTorch (not skipped for an older one, nor this rank's
                for rank 0's random states: the message says to upgrade torch).
            UnsafeCheckpointError: the newest step file (or this rank's own file of it)
                holds values ``weights_only=True`` refuses (not skipped for an older one).
            CheckpointError: under a process group, another rank failed before the ranks
                agreed (with any error this list names, such as an ``OSError``), or could
                not restore its own part (its rank file holds another step or rank than its
                name says, or was saved by a newer PyTorch): the message names the rank and
                its error; or the ranks found different newest steps, or the other ranks
                did not call ``restore`` within the group's timeout; nothing is loaded then.
            CheckpointError: under a process group, another rank could not load the step
                the ranks agreed on into its own objects (any error this list names for
                that, such as a ``StateDictMismatchError`` from a model built with other
                sizes on that rank; the message names the rank and its error), or did not
                say within the group's timeout that it had: this rank's state *was* loaded,
                but training must not go on with the ranks out of step.
            OSError: the newest file could not be read (no permission, too many open
                files, a disk or network-filesystem error): raised, not skipped, since the
                file may be fine; or the directory cannot be listed (as :meth:`steps`;
                ``CheckpointError`` if it has become a file).
            MemoryError: host memory ran out loading the newest file (raised, not skipped:
                the file is fine).
            torch.OutOfMemoryError: GPU memory ran out loading it onto ``device`` (raised,
                not skipped); the message says to restore with ``device="cpu"`` (the
                default) or free GPU memory.
        """
        return restore_newest(self, state, device)

    # -------------------------------------------------------------- preemption

    def preemption(
        self,
        signals: Iterable[str | int] | str | int = ("SIGTERM", "SIGUSR1"),
        grace_s: float = 25.0,
        *,
        check_every: int | None = None,
    ) -> Preemption:
        """A context manager whose value's ``requested`` turns True once a signal asks the
        run to stop, at the same step on every rank.

        The handlers only set a flag, so the loop decides when to save; a second signal
        during the final save does not interrupt it. ``deadline_s`` says how much of
        ``grace_s`` is left. While ``requested`` is True, ``save`` ignores ``every``.

        Args:
            signals: names (``"SIGTERM"``, ``"USR1"``) or numbers of the signals to catch.
            grace_s: seconds between the first signal and the hard kill the loop expects
                (torchrun sends SIGKILL 30 s after SIGTERM; the default leaves 5 s spare).
            check_every: under a process group, compare the ranks' flags every this many
                reads of ``requested``; None measures the comparison on entry and picks
                the interval that keeps it under 1 % of a 10 ms step.

        Returns:
            A :class:`Preemption` (enter it with ``with``).

        Raises:
            ValueError: an unknown or uncatchable signal, ``grace_s`` not a finite number
                > 0, or ``check_every`` not an int >= 1.
            RuntimeError: entered outside the main thread, or entered twice.
        """
        stop = Preemption(signals, grace_s, check_every)
        # Weakly: a Preemption kept must not keep this object (and its directory lock) alive.
        stop._on_stop = partial(_stop_agreed, weakref.ref(self))
        return stop


def _stop_agreed(ckpt: weakref.ref[Checkpointer]) -> None:
    """A :meth:`Checkpointer.preemption` object agreed a stop: from now on ``save`` ignores
    ``every``."""
    alive = ckpt()
    if alive is not None:
        alive._stop_requested = True
