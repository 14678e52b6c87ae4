"""``trainperf doctor``: check the environment a training run depends on, a status per check.

Each check returns a :class:`Check`: its name, its status (a :data:`CheckStatus`, ``ok``,
``warn``, ``fail`` or ``skip``, held in the field ``verdict``), the measured value, and the
fix. The ``check_*`` functions are pure: they take their inputs as arguments, so each can be
tested against any environment. :func:`diagnose` gathers the real inputs (NVML, torch,
cgroups, ``/dev/shm``, NumPy's BLAS, environment variables) and runs them all into a
:class:`DoctorReport`; ``diagnose(dist=True)`` (``trainperf doctor --dist``) also starts
ranks for an all_reduce sweep (:func:`all_reduce_sweep`) and checks the interconnect.
Nothing here initialises CUDA.

Example:
    >>> from trainperf.doctor import check_load
    >>> check_load(load_average=0.5, cpus=4).verdict  # the check's status
    'ok'
"""

from __future__ import annotations

from trainperf._utils.public import set_public_module
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
)
from trainperf.doctor._diagnose import DoctorReport, diagnose
from trainperf.doctor._dist_checks import (
    IommuGroup,
    acs_redirecting_bridges,
    check_all_reduce,
    check_iommu,
    check_p2p,
)
from trainperf.doctor._gpu import check_cuda_arch, check_gpus, check_torch_build
from trainperf.doctor._interconnect import (
    GpuLink,
    LinkEstimate,
    LoopbackBaseline,
    link_estimate,
    loopback_estimate,
    measure_loopback,
    pcie_gb_per_s,
    read_gpu_links,
)
from trainperf.doctor._nccl_shm import check_nccl_shm, nccl_shm_need
from trainperf.doctor._net_checks import (
    IfnameFilter,
    check_hostname,
    check_nccl_env,
    check_socket_ifname,
    nccl_default_interfaces,
    parse_nccl_ifname,
)
from trainperf.doctor._sweep import AllReduceSweep, SweepRow, all_reduce_sweep, bus_bandwidth
from trainperf.doctor._visible_checks import (
    check_visible_devices,
)

__all__ = [
    "AllReduceSweep",
    "Check",
    "CheckStatus",
    "DoctorReport",
    "GpuLink",
    "IfnameFilter",
    "IommuGroup",
    "LinkEstimate",
    "LoopbackBaseline",
    "SweepRow",
    "acs_redirecting_bridges",
    "all_reduce_sweep",
    "bus_bandwidth",
    "check_all_reduce",
    "check_blas",
    "check_cpus",
    "check_cuda_arch",
    "check_gpus",
    "check_hostname",
    "check_iommu",
    "check_load",
    "check_memory",
    "check_nccl_env",
    "check_nccl_shm",
    "check_p2p",
    "check_shm",
    "check_socket_ifname",
    "check_start_method",
    "check_steal",
    "check_threads",
    "check_torch_build",
    "check_visible_devices",
    "diagnose",
    "link_estimate",
    "loopback_estimate",
    "measure_loopback",
    "nccl_default_interfaces",
    "nccl_shm_need",
    "parse_nccl_ifname",
    "pcie_gb_per_s",
    "read_gpu_links",
]

set_public_module(globals(), __all__, __name__)
