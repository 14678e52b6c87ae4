"""What this process may really use: CPUs, memory and shared memory, container-aware.

``os.cpu_count()`` and ``psutil.virtual_memory().total`` describe the host, not the
container: a job given 4 CPUs on a 64-core host by a cgroup quota sees 64 there. The
DataLoader autotuner, ``ddp.launch`` (threads per rank) and ``doctor`` all size their work
from :func:`host_limits`, which reads the CPU affinity mask, the cgroup CPU quota
(v2 ``cpu.max`` or v1 ``cpu.cfs_quota_us``/``cpu.cfs_period_us``), the cgroup memory limit
(v2 ``memory.max`` or v1 ``memory.limit_in_bytes``) and ``/dev/shm``.
:func:`cgroup_cpu_pressure` reads how long threads under this process's CPU limit waited
for a core (Linux PSI), which ``doctor``'s ``load`` check judges.
"""

from __future__ import annotations

import errno
import math
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import psutil

from trainperf._utils import launch_env
from trainperf._utils.cgroup import (
    V1_UNLIMITED,
    cgroup_dirs,
    cpu_limit_dir,
    cpu_share,
    in_root_cgroup,
    inactive_file,
    is_root_cgroup,
    read_file,
    some_avg60,
    v2_cpu_share,
    whole,
)
from trainperf._utils.format import format_bytes as fb
from trainperf._utils.serialize import result_dict
from trainperf._utils.validate import positive_int

__all__ = [
    "HostLimits",
    "cgroup_cpu_pressure",
    "cgroup_cpu_quota",
    "cgroup_memory_limit",
    "host_limits",
    "local_world_size",
    "usable_cpus",
]

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")
SHM_PATH = Path("/dev/shm")
PROC_PRESSURE_CPU = Path("/proc/pressure/cpu")

# Where a CPU pressure figure comes from: this process's cgroup, or the whole host.
PressureScope = Literal["cgroup", "host"]


@dataclass(frozen=True)
class HostLimits:
    """The CPU, memory and shared-memory limits that bound this process.

    Attributes:
        cpus_host: logical CPUs of the host (``os.cpu_count()``).
        cpus_affinity: CPUs this process may be scheduled on (``sched_getaffinity``).
        cpu_quota: CPUs' worth of time allowed by the cgroup quota, or None when unlimited.
        cpus: usable CPUs: the affinity count capped by the quota (rounded down, at least 1).
        memory_total: bytes of host memory.
        memory_limit: the cgroup memory limit in bytes, or None when unlimited.
        memory_available: bytes that can still be allocated before hitting the host's or
            the cgroup's limit, whichever is nearer.
        shm_total: size of ``/dev/shm`` in bytes (None where there is none, or it could
            not be read).
        shm_free: free bytes in ``/dev/shm`` (None where there is none, or it could not be
            read).
        shm_error: why ``/dev/shm`` could not be read, e.g. ``"EACCES: Permission denied"``;
            None where it was read or does not exist (a missing ``/dev/shm`` is no error).
    """

    cpus_host: int
    cpus_affinity: int
    cpu_quota: float | None
    cpus: int
    memory_total: int
    memory_limit: int | None
    memory_available: int
    shm_total: int | None
    shm_free: int | None
    shm_error: str | None = None

    def __str__(self) -> str:
        quota = "" if self.cpu_quota is None else f", cgroup quota {self.cpu_quota:g}"
        cpus = f"{self.cpus_affinity} in the affinity mask of {self.cpus_host}{quota}"
        limit = "" if self.memory_limit is None else f", cgroup limit {fb(self.memory_limit)}"
        memory = f"{fb(self.memory_available)} available of {fb(self.memory_total)}{limit}"
        if self.shm_error is not None:
            shm = f"unreadable ({self.shm_error})"
        elif self.shm_free is None:
            shm = "none"
        else:
            shm = f"{fb(self.shm_free)} free of {fb(self.shm_total)}"
        return f"CPUs: {self.cpus} usable ({cpus})\nmemory: {memory}\n/dev/shm: {shm}"

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-safe dict (sizes in bytes)."""
        return result_dict(self)


def cgroup_cpu_quota(
    root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_SELF_CGROUP
) -> float | None:
    """CPUs' worth of time the cgroup quota allows, or None when there is no quota (or none
    that can be read: a process whose cgroup lies outside its cgroup namespace's root, a
    ``/proc/self/cgroup`` path with ``..``, cannot see its own cgroup).

    Example:
        >>> import tempfile, pathlib
        >>> d = pathlib.Path(tempfile.mkdtemp())
        >>> _ = (d / "cpu.max").write_text("250000 100000\\n")
        >>> cgroup_cpu_quota(d, d / "missing")
        2.5
    """
    quotas: list[float] = []
    for d in cgroup_dirs("cpu", root, proc_cgroup):
        v2 = read_file(d / "cpu.max")
        if v2 is not None:
            share = v2_cpu_share(v2)
        else:
            quota_us, period_us = (
                read_file(d / "cpu.cfs_quota_us"),
                read_file(d / "cpu.cfs_period_us"),
            )
            share = (
                None if quota_us is None or period_us is None else cpu_share(quota_us, period_us)
            )
        if share is not None:
            quotas.append(share)
    # The tightest limit on the way up to the root is the one that binds.
    return min(quotas) if quotas else None


def cgroup_cpu_pressure(
    root: Path = CGROUP_ROOT,
    proc_cgroup: Path = PROC_SELF_CGROUP,
    proc_pressure: Path = PROC_PRESSURE_CPU,
) -> tuple[float, PressureScope] | None:
    """The share of the last minute in which threads under this process's CPU limit waited
    for a core (Linux PSI ``some avg60`` of ``cpu.pressure``, as a fraction), and its scope.

    The cgroup read is the level whose CPU limit binds (the smallest ``cpu.max`` quota or
    ``cpuset.cpus`` set, the outermost of equals, so a SLURM job's limit counts all its
    steps), else this process's own; cgroup v2 only (``/sys/fs/cgroup/unified`` on hybrid
    hosts). Unlike the load average, that figure counts only the threads sharing this
    process's CPUs: neighbours on other cores do not raise it. Where no cgroup has a
    readable ``cpu.pressure``, the host-wide ``proc_pressure`` is read (scope ``"host"``);
    None where neither is (no PSI: not Linux, a kernel before 4.20, or ``psi=0``). A process
    in the host's root cgroup (no container: ``/proc/self/cgroup`` is ``0::/``) reads the
    root's ``cpu.pressure``, which counts every thread on the host: scope ``"host"`` too.

    Example:
        >>> import tempfile, pathlib
        >>> d = pathlib.Path(tempfile.mkdtemp())
        >>> _ = (d / "cpu.pressure").write_text("some avg10=41.00 avg60=35.50 avg300=9.10 "
        ...                                     "total=123\\n")
        >>> cgroup_cpu_pressure(d, d / "missing", d / "missing")
        (0.355, 'cgroup')
        >>> cgroup_cpu_pressure(d / "missing", d / "missing", d / "cpu.pressure")
        (0.355, 'host')
    """
    dirs = cgroup_dirs("cpu", root, proc_cgroup)
    if (root / "unified").is_dir():  # hybrid layout: the v2 hierarchy is mounted there
        dirs += cgroup_dirs("cpu", root / "unified", proc_cgroup)
    binding = cpu_limit_dir(dirs)
    in_root = in_root_cgroup(proc_cgroup)
    for d in ([binding] if binding is not None else []) + dirs:
        share = some_avg60(d / "cpu.pressure")
        if share is not None:
            host_wide = in_root and d in (root, root / "unified") and is_root_cgroup(d)
            return share, "host" if host_wide else "cgroup"
    share = some_avg60(proc_pressure)
    return None if share is None else (share, "host")


def cgroup_memory_limit(
    root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_SELF_CGROUP
) -> tuple[int | None, int | None]:
    """The binding cgroup memory limit and its current usage in bytes (None where not set or
    unknown): of every level from this process's cgroup up to the root, the one with the least
    room left (``limit - usage``). Without any limit the usage is this process's cgroup's.

    The usage is the working set, as docker and Kubernetes count it: the cgroup's usage less
    its inactive file cache (``inactive_file`` in ``memory.stat``; ``total_inactive_file``
    under cgroup v1), which the kernel reclaims before it kills anything. A container that
    has read its dataset once holds that much cache; counted as used, it left no room.

    Example:
        >>> import tempfile, pathlib
        >>> d = pathlib.Path(tempfile.mkdtemp())
        >>> _ = (d / "memory.max").write_text("4294967296\\n")
        >>> _ = (d / "memory.current").write_text("1073741824\\n")
        >>> cgroup_memory_limit(d, d / "missing")
        (4294967296, 1073741824)
        >>> _ = (d / "memory.stat").write_text("anon 268435456\\ninactive_file 536870912\\n")
        >>> cgroup_memory_limit(d, d / "missing")
        (4294967296, 536870912)
    """
    limit: int | None = None
    usage: int | None = None
    own: int | None = None  # the process's own (innermost) cgroup's usage
    headroom: int | None = None
    for d in cgroup_dirs("memory", root, proc_cgroup):
        for limit_name, usage_name in (
            ("memory.max", "memory.current"),
            ("memory.limit_in_bytes", "memory.usage_in_bytes"),
        ):
            raw = read_file(d / limit_name)
            if raw is None:
                continue
            here = whole(read_file(d / usage_name))
            if here is not None:
                v1 = limit_name == "memory.limit_in_bytes"
                key = "total_inactive_file" if v1 else "inactive_file"
                here = max(0, here - inactive_file(d, key))
            if own is None:
                own = here
            bytes_ = whole(raw)
            if bytes_ is not None and bytes_ < V1_UNLIMITED:
                # The level with the least room binds, which need not be the smallest limit:
                # a parent's limit is shared with its other children. A level whose usage is
                # unknown counts at least this process's own cgroup's.
                used = here if here is not None else own
                room = bytes_ - (used or 0)
                if headroom is None or room < headroom:
                    headroom, limit, usage = room, bytes_, used
            break
    if limit is None:
        usage = own
    return limit, usage


def host_limits(
    *,
    cgroup_root: Path = CGROUP_ROOT,
    proc_cgroup: Path = PROC_SELF_CGROUP,
    shm_path: Path = SHM_PATH,
) -> HostLimits:
    """Read the limits that bound this process now.

    The keyword arguments exist so tests (and unusual hosts) can point at other files.

    Example:
        >>> limits = host_limits()
        >>> 1 <= limits.cpus <= limits.cpus_affinity
        True
        >>> limits.memory_available > 0
        True
    """
    cpus_host = os.cpu_count() or 1
    try:
        cpus_affinity = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS and Windows have no affinity call
        cpus_affinity = cpus_host
    # A host has at least the CPUs this process may run on: os.cpu_count() may be None, or
    # (under LXCFS) count the container's view of /sys where the mask is the host's.
    cpus_host = max(cpus_host, cpus_affinity)
    quota = cgroup_cpu_quota(cgroup_root, proc_cgroup)
    cpus = cpus_affinity if quota is None else max(1, min(cpus_affinity, math.floor(quota)))

    vm = psutil.virtual_memory()
    mem_limit, mem_usage = cgroup_memory_limit(cgroup_root, proc_cgroup)
    available = int(vm.available)
    if mem_limit is not None:
        # Page cache counts in cgroup usage but is reclaimable; the host's "available" already
        # accounts for it, so the cgroup headroom is only a cap, never a reason to go higher.
        headroom = mem_limit - (mem_usage or 0)
        available = max(0, min(available, headroom))

    shm_total, shm_free, shm_error = _shm_usage(shm_path)
    return HostLimits(
        cpus_host=cpus_host,
        cpus_affinity=cpus_affinity,
        cpu_quota=quota,
        cpus=cpus,
        memory_total=int(vm.total),
        memory_limit=mem_limit,
        memory_available=available,
        shm_total=shm_total,
        shm_free=shm_free,
        shm_error=shm_error,
    )


def _shm_usage(path: Path) -> tuple[int | None, int | None, str | None]:
    """``(total, free, error)`` bytes of the file system at ``path``: sizes None and no error
    where it does not exist; sizes None and the reason (``"EACCES: Permission denied"``)
    where it exists but could not be read, which says nothing about its size."""
    try:
        usage = shutil.disk_usage(path)
    except (FileNotFoundError, NotADirectoryError):  # NotADirectory: a parent is a file
        return None, None, None
    except OSError as e:
        name = errno.errorcode.get(e.errno, f"errno {e.errno}") if e.errno else type(e).__name__
        return None, None, f"{name}: {e.strerror or e}"
    return usage.total, usage.free, None


def usable_cpus(
    local_ranks: int = 1,
    *,
    limits: HostLimits | None = None,
    env: Mapping[str, str] | None = None,
) -> int:
    """CPUs one of ``local_ranks`` processes on this host may use (at least 1).

    The host's usable CPUs are shared by the ranks, except where SLURM already bound each rank
    to its own: when the ranks are SLURM tasks (SLURM's tasks on this node: in an srun step
    ``SLURM_STEP_TASKS_PER_NODE``, else ``SLURM_NTASKS_PER_NODE``, else
    ``SLURM_TASKS_PER_NODE``, equal ``local_ranks``) and this
    process's affinity is no wider than ``SLURM_CPUS_PER_TASK``, the affinity is this rank's
    share and is not divided again. The variables are read by the rules of
    :mod:`trainperf._utils.launch_env` (``"4(x2),3"`` counts this node's entry).

    Args:
        local_ranks: training processes sharing this host (one per GPU under DDP).
        limits: limits to use instead of reading them now.
        env: the environment to read (default ``os.environ``).

    Raises:
        ValueError: ``local_ranks`` is not an int >= 1, or (with ``local_ranks`` > 1) a SLURM
            variable it reads is set but malformed; the message names it.

    Example:
        >>> limits = HostLimits(64, 64, 8.0, 8, 2**34, None, 2**33, None, None)
        >>> usable_cpus(2, limits=limits, env={})
        4
        >>> bound = HostLimits(64, 8, None, 8, 2**34, None, 2**33, None, None)
        >>> usable_cpus(4, limits=bound, env={"SLURM_NTASKS_PER_NODE": "4",
        ...                                   "SLURM_CPUS_PER_TASK": "8"})
        8
    """
    local_ranks = positive_int("local_ranks", local_ranks)
    limits = limits or host_limits()
    if local_ranks > 1 and _bound_per_task(local_ranks, limits, env):
        return max(1, limits.cpus)
    return max(1, limits.cpus // local_ranks)


def _bound_per_task(local_ranks: int, limits: HostLimits, env: Mapping[str, str] | None) -> bool:
    """Whether SLURM bound each of the ``local_ranks`` ranks to CPUs of its own."""
    if launch_env.tasks_on_this_node(env) != local_ranks:
        return False
    per_task = launch_env.read_int("SLURM_CPUS_PER_TASK", env)
    return per_task is not None and limits.cpus_affinity <= per_task


def local_world_size(env: Mapping[str, str] | None = None) -> int:
    """Training processes sharing this host: ``LOCAL_WORLD_SIZE`` (torchrun), else SLURM's
    tasks on this node (in an srun step ``SLURM_STEP_TASKS_PER_NODE``, the step's own also
    under ``srun --preserve-env``; else ``SLURM_NTASKS_PER_NODE``, else
    ``SLURM_TASKS_PER_NODE``; of
    ``"4(x2),3"`` the entry of node ``SLURM_NODEID``, or the first without it), else
    ``WORLD_SIZE``, else 1. SLURM's count comes before ``WORLD_SIZE`` because job scripts
    often export ``WORLD_SIZE=$SLURM_NTASKS``, the whole job's size, not this node's.

    The same rule as ``trainperf.ddp`` uses, from :mod:`trainperf._utils.launch_env`.

    Args:
        env: the environment to read (default ``os.environ``).

    Raises:
        ValueError: a variable it reads is set but malformed (not a whole number >= 1, or
            not SLURM's ``4(x2),3`` form); the message names it, its value and the fix.

    Example:
        >>> local_world_size({"LOCAL_WORLD_SIZE": "4"})
        4
        >>> local_world_size({"SLURM_TASKS_PER_NODE": "4(x2),3", "SLURM_NODEID": "2"})
        3
        >>> local_world_size({"WORLD_SIZE": "16", "SLURM_NTASKS_PER_NODE": "8"})
        8
        >>> local_world_size({})
        1
    """
    return launch_env.local_world_size(env)
