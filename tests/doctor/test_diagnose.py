"""diagnose() and DoctorReport (``doctor/_diagnose.py``): mocked inputs and the whole report."""

from __future__ import annotations

import collections
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

from tests.doctor._fakes import GiB, MiB, _pool, gpu, limits, write
from trainperf._utils import imports as _imports
from trainperf.device import GpuInfo
from trainperf.doctor import Check, DoctorReport, check_shm, diagnose
from trainperf.errors import DeviceError
from trainperf.limits import cgroup_cpu_pressure, host_limits

doctor_module = importlib.import_module("trainperf.doctor._diagnose")
device_module = importlib.import_module("trainperf.device")

NAMES = [
    "gpus", "torch", "cuda_arch", "cpus", "memory", "shm", "blas", "threads", "load",
    "steal", "start_method", "visible_devices",
]  # fmt: skip


@pytest.fixture(autouse=True)
def no_cpu_pressure(monkeypatch: pytest.MonkeyPatch) -> None:
    """No PSI figure unless a test gives one: the machine's own would decide ``load``."""
    monkeypatch.setattr(doctor_module, "cgroup_cpu_pressure", lambda: None)


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


def test_diagnose_says_cuda_visible_devices_hides_the_hosts_gpus(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(device_module, "gpus", lambda **_: [])
    monkeypatch.setattr(doctor_module, "_nvml_system", lambda: ("550.54", 12040, 2))
    report = diagnose(limits=limits(), env={"CUDA_VISIBLE_DEVICES": "5"})
    gpus = {c.name: c for c in report.checks}["gpus"]
    assert "hides all 2 GPU(s)" in gpus.value and "CPU-only" not in gpus.fix


def test_diagnose_fails_a_uuid_that_makes_no_gpu_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device_module, "gpus", lambda **_: [])
    monkeypatch.setattr(doctor_module, "_nvml_system", lambda: ("550.54", 12040, 2))
    report = diagnose(limits=limits(), env={"CUDA_VISIBLE_DEVICES": "GPU-9999"})
    check = {c.name: c for c in report.checks}["visible_devices"]
    assert check.verdict == "fail" and "only 0 of its 1 UUID(s)" in check.fix


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


def test_diagnose_sizes_shm_for_every_rank_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    # 8 GPUs, 32 CPUs: all ranks' 32 workers share one 1 GiB /dev/shm (not 4 per GPU).
    monkeypatch.setattr(device_module, "gpus", lambda **_: [gpu(i) for i in range(8)])
    one_gib = limits(shm_total=GiB, shm_free=GiB)
    shm = {c.name: c for c in diagnose(limits=one_gib, env={}).checks}["shm"]
    assert shm.verdict == "warn" and "32 workers" in shm.value
    assert shm.verdict == check_shm(one_gib, workers=32).verdict


@pytest.mark.parametrize(("api", "vendor", "verdict"), [
    ("openblas", "GenuineIntel", "warn"), ("mkl", "GenuineIntel", "ok"),
    ("openblas", "AuthenticAMD", "ok"),
])  # fmt: skip
def test_diagnose_reads_blas_through_a_mocked_threadpoolctl(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, api: str, vendor: str, verdict: str
) -> None:
    fake = types.ModuleType("threadpoolctl")
    # One thread per core, OpenBLAS's default (a cap of a few would not be warned about).
    fake.threadpool_info = lambda: [_pool(api, threads=32)]  # type: ignore[attr-defined]
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


def test_diagnose_counts_torchrun_ranks_as_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)
    env = {"LOCAL_WORLD_SIZE": "4"}
    threads = {c.name: c for c in diagnose(limits=limits(cpus=16), env=env).checks}["threads"]
    assert threads.verdict == "warn" and "4 process(es)" in threads.value


def test_diagnose_reads_the_load_average(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "getloadavg", lambda: (48.0, 30.0, 12.0), raising=False)
    whole = limits(cpus_host=16, cpus_affinity=16, cpus=16)
    load = {c.name: c for c in diagnose(limits=whole, env={}).checks}["load"]
    assert load.verdict == "warn" and "load average 48.0 for 16 usable CPUs" in load.value
    monkeypatch.setattr(os, "getloadavg", lambda: (3.0, 2.0, 1.0))
    assert {c.name: c for c in diagnose(limits=limits(cpus=16), env={}).checks}[
        "load"
    ].verdict == "ok"
    monkeypatch.delattr(os, "getloadavg")  # Windows has none
    load = {c.name: c for c in diagnose(limits=limits(cpus=16), env={}).checks}["load"]
    assert load.verdict == "skip"


def test_diagnose_judges_the_host_wide_load_against_the_hosts_cpus(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A container with a 4-CPU quota on a busy but not overloaded 64-core host: the load
    # average counts the host's threads, which run on the other cores.
    monkeypatch.setattr(os, "getloadavg", lambda: (40.0, 30.0, 12.0), raising=False)
    pod = limits(cpus_host=64, cpus_affinity=64, cpu_quota=4.0, cpus=4)
    load = {c.name: c for c in diagnose(limits=pod, env={}).checks}["load"]
    assert load.verdict == "ok" and "64 CPUs of the host" in load.value


@pytest.mark.parametrize(
    ("job", "host", "cpus", "verdict"),
    [
        (65.0, 10.0, 8, "warn"),  # the job's own threads wait for its 8 CPUs
        (1.0, 80.0, 8, "ok"),  # the host is busy, the job's cgroup is not stalled
        (None, None, 8, "ok"),  # no PSI: the load average against the host's 128 CPUs
        (None, 65.0, 8, "ok"),  # no cgroup figure: the host-wide one counts the neighbours
        (None, 65.0, 128, "warn"),  # no cgroup figure, no limit: the host's threads are its own
    ],
)
def test_diagnose_judges_a_quota_jobs_load_by_its_cgroups_cpu_pressure(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    job: float | None,
    host: float | None,
    cpus: int,
    verdict: str,
) -> None:
    # A job in an 8-CPU quota (or none) on a 128-core host, host-wide load 40 (< 1.5 x 128);
    # before: ok whatever its own cgroup's threads went through, and warned on the host-wide
    # pressure though 8 CPUs were its own.
    root, proc_pressure = tmp_path / "cgroup", tmp_path / "pressure_cpu"
    write(tmp_path / "proc_cgroup", "0::/job\n")
    if cpus < 128:
        write(root / "job" / "cpu.max", f"{cpus * 100000} 100000\n")
    for path, avg60 in ((root / "job" / "cpu.pressure", job), (proc_pressure, host)):
        if avg60 is not None:
            write(path, f"some avg10=0.00 avg60={avg60:.2f} avg300=0.00 total=1\n")
    monkeypatch.setattr(
        doctor_module,
        "cgroup_cpu_pressure",
        lambda: cgroup_cpu_pressure(root, tmp_path / "proc_cgroup", proc_pressure),
    )
    monkeypatch.setattr(os, "getloadavg", lambda: (40.0, 30.0, 12.0), raising=False)
    quota = float(cpus) if cpus < 128 else None
    job_limits = limits(cpus_host=128, cpus_affinity=128, cpu_quota=quota, cpus=cpus)
    load = {c.name: c for c in diagnose(limits=job_limits, env={}).checks}["load"]
    assert load.verdict == verdict
    assert ("CPU pressure" in load.value) == (job is not None or host is not None)


def test_diagnose_names_the_root_cgroups_pressure_host_wide(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # No container ("0::/"): /sys/fs/cgroup/cpu.pressure is the whole host's. Before: the
    # finding called it "this cgroup's" and warned a job pinned to 8 of 128 cores about it.
    root = tmp_path / "cgroup"
    write(tmp_path / "proc_cgroup", "0::/\n")
    write(root / "cpu.pressure", "some avg10=0.00 avg60=65.00 avg300=0.00 total=1\n")
    monkeypatch.setattr(
        doctor_module,
        "cgroup_cpu_pressure",
        lambda: cgroup_cpu_pressure(root, tmp_path / "proc_cgroup", tmp_path / "missing"),
    )
    monkeypatch.setattr(os, "getloadavg", lambda: (40.0, 30.0, 12.0), raising=False)
    pinned = limits(cpus_host=128, cpus_affinity=8, cpu_quota=None, cpus=8)
    load = {c.name: c for c in diagnose(limits=pinned, env={}).checks}["load"]
    assert "host-wide" in load.value and "this cgroup's" not in load.value
    assert load.verdict == "ok"


def test_diagnose_reads_the_steal_since_boot(monkeypatch: pytest.MonkeyPatch) -> None:
    from trainperf._utils import steal

    fields = "user nice system idle iowait irq softirq steal guest guest_nice"
    Times = collections.namedtuple("Times", fields)  # psutil's scputimes on Linux

    def times(stolen: float) -> Any:
        # 400 s idle, 100 s busy of which 5 s guest (already in user), `stolen` s stolen.
        return lambda: Times(80.0, 0.0, 20.0, 400.0, 0.0, 0.0, 0.0, stolen, 5.0, 0.0)

    monkeypatch.setattr(steal.psutil, "cpu_times", times(25.0))
    found = {c.name: c for c in diagnose(limits=limits(), env={}).checks}["steal"]
    # 25 s stolen of the 125 s the CPUs wanted (100 s busy, guest counted once, 25 stolen).
    assert found.verdict == "warn" and "withheld 20.0% of the CPU time" in found.value, found
    assert "dedicated cores" in found.fix
    monkeypatch.setattr(steal.psutil, "cpu_times", times(1.0))
    assert {c.name: c for c in diagnose(limits=limits(), env={}).checks}["steal"].verdict == "ok"


@pytest.mark.parametrize("name", ["MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"])
def test_diagnose_flags_an_invalid_blas_thread_variable(name: str) -> None:
    # Before: OMP_NUM_THREADS=abc was flagged, MKL_NUM_THREADS=-3 passed as ok.
    threads = {c.name: c for c in diagnose(limits=limits(), env={name: "-3"}).checks}["threads"]
    assert threads.verdict == "warn" and f"{name}=-3" in threads.value
    assert threads.fix.startswith(f"{name} must be an integer >= 1, got '-3'")


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
    # '0,0' shows no GPU of a GPU host (fail); on a host without one it changes nothing (ok).
    no_gpu = by_name["gpus"].verdict == "skip" and "no NVIDIA GPU" in by_name["gpus"].value
    assert by_name["visible_devices"].verdict == ("ok" if no_gpu else "fail")
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


def test_diagnose_reads_the_cudnn_version_without_initialising_cuda(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # torch.backends.cudnn.version() checks every GPU's compute capability the first time it
    # runs on a host with CUDA, and that initialises CUDA: a GPU host, in a fresh process.
    cudnn: Any = torch.backends.cudnn
    if not cudnn.is_available():
        pytest.skip("this PyTorch build has no cuDNN")
    if "__cudnn_version" in cudnn.version.__globals__:
        monkeypatch.setitem(cudnn.version.__globals__, "__cudnn_version", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)

    def initialise_cuda() -> None:
        raise AssertionError("diagnose() initialised CUDA")

    monkeypatch.setattr(torch.cuda, "_lazy_init", initialise_cuda)
    monkeypatch.setattr(device_module, "gpus", lambda **_: [gpu(0)])
    checks = {c.name: c for c in diagnose(limits=limits(), env={}).checks}
    assert "cuDNN " in checks["torch"].value
    # Without the binding that reads the library's number, it is left out rather than asked.
    monkeypatch.delattr(torch._C, "_cudnn", raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert doctor_module._cudnn_version() is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert doctor_module._cudnn_version() == cudnn.version()


@pytest.mark.requires_cuda
def test_diagnose_in_a_fresh_process_on_a_gpu_host_leaves_cuda_uninitialised() -> None:
    # The test above fakes a GPU host; this one is the real thing, where CUDA was not yet
    # started by anything else in the process (the test process may have started it).
    import subprocess

    code = (
        "import torch, trainperf.doctor as d; d.diagnose(); "
        "print('initialised' if torch.cuda.is_initialized() else 'untouched')"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip().splitlines()[-1] == "untouched", out.stdout + out.stderr


def test_worst_orders_fail_warn_ok_skip() -> None:
    def report(*verdicts: str) -> DoctorReport:
        return DoctorReport(tuple(Check(f"c{i}", v, "x") for i, v in enumerate(verdicts)))  # type: ignore[arg-type]

    assert report().worst == "skip"
    assert report("skip", "ok").worst == "ok"
    assert report("ok", "warn", "skip").worst == "warn"
    assert report("warn", "fail", "ok").worst == "fail"


def test_the_report_is_a_table_and_its_dict_is_json_safe() -> None:
    checks = (
        Check("shm", "fail", "16 MiB", "enlarge /dev/shm"),
        Check("load", "ok", "load 0.5", "nothing shown for ok"),
        Check("blas", "skip", "no threadpoolctl", "pip install threadpoolctl"),
    )
    report = DoctorReport(checks)
    assert str(report).splitlines() == [
        "check  verdict  value",
        "shm    fail     16 MiB",
        "                fix: enlarge /dev/shm",
        "load   ok       load 0.5",
        "blas   skip     no threadpoolctl",
        "                fix: pip install threadpoolctl",
    ]
    data = report.to_dict()
    # Only str, int, float, bool, None, lists and dicts survive a JSON round trip unchanged.
    assert json.loads(json.dumps(data)) == data
    assert data == {"worst": "fail", "checks": [c.to_dict() for c in checks]}
    assert json.loads(json.dumps(DoctorReport(()).to_dict())) == {"worst": "skip", "checks": []}


def test_the_table_columns_line_up_under_the_header_with_short_or_long_names() -> None:
    for name in ("io", "gpus", "start_method"):
        lines = str(DoctorReport((Check(name, "warn", "v", "do x"),))).splitlines()
        header, row, fix = lines
        assert row.index("warn") == header.index("verdict")
        assert row[header.index("value") :] == "v"
        assert fix.index("fix:") == header.index("value")


def test_report_with_sweeps_prints_them_after_the_table_and_adds_them_to_json() -> None:
    from trainperf.doctor import AllReduceSweep, SweepRow

    checks = (Check("all_reduce", "ok", "gloo, 2 ranks"),)
    sweep = AllReduceSweep("gloo", 2, "cpu", (SweepRow(2**20, 3, 0.002, 0.524, 0.524),))
    plain, with_sweep = DoctorReport(checks), DoctorReport(checks, (sweep,))
    assert "all_reduce" not in plain.to_dict()
    assert json.loads(json.dumps(with_sweep.to_dict()))["all_reduce"] == [sweep.to_dict()]
    assert str(with_sweep) == str(plain) + "\n\n" + str(sweep)


def test_diagnose_starts_no_ranks_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[object] = []

    def dist_checks(**kwargs: object) -> tuple[list[Check], list[object]]:
        seen.append(kwargs["gpus"])
        return [Check("all_reduce", "ok", "faked")], []

    monkeypatch.setattr(doctor_module, "dist_checks", dist_checks)
    monkeypatch.setattr(device_module, "gpus", lambda **_: [gpu(0)])
    assert [c.name for c in diagnose(limits=limits(), env={}).checks] == NAMES
    report = diagnose(limits=limits(), env={}, dist=True)
    assert [c.name for c in report.checks] == [*NAMES, "all_reduce"]
    assert seen == [[gpu(0)]]  # the GPUs the other checks saw


def test_diagnose_reads_a_cpuinfo_that_is_not_utf8(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # A model name with a stray byte once stopped the whole report with UnicodeDecodeError.
    fake = types.ModuleType("threadpoolctl")
    fake.threadpool_info = lambda: [_pool("openblas", threads=32)]  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "threadpoolctl", fake)
    real = _imports.is_available
    monkeypatch.setattr(_imports, "is_available", lambda n: n == "threadpoolctl" or real(n))
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_bytes(b"processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: \xff\xfe\n")
    report = diagnose(limits=limits(), env={}, cpuinfo=cpuinfo)
    blas = {c.name: c for c in report.checks}["blas"]
    assert blas.verdict == "warn" and "GenuineIntel" in blas.value
    json.dumps(report.to_dict(), allow_nan=False)


def test_diagnose_on_a_host_of_garbage_cgroup_files_is_json_safe(tmp_path: Path) -> None:
    # Malformed or undecodable cgroup files read as no limit: a report, not a traceback.
    (tmp_path / "cpu.max").write_bytes(b"\xff 100000\n")
    (tmp_path / "memory.max").write_bytes("\u00b2\n".encode())
    faked = host_limits(cgroup_root=tmp_path, proc_cgroup=tmp_path / "none", shm_path=tmp_path)
    report = diagnose(limits=faked, env={}, cpuinfo=tmp_path / "missing")
    cpus = {c.name: c for c in report.checks}["cpus"]
    assert "quota" not in cpus.value
    json.loads(json.dumps(report.to_dict(), allow_nan=False))
