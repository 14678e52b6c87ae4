"""trainperf.doctor: every check against faked environments, and the whole report."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from trainperf._utils import imports as _imports
from trainperf.device import GpuInfo
from trainperf.doctor import (
    Check,
    DoctorReport,
    check_blas,
    check_cpus,
    check_cuda_arch,
    check_gpus,
    check_load,
    check_memory,
    check_shm,
    check_start_method,
    check_threads,
    check_torch_build,
    check_visible_devices,
    diagnose,
)
from trainperf.errors import DeviceError
from trainperf.limits import HostLimits, host_limits

doctor_module = importlib.import_module("trainperf.doctor")
device_module = importlib.import_module("trainperf.device")

GiB = 2**30
MiB = 2**20
NAMES = [
    "gpus", "torch", "cuda_arch", "cpus", "memory", "shm", "blas", "threads", "load",
    "start_method", "visible_devices",
]  # fmt: skip


def gpu(index: int = 0, cc: tuple[int, int] | None = (8, 0), **changes: object) -> GpuInfo:
    info = GpuInfo(
        index=index, nvml_index=index, uuid=f"GPU-{index:08d}", name="NVIDIA A100-SXM4-80GB",
        memory_total=80 * GiB, memory_used=GiB // 2, memory_free=80 * GiB - GiB // 2,
        utilization=0, compute_capability=cc, pci_bus_id=f"00000000:{index + 1:02X}:00.0",
    )  # fmt: skip
    return dataclasses.replace(info, **changes)  # type: ignore[arg-type]


def limits(**changes: object) -> HostLimits:
    base = HostLimits(
        cpus_host=32, cpus_affinity=32, cpu_quota=None, cpus=32, memory_total=256 * GiB,
        memory_limit=None, memory_available=200 * GiB, shm_total=64 * GiB, shm_free=64 * GiB,
    )  # fmt: skip
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


# --------------------------------------------------------------------------- GPUs and torch


def test_gpus_none_ok_busy_and_broken() -> None:
    assert check_gpus([]).verdict == "skip"
    ok = check_gpus([gpu(0), gpu(1)], driver="580.1")
    assert ok.verdict == "ok" and "cuda:1 NVIDIA A100" in ok.value and "580.1" in ok.value
    busy = check_gpus([gpu(0, utilization=97, memory_used=40 * GiB)])
    assert busy.verdict == "warn" and "97% busy" in busy.value and "select_gpus" in busy.fix
    broken = check_gpus([], error="NVML refused access")
    assert broken.verdict == "fail" and "refused" in broken.value


def test_torch_build_versions_and_failures() -> None:
    ok = check_torch_build(
        torch_version="2.5.0", cuda="12.4", cudnn=90100, nccl=(2, 21, 5), gpu_count=1,
        driver_cuda=12040,
    )  # fmt: skip
    assert ok.verdict == "ok"
    assert "cuDNN 9.1.0" in ok.value and "NCCL 2.21.5" in ok.value and "CUDA 12.4" in ok.value
    old_cudnn = check_torch_build(
        torch_version="1.13", cuda="11.7", cudnn=8902, nccl=None, gpu_count=0
    )
    assert "cuDNN 8.9.2" in old_cudnn.value
    cpu_only = check_torch_build(
        torch_version="2.5.0+cpu", cuda=None, cudnn=None, nccl=None, gpu_count=2
    )
    assert cpu_only.verdict == "fail" and "CPU-only" in cpu_only.fix
    assert check_torch_build(
        torch_version="2.5.0+cpu", cuda=None, cudnn=None, nccl=None, gpu_count=0
    ).verdict == "ok"  # fmt: skip
    old_driver = check_torch_build(
        torch_version="2.5.0", cuda="12.4", cudnn=None, nccl=None, gpu_count=1, driver_cuda=11080
    )
    assert old_driver.verdict == "fail" and "update the NVIDIA driver" in old_driver.fix
    minor = check_torch_build(
        torch_version="2.5.0", cuda="12.4", cudnn=None, nccl=None, gpu_count=1, driver_cuda=12020
    )
    assert minor.verdict == "warn"


@pytest.mark.parametrize(
    ("arch_list", "cc", "verdict"),
    [
        (["sm_80", "sm_90"], (8, 6), "ok"),  # sm_80 machine code runs on 8.6
        (["sm_70", "sm_80"], (9, 0), "fail"),  # an old build on a Hopper card
        (["sm_50", "sm_60", "sm_70"], (8, 0), "fail"),
        (["sm_80", "compute_80"], (9, 0), "warn"),  # PTX only: JIT at start-up
        (["sm_90a"], (9, 0), "ok"),
        (["sm_90a"], (10, 0), "fail"),  # arch-specific code runs on that arch only
        (["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"], (12, 0), "ok"),
        (["sm_86"], (8, 0), "fail"),  # newer minor does not run on an older one
    ],
)
def test_cuda_arch_against_compute_capability(
    arch_list: list[str], cc: tuple[int, int], verdict: str
) -> None:
    check = check_cuda_arch(arch_list, [("GPU", cc)])
    assert check.verdict == verdict
    if verdict == "fail":
        assert f"sm_{cc[0]}{cc[1]}" in check.value and "pytorch.org" in check.fix


def test_cuda_arch_skips_without_gpus_or_arch_list() -> None:
    assert check_cuda_arch(["sm_80"], []).verdict == "skip"
    assert check_cuda_arch([], [("GPU", (8, 0))]).verdict == "skip"


def test_diagnose_reports_an_arch_mismatch_from_mocked_torch_and_gpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: ["sm_50", "sm_60", "sm_70"])
    monkeypatch.setattr(device_module, "gpus", lambda **_: [gpu(0, cc=(9, 0), name="NVIDIA H100")])
    report = diagnose(limits=limits(), env={})
    arch = {c.name: c for c in report.checks}["cuda_arch"]
    assert arch.verdict == "fail" and "NVIDIA H100 (sm_90)" in arch.value
    assert report.worst == "fail"


def test_diagnose_turns_an_nvml_error_into_a_failed_check(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(**_: object) -> list[GpuInfo]:
        raise DeviceError("NVML refused access to the GPUs")

    monkeypatch.setattr(device_module, "gpus", refuse)
    gpus = {c.name: c for c in diagnose(limits=limits(), env={}).checks}["gpus"]
    assert gpus.verdict == "fail" and "refused" in gpus.value


def test_diagnose_lists_gpus_from_the_env_it_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[object] = []

    def fake_gpus(*, env: object = None) -> list[GpuInfo]:
        seen.append(env)
        return []

    monkeypatch.setattr(device_module, "gpus", fake_gpus)
    env = {"CUDA_VISIBLE_DEVICES": "1"}
    diagnose(limits=limits(), env=env)
    diagnose(limits=limits())
    assert seen == [env, None]  # None: gpus() reads os.environ (and torch's view) itself


def fake_pynvml(driver_error: bool = False) -> types.ModuleType:
    nvml: Any = types.ModuleType("pynvml")
    nvml.NVMLError = type("NVMLError", (Exception,), {})
    for name in ("LibraryNotFound", "DriverNotLoaded", "NoPermission", "Unknown"):
        setattr(nvml, f"NVMLError_{name}", type(name, (nvml.NVMLError,), {}))
    nvml.calls = []
    nvml.nvmlInit = lambda: nvml.calls.append("init")
    nvml.nvmlShutdown = lambda: nvml.calls.append("shutdown")

    def driver() -> bytes:
        if driver_error:
            raise nvml.NVMLError_Unknown("lost")
        return b"550.54"

    nvml.nvmlSystemGetDriverVersion = driver
    nvml.nvmlSystemGetCudaDriverVersion = lambda: 12040
    nvml.nvmlDeviceGetCount = lambda: 0
    return nvml


def test_doctor_reads_the_driver_through_one_nvml_session(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = fake_pynvml()
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    assert doctor_module._nvml_system() == ("550.54", 12040, 0)
    assert nvml.calls == ["init", "shutdown"]
    broken = fake_pynvml(driver_error=True)
    monkeypatch.setitem(sys.modules, "pynvml", broken)
    assert doctor_module._nvml_system() == (None, None, 0)
    assert broken.calls == ["init", "shutdown"]


def test_diagnose_uses_the_loaders_start_method() -> None:
    from trainperf.loader._faults import start_method

    check = {c.name: c for c in diagnose(limits=limits(), env={}).checks}["start_method"]
    assert check.value == f"{start_method({})} on {sys.platform}"


# --------------------------------------------------------------------------- host


def test_cpus_from_a_faked_cgroup_quota(tmp_path: Path) -> None:
    write(tmp_path / "cpu.max", "200000 100000\n")
    faked = host_limits(cgroup_root=tmp_path, proc_cgroup=tmp_path / "none", shm_path=tmp_path)
    check = check_cpus(faked, gpu_count=1)
    assert faked.cpus <= 2
    assert check.verdict == "warn" and "cgroup quota 2" in check.value
    assert "4-8" in check.fix
    assert check_cpus(faked, gpu_count=0).verdict == "ok"


def test_cpus_per_gpu_and_hidden_cpus() -> None:
    assert check_cpus(limits(), gpu_count=4).verdict == "ok"  # 8 per GPU
    assert check_cpus(limits(), gpu_count=16).verdict == "warn"  # 2 per GPU
    quota = check_cpus(limits(cpus_host=64, cpu_quota=8.0, cpus=8), gpu_count=1)
    assert quota.verdict == "ok" and "usable_cpus" in quota.fix
    pinned = check_cpus(limits(cpus_host=64, cpus_affinity=16, cpus=16), gpu_count=2)
    assert "affinity 16 of 64" in pinned.value


def test_memory_from_a_faked_cgroup_limit(tmp_path: Path) -> None:
    write(tmp_path / "memory.max", str(GiB))
    write(tmp_path / "memory.current", str(GiB - 50 * MiB))
    faked = host_limits(cgroup_root=tmp_path, proc_cgroup=tmp_path / "none", shm_path=tmp_path)
    check = check_memory(faked)
    assert check.verdict == "warn" and "cgroup limit 1.0 GiB" in check.value
    assert "killed" in check.fix
    roomy = check_memory(limits(memory_limit=64 * GiB, memory_available=60 * GiB))
    assert roomy.verdict == "ok" and "cgroup limit" in roomy.fix
    assert check_memory(limits()).verdict == "ok"


def test_shm_tiny_small_enough_and_missing() -> None:
    tiny = check_shm(limits(shm_total=64 * MiB, shm_free=64 * MiB), workers=8)
    assert tiny.verdict == "fail" and "--shm-size" in tiny.fix and "64 MiB" in tiny.value
    small = check_shm(limits(shm_total=GiB, shm_free=GiB), workers=8)
    assert small.verdict == "warn"  # 8 workers x 2 batches x 74 MiB > 1 GiB
    assert check_shm(limits(), workers=8).verdict == "ok"
    assert check_shm(limits(shm_total=None, shm_free=None), workers=8).verdict == "skip"
    assert (
        check_shm(limits(shm_total=GiB, shm_free=GiB), workers=1, batch_bytes=MiB).verdict == "ok"
    )


def test_diagnose_sizes_shm_for_every_rank_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    # 8 GPUs, 32 CPUs: all ranks' 32 workers share one 1 GiB /dev/shm (not 4 per GPU).
    monkeypatch.setattr(device_module, "gpus", lambda **_: [gpu(i) for i in range(8)])
    one_gib = limits(shm_total=GiB, shm_free=GiB)
    shm = {c.name: c for c in diagnose(limits=one_gib, env={}).checks}["shm"]
    assert shm.verdict == "warn" and "32 workers" in shm.value
    assert shm.verdict == check_shm(one_gib, workers=32).verdict


def _pool(api: str, threads: int = 4) -> dict[str, object]:
    return {"user_api": "blas", "internal_api": api, "num_threads": threads, "version": "1.0"}


def test_blas_openblas_vs_mkl_on_intel_and_amd() -> None:
    intel_openblas = check_blas([_pool("openblas")], "GenuineIntel", cpus=8)
    assert intel_openblas.verdict == "warn" and "MKL" in intel_openblas.fix
    assert check_blas([_pool("mkl")], "GenuineIntel", cpus=8).verdict == "ok"
    assert check_blas([_pool("openblas")], "AuthenticAMD", cpus=8).verdict == "ok"
    over = check_blas([_pool("mkl", threads=64)], "GenuineIntel", cpus=8)
    assert over.verdict == "warn" and "64 BLAS threads" in over.fix
    missing = check_blas(None, "GenuineIntel", cpus=8)
    assert missing.verdict == "skip" and missing.fix == "pip install threadpoolctl"
    openmp_only = [{"user_api": "openmp", "internal_api": "openmp", "num_threads": 8}]
    assert check_blas(openmp_only, "GenuineIntel", cpus=8).verdict == "skip"


@pytest.mark.parametrize(("api", "vendor", "verdict"), [
    ("openblas", "GenuineIntel", "warn"), ("mkl", "GenuineIntel", "ok"),
    ("openblas", "AuthenticAMD", "ok"),
])  # fmt: skip
def test_diagnose_reads_blas_through_a_mocked_threadpoolctl(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, api: str, vendor: str, verdict: str
) -> None:
    fake = types.ModuleType("threadpoolctl")
    fake.threadpool_info = lambda: [_pool(api, threads=2)]  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "threadpoolctl", fake)
    real = _imports.is_available
    monkeypatch.setattr(_imports, "is_available", lambda n: n == "threadpoolctl" or real(n))
    cpuinfo = write(tmp_path / "cpuinfo", f"processor\t: 0\nvendor_id\t: {vendor}\n")
    blas = {c.name: c for c in diagnose(limits=limits(), env={}, cpuinfo=cpuinfo).checks}["blas"]
    assert blas.verdict == verdict and api in blas.value and vendor in blas.value


def test_diagnose_without_threadpoolctl_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = _imports.is_available
    monkeypatch.setattr(_imports, "is_available", lambda n: n != "threadpoolctl" and real(n))
    blas = {c.name: c for c in diagnose(limits=limits(), env={}).checks}["blas"]
    assert blas.verdict == "skip" and "pip install threadpoolctl" in blas.fix


def test_threads_oversubscription_and_bad_omp() -> None:
    over = check_threads(32, None, cpus=32, processes=4)
    assert over.verdict == "warn" and "torch.set_num_threads(8)" in over.fix
    assert check_threads(8, "8", cpus=32, processes=4).verdict == "ok"
    beyond_quota = check_threads(64, None, cpus=8)
    assert beyond_quota.verdict == "warn" and "set_num_threads(8)" in beyond_quota.fix
    omp = check_threads(2, "8", cpus=2)
    assert omp.verdict == "warn" and "OMP_NUM_THREADS=2" in omp.fix
    bad = check_threads(4, "four", cpus=8)
    assert bad.verdict == "warn" and "'four'" in bad.fix


@pytest.mark.parametrize("value", ["0", "-2", "four", "", "1.5"])
def test_threads_omp_must_be_an_integer_of_at_least_one(value: str) -> None:
    check = check_threads(2, value, cpus=8, processes=2)
    assert check.verdict == "warn"
    assert f"got {value!r}" in check.fix and "set OMP_NUM_THREADS=4" in check.fix
    assert check_threads(2, " 3 ", cpus=8).verdict == "ok"


def test_diagnose_counts_torchrun_ranks_as_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)
    env = {"LOCAL_WORLD_SIZE": "4"}
    threads = {c.name: c for c in diagnose(limits=limits(cpus=16), env=env).checks}["threads"]
    assert threads.verdict == "warn" and "4 process(es)" in threads.value


def test_load_average_against_the_usable_cpus() -> None:
    over = check_load(25.3, cpus=16)
    assert over.verdict == "warn" and "25.3" in over.value and "16 usable CPUs" in over.value
    assert "1.6x" in over.fix and "taskset" in over.fix and "OMP_NUM_THREADS" in over.fix
    assert check_load(24.0, cpus=16).verdict == "ok"  # 1.5x: busy, not clearly over
    assert check_load(0.3, cpus=2).verdict == "ok"
    assert check_load(None, cpus=2).verdict == "skip"


def test_diagnose_reads_the_load_average(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "getloadavg", lambda: (48.0, 30.0, 12.0), raising=False)
    load = {c.name: c for c in diagnose(limits=limits(cpus=16), env={}).checks}["load"]
    assert load.verdict == "warn" and "load average 48.0 for 16 usable CPUs" in load.value
    monkeypatch.setattr(os, "getloadavg", lambda: (3.0, 2.0, 1.0))
    assert {c.name: c for c in diagnose(limits=limits(cpus=16), env={}).checks}[
        "load"
    ].verdict == "ok"
    monkeypatch.delattr(os, "getloadavg")  # Windows has none
    load = {c.name: c for c in diagnose(limits=limits(cpus=16), env={}).checks}["load"]
    assert load.verdict == "skip"


def test_start_method() -> None:
    assert check_start_method("fork", "linux").verdict == "ok"
    spawn = check_start_method("spawn", "darwin")
    assert spawn.verdict == "warn" and "__name__ == '__main__'" in spawn.fix
    assert check_start_method("forkserver", "linux").verdict == "warn"


@pytest.mark.parametrize(
    ("visible", "order", "gpus", "verdict", "needle"),
    [
        (None, None, 4, "ok", "all 4"),
        ("", None, 2, "warn", "hides every GPU"),
        ("-1", None, 2, "warn", "hides every GPU"),
        ("", None, 0, "ok", "hides every GPU"),
        ("0,0", "PCI_BUS_ID", 2, "fail", "listed twice"),
        ("0,gpu1", None, 2, "fail", "'gpu1'"),
        ("5", "PCI_BUS_ID", 2, "fail", "index 5 does not exist"),
        ("1,3", None, 4, "warn", "CUDA_DEVICE_ORDER=PCI_BUS_ID"),
        ("1,3", "FASTEST_FIRST", 4, "warn", "CUDA_DEVICE_ORDER=PCI_BUS_ID"),
        ("1,3", "PCI_BUS_ID", 4, "ok", ""),
        ("0", None, 1, "ok", ""),
        ("GPU-8d3b,GPU-77aa", None, 4, "ok", ""),
        ("GPU-8d3b,GPU-8D3B", None, 4, "fail", "listed twice"),
        ("0,GPU-8d3b", "PCI_BUS_ID", 4, "fail", "so only 0 are visible"),
        ("GPU-8d3b,1", None, 4, "fail", "'1' is not a GPU- UUID"),
        ("abc", None, 2, "fail", "no GPU is visible"),
        ("+1", "PCI_BUS_ID", 2, "ok", ""),
        (None, "PCI", 2, "warn", "ignores"),
    ],
)
def test_visible_devices(
    visible: str | None, order: str | None, gpus: int, verdict: str, needle: str
) -> None:
    check = check_visible_devices(visible, order, gpus)
    assert check.verdict == verdict
    assert needle in check.value + check.fix


# --------------------------------------------------------------------------- the report


def test_diagnose_against_a_faked_host(tmp_path: Path) -> None:
    write(tmp_path / "cpu.max", "100000 100000\n")
    faked = host_limits(cgroup_root=tmp_path, proc_cgroup=tmp_path / "none", shm_path=tmp_path)
    faked = dataclasses.replace(faked, shm_total=16 * MiB, shm_free=16 * MiB)
    env = {"CUDA_VISIBLE_DEVICES": "0,0", "OMP_NUM_THREADS": "1"}
    report = diagnose(limits=faked, env=env, cpuinfo=tmp_path / "missing")
    by_name = {c.name: c for c in report.checks}
    assert [c.name for c in report.checks] == NAMES
    assert by_name["cpus"].value.startswith("1 usable")
    assert by_name["shm"].verdict == "fail"
    assert by_name["visible_devices"].verdict == "fail"
    assert "OMP_NUM_THREADS=1" in by_name["threads"].value
    assert report.worst == "fail"
    document = json.loads(json.dumps(report.to_dict()))
    assert document["worst"] == "fail"
    assert [c["name"] for c in document["checks"]] == NAMES
    assert set(document["checks"][0]) == {"name", "verdict", "value", "fix"}
    table = str(report)
    assert all(name in table for name in NAMES) and "enlarge /dev/shm" in table


def test_diagnose_on_this_machine_never_initialises_cuda() -> None:
    was = torch.cuda.is_initialized()
    report = diagnose()
    assert [c.name for c in report.checks] == NAMES
    assert all(c.verdict in ("ok", "warn", "fail", "skip") for c in report.checks)
    assert torch.cuda.is_initialized() == was


def test_worst_orders_fail_warn_ok_skip() -> None:
    def report(*verdicts: str) -> DoctorReport:
        return DoctorReport(tuple(Check(f"c{i}", v, "x") for i, v in enumerate(verdicts)))  # type: ignore[arg-type]

    assert report().worst == "skip"
    assert report("skip", "ok").worst == "ok"
    assert report("ok", "warn", "skip").worst == "warn"
    assert report("warn", "fail", "ok").worst == "fail"
