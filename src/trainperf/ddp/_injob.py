"""``launch`` inside a torchrun or SLURM job: no workers to start, ``main`` runs here.

The process group is initialised from the launcher's environment (``env://``) unless it
already exists, ``main`` runs under :func:`~trainperf.ddp.watchdog` when ``hang_timeout`` is
set (there is no launcher of ours to watch the ranks, so they watch each other), and the
group is destroyed afterwards; the environment variables set here are put back.
``sys.exit(0)`` (or ``sys.exit()``) in ``main`` counts as returning None, as under ``launch``'s
own ranks, and is named in the errors; ``sys.exit(n)`` with another value fails. ``main`` may
destroy the group itself, on every rank or on some: ``launch_all``'s ranks then agree, on the
store, to gather the values in a group made for that. A rank whose ``main`` fails (or is
ended by the watchdog) says so on that store first, so the others do not wait out ``timeout``.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import pickle
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from trainperf.ddp import _env
from trainperf.ddp._group_exits import finished
from trainperf.ddp._shared_gpu import refuse_shared_gpu
from trainperf.ddp._worker import call_main, called, rank_device
from trainperf.errors import LaunchError

__all__ = ["resolve_backend", "run_in_process"]


def resolve_backend(backend: str | None, gpu_count: int) -> str:
    if backend is None:
        return "nccl" if gpu_count > 0 else "gloo"
    if backend == "nccl" and gpu_count == 0:
        raise ValueError(
            "backend='nccl' needs CUDA GPUs and none is visible; "
            "use backend='gloo' (or None) on CPU"
        )
    return backend


def run_in_process(
    env: _env.DistributedEnv,
    main: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    backend: str | None,
    timeout: timedelta,
    all_ranks: bool,
    hang_timeout: float | None,
) -> Any:
    import torch
    import torch.distributed as dist

    from trainperf.ddp._watchdog import Watchdog
    from trainperf.limits import usable_cpus

    names = (*_env.TORCHRUN_VARS, "LOCAL_WORLD_SIZE")
    saved = {name: os.environ.get(name) for name in names}
    values = (env.rank, env.world_size, env.local_rank, env.master_addr, env.master_port)
    os.environ.update({n: str(v) for n, v in zip(_env.TORCHRUN_VARS, values, strict=True)})
    os.environ["LOCAL_WORLD_SIZE"] = str(env.local_world_size)
    created = False
    try:
        if not dist.is_initialized():
            if "OMP_NUM_THREADS" not in os.environ:
                torch.set_num_threads(usable_cpus(env.local_world_size))
            _init_group(env, backend, timeout)
            created = True
        store = _default_store()  # kept: main may destroy the group, and the store with it
        # Taken before main, on every rank alike: a rank whose main fails posts it there.
        store = None if store is None or not all_ranks else _gather_store(store)
        # No launcher of ours to watch the ranks: they watch each other (a hang ends every
        # rank with status 124 and the verdict on stderr).
        watch = Watchdog(
            hang_timeout,
            None,
            option="hang_timeout",
            on_hang=lambda verdict: _post_failure(env, store, f"was ended by a hang: {verdict}"),
            scope="main",
        )
        try:
            # sys.exit(0) (or sys.exit()) in main counts as returning None, as under
            # launch's own spawner; ``call`` names it in the errors below.
            result, call = call_main(functools.partial(_watched, watch, main), args, kwargs)
            if all_ranks:
                _check_gatherable(result)
        except BaseException as e:
            # The others wait for this rank's value: tell them now, not after timeout.
            _post_failure(env, store, _raised(e))
            raise
        if not all_ranks:
            return result
        if _must_regroup(env, timeout, store, finished(call)):
            # main destroyed the group itself, here or on another rank (allowed: launch
            # destroys only one that is left). A new one carries the values, and is
            # destroyed below.
            _regroup(env, backend, timeout, store)
            created = True
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, result)
        return gathered
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _watched(watch: Any, main: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """``main`` under ``watch`` (a :class:`~trainperf.ddp._watchdog.Watchdog`), which sees
    how it ended: a ``sys.exit(0)`` leaves its block as the clean exit it is. Its own
    parameters are positional-only: ``main``'s keywords may be named ``watch`` or ``main``."""
    with watch.start():
        return main(*args, **kwargs)


def _init_group(
    env: _env.DistributedEnv, backend: str | None, timeout: timedelta, store: Any = None
) -> None:
    """The default process group: from the launcher's environment (``env://``), or on
    ``store``. Under NCCL each rank takes its node-local GPU; where a node runs several ranks,
    they check on the store that no two are on the same card, and NCCL starts lazily (its
    eager start, ``device_id=``, would fail on a shared card before the check).

    Raises:
        ValueError: more ranks on this node than visible GPUs (several visible).
        DeviceError: ranks of this node share a GPU.
        LaunchError: a rank of this node did not post its card within ``timeout``.
    """
    import torch
    import torch.distributed as dist

    resolved = resolve_backend(backend, torch.cuda.device_count())
    device = None
    if resolved == "nccl":
        device = rank_device(env.local_rank, env.local_world_size)
        torch.cuda.set_device(device)
    # Every rank of a node with several posts its card and starts NCCL lazily: the eager
    # start (device_id=) fails on a shared card before the check, and it waits for every
    # rank to join NCCL while another may still wait on the store for this one's card.
    ask = resolved == "nccl" and store is None and env.local_world_size > 1
    dist.init_process_group(
        resolved,
        init_method=None if store is not None else "env://",
        store=store,
        rank=env.rank,
        world_size=env.world_size,
        timeout=timeout,
        device_id=None if ask else device,
    )
    shared = _default_store() if ask else None
    if shared is not None:
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        try:
            refuse_shared_gpu(shared, env.local_rank, env.local_world_size, uuid, wait=timeout)
        except BaseException:
            dist.destroy_process_group()  # the caller destroys only groups it was given
            raise


def _default_store() -> Any:
    """The default group's store, or None where torch does not say (a private accessor)."""
    from torch.distributed import distributed_c10d

    try:
        return distributed_c10d._get_default_store()
    except (AttributeError, ValueError, KeyError, RuntimeError):
        return None


# The failed ranks a launch_all error lists one by one.
_SHOWN_FAILURES = 4

# How many in-job gathers (launch_all calls) this process made; the same count on every rank
# (each runs the same launch_all calls), so their keys agree.
_gathers = itertools.count()


def _gather_store(store: Any) -> Any:
    """This gather's own keys on the first group's store, apart from every earlier
    gather's and earlier torchrun restart's (torchrun's agent keeps its store)."""
    import torch.distributed as dist

    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    prefix = f"trainperf/launch_all/{restart}/{next(_gathers)}/"
    return dist.PrefixStore(prefix, store)  # type: ignore[attr-defined]


def _must_regroup(
    env: _env.DistributedEnv, timeout: timedelta, store: Any, how: str = "returned from main"
) -> bool:
    """Whether every rank makes a default group again to gather the values: yes if main
    destroyed the group on any rank. The ranks agree on the store, not in a collective (the
    group is gone on some); each waits at most ``timeout`` for the others to report. ``how``:
    how this rank finished main, for the errors (``"called sys.exit(0)"``).

    Raises:
        LaunchError: main failed on another rank (it posts that at once: the message
            names the rank and its exception), or a rank did not report within
            ``timeout`` (still in main, or died).
    """
    import torch.distributed as dist

    alive = dist.is_initialized()
    if store is None:
        return not alive  # no store kept (torch no longer says which): nothing to agree on
    keys = [f"reported/{rank}" for rank in range(env.world_size)]
    try:
        if not alive:
            store.add("destroyed", 1)  # before "reported": who read every report sees it
        store.set(keys[env.rank], "1")
        store.wait(keys, timeout)
        failed = _failures(env, store)
    except RuntimeError as e:  # DistStoreError on a timeout, DistNetworkError if gone
        raise LaunchError(_unreported_message(env, timeout, store, keys, how)) from e
    if failed:
        raise LaunchError(_failed_message(env, failed, how))
    regroup = int(store.add("destroyed", 0)) > 0
    if regroup and alive:
        dist.destroy_process_group()  # destroyed on another rank: cannot carry the values
    return regroup


def _check_gatherable(result: Any) -> None:
    """Refuse, on this rank, a value ``all_gather_object`` cannot pickle: failing inside the
    gather would leave the other ranks in it (NCCL waits ``timeout``; gloo says only
    "Connection reset by peer")."""
    try:
        pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:
        raise TypeError(
            f"launch_all: main returned a value that cannot be pickled to gather it from "
            f"every rank ({type(result).__name__}): {e}; return picklable CPU values (build "
            "the rest from them after launch_all)"
        ) from e


def _raised(exc: BaseException) -> str:
    """``"raised ValueError: its first line"``, whatever ``str(exc)`` does; ``"called
    sys.exit(3)"`` for a ``SystemExit``, as launch's own spawner says (:func:`called`).

    Example:
        >>> _raised(ValueError("bad batch\\nmore")), _raised(SystemExit("no data"))
        ('raised ValueError: bad batch', "called sys.exit('no data')")
    """
    if (call := called(exc)) is not None:
        return call
    try:
        lines = str(exc).strip().splitlines()
    except Exception:
        lines = []
    return f"raised {type(exc).__name__}" + (f": {lines[0]}" if lines else "")


def _post_failure(env: _env.DistributedEnv, store: Any, what: str) -> None:
    """This rank's main failed (``what``: how): say so on the gather's store, so that the
    ranks waiting for its value in ``_must_regroup`` stop at once and name it."""
    if store is None:
        return
    with contextlib.suppress(Exception):  # the store is gone: the others find out by timeout
        store.set(f"failed/{env.rank}", what[:500])
        store.add("failed", 1)
        store.set(f"reported/{env.rank}", "failed")  # last: a waiter that sees it sees why


def _failures(env: _env.DistributedEnv, store: Any) -> dict[int, str]:
    """``{rank: "raised Type: message"}`` for the ranks whose main failed (one read if none
    did)."""
    if int(store.add("failed", 0)) == 0:
        return {}
    keys = [f"failed/{rank}" for rank in range(env.world_size)]
    return {r: bytes(store.get(k)).decode() for r, k in enumerate(keys) if store.check([k])}


def _failed_message(
    env: _env.DistributedEnv, failed: dict[int, str], how: str = "returned from main"
) -> str:
    shown = sorted(failed)[:_SHOWN_FAILURES]
    lines = [f"  rank {rank} {failed[rank]}" for rank in shown]
    if len(failed) > len(shown):
        lines.append(f"  ... and {len(failed) - len(shown)} more")
    return (
        f"launch_all: rank {env.rank} {how}, but main failed on rank(s) "
        f"{sorted(failed)}, so their values cannot be gathered (see their output):\n"
        + "\n".join(lines)
    )


def _unreported_message(
    env: _env.DistributedEnv, timeout: timedelta, store: Any, keys: list[str], how: str
) -> str:
    seconds = f"timeout={timeout.total_seconds():g} s"
    try:
        missing = [rank for rank, key in enumerate(keys) if not store.check([key])]
    except RuntimeError:
        missing = []
    if not missing:
        return (
            f"launch_all: rank {env.rank} {how}, but the store that gathers "
            f"every rank's value became unreachable within {seconds} (the rank that hosts "
            "it, rank 0 unless the launcher hosts it, may have failed or exited); see the "
            "other ranks' output"
        )
    message = (
        f"launch_all: rank {env.rank} {how}, but rank(s) {missing} did not finish main "
        f"within {seconds}, so their values cannot be gathered; see their output for an "
        "error, or pass a longer timeout if main takes that much longer on them"
    )
    try:
        failed = _failures(env, store)
    except RuntimeError:
        failed = {}
    return message if not failed else f"{message}\n\n{_failed_message(env, failed, how)}"


def _regroup(env: _env.DistributedEnv, backend: str | None, timeout: timedelta, store: Any) -> None:
    """A default group again, after main destroyed the first, to gather the values. On the
    gather's own keys of the first group's store: a group made again on the first one's
    keys (``env://``) reads its stale addresses under torchrun (whose agent keeps the store)
    and fails to connect."""
    import torch.distributed as dist

    if store is None:
        # No store kept (torch no longer says which): from the environment, as at first.
        _init_group(env, backend, timeout)
        return
    _init_group(env, backend, timeout, dist.PrefixStore("group/", store))  # type: ignore[attr-defined]
