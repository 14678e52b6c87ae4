"""``trainperf doctor``: :func:`diagnose` runs every check; :class:`DoctorReport` holds them.

Each check returns a :class:`Check` (name, status ``ok``/``warn``/``fail``/``skip``, the
measured value, and the fix). The check functions (in ``_checks`` and ``_gpu``, exported by
:mod:`trainperf.doctor`) take their inputs as arguments, so they can be tested against
any environment; :func:`diagnose` gathers the real inputs (NVML, torch, cgroups,
``/dev/shm``, NumPy's BLAS, environment variables) and runs them all.
Nothing here initialises CUDA, and the whole run takes a second or two without a GPU.
``diagnose(dist=True)`` adds the multi-process pre-flight of ``_dist`` (ranks started, an
all_reduce sweep, the interconnect checks), which takes 5 to 30 seconds.
"""

from __future__ import annotations

import importlib
import os
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainperf._utils import imports as _imports
from trainperf._utils.steal import boot_steal_share
from trainperf.device import GpuInfo
from trainperf.device._inventory import nvml_session
from trainperf.doctor._checks import (
    Check,
    CheckStatus,
    check_cpus,
    check_memory,
    check_shm,
    check_start_method,
)
from trainperf.doctor._cpu_checks import (
    check_blas,
    check_load,
    check_steal,
    check_threads,
    load_average,
)
from trainperf.doctor._dist import dist_checks
from trainperf.doctor._gpu import check_cuda_arch, check_gpus, check_torch_build
from trainperf.doctor._sweep import AllReduceSweep
from trainperf.doctor._visible_checks import (
    check_visible_devices,
)
from trainperf.errors import DeviceError
from trainperf.limits import (
    HostLimits,
    PressureScope,
    cgroup_cpu_pressure,
    host_limits,
    local_world_size,
)
from trainperf.loader._faults import start_method

__all__ = ["DoctorReport", "diagnose"]

_SEVERITY: dict[str, int] = {"skip": 0, "ok": 1, "warn": 2, "fail": 3}


@dataclass(frozen=True)
class DoctorReport:
    """Every check's outcome, printable as a table.

    Attributes:
        checks: the checks, in the order they ran.
        sweeps: the all_reduce sweeps ``diagnose(dist=True)`` ran (empty otherwise), each an
            :class:`~trainperf.doctor.AllReduceSweep`, printed after the table.
    """

    checks: tuple[Check, ...]
    sweeps: tuple[AllReduceSweep, ...] = ()

    @property
    def worst(self) -> CheckStatus:
        """The most severe status among the checks: fail > warn > ok > skip."""
        worst: CheckStatus = "skip"
        for check in self.checks:
            if _SEVERITY[check.verdict] > _SEVERITY[worst]:
                worst = check.verdict
        return worst

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: ``{"worst": ..., "checks": [{name, verdict, value, fix}, ...]}``.

        ``worst`` is :attr:`worst`; each check is :meth:`Check.to_dict`, whose ``verdict``
        key holds the check's status. After ``diagnose(dist=True)`` an ``"all_reduce"`` key
        holds each sweep's :meth:`~trainperf.doctor.AllReduceSweep.to_dict`.

        Example:
            >>> report = DoctorReport((Check("shm", "warn", "64 MiB", "enlarge /dev/shm"),))
            >>> data = report.to_dict()
            >>> data["worst"], data["checks"][0]["fix"]
            ('warn', 'enlarge /dev/shm')
        """
        data: dict[str, Any] = {"worst": self.worst, "checks": [c.to_dict() for c in self.checks]}
        if self.sweeps:
            data["all_reduce"] = [s.to_dict() for s in self.sweeps]
        return data

    def __str__(self) -> str:
        width = max((len(c.name) for c in self.checks), default=0)
        width = max(width, len("check"))  # the header's own word sets the least width
        lines = [f"{'check':<{width}}  verdict  value"]
        for c in self.checks:
            lines.append(f"{c.name:<{width}}  {c.verdict:<7}  {c.value}")
            if c.fix and c.verdict != "ok":
                lines.append(f"{'':<{width}}  {'':<7}  fix: {c.fix}")
        for sweep in self.sweeps:
            lines.extend(["", str(sweep)])
        return "\n".join(lines)


# --------------------------------------------------------------------------- gathering


def _nvml_system() -> tuple[str | None, int | None, int]:
    """Driver version, the CUDA version it supports, and the physical GPU count."""
    try:
        with nvml_session("reading the driver version") as nvml:
            if nvml is None:  # no driver or pynvml: the gpus check says so
                return None, None, 0
            driver = nvml.nvmlSystemGetDriverVersion()
            return (
                driver.decode() if isinstance(driver, bytes) else str(driver),
                int(nvml.nvmlSystemGetCudaDriverVersion()),
                int(nvml.nvmlDeviceGetCount()),
            )
    except DeviceError:  # the gpus check reports NVML's failure itself
        return None, None, 0


def _list_gpus(env: Mapping[str, str] | None) -> tuple[list[GpuInfo], str | None]:
    from trainperf import device

    with warnings.catch_warnings():
        # doctor reports a missing driver itself; gpus()'s warning would repeat it.
        warnings.simplefilter("ignore", RuntimeWarning)
        try:
            return device.gpus(env=env), None
        except DeviceError as e:
            return [], str(e)


def _blas_pools() -> list[dict[str, Any]] | None:
    if not _imports.is_available("threadpoolctl"):
        return None
    import numpy  # noqa: F401  (threadpoolctl only sees the BLAS of modules already loaded)

    # Imported by name: threadpoolctl ships no type information.
    threadpoolctl = importlib.import_module("threadpoolctl")
    return list(threadpoolctl.threadpool_info())


def _cpu_vendor(cpuinfo: Path) -> str | None:
    try:
        # A stray byte in a model name must not cost the vendor (or the whole report).
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return None
    match = re.search(r"^vendor_id\s*:\s*(\S+)", text, re.MULTILINE)
    return match.group(1) if match else None


def _cudnn_version() -> int | None:
    """cuDNN's version number, read without initialising CUDA.

    ``torch.backends.cudnn.version()`` checks every GPU's compute capability the first time it
    runs where CUDA is available, which initialises CUDA (and it raises on a cuDNN that does
    not match the build); the library's own number needs neither.
    """
    cudnn_module: Any = torch.backends.cudnn  # its functions are untyped
    if not cudnn_module.is_available():
        return None
    get_version = getattr(getattr(torch._C, "_cudnn", None), "getVersionInt", None)
    if callable(get_version):
        return int(get_version())
    # A PyTorch without that binding: only where asking cannot be what starts CUDA.
    if torch.cuda.is_initialized() or not torch.cuda.is_available():  # type: ignore[no-untyped-call]
        version = cudnn_module.version()
        return None if version is None else int(version)
    return None


def _torch_versions() -> tuple[int | None, tuple[int, ...] | None]:
    cudnn = _cudnn_version()
    nccl: tuple[int, ...] | None = None
    try:
        if torch.version.cuda is not None and torch.distributed.is_nccl_available():
            raw = torch.cuda.nccl.version()  # type: ignore[no-untyped-call]
            nccl = tuple(raw) if isinstance(raw, tuple) else (int(raw),)
    except (RuntimeError, AttributeError):
        nccl = None
    return cudnn, nccl


def _host_checks(
    environ: Mapping[str, str],
    limits: HostLimits,
    gpus: list[GpuInfo],
    gpu_error: str | None,
    cpuinfo: Path,
) -> list[Check]:
    driver, driver_cuda, physical = _nvml_system()
    physical = max(physical, len(gpus))
    cudnn, nccl = _torch_versions()
    try:
        processes = local_world_size(environ)
    except ValueError:  # a malformed launcher variable: the threads check assumes one process
        processes = 1
    return [
        check_gpus(gpus, driver, gpu_error, physical=physical),
        check_torch_build(
            torch_version=torch.__version__,
            cuda=torch.version.cuda,
            cudnn=cudnn,
            nccl=nccl,
            gpu_count=physical,
            driver_cuda=driver_cuda,
        ),
        check_cuda_arch(torch.cuda.get_arch_list(), [(g.name, g.compute_capability) for g in gpus]),
        check_cpus(limits, len(gpus)),
        check_memory(limits),
        # Every rank's workers share the one /dev/shm: the whole host's workers count.
        check_shm(limits, workers=max(1, limits.cpus)),
        check_blas(_blas_pools(), _cpu_vendor(cpuinfo), limits.cpus),
        check_threads(
            torch.get_num_threads(),
            environ.get("OMP_NUM_THREADS"),
            limits.cpus,
            processes,
            env=environ,
        ),
        _load_check(limits),
        check_steal(boot_steal_share()),
        check_start_method(start_method({})),
        check_visible_devices(
            environ.get("CUDA_VISIBLE_DEVICES"),
            environ.get("CUDA_DEVICE_ORDER"),
            physical,
            shown=None if gpu_error else len(gpus),
        ),
    ]


def _load_check(limits: HostLimits) -> Check:
    """The ``load`` check on this host's load average and its cgroup's CPU pressure."""
    pressure = cgroup_cpu_pressure()
    share: float | None = None
    scope: PressureScope = "cgroup"
    if pressure is not None:
        share, scope = pressure
    host = max(limits.cpus, limits.cpus_host)
    return check_load(
        load_average(), limits.cpus, host_cpus=host, cpu_pressure=share, pressure_scope=scope
    )


def diagnose(
    *,
    limits: HostLimits | None = None,
    env: Mapping[str, str] | None = None,
    cpuinfo: Path = Path("/proc/cpuinfo"),
    dist: bool = False,
) -> DoctorReport:
    """Run every check against this machine and return the report.

    Args:
        limits: host limits to use instead of reading them (tests pass fake cgroups here).
        env: environment variables to use instead of ``os.environ``, for every check that
            reads one: ``CUDA_VISIBLE_DEVICES`` and ``CUDA_DEVICE_ORDER`` (also for the GPU
            list, :func:`trainperf.gpus`), ``OMP_NUM_THREADS``, ``MKL_NUM_THREADS``,
            ``OPENBLAS_NUM_THREADS`` and ``LOCAL_WORLD_SIZE``, and
            with ``dist=True`` the ``NCCL_*``/``GLOO_*`` variables and ``MASTER_ADDR``. The
            ranks of the all_reduce sweep run in this process's own environment.
        cpuinfo: where to read the CPU vendor from.
        dist: also run the multi-process pre-flight (``trainperf doctor --dist``, 5-30 s):
            start one rank per GPU (NCCL; 2 CPU ranks with gloo without 2 GPUs), time an
            all_reduce sweep against what the link should give, and check ``/dev/shm`` for
            NCCL, the ``NCCL_*`` variables, the socket interfaces and names, IOMMU/ACS and,
            with 2+ GPUs, peer-to-peer on against off.

    Returns:
        A :class:`DoctorReport`; ``print`` it for a table, ``to_dict()`` for JSON.

    Example:
        >>> report = diagnose()
        >>> [c.name for c in report.checks][:3]
        ['gpus', 'torch', 'cuda_arch']
        >>> report.worst in ("ok", "warn", "fail")
        True
    """
    environ = os.environ if env is None else env
    limits = host_limits() if limits is None else limits
    gpus, gpu_error = _list_gpus(env)
    dist_part: tuple[list[Check], list[AllReduceSweep]] = ([], [])
    if dist:
        # First, while nothing here has loaded CUDA's driver, so gloo ranks can be forked.
        dist_part = dist_checks(env=environ, limits=limits, gpus=gpus)
    checks = _host_checks(environ, limits, gpus, gpu_error, cpuinfo) + dist_part[0]
    return DoctorReport(tuple(checks), tuple(dist_part[1]))
