"""The CPU-contention checks of ``trainperf doctor``: NumPy's BLAS, thread counts, the load
average and hypervisor steal; pure functions of their inputs, like those in ``_checks``.
Import everything from :mod:`trainperf.doctor`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

from trainperf._utils.validate import as_real_number, non_negative_number, positive_int
from trainperf.doctor._checks import Check
from trainperf.limits import PressureScope

__all__ = ["check_blas", "check_load", "check_steal", "check_threads", "load_average"]

# A 1-minute load average above this many times the usable CPUs is oversubscription.
OVERLOAD_FACTOR = 1.5
# The share of the last minute in which threads under this process's CPU limit may wait for
# a core (PSI "some avg60") before it is contention.
PRESSURE_WARN = 0.2
# The share of the CPU time the CPUs wanted that the hypervisor may steal before it matters.
STEAL_WARN = 0.1


def check_blas(
    pools: Sequence[Mapping[str, Any]] | None, cpu_vendor: str | None, cpus: int
) -> Check:
    """NumPy's BLAS (via threadpoolctl): OpenBLAS on an Intel CPU, or too many threads.

    OpenBLAS on an Intel CPU is a warning only while it runs more than one thread and more
    than a quarter of the usable CPUs: capped below that, it cannot peg the cores.

    Args:
        pools: ``threadpoolctl.threadpool_info()``; None when threadpoolctl is missing.
        cpu_vendor: ``vendor_id`` from ``/proc/cpuinfo``, e.g. ``"GenuineIntel"``.
        cpus: usable CPUs.

    Raises:
        ValueError: ``cpus`` is not an int >= 1.

    Example:
        >>> pools = [{"user_api": "blas", "internal_api": "openblas", "num_threads": 4,
        ...           "version": "0.3.27"}]
        >>> check_blas(pools, "GenuineIntel", cpus=4).verdict
        'warn'
        >>> pools[0]["num_threads"] = 1  # OPENBLAS_NUM_THREADS=1: already capped
        >>> check_blas(pools, "GenuineIntel", cpus=4).verdict
        'ok'
        >>> check_blas(None, "GenuineIntel", cpus=4).verdict
        'skip'
    """
    cpus = positive_int("cpus", cpus)
    if pools is None:
        fix = "pip install threadpoolctl"
        return Check(
            "blas",
            "skip",
            "threadpoolctl is not installed, so NumPy's BLAS cannot be inspected",
            fix,
        )
    blas = [p for p in pools if p.get("user_api") == "blas"]
    if not blas:
        return Check("blas", "skip", "NumPy loaded no BLAS that threadpoolctl recognises", "")
    libs = [
        f"{p.get('internal_api')} {p.get('version') or ''}".strip()
        + f" ({p.get('num_threads')} threads)"
        for p in blas
    ]
    value = ", ".join(libs) + (f"; CPU {cpu_vendor}" if cpu_vendor else "")
    apis = {str(p.get("internal_api")) for p in blas}
    openblas_threads = max(
        (int(p.get("num_threads") or 0) for p in blas if p.get("internal_api") == "openblas"),
        default=0,
    )
    # Capped to 1 thread (OPENBLAS_NUM_THREADS=1), or to a quarter of the CPUs or fewer, it
    # cannot peg the cores: the cap this warning asks for is already in place.
    capped = openblas_threads <= max(1, cpus // 4)
    if "openblas" in apis and "mkl" not in apis and cpu_vendor == "GenuineIntel" and not capped:
        fix = (
            "on Intel CPUs an OpenBLAS NumPy can peg every core and starve the GPU's data "
            "loading: use an MKL build (conda install numpy 'libblas=*=*mkl'), or cap its threads "
            "(OPENBLAS_NUM_THREADS=1, or threadpoolctl.threadpool_limits(1, 'blas'))"
        )
        return Check("blas", "warn", value, fix)
    threads = max(int(p.get("num_threads") or 0) for p in blas)
    if threads > cpus:
        fix = (
            f"{threads} BLAS threads for {cpus} usable CPUs oversubscribes them: set "
            f"OMP_NUM_THREADS={cpus} (or threadpoolctl.threadpool_limits({cpus}))"
        )
        return Check("blas", "warn", value, fix)
    return Check("blas", "ok", value)


# One thread count as libgomp reads OMP_NUM_THREADS (strtoul, C whitespace around it): ASCII
# digits only, where Python's int() also takes "1_0" and "\u0664", which libgomp rejects.
_THREAD_COUNT = re.compile(r"[ \t\n\v\f\r]*\+?([0-9]+)[ \t\n\v\f\r]*")

# The thread-count variables torch and NumPy's BLAS read, and what a bad value leads to.
_THREAD_VARIABLES = {
    "OMP_NUM_THREADS": "OpenMP then ignores it and starts one thread per core",
    "MKL_NUM_THREADS": "MKL and torch then ignore it and start one thread per core",
    "OPENBLAS_NUM_THREADS": "OpenBLAS then ignores it and starts one thread per core",
}


def _thread_count(text: str | None, *, nested: bool = False) -> int | None:
    """The (outermost) thread count of a thread-count variable: an integer >= 1, or with
    ``nested`` (``OMP_NUM_THREADS``) a list of them (``"4,2"``, one per nesting level, as
    OpenMP accepts); None when unset or unreadable."""
    if text is None:
        return None
    matches = [_THREAD_COUNT.fullmatch(part) for part in (text.split(",") if nested else [text])]
    levels = [int(m.group(1)) for m in matches if m is not None]
    if len(levels) != len(matches) or not all(n >= 1 for n in levels):
        return None
    return levels[0]


def _setting(text: str | None) -> str:
    """A variable as the value shows it: ``unset``, or as written (quoted when it is empty
    or has spaces at either end, which would otherwise not show)."""
    if text is None:
        return "unset"
    return text if text and text == text.strip() else repr(text)


def _invalid_thread_variable(name: str, text: str | None, share: int) -> str:
    """The fix where thread-count variable ``name`` is set to what its readers ignore (0,
    a negative number, junk), else ''."""
    nested = name == "OMP_NUM_THREADS"
    if text is None or _thread_count(text, nested=nested) is not None:
        return ""
    lists = " (or a comma-separated list of them, one per nesting level)" if nested else ""
    return (
        f"{name} must be an integer >= 1{lists}, got {text!r} ({_THREAD_VARIABLES[name]}): "
        f"set {name}={share}"
    )


def check_threads(
    torch_threads: int,
    omp_num_threads: str | None,
    cpus: int,
    processes: int = 1,
    *,
    env: Mapping[str, str] | None = None,
) -> Check:
    """torch's intra-op threads, the thread-count variables and oversubscription of the CPUs.

    Every PyTorch process starts one thread per core it sees; several training processes on
    one host (several experiments, or DDP ranks) then thrash. The fix is
    ``torch.set_num_threads(cpus // processes)`` in each. ``OMP_NUM_THREADS``,
    ``MKL_NUM_THREADS`` and ``OPENBLAS_NUM_THREADS`` set to 0, a negative number or junk are
    ignored by what reads them (OpenMP, MKL and torch, OpenBLAS), which then start one
    thread per core: a warning too.

    Args:
        torch_threads: ``torch.get_num_threads()``.
        omp_num_threads: the ``OMP_NUM_THREADS`` variable, None when unset.
        cpus: usable CPUs.
        processes: training processes sharing the host (``LOCAL_WORLD_SIZE`` under torchrun).
        env: the environment (``os.environ``), read for ``MKL_NUM_THREADS`` and
            ``OPENBLAS_NUM_THREADS`` (shown where set); None: neither is set.

    Raises:
        ValueError: ``cpus``, ``processes`` or ``torch_threads`` is not an int >= 1.

    Example:
        >>> check_threads(16, None, cpus=16, processes=4).verdict
        'warn'
        >>> check_threads(4, "4", cpus=16, processes=4).verdict
        'ok'
        >>> check_threads(4, "0", cpus=16).verdict
        'warn'
        >>> check_threads(4, "4", cpus=16, processes=4, env={"MKL_NUM_THREADS": "-3"}).verdict
        'warn'
    """
    cpus = positive_int("cpus", cpus)
    processes = positive_int("processes", processes)
    torch_threads = positive_int("torch_threads", torch_threads)
    variables = {"OMP_NUM_THREADS": omp_num_threads}
    variables.update({name: env[name] for name in _THREAD_VARIABLES if env and name in env})
    settings = ", ".join(f"{name}={_setting(text)}" for name, text in variables.items())
    value = (
        f"torch {torch_threads} threads, {settings}, {cpus} usable CPUs, {processes} process(es)"
    )
    share = max(1, cpus // max(1, processes))
    invalid = [_invalid_thread_variable(name, text, share) for name, text in variables.items()]
    if any(invalid):
        return Check("threads", "warn", value, "; ".join(fix for fix in invalid if fix))
    omp = _thread_count(omp_num_threads, nested=True)
    if omp is not None and omp * processes > cpus:
        fix = (
            f"OMP_NUM_THREADS={omp} x {processes} process(es) oversubscribes "
            f"{cpus} usable CPUs: set OMP_NUM_THREADS={share}"
        )
        return Check("threads", "warn", value, fix)
    if torch_threads * processes > cpus:
        fix = (
            f"{processes} x {torch_threads} threads oversubscribe {cpus} CPUs: call "
            f"torch.set_num_threads({share}) in each process (or OMP_NUM_THREADS={share})"
        )
        return Check("threads", "warn", value, fix)
    return Check("threads", "ok", value)


def load_average() -> float | None:
    """The host's 1-minute load average, None where the platform has none (Windows).

    Example:
        >>> value = load_average()
        >>> value is None or value >= 0
        True
    """
    getloadavg = getattr(os, "getloadavg", None)
    if getloadavg is None:
        return None
    try:
        return float(getloadavg()[0])
    except OSError:  # the platform could not tell
        return None


def check_load(
    load_average: float | None,
    cpus: int,
    *,
    host_cpus: int | None = None,
    cpu_pressure: float | None = None,
    pressure_scope: PressureScope = "cgroup",
) -> Check:
    """Other jobs, or too many threads, competing for this process's CPUs: the 1-minute load
    average, and where Linux reports it the CPU pressure (PSI) of this process's cgroup.

    ``check_threads`` sees only this process's own settings; the load average counts every
    runnable (or I/O-waiting) thread on the host, so several jobs that together want more
    cores than there are show up here. Data loading and kernel launches then wait for a core.

    The load average is the whole host's, even inside a container (``/proc/loadavg`` is not
    namespaced), so where this process may use fewer CPUs than the host has (a cgroup quota
    or an affinity mask) it is judged against ``host_cpus``: a pod given 8 CPUs of a busy
    96-core node sees the node's load, spread over cores it does not use. That alone would
    miss a job overloading its own 8 CPUs (a load of 40 is under 1.5 x 96), which the CPU
    pressure of its cgroup catches: the share of the last minute in which its threads
    waited for a core, neighbours on other cores left out.

    The rule: warn when the load average is over 1.5 x the CPUs it is judged against, or
    the CPU pressure is over 20 %; ok otherwise. A host-wide pressure (``pressure_scope=
    "host"``: no cgroup reports one) is shown but judged only where ``cpus`` is all the
    host's: with fewer it counts the neighbours too. Without a pressure figure (no PSI) the
    load average alone decides, as before.

    Args:
        load_average: ``os.getloadavg()[0]``; None where the platform has none (Windows).
        cpus: usable CPUs.
        host_cpus: logical CPUs of the host (``HostLimits.cpus_host``); None: ``cpus``.
        cpu_pressure: the share (0 to 1) of the last minute in which threads under this
            process's CPU limit waited for a core, PSI ``some avg60``
            (``trainperf.limits.cgroup_cpu_pressure()``); None where unknown.
        pressure_scope: whose threads ``cpu_pressure`` counts: ``"cgroup"``, those under
            this process's CPU limit, or ``"host"``, the whole host's (``/proc/pressure/cpu``,
            read where no cgroup reports one, or the root cgroup's, read where the process
            is in no container; not judged where ``cpus < host_cpus``).

    Raises:
        ValueError: ``cpus`` is not an int >= 1, ``host_cpus`` not an int >= ``cpus``,
            ``load_average`` not a finite number >= 0, ``cpu_pressure`` not a number from 0
            to 1, or ``pressure_scope`` neither ``"cgroup"`` nor ``"host"``.

    Example:
        >>> check_load(24.0, cpus=8).verdict
        'warn'
        >>> check_load(6.5, cpus=8).verdict, check_load(None, cpus=8).verdict
        ('ok', 'skip')
        >>> check_load(24.0, cpus=8, host_cpus=64).verdict  # the host's other cores
        'ok'
        >>> check_load(24.0, cpus=8, host_cpus=64, cpu_pressure=0.6).verdict  # its own
        'warn'
        >>> check_load(24.0, 8, host_cpus=64, cpu_pressure=0.6, pressure_scope="host").verdict
        'ok'
    """
    cpus = positive_int("cpus", cpus)
    host = _host_cpus(cpus, host_cpus)
    pressure = _pressure(cpu_pressure, pressure_scope)
    if load_average is not None:
        load_average = non_negative_number("load_average", load_average)
    if load_average is None and pressure is None:
        return Check("load", "skip", "no load average on this platform", "")
    value = "; ".join(
        part
        for part in (_load_value(load_average, cpus, host), _pressure_value(pressure, cpus, host))
        if part
    )
    fix = _load_fix(load_average, cpus, host) or _pressure_fix(pressure, cpus, host)
    return Check("load", "warn", value, fix) if fix else Check("load", "ok", value)


def _pressure(share: object, scope: object) -> tuple[float, PressureScope] | None:
    """``(share, scope)`` checked: a fraction from 0 to 1 and ``"cgroup"`` or ``"host"``."""
    if scope not in ("cgroup", "host"):
        raise ValueError(
            f"pressure_scope must be 'cgroup' or 'host', got {scope!r}: pass the scope "
            "trainperf.limits.cgroup_cpu_pressure() returned with the share"
        )
    if share is None:
        return None
    number = as_real_number(share)
    if number is None or not 0.0 <= number <= 1.0:  # NaN too
        raise ValueError(
            f"cpu_pressure must be None or a fraction from 0 to 1 of the last minute (PSI "
            f"some avg60 / 100, trainperf.limits.cgroup_cpu_pressure()), got {share!r}"
        )
    return float(number), "host" if scope == "host" else "cgroup"


def _load_value(load: float | None, cpus: int, host: int) -> str:
    """The load average as the value shows it ('' without one)."""
    if load is None:
        return ""
    if host == cpus:
        return f"1-minute load average {load:.1f} for {cpus} usable CPUs"
    return (
        f"1-minute load average {load:.1f} (host-wide) for the {host} CPUs of the host, "
        f"{cpus} usable here"
    )


def _pressure_value(pressure: tuple[float, PressureScope] | None, cpus: int, host: int) -> str:
    """The CPU pressure as the value shows it ('' without one)."""
    if pressure is None:
        return ""
    share, scope = pressure
    # A host-wide figure is the root cgroup's or /proc/pressure/cpu: the same threads.
    whose = "this cgroup's" if scope == "cgroup" else "host-wide"
    value = f"CPU pressure {share:.0%} ({whose} PSI some avg60)"
    if scope == "host" and cpus < host:
        value += (
            f", not judged: {cpus} of the host's {host} CPUs usable here, so other jobs' "
            "threads on other cores count too"
        )
    return value


_FEWER_THREADS = (
    "lower each job's threads so that together they fit (OMP_NUM_THREADS, "
    "torch.set_num_threads(), DataLoader num_workers)"
)


def _load_fix(load: float | None, cpus: int, host: int) -> str:
    """The fix when the load average is over 1.5x the CPUs it is judged against, else ''."""
    if load is None or load <= OVERLOAD_FACTOR * host:
        return ""
    over = f"the {cpus} usable CPUs" if host == cpus else f"the host's {host} CPUs"
    return (
        f"a load of {load:.1f} is {load / host:.1f}x {over}, so threads wait for a core: run "
        f"fewer jobs at once, {_FEWER_THREADS}, or pin each job to cores of its own "
        "(taskset -c <first>-<last> python train.py)"
    )


def _pressure_fix(pressure: tuple[float, PressureScope] | None, cpus: int, host: int) -> str:
    """The fix when the CPU pressure is over ``PRESSURE_WARN``, else ''. A host-wide figure
    is judged only where this process may use all the host's CPUs: with fewer, it counts the
    neighbours' threads on other cores, which the load average is not judged on either."""
    if pressure is None or pressure[0] <= PRESSURE_WARN:
        return ""
    share, scope = pressure
    if scope == "host":
        if cpus < host:
            return ""
        return (
            f"threads on this host waited for a core {share:.0%} of the last minute (a "
            f"host-wide figure): run fewer jobs at once, {_FEWER_THREADS}, or pin each job to "
            "cores of its own"
        )
    if cpus == host:
        return (
            f"this cgroup's threads waited for a core {share:.0%} of the last minute: run "
            f"fewer jobs at once, {_FEWER_THREADS}, or pin each job to cores of its own"
        )
    return (
        f"threads under this process's CPU limit ({cpus} CPUs) waited for a core {share:.0%} "
        f"of the last minute: the job runs more threads than its {cpus} CPUs. Lower them so "
        "that together they fit (OMP_NUM_THREADS, torch.set_num_threads(), DataLoader "
        "num_workers), or ask for more CPUs (a larger cgroup quota, cpu.max, or CPU set)"
    )


def _host_cpus(cpus: int, host_cpus: int | None) -> int:
    """``host_cpus`` checked against ``cpus`` (a host has at least the CPUs one may use)."""
    if host_cpus is None:
        return cpus
    host = as_real_number(host_cpus)  # a NumPy integer too, as a Python int
    if not isinstance(host, int) or host < cpus:
        raise ValueError(
            f"host_cpus must be an int >= cpus ({cpus}), got {host_cpus!r}: pass the host's "
            "logical CPUs (HostLimits.cpus_host), or None to judge the load by cpus alone"
        )
    return host


def _fraction(share: object) -> float:
    """``share`` as a Python float if it is a number from 0 to 1 (NumPy's too), else
    ``ValueError``: a string or a bool is no share of the CPU time, and NaN is none either."""
    number = as_real_number(share)
    if number is None or not 0.0 <= number <= 1.0:  # NaN too
        raise ValueError(
            f"share must be None or a fraction from 0 to 1 of the CPU time "
            f"(boot_steal_share()), got {share!r}"
        )
    return float(number)


def check_steal(share: float | None) -> Check:
    """The CPU time the hypervisor withheld from this VM since boot (*steal*): a VM whose
    physical CPUs other tenants share, or a burstable instance out of CPU credits.

    Stolen time is in no process's CPU time: data loading, kernel launches and every CPU
    figure measured here (tuning, ``trainperf.watch``) get that much less of a core.

    Args:
        share: the stolen share of the CPU time the CPUs wanted since boot (busy or
            stolen, idle left out), ``trainperf._utils.steal.boot_steal_share()``; None
            where the platform reports no steal (only Linux does).

    Raises:
        ValueError: ``share`` is neither None nor a number from 0 to 1 (a string, a
            bool, NaN).

    Example:
        >>> check_steal(0.25).verdict, check_steal(0.02).verdict, check_steal(None).verdict
        ('warn', 'ok', 'skip')
    """
    if share is None:
        return Check("steal", "skip", "no steal figure on this platform (Linux VMs report it)")
    share = _fraction(share)
    value = (
        f"the hypervisor withheld {share:.1%} of the CPU time this machine's CPUs wanted "
        "since boot (steal)"
    )
    if share >= STEAL_WARN:
        fix = (
            "other tenants share this VM's physical CPUs, or a burstable instance ran out of "
            "CPU credits: data loading and every CPU figure lose that share. Rent an instance "
            "type with dedicated cores (not shared-core or burstable), or move the job to "
            "another host; trainperf.watch reports the steal during your own loop "
            "(report.host_steal_mean)"
        )
        return Check("steal", "warn", value, fix)
    return Check("steal", "ok", value)
