"""Multi-process training on torch.distributed: ``launch(main)`` and the helpers ranks use.

``launch(main)`` at the bottom of a plain training script starts one process per GPU
(NCCL), or as many CPU ranks as asked for (gloo), with the process group initialised; the
same script runs unchanged under ``torchrun`` or ``srun`` across nodes. Failures are
reported with the failing rank's traceback, and nothing is left running.

Import it as ``import trainperf.ddp`` (or ``from trainperf import ddp``): the top-level
``trainperf`` package does not import it, so ``import trainperf`` stays light.

Example:
    >>> import trainperf.ddp as ddp
    >>> ddp.rank(), ddp.world_size(), ddp.is_main_process()
    (0, 1, True)
"""

from __future__ import annotations

from trainperf._utils.public import set_public_module
from trainperf.ddp._data_parallel import data_parallel
from trainperf.ddp._env import expand_nodelist
from trainperf.ddp._hang_report import HangReport
from trainperf.ddp._helpers import (
    DistributedLoader,
    all_reduce_mean,
    barrier,
    distributed_loader,
    is_main_process,
    local_rank,
    print0,
    rank,
    world_size,
    wrap_model,
)
from trainperf.ddp._launch import Backend, StartMethod, launch, launch_all
from trainperf.ddp._watchdog import Watchdog, watchdog
from trainperf.errors import HangError

__all__ = [
    "Backend",
    "DistributedLoader",
    "HangError",
    "HangReport",
    "StartMethod",
    "Watchdog",
    "all_reduce_mean",
    "barrier",
    "data_parallel",
    "distributed_loader",
    "expand_nodelist",
    "is_main_process",
    "launch",
    "launch_all",
    "local_rank",
    "print0",
    "rank",
    "watchdog",
    "world_size",
    "wrap_model",
]

# HangError is trainperf.errors' (re-exported here and at the top level): it keeps
# `trainperf` as its public module, like every exception.
set_public_module(globals(), [n for n in __all__ if n != "HangError"], __name__)
