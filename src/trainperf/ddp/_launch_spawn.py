"""Starting the ranks on this host and watching them: the store they join through, one
:class:`~trainperf.ddp._group.Group` per attempt, restarts after a failure, and hang
detection across them.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import signal
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.context import BaseContext
from typing import Any

from trainperf._utils.lifetime import started_from_main
from trainperf.ddp import _capacity
from trainperf.ddp._detector import HangDetector
from trainperf.ddp._group import Group
from trainperf.ddp._procs import Interrupted, SignalGuard
from trainperf.ddp._store import LOCALHOST, StoreHost, listen
from trainperf.ddp._worker import KEEP_START_METHOD as _KEEP
from trainperf.ddp._worker import WorkerSpec
from trainperf.errors import LaunchError

logger = logging.getLogger("trainperf.ddp")


def _spawn(
    main: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    nprocs: int,
    backend: str,
    start_method: str,
    timeout: timedelta,
    max_restarts: int,
    all_ranks: bool,
    grace_s: float,
    hang_timeout: float | None,
) -> dict[int, Any]:
    from trainperf.limits import usable_cpus

    ctx = multiprocessing.get_context(start_method)
    detector = None if hang_timeout is None else HangDetector(nprocs, hang_timeout)
    try:
        # The guard comes first: an interrupt from here on stops whatever was started.
        with SignalGuard() as guard, StoreHost(listen(), timeout) as host:
            threads = None if "OMP_NUM_THREADS" in os.environ else usable_cpus(nprocs)
            base = WorkerSpec(
                main=main,
                args=args,
                kwargs=kwargs,
                backend=backend,
                world_size=nprocs,
                master_addr=LOCALHOST,
                master_port=host.sock.getsockname()[1],
                store_prefix="",
                timeout=timeout,
                threads=threads,
                parent_pid=os.getpid(),
                send_result_from_all=all_ranks,
                from_main=started_from_main(),
                # Spawned ranks only: forked ones keep fork, as their parent's children would.
                child_start_method=(
                    multiprocessing.get_start_method(allow_none=True)
                    if start_method == "spawn"
                    else _KEEP
                ),
                grace_s=grace_s,
                hang=None if detector is None else detector.spec,
            )
            measure = nprocs > 1 and _capacity.needs_measuring(
                nprocs, _own_memory(), _capacity.available_memory()
            )
            return _attempts(ctx, base, guard, max_restarts, host.start, measure, detector)
    except Interrupted as e:
        if e.signum == signal.SIGINT:
            raise KeyboardInterrupt from None
        raise SystemExit(128 + e.signum) from None
    finally:
        if detector is not None:
            detector.close()


def _own_memory() -> int:
    """This process's resident memory: what a rank with torch imported costs, roughly."""
    import psutil

    return int(psutil.Process().memory_info().rss)


def _attempts(
    ctx: BaseContext,
    base: WorkerSpec,
    guard: SignalGuard,
    max_restarts: int,
    on_started: Callable[[], None] | None = None,
    measure_first: bool = False,
    detector: HangDetector | None = None,
) -> dict[int, Any]:
    """Run the group; after a failure, run it again from scratch, up to ``max_restarts``."""
    attempt = 0
    while True:
        # Each attempt rendezvouses under its own key prefix in the one store.
        spec = dataclasses.replace(base, store_prefix=f"trainperf/attempt{attempt}/")
        label = f" (attempt {attempt + 1} of {max_restarts + 1})" if max_restarts else ""
        if detector is not None:
            detector.reset()
        group = Group(
            ctx, spec, label, guard, on_started, measure_first=measure_first, detector=detector
        )
        try:
            return group.run()
        except LaunchError as e:
            if attempt == max_restarts or not group.restartable:
                raise
            logger.warning("%s\nrestarting all %d ranks", e, base.world_size)
        attempt += 1
        measure_first = False  # measured once; the host has not changed since
