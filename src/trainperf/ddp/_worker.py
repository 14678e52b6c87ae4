"""What runs inside each worker that ``launch`` spawns.

A worker ties its life to the parent's (:func:`~trainperf._utils.lifetime.die_with_parent`:
the parent-death signal, or a watcher thread), takes its own process group
so the parent can stop it together with its DataLoader workers, loads ``main`` (under spawn:
imports its module, inside the worker's own error handling, so an import that fails is
reported like any exception), joins the process group through the parent's store, runs
``main`` and sends its messages back: ``loaded`` once ``main`` is imported, then its result,
or the exception it died of, stamped with the time it was raised so the parent can tell the
first failure from the ranks that failed because a peer had gone.

A spawned worker starts with its stderr on a pipe to the launcher, which keeps the tail: what
Python prints when importing the script fails before any trainperf code runs (a
bootstrapping ``RuntimeError``, an exception at import time) reaches the ``LaunchError``.
The worker puts its real stderr back as its first act.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import multiprocessing
import os
import pickle
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from types import TracebackType
from typing import Any, NoReturn, cast

from trainperf._utils.lifetime import die_with_parent

__all__ = [
    "KEEP_START_METHOD",
    "REIMPORT_EXIT_CODE",
    "WORKER_NAME_PREFIX",
    "Failure",
    "InheritedFd",
    "WorkerSpec",
    "called_function",
    "rank_device",
    "reimporting_main",
    "worker_main",
]

# Each worker process is named f"{WORKER_NAME_PREFIX}{rank}".
WORKER_NAME_PREFIX = "trainperf-rank"
KEEP_START_METHOD = "keep"
"""WorkerSpec.child_start_method: leave the rank's default start method as it is."""
# The exit status of a spawned worker whose import of the script called launch() again (no
# __main__ guard); the launcher turns it into the advice to add one.
REIMPORT_EXIT_CODE = 117


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs; pickled once per rank under spawn.

    ``main``, ``args`` and ``kwargs`` travel as one pickled blob (``packed``) that the
    worker loads inside its own error handling: a module the worker cannot import then
    fails as a reported exception, not as a crash of multiprocessing's bootstrap. Each of
    them is labelled in the blob (``labels``), so a failure names the one being unpickled.
    """

    main: Callable[..., Any] | None
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    backend: str
    world_size: int
    master_addr: str
    master_port: int
    store_prefix: str
    timeout: timedelta
    threads: int | None
    parent_pid: int
    send_result_from_all: bool
    from_main: bool = True  # the launcher's main thread starts the ranks (die_with_parent)
    # The launching process's own default start method (None: the platform's), for a
    # spawned rank's own children (its DataLoader workers), not the one that started the
    # rank; KEEP_START_METHOD: leave the rank's as it is (forked ranks).
    child_start_method: str | None = KEEP_START_METHOD
    grace_s: float | None = None
    hang: Any = None  # a _progress.ProgressSpec when hang detection is on
    packed: bytes | None = None
    labels: tuple[str, ...] = ()  # main's arguments, in the order they are unpickled

    def __reduce__(self) -> tuple[Any, ...]:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if fields["main"] is not None:
            call, labels = _labelled(fields.pop("main"), fields.pop("args"), fields.pop("kwargs"))
            # Once per rank: queues and pipes travel as descriptors handed to that one child.
            fields.update(main=None, args=(), kwargs={}, packed=_pack(call), labels=labels)
        return (_rebuild_spec, (fields,))

    def load(self) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
        """``(main, args, kwargs)``, unpickled here when they came packed."""
        if self.packed is None:
            return cast(Callable[..., Any], self.main), self.args, self.kwargs
        _unpickled.clear()
        call: tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]] = pickle.loads(self.packed)
        return call

    def failed_argument(self) -> str | None:
        """After :meth:`load` raised: the argument being unpickled (``"args[1] (pkg.Cls)"``),
        or None when main itself failed."""
        if _MAIN not in _unpickled:
            return None
        done = len(_unpickled) - 1
        return self.labels[done] if done < len(self.labels) else "arguments"


_MAIN = "main"
# The labels of what this worker has unpickled so far, in order: the first one missing after
# a failure is the one that failed.
_unpickled: list[str] = []


class _Labelled:
    """One of ``main``, its arguments, on the way to a worker: unpickled, it is the value
    itself, and its label is recorded once the value is built."""

    def __init__(self, label: str, value: Any) -> None:
        self.label = label
        self.value = value

    def __reduce__(self) -> tuple[Any, ...]:
        return (_arrived, (self.label, self.value))


def _labelled(
    main: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], tuple[str, ...]]:
    """``(main, args, kwargs)`` with each value labelled, and the labels in unpickling order."""
    positional = [f"args[{i}] ({_class_name(type(a))})" for i, a in enumerate(args)]
    keyword = {k: f"kwargs[{k!r}] ({_class_name(type(v))})" for k, v in kwargs.items()}
    call = (
        _Labelled(_MAIN, main),
        tuple(_Labelled(label, a) for label, a in zip(positional, args, strict=True)),
        {k: _Labelled(keyword[k], v) for k, v in kwargs.items()},
    )
    return call, (*positional, *keyword.values())


def _arrived(label: str, value: Any) -> Any:
    _unpickled.append(label)
    return value


def _class_name(cls: type) -> str:
    """``pkg.mod.Name`` as the user wrote it (``Name`` for builtins; a spawned rank imports
    the script as ``__mp_main__``: the user wrote ``__main__``)."""
    module = "__main__" if cls.__module__ == "__mp_main__" else cls.__module__
    return cls.__qualname__ if module == "builtins" else f"{module}.{cls.__qualname__}"


class _CopyingPickler(ForkingPickler):
    """multiprocessing's pickler (queues, pipes and locks travel as under spawn), except
    that tensors are copied into each rank, as a forked rank or a torchrun rank has its own:
    torch's reducers would move every tensor of ``args`` into shared memory, so a model passed
    to ``main`` had one set of parameters for every rank (and the launcher), each rank's
    optimizer step applied to it. A CPU tensor already in shared memory
    (``tensor.share_memory_()``, ``model.share_memory()``) stays shared: that was asked for."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # One storage object per storage, so pickle's memo writes it once and views of one
        # buffer (parameters carved out of a flat one) stay views of one copy in the rank.
        self._storages: dict[tuple[int, Any], Any] = {}

    def reducer_override(self, obj: Any) -> Any:
        torch = sys.modules.get("torch")  # not imported: there is no tensor to pickle
        if torch is None:
            return NotImplemented
        if isinstance(obj, torch.Tensor):
            try:
                storage = obj.untyped_storage()
            except (NotImplementedError, RuntimeError):  # sparse and such: no one storage
                return obj.__reduce_ex__(2)
        elif isinstance(obj, torch.TypedStorage):  # what a tensor's reduction holds
            storage = obj._untyped_storage
        elif isinstance(obj, torch.UntypedStorage):
            storage = obj
        else:
            return NotImplemented
        if storage.device.type == "cpu" and storage.is_shared():
            return NotImplemented  # torch's reducer: shared, as the user made it
        if not isinstance(obj, torch.Tensor):
            return obj.__reduce__()  # a storage by value (torch.save into bytes)
        reduced = obj.__reduce_ex__(2)  # by value; its storage comes back here
        args = reduced[1]
        if args and isinstance(args[0], torch.TypedStorage):
            key = (args[0]._untyped_storage._cdata, args[0].dtype)
            same = self._storages.setdefault(key, args[0])
            reduced = (reduced[0], (same, *args[1:]), *reduced[2:])
        return reduced


def _pack(call: tuple[Any, ...]) -> bytes:
    buf = io.BytesIO()
    _CopyingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(call)
    return buf.getvalue()


def _rebuild_spec(fields: dict[str, Any]) -> WorkerSpec:
    return WorkerSpec(**fields)


class InheritedFd:
    """A file descriptor of the launcher handed to a spawned worker under the same number.

    Pickled only while multiprocessing starts the worker (which passes the descriptor
    along); a forked worker inherits every descriptor and needs none of this.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, ...]:
        from multiprocessing import reduction

        return (_rebuild_fd, (reduction.DupFd(self.fd),))


def _rebuild_fd(dup: Any) -> InheritedFd:
    return InheritedFd(dup.detach())


@dataclass(frozen=True)
class Failure:
    """The exception a worker's ``main`` (or its set-up) raised, as plain strings."""

    rank: int
    pid: int
    type_name: str
    message: str
    traceback: str
    time: float
    # "load": importing main's module (unpickling main) failed; "args": unpickling one of
    # main's arguments failed (``argument`` names it); "main": the set-up or main raised.
    stage: str = "main"
    argument: str = ""


def reimporting_main() -> bool:
    """Whether this is a worker that ``launch`` spawned, still importing the main script.

    Under spawn each worker first imports the script again (as ``__mp_main__``); a
    ``launch()`` call that no ``if __name__ == "__main__":`` guard protects then runs in the
    worker too, where Python refuses it with a long "bootstrapping phase" traceback. Until
    that import is over, multiprocessing has not set the worker's parent process yet, while
    the process already bears the name the launcher gave it.

    Example:
        >>> reimporting_main()  # the launching process itself
        False
    """
    me = multiprocessing.current_process()
    return me.name.startswith(WORKER_NAME_PREFIX) and multiprocessing.parent_process() is None


def called_function(main: Callable[..., Any]) -> Callable[..., Any]:
    """The function ``main`` calls: itself, or what a ``functools.partial`` wraps.

    Example:
        >>> import functools, operator
        >>> called_function(functools.partial(functools.partial(operator.add, 1), 2))
        <built-in function add>
    """
    while isinstance(main, functools.partial):
        main = main.func
    return main


def rank_device(local_rank: int) -> Any:
    """The CUDA device a rank with this local rank uses (one process per GPU).

    A job whose scheduler binds one GPU per task shows each task a single device; any
    other layout needs ``local_rank < device_count``.
    """
    import torch

    count = torch.cuda.device_count()
    if count == 1:
        return torch.device("cuda", 0)
    if local_rank >= count:
        raise ValueError(
            f"local rank {local_rank} has no GPU: only {count} visible "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); start at most "
            f"{count} processes per node, or use backend='gloo'"
        )
    return torch.device("cuda", local_rank)


def _user_frames(tb: TracebackType | None) -> TracebackType | None:
    """Drop this module's own frames from the top of a traceback: users want theirs."""
    start = tb
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return tb if tb is not None else start


def _describe(rank: int, exc: BaseException, stage: str = "main", argument: str = "") -> Failure:
    cls = type(exc)
    return Failure(
        rank=rank,
        pid=os.getpid(),
        type_name=_class_name(cls),
        message=_text(exc),
        traceback="".join(traceback.format_exception(cls, exc, _user_frames(exc.__traceback__))),
        time=time.time(),
        stage=stage,
        argument=argument,
    )


def _text(exc: BaseException) -> str:
    """``str(exc)``, or what can be said when its ``__str__`` raises (the report must go)."""
    try:
        return str(exc)
    except Exception as e:
        return f"<{type(exc).__name__} whose str() raised {type(e).__name__}: {e!r}>"


def _setup(spec: WorkerSpec, rank: int) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(spec.world_size),
        LOCAL_WORLD_SIZE=str(spec.world_size),
        MASTER_ADDR=spec.master_addr,
        MASTER_PORT=str(spec.master_port),
    )
    if spec.threads is not None:
        torch.set_num_threads(spec.threads)
    device = None
    if spec.backend == "nccl":
        device = rank_device(rank)
        torch.cuda.set_device(device)
    client = dist.TCPStore(  # type: ignore[attr-defined]
        spec.master_addr, spec.master_port, is_master=False, timeout=spec.timeout
    )
    dist.init_process_group(
        spec.backend,
        store=dist.PrefixStore(spec.store_prefix, client),  # type: ignore[attr-defined]
        rank=rank,
        world_size=spec.world_size,
        timeout=spec.timeout,
        device_id=device,
    )
    # Every rank's side of the connections is up before any rank's main runs: a rank whose
    # main returns at once would otherwise tear the group down while a slower peer was still
    # connecting ("Gloo connectFullMesh failed ... Connection closed by peer").
    dist.barrier()


@contextlib.contextmanager
def _uncounted(tracker: Any) -> Iterator[None]:
    """The launcher's own collectives (the group's start-up barriers) are not counted as
    main's: the first collective a hang report names is main's first."""
    if tracker is None:
        yield
        return
    tracker.depth += 1
    try:
        yield
    finally:
        tracker.depth -= 1


def _destroy() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _is_clean_exit(exc: BaseException) -> bool:
    return isinstance(exc, SystemExit) and exc.code in (None, 0)


def _send(conn: Connection, message: tuple[str, int, Any]) -> None:
    # Plain pickle copies tensors into the message; multiprocessing's own pickler would
    # share their storage through a file descriptor that dies with this process.
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def _report_failure(conn: Connection, failure: Failure) -> None:
    # OSError: the parent is gone or stopped listening; the exit code still tells it.
    with contextlib.suppress(OSError):
        _send(conn, ("error", failure.rank, failure))


def _restore_stderr(stderr: InheritedFd | None) -> None:
    """Point fd 2 back at the launcher's stderr (it was a pipe while Python started)."""
    if stderr is None:
        return
    with contextlib.suppress(OSError):
        os.dup2(stderr.fd, 2)
    with contextlib.suppress(OSError):
        os.close(stderr.fd)


def _load(spec: WorkerSpec, rank: int, conn: Connection) -> Any:
    """``(main, args, kwargs)``, then tell the launcher (it may be measuring this rank)."""
    try:
        call = spec.load()
    except BaseException as exc:
        argument = spec.failed_argument()
        if argument is None:
            _report_failure(conn, _describe(rank, exc, stage="load"))
        else:
            _report_failure(conn, _describe(rank, exc, stage="args", argument=argument))
        _exit_now(1)
    import torch  # noqa: F401  (what a rank costs is measured with torch imported)

    with contextlib.suppress(OSError):
        _send(conn, ("loaded", rank, None))
    return call


# Keeps the stack file open for faulthandler for the life of the worker.
_stack_files: list[Any] = []


def _track(spec: WorkerSpec, rank: int) -> Any:
    """Hang detection on: write progress into this rank's slot, dump stacks on request.

    Installed before main's module is imported, so its ``dist.*`` calls are seen.
    """
    if spec.hang is None:
        return None
    import faulthandler

    from trainperf.ddp import _progress
    from trainperf.ddp._stacks import DUMP_SIGNAL

    tracker = _progress.Tracker(_progress.attach(spec.hang.path), rank)
    _progress.install(tracker)
    _progress._launched.append(True)
    stacks = open(os.path.join(spec.hang.stacks_dir, f"rank{rank}.stacks"), "w")  # noqa: SIM115
    _stack_files.append(stacks)
    faulthandler.register(DUMP_SIGNAL, file=stacks, all_threads=True, chain=False)
    return tracker


def _finish_background_saves() -> None:
    """Finish the background checkpoint writes ``main`` left running before this rank
    reports its result: after that the launcher gives a rank only a few seconds to exit,
    and stopping it would kill the writer and lose the checkpoint. Nothing when
    trainperf.checkpoint was never imported."""
    module = sys.modules.get("trainperf.checkpoint._checkpointer")
    if module is not None:
        module._wait_at_exit()


def worker_main(
    spec: WorkerSpec, rank: int, conn: Connection, stderr: InheritedFd | None = None
) -> None:
    """Entry point of a spawned worker (``multiprocessing.Process`` target)."""
    # A forked worker inherits the launcher's handlers, which would raise in the wrong process.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _restore_stderr(stderr)
    die_with_parent(spec.parent_pid, spec.from_main)
    # A spawned process makes spawn its default too: its DataLoader workers would start a
    # fresh interpreter each (a dataset class defined in main cannot be pickled there, and
    # each epoch's workers import torch again), unlike the same script under torchrun.
    if spec.child_start_method != KEEP_START_METHOD:
        multiprocessing.set_start_method(spec.child_start_method, force=True)
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    if spec.grace_s is not None:
        # What the launcher gives a rank between SIGTERM and SIGKILL (preemption handlers).
        os.environ["TRAINPERF_GRACE_S"] = f"{spec.grace_s:g}"
    try:
        tracker = _track(spec, rank)
    except Exception as e:
        # Hang detection is a help, not a condition to run: without it this rank's slot
        # never says "ready", so the launcher's hang clock does not start.
        print(
            f"trainperf.ddp: rank {rank}: hang detection is off ({e!r})",
            file=sys.stderr,
            flush=True,
        )
        tracker = None
    main, args, kwargs = _load(spec, rank, conn)

    try:
        with _uncounted(tracker):
            _setup(spec, rank)
        if tracker is not None:
            tracker.ready(armed=True)
        result = main(*args, **kwargs)
        _finish_background_saves()
        if tracker is not None:
            tracker.returned()
        payload = result if (rank == 0 or spec.send_result_from_all) else None
        try:
            # The result goes out before the group is torn down: a peer still inside a
            # collective fails as soon as this rank disconnects, and the launcher must by
            # then know that this rank had returned.
            _send(conn, ("ok", rank, payload))
        except (pickle.PicklingError, TypeError, AttributeError) as e:
            raise TypeError(
                f"main returned a value that cannot be pickled back to the launcher "
                f"({type(result).__name__}): {e}"
            ) from e
    except BaseException as exc:
        if _is_clean_exit(exc):
            _send(conn, ("ok", rank, None))
        else:
            # Report before tearing the group down: destroying it can block after a fault,
            # and the time stamp must precede the errors this exit causes in the peers.
            _report_failure(conn, _describe(rank, exc))
            _exit_now(1)
    conn.close()
    try:
        _destroy()
    except Exception:
        # main succeeded and its result is already with the launcher: a failed clean-up
        # is worth a warning, not the run.
        print(
            f"trainperf.ddp: rank {rank}: destroy_process_group failed after main returned:\n"
            + traceback.format_exc(),
            file=sys.stderr,
            flush=True,
        )


def _exit_now(code: int) -> NoReturn:
    """Leave without interpreter shutdown: after a fault it can block (threads, NCCL)."""
    with contextlib.suppress(Exception):
        _destroy()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
