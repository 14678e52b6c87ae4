"""``trainperf doctor --dist``: gather the real inputs of the interconnect checks and run them.

:func:`dist_checks` starts the ranks (one per GPU with NCCL, or 2 CPU ranks with gloo), runs
the all_reduce sweep (and, with 2+ GPUs, the same with peer-to-peer switched the other way),
measures or reads the link it should reach, and reads ``/dev/shm``, the ``NCCL_*`` and
``GLOO_*`` variables, the network interfaces and names, the IOMMU groups, the kernel
command line and ``lspci -vvv``. The checks themselves are pure functions in
``_dist_checks``, ``_nccl_shm`` and ``_net_checks``. :func:`diagnose` calls this with
``dist=True``.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from trainperf._utils.cgroup import read_file
from trainperf._utils.launch_env import is_set, step_tasks_variable
from trainperf.device import GpuInfo
from trainperf.doctor._checks import Check
from trainperf.doctor._dist_checks import (
    IommuGroup,
    acs_redirecting_bridges,
    check_all_reduce,
    check_iommu,
    check_p2p,
)
from trainperf.doctor._interconnect import (
    LinkEstimate,
    link_estimate,
    loopback_estimate,
    measure_loopback,
    read_gpu_links,
    read_p2p_blocked,
)
from trainperf.doctor._nccl_shm import check_nccl_shm
from trainperf.doctor._net_checks import (
    check_hostname,
    check_nccl_env,
    check_socket_ifname,
    nccl_one,
    p2p_level_off,
)
from trainperf.doctor._sweep import NCCL_SIZES, AllReduceSweep, Backend, all_reduce_sweep
from trainperf.errors import DeviceError, TrainperfError
from trainperf.limits import HostLimits

__all__ = [
    "dist_checks",
    "host_dist_checks",
    "launcher_running",
    "read_acs",
    "read_interfaces",
    "read_iommu_groups",
    "resolve",
]

_NVIDIA = "0x10de"
_ERROR_CHARS = 400


# --------------------------------------------------------------------------- reading the host


def read_interfaces() -> dict[str, list[str]]:
    """Every network interface (``socket.if_nameindex()``) and its IPv4/IPv6 addresses.

    Example:
        >>> "lo" in read_interfaces()
        True
    """
    import psutil

    families = (socket.AF_INET, socket.AF_INET6)
    addresses = psutil.net_if_addrs()
    names = [name for _, name in socket.if_nameindex()]
    names += [name for name in addresses if name not in names]
    return {n: [a.address for a in addresses.get(n, []) if a.family in families] for n in names}


def resolve(name: str) -> list[str] | None:
    """The addresses ``name`` resolves to (``getaddrinfo``), None when it does not resolve.

    Example:
        >>> "127.0.0.1" in (resolve("localhost") or ["127.0.0.1"])
        True
    """
    try:
        infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):  # socket.gaierror is an OSError
        return None
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def _read(path: Path) -> str | None:
    # "replace": what is read here is shown (the IOMMU type, the kernel command line).
    return read_file(path, errors="replace")


def read_iommu_groups(
    root: Path = Path("/sys/kernel/iommu_groups"), pci: Path = Path("/sys/bus/pci/devices")
) -> list[IommuGroup]:
    """The IOMMU groups, each with its ``type`` and the NVIDIA GPUs in it (empty: IOMMU off).

    Example:
        >>> import pathlib, tempfile
        >>> read_iommu_groups(pathlib.Path(tempfile.mkdtemp()) / "none")
        []
    """
    try:
        entries = sorted(root.iterdir(), key=lambda p: (len(p.name), p.name))
    except OSError:
        return []
    groups = []
    for entry in entries:
        try:
            devices = sorted(d.name for d in (entry / "devices").iterdir())
        except OSError:
            devices = []
        gpus = tuple(
            d
            for d in devices
            if _read(pci / d / "vendor") == _NVIDIA
            and (_read(pci / d / "class") or "").startswith("0x03")
        )
        groups.append(IommuGroup(entry.name, _read(entry / "type"), gpus))
    return groups


def read_acs(run_lspci: bool = True) -> tuple[list[str] | None, str]:
    """Bridges with ACS ``SrcValid+`` per ``lspci -vvv``; None and why when it cannot tell.

    Example:
        >>> read_acs(run_lspci=False)
        (None, 'not read without 2+ GPUs')
    """
    if not run_lspci:
        return None, "not read without 2+ GPUs"
    lspci = shutil.which("lspci")
    if lspci is None:
        return None, "lspci not installed (apt install pciutils)"
    try:
        out = subprocess.run(
            [lspci, "-vvv"], capture_output=True, text=True, timeout=15, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"lspci -vvv failed: {e}"
    if "ACSCtl" not in out and hasattr(os, "geteuid") and os.geteuid() != 0:
        return None, "lspci needs root to read ACS (sudo lspci -vvv | grep ACSCtl)"
    return list(acs_redirecting_bridges(out)), ""


def _infiniband(root: Path = Path("/sys/class/infiniband")) -> list[str]:
    try:
        return sorted(p.name for p in root.iterdir())
    except OSError:
        return []


# --------------------------------------------------------------------------- the checks


def host_dist_checks(
    *,
    env: Mapping[str, str],
    limits: HostLimits,
    gpus: Sequence[GpuInfo],
    ranks: int,
    backend: str,
    cmdline: Path = Path("/proc/cmdline"),
    read_lspci: bool = True,
) -> list[Check]:
    """The checks that need no rank: ``nccl_shm``, ``nccl_env``, ``ifname``, ``hostname``,
    ``iommu``. ``nccl_shm`` and ``iommu`` are skips with fewer than 2 GPUs: NCCL runs one
    rank per GPU, so such a host has no two NCCL ranks to share memory or peer-to-peer.

    Example:
        >>> from trainperf.limits import host_limits
        >>> checks = host_dist_checks(env={"NCCL_SOCKET_IFNAME": "bogus0"},
        ...                           limits=host_limits(), gpus=[], ranks=2, backend="gloo",
        ...                           read_lspci=False)
        >>> [(c.name, c.verdict) for c in checks if c.name == "ifname"]
        [('ifname', 'fail')]
    """
    interfaces = read_interfaces()
    hostname = socket.gethostname()
    master = env.get("MASTER_ADDR")
    acs, acs_note = read_acs(read_lspci and len(gpus) >= 2)
    return [
        check_nccl_shm(
            limits.shm_free,
            ranks,
            backend=backend,
            env=env,
            shm_error=limits.shm_error,
            gpus=len(gpus),
        ),
        check_nccl_env(env, _infiniband()),
        check_socket_ifname(
            env.get("NCCL_SOCKET_IFNAME"), env.get("GLOO_SOCKET_IFNAME"), interfaces
        ),
        check_hostname(
            hostname,
            resolve(hostname),
            interfaces,
            master_addr=master,
            master_resolved=None if master is None else resolve(master),
        ),
        check_iommu(_read(cmdline) or "", read_iommu_groups(), acs, len(gpus), acs_note=acs_note),
    ]


def _summary(error: BaseException) -> str:
    # A LaunchError carries the rank's traceback after its one-line summary.
    text = " ".join(str(error).split("\nTraceback", 1)[0].split())
    return text if len(text) <= _ERROR_CHARS else text[: _ERROR_CHARS - 3] + "..."


def _sweep(
    backend: Backend,
    ranks: int,
    env: Mapping[str, str | None] | None = None,
    sizes: Sequence[int] | None = None,
) -> tuple[AllReduceSweep | None, str | None]:
    try:
        return all_reduce_sweep(backend=backend, nprocs=ranks, env=env, sizes=sizes), None
    except (TrainperfError, ValueError, OSError) as e:  # LaunchError is a TrainperfError
        return None, _summary(e)


def _gpu_link(gpus: Sequence[GpuInfo]) -> LinkEstimate:
    try:
        return link_estimate(read_gpu_links(gpus))
    except DeviceError as e:
        return LinkEstimate("unknown", None, f"NVML failed reading the links: {_summary(e)}")


def _p2p_overrides(env: Mapping[str, str]) -> tuple[dict[str, str | None], bool]:
    """The run to compare with: P2P switched the other way; whether it is the P2P-off one."""
    # Read as NCCL reads them (C's strtol: "01" and "1abc" are 1, "00" and "abc" are 0; only
    # 1 switches P2P off).
    if nccl_one(env.get("NCCL_P2P_DISABLE"), c_int=True) or p2p_level_off(
        env.get("NCCL_P2P_LEVEL")
    ):
        return {"NCCL_P2P_DISABLE": "0", "NCCL_P2P_LEVEL": None}, False
    return {"NCCL_P2P_DISABLE": "1"}, True


def _p2p_check(
    env: Mapping[str, str], gpus: Sequence[GpuInfo], first: tuple[AllReduceSweep | None, str | None]
) -> tuple[Check, AllReduceSweep | None]:
    """Run the sweep again with P2P switched the other way, and compare (2+ GPUs only)."""
    if len(gpus) < 2:
        return check_p2p(len(gpus)), None
    overrides, other_is_off = _p2p_overrides(env)
    other = _sweep("nccl", len(gpus), overrides, NCCL_SIZES[-2:])
    on, off = (first, other) if other_is_off else (other, first)

    def peak(result: tuple[AllReduceSweep | None, str | None]) -> float | None:
        row = result[0].peak if result[0] is not None else None
        return None if row is None else row.busbw_gb_per_s

    check = check_p2p(
        len(gpus),
        with_p2p=peak(on),
        without_p2p=peak(off),
        with_error=on[1],
        without_error=off[1],
        nvml_blocked=read_p2p_blocked(gpus),
    )
    return check, other[0]


def launcher_running(env: Mapping[str, str]) -> str | None:
    """The launcher variables set in ``env`` (torchrun, or a SLURM job) where
    :func:`trainperf.ddp.launch` would start no ranks of its own: it joins the job's process
    group (:func:`trainperf.ddp._env.detect` finds one), or refuses the variables (the batch
    script of a job of several tasks, outside an srun step). ``srun --preserve-env -n 1``
    in a larger job is one process: launch starts its ranks there.

    Under a launcher the sweep would neither measure this host alone nor be able to rerun
    with peer-to-peer switched off: it is skipped.

    Example:
        >>> launcher_running({"RANK": "0", "WORLD_SIZE": "8"})
        'RANK=0, WORLD_SIZE=8'
        >>> step = {"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_STEP_ID": "0",
        ...         "SLURM_NTASKS": "4", "SLURM_TASKS_PER_NODE": "4", "SLURM_JOB_ID": "7",
        ...         "SLURM_JOB_NODELIST": "n1"}
        >>> launcher_running(step)
        'SLURM_PROCID=0, SLURM_NTASKS=4'
        >>> launcher_running({**step, "SLURM_STEP_NUM_TASKS": "1"}) is None  # srun -E -n 1
        True
    """
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
    torchrun = [f"{k}={env[k]}" for k in names if is_set(k, env)]  # blank: unset, as in launch
    if torchrun:
        return ", ".join(torchrun)
    from trainperf.ddp._env import detect

    tasks = step_tasks_variable(env)
    slurm = f"SLURM_PROCID={env.get('SLURM_PROCID', '')}, {tasks}={env.get(tasks, '')}"
    try:
        job = detect(env)
    except ValueError as e:  # launch() refuses it: the sweep would not run there either
        return f"{slurm}; launch() refuses it: {e}"
    return None if job is None else slurm


def _skipped_under_launcher(markers: str) -> Check:
    fix = (
        "run `trainperf doctor --dist` on the host itself, outside torchrun/srun (once per "
        "host): it starts its own ranks"
    )
    return Check("all_reduce", "skip", f"not run inside a launched job ({markers})", fix)


def dist_checks(
    *, env: Mapping[str, str], limits: HostLimits, gpus: Sequence[GpuInfo]
) -> tuple[list[Check], list[AllReduceSweep]]:
    """Start the ranks, run the sweep(s) and every ``--dist`` check.

    With 2+ GPUs: NCCL, one rank per GPU, judged against NVLink/PCIe from NVML, and a second
    run with peer-to-peer switched the other way. Otherwise: gloo, 2 CPU ranks, judged
    against the loopback socket measured here.

    Returns:
        ``(checks, sweeps)``: ``all_reduce``, ``nccl_shm``, ``nccl_env``, ``ifname``,
        ``hostname``, ``iommu``, ``p2p``, and the sweeps that ran.
    """
    nccl = len(gpus) >= 2
    backend: Backend = "nccl" if nccl else "gloo"
    ranks = len(gpus) if nccl else 2
    host = host_dist_checks(env=env, limits=limits, gpus=gpus, ranks=ranks, backend=backend)
    # What launch() sees decides whether it starts ranks: this process's own environment.
    markers = launcher_running(os.environ)
    if markers is not None:
        return [_skipped_under_launcher(markers), *host, check_p2p(len(gpus))], []
    # The loopback is measured before the ranks start, so they do not compete with it.
    link = _gpu_link(gpus) if nccl else loopback_estimate(measure_loopback())
    first = _sweep(backend, ranks)
    sweeps = [first[0]] if first[0] is not None else []
    p2p, other = _p2p_check(env, gpus, first)
    if other is not None:
        sweeps.append(other)
    return [check_all_reduce(first[0], link, first[1]), *host, p2p], sweeps
