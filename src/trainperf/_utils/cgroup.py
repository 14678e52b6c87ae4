"""Readers of the cgroup and PSI files under ``/sys/fs/cgroup`` and ``/proc``, for
:mod:`trainperf.limits` (its ``cgroup_cpu_quota``, ``cgroup_cpu_pressure`` and
``cgroup_memory_limit``); :func:`read_file` also for ``doctor``'s reads of ``/sys`` and
``/proc/cmdline``.

Every reader takes the kernel's text as it is: a file that cannot be read, or a figure
that is not one, is None (no limit, no figure), never an error out of ``doctor``.
"""

from __future__ import annotations

import math
from pathlib import Path, PurePosixPath

__all__ = [
    "V1_UNLIMITED",
    "cgroup_dirs",
    "cpu_limit_dir",
    "cpu_share",
    "cpuset_size",
    "in_namespace",
    "in_root_cgroup",
    "inactive_file",
    "is_root_cgroup",
    "read_file",
    "some_avg60",
    "v2_cpu_share",
    "whole",
]

# cgroup v1 reports "no limit" as a huge page-aligned number rather than "max".
V1_UNLIMITED = 1 << 60


def read_file(path: Path, errors: str = "surrogateescape") -> str | None:
    """The stripped text of ``path``, None where it cannot be read; bytes that are no UTF-8
    decoded by ``errors`` (``"replace"`` for text that is only shown, as ``doctor``'s reads
    of ``/sys`` and ``/proc/cmdline``: a lone surrogate cannot be printed)."""
    # surrogateescape: a cgroup's name is bytes, and must lead back to its directory; bytes
    # that are no UTF-8 in a figure make it malformed, not an error out of doctor.
    try:
        return path.read_text(errors=errors).strip()
    except OSError:
        return None


def whole(text: str | None) -> int | None:
    """``text`` as a whole number of ASCII digits, as the kernel writes them; None for
    anything else (``str.isdigit()`` also takes ``"\u00b2"``, which ``int()`` refuses, and
    ``int()`` takes full-width digits and refuses more than 4300)."""
    if not text or not text.isascii() or not text.isdigit():
        return None
    try:
        return int(text)
    except ValueError:  # past int()'s digit limit: no real figure
        return None


def in_namespace(rel: str) -> PurePosixPath | None:
    """A ``/proc/self/cgroup`` path relative to the cgroup namespace's root, None where it
    leads out of it.

    A process whose cgroup lies outside its cgroup namespace's root (moved there after the
    namespace was made, or entered with ``nsenter``) sees its path climb out with ``..``:
    ``0::/../../user.slice``. The mount shows only the namespace's root and below, so no
    directory in it is that cgroup or one of its ancestors.
    """
    parts: list[str] = []
    for part in PurePosixPath(rel.strip()).parts:
        if part in ("/", "."):
            continue
        if part != "..":
            parts.append(part)
        elif not parts:
            return None
        else:
            parts.pop()
    return PurePosixPath(*parts)


def cgroup_dirs(controller: str, root: Path, proc_cgroup: Path) -> list[Path]:
    """Directories whose limits bind this process for ``controller``, leaf first.

    A limit set on any ancestor cgroup binds too (SLURM puts it on the job, not the step),
    so every directory from the process's own cgroup up to the mount point is returned.
    Inside a container the cgroup namespace usually makes the mount point itself the
    process's own cgroup; on a host the process's path must be appended. Only existing
    directories are returned. Where the process's cgroup lies outside its namespace's root
    (a path with ``..``), that hierarchy's mount point is no ancestor of it: the mount
    point is not tried, and a limit that cannot be read counts as none, rather than
    another cgroup's limit being read as binding.
    """
    text = read_file(proc_cgroup) or ""
    leaves: list[Path] = []
    outside = False
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, raw = parts
        if controllers != "" and controller not in controllers.split(","):
            continue
        rel = in_namespace(raw)
        if rel is None:
            outside = True
        elif controllers == "":  # cgroup v2 unified hierarchy
            leaves.append(root / rel)
        else:
            leaves.extend(root / name / rel for name in (controllers, controller))
    out: list[Path] = []
    for leaf in leaves:
        for d in (leaf, *leaf.parents):
            if not d.is_relative_to(root):
                break
            if d not in out and d.is_dir():
                out.append(d)
    if outside:  # the mount shows another cgroup, none of this process's
        return out
    for d in (root / controller, root):
        if d not in out and d.is_dir():
            out.append(d)
    return out


def v2_cpu_share(cpu_max: str) -> float | None:
    """CPUs a v2 ``cpu.max`` (``"<quota> <period>"``, the period 100000 when left out)
    allows; None for no limit or a malformed figure."""
    quota, _, period = cpu_max.partition(" ")
    return cpu_share(quota, period or "100000")


def cpu_share(quota: str, period: str) -> float | None:
    """CPUs a quota allows per period; None for no limit ("max", v1's -1) or a malformed
    figure (a zero period is no limit, not a division by zero)."""
    q, p = whole(quota.strip()), whole(period.strip())
    if not q or not p:
        return None
    try:
        share = q / p
    except OverflowError:  # a quota past any float: no real limit
        return None
    # A share that rounds to 0 (a period of hundreds of digits) is no real figure either.
    return share if 0.0 < share < math.inf else None


def cpu_limit_dir(dirs: list[Path]) -> Path | None:
    """Of ``dirs`` (leaf first), the one whose CPU limit binds: the fewest CPUs by quota or
    CPU set, the outermost of equals; None where none sets a limit."""
    best: tuple[float, Path] | None = None
    for d in dirs:
        quota = v2_cpu_share(read_file(d / "cpu.max") or "max")
        cpuset = cpuset_size(read_file(d / "cpuset.cpus"))
        limits = [x for x in (quota, cpuset) if x is not None]
        if limits and (best is None or min(limits) <= best[0]):
            best = min(limits), d
    return None if best is None else best[1]


def cpuset_size(text: str | None) -> int | None:
    """CPUs in a cpuset list (``"0-3,8"`` is 5); None if empty (v2: not set) or malformed."""
    count = 0
    for part in (text or "").split(","):
        first, dash, last = part.strip().partition("-")
        low, high = whole(first), whole(last if dash else first)  # "0-": malformed
        if low is None or high is None or high < low:
            return None
        count += high - low + 1
    return count or None


def in_root_cgroup(proc_cgroup: Path) -> bool:
    """Whether ``proc_cgroup`` puts this process in its v2 hierarchy's top cgroup (``0::/``):
    the host's root cgroup, or a container's own where a cgroup namespace hides the rest."""
    lines = (read_file(proc_cgroup) or "").splitlines()
    return any(line.partition("::")[::2] == ("0", "/") for line in lines)


def is_root_cgroup(d: Path) -> bool:
    """Whether ``d``, a mounted cgroup v2 directory, is the hierarchy's real root: the kernel
    gives every other cgroup a ``cgroup.type`` file, a namespaced container's top one too.
    The root's ``cpu.pressure`` counts every thread on the host."""
    return not (d / "cgroup.type").exists()


def some_avg60(path: Path) -> float | None:
    """``avg60`` of the ``some`` line of a PSI file as a fraction; None if unreadable."""
    for line in (read_file(path) or "").splitlines():
        kind, *fields = line.split() or [""]
        if kind != "some":
            continue
        for field in fields:
            name, _, value = field.partition("=")
            if name == "avg60":
                try:
                    share = float(value) / 100
                except ValueError:
                    return None
                return share if 0.0 <= share <= 1.0 else None
    return None


def inactive_file(d: Path, key: str) -> int:
    """Bytes of inactive file cache in ``d/memory.stat`` (its ``key`` line), 0 if unknown."""
    raw = read_file(d / "memory.stat")
    for line in (raw or "").splitlines():
        name, _, value = line.partition(" ")
        number = whole(value.strip())
        if name == key and number is not None:
            return number
    return 0
