"""``trainperf doctor``: check the environment a training run depends on, a status per check.

Each check returns a :class:`Check`: its name, its status (a :data:`CheckStatus`, ``ok``,
``warn``, ``fail`` or ``skip``, held in the field ``verdict``), the measured value, and the
fix. The ``check_*`` functions are pure: they take their inputs as arguments, so each can be
tested against any environment. :func:`diagnose` gathers the real inputs (NVML, torch,
cgroups, ``/dev/shm``, NumPy's BLAS, environment variables) and runs them all into a
:class:`DoctorReport`. Nothing here initialises CUDA.

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
    check_blas,
    check_cpus,
    check_load,
    check_memory,
    check_shm,
    check_start_method,
    check_threads,
    check_visible_devices,
)
from trainperf.doctor._diagnose import DoctorReport, diagnose
from trainperf.doctor._gpu import check_cuda_arch, check_gpus, check_torch_build

__all__ = [
    "Check",
    "CheckStatus",
    "DoctorReport",
    "check_blas",
    "check_cpus",
    "check_cuda_arch",
    "check_gpus",
    "check_load",
    "check_memory",
    "check_shm",
    "check_start_method",
    "check_threads",
    "check_torch_build",
    "check_visible_devices",
    "diagnose",
]

set_public_module(globals(), __all__, __name__)
