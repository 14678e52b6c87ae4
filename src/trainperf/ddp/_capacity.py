"""How many ranks this host can hold: the CPU and memory rules ``launch`` applies to ``nprocs``.

- **CPUs** (gloo ranks): at most :data:`MAX_RANKS_PER_CPU` ranks per usable CPU
  (:func:`trainperf.limits.host_limits`, container-aware). Each rank is a process with its
  own interpreter, and far more of them than CPUs spend their time being switched in and
  out. ``TRAINPERF_OVERSUBSCRIBE=1`` lifts the rule (the memory rule still applies). NCCL
  ranks are bounded by the GPUs instead.
- **Memory**: when ``nprocs`` copies of the launcher's own footprint would need more than
  half the available memory, rank 0 is started alone first; once it has imported torch and
  ``main``'s module, its unique memory (USS; at least :data:`MIN_RANK_BYTES`) times
  ``nprocs`` must fit in :data:`MEMORY_SHARE` of the memory that was available before it
  started, or the launch is refused before the others start. That is the footprint at
  start-up: what ``main`` allocates later comes on top.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import psutil

from trainperf._utils import launch_env
from trainperf._utils.format import format_bytes

__all__ = [
    "MAX_RANKS_PER_CPU",
    "MEMORY_SHARE",
    "MIN_RANK_BYTES",
    "OVERSUBSCRIBE_VAR",
    "available_memory",
    "cpu_refusal",
    "memory_refusal",
    "needs_measuring",
    "oversubscription_allowed",
    "rank_memory",
]

MAX_RANKS_PER_CPU = 4
MEMORY_SHARE = 0.9
MIN_RANK_BYTES = 64 * 2**20
OVERSUBSCRIBE_VAR = "TRAINPERF_OVERSUBSCRIBE"
_YES = ("1", "true", "yes")
_NO = ("0", "false", "no")


def oversubscription_allowed(env: Mapping[str, str] | None = None) -> bool:
    """Whether ``TRAINPERF_OVERSUBSCRIBE`` lifts the CPU rule (``1``/``true``/``yes``).

    Raises:
        ValueError: the variable is set to something else than yes/no words.

    Example:
        >>> oversubscription_allowed({}), oversubscription_allowed({"TRAINPERF_OVERSUBSCRIBE": "1"})
        (False, True)
    """
    value = (launch_env.text(OVERSUBSCRIBE_VAR, env) or "").strip().lower()
    if value in _YES:
        return True
    if value in ("", *_NO):
        return False
    raise ValueError(
        f"environment variable {OVERSUBSCRIBE_VAR} must be 1 or 0 (also true/false, yes/no), "
        f"got {value!r}; unset it or set it to 1 to start more ranks than the CPU rule allows"
    )


def cpu_refusal(nprocs: int, cpus: int) -> str | None:
    """Why ``nprocs`` gloo ranks are too many for ``cpus`` usable CPUs, or None if they fit.

    Example:
        >>> cpu_refusal(8, 2) is None
        True
        >>> cpu_refusal(10000, 2).split(":")[0]
        'nprocs=10000 is more than 4 ranks per usable CPU'
    """
    limit = MAX_RANKS_PER_CPU * cpus
    if nprocs <= limit:
        return None
    return (
        f"nprocs={nprocs} is more than {MAX_RANKS_PER_CPU} ranks per usable CPU: this host "
        f"gives this process {cpus} CPU{'s' if cpus != 1 else ''} (trainperf.host_limits(): "
        f"affinity mask and cgroup quota), so at most {limit} gloo ranks; every rank is a "
        f"process of its own, and {nprocs} of them would spend their time being switched in "
        f"and out. Use nprocs<={limit}, or set {OVERSUBSCRIBE_VAR}=1 to start them anyway (the "
        "memory check still applies)"
    )


def needs_measuring(nprocs: int, estimate: int, available: int) -> bool:
    """Whether to measure rank 0 before starting the others: ``nprocs`` ranks of
    ``estimate`` bytes each would take more than half of ``available``.

    Example:
        >>> gib, mib = 2**30, 2**20
        >>> needs_measuring(4, 500 * mib, 20 * gib), needs_measuring(64, 500 * mib, 20 * gib)
        (False, True)
    """
    return nprocs * estimate > available / 2


def memory_refusal(nprocs: int, per_rank: int, available: int) -> str | None:
    """Why ``nprocs`` ranks of ``per_rank`` bytes do not fit in ``available``, or None.

    ``per_rank`` is raised to :data:`MIN_RANK_BYTES` (a forked rank shares its parent's
    pages at first, and its own grow as it runs); the ranks must fit in
    :data:`MEMORY_SHARE` of ``available``.

    Example:
        >>> memory_refusal(4, 300 * 2**20, 20 * 2**30) is None
        True
        >>> memory_refusal(100, 300 * 2**20, 20 * 2**30).split(" (")[0]
        'nprocs=100 ranks would need about 29.3 GiB at start-up'
        >>> memory_refusal(100, 300 * 2**20, 20 * 2**30).split("Use ")[1][:13]
        'nprocs<=61, o'
    """
    per_rank = max(per_rank, MIN_RANK_BYTES)
    budget = MEMORY_SHARE * available
    if nprocs * per_rank <= budget:
        return None
    fit = max(1, math.floor(budget / per_rank))
    return (
        f"nprocs={nprocs} ranks would need about {format_bytes(nprocs * per_rank)} at start-up "
        f"({format_bytes(per_rank)} per rank, measured on rank 0 once torch and main's module "
        f"were imported), but {format_bytes(available)} is available (trainperf.host_limits(): "
        "the host's memory or the cgroup limit, whichever is nearer); starting them would end "
        f"in the out-of-memory killer. Use nprocs<={fit}, or free memory (every rank also "
        "needs what main allocates on top of this)"
    )


def available_memory() -> int:
    """Bytes this process may still allocate (host or cgroup, whichever is nearer)."""
    from trainperf.limits import host_limits

    return host_limits().memory_available


def rank_memory(pid: int) -> int:
    """The memory only process ``pid`` holds (USS), or its RSS where USS cannot be read;
    0 if it is gone."""
    try:
        proc = psutil.Process(pid)
        try:
            return int(proc.memory_full_info().uss)
        except (psutil.AccessDenied, AttributeError):
            return int(proc.memory_info().rss)
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return 0
