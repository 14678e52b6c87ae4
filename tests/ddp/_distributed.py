"""The one helper multi-process tests use: run a function on every rank, get every result.

Worker functions must live at module top level in an importable module (``tests.ddp._workers``)
so that spawned workers can import them; ``multiprocessing`` hands the parent's
``sys.path`` (which pytest put ``tests/`` on) to spawned children.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

from trainperf.ddp import launch, launch_all

__all__ = ["FORK", "LONG", "fast_start_method", "launch_fork", "spawn"]

FORK = "fork"
LONG = timedelta(minutes=30)  # the default: a test that waits for it would time out


def fast_start_method() -> str:
    """ "fork" (no interpreter start-up per rank) unless CUDA is already initialised here.

    On a GPU machine an earlier test may have initialised CUDA in this process, and launch
    then refuses fork; spawn is slower but always safe.
    """
    import torch

    from trainperf.ddp._launch_checks import cuda_driver_loaded

    # Forked children of a process that loaded CUDA's driver (the conftest's
    # torch.cuda.is_available() does) are on shaky ground even without using the GPU.
    return "spawn" if torch.cuda.is_initialized() or cuda_driver_loaded() else "fork"


def spawn(
    fn: Callable[..., Any],
    world_size: int = 2,
    backend: str = "gloo",
    *,
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
    start_method: str = "spawn",
    timeout_s: float = 60.0,
    hang_timeout_s: float | None = None,
) -> dict[int, Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return ``{rank: result}``.

    Hang detection is off unless ``hang_timeout_s`` (below ``timeout_s``) turns it on. The
    tests read what a waiting collective does at ``timeout_s`` (a 3 s group timeout, then
    the rank's own error), or let one rank work alone while the other waits (a tuner
    measuring on local rank 0): a detector firing first would make those a ``HangError``.
    Launch's default, 300 s, never fired before these timeouts and warned that it could not.
    """
    if start_method == FORK:
        start_method = fast_start_method()
    results = launch_all(
        fn,
        *args,
        nprocs=world_size,
        backend=backend,  # type: ignore[arg-type]
        start_method=start_method,  # type: ignore[arg-type]
        timeout=timedelta(seconds=timeout_s),
        hang_timeout=hang_timeout_s,
        **(kwargs or {}),
    )
    return dict(enumerate(results))


def launch_fork(main: Callable[..., Any], *args: Any, nprocs: int = 2, **kw: Any) -> Any:
    """``launch`` on gloo ranks started the quick way (fork where it is safe)."""
    return launch(
        main, *args, nprocs=nprocs, backend="gloo", start_method=fast_start_method(), **kw
    )
