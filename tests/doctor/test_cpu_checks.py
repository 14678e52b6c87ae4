"""The CPU-contention checks (``doctor/_cpu_checks.py``): BLAS, threads, load."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.doctor._fakes import _pool
from trainperf.doctor import (
    check_blas,
    check_load,
    check_steal,
    check_threads,
)
from trainperf.limits import PressureScope, cgroup_cpu_pressure


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


@pytest.mark.parametrize(("threads", "cpus", "verdict"), [(1, 8, "ok"), (1, 1, "ok"),
                                                         (2, 8, "ok"), (3, 8, "warn"),
                                                         (8, 8, "warn")])  # fmt: skip
def test_blas_openblas_on_intel_already_capped_is_not_a_warning(
    threads: int, cpus: int, verdict: str
) -> None:
    # OPENBLAS_NUM_THREADS=1 (or a cap to a quarter of the CPUs) is the fix the warning gives.
    check = check_blas([_pool("openblas", threads=threads)], "GenuineIntel", cpus=cpus)
    assert check.verdict == verdict
    assert f"({threads} threads)" in check.value


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


@pytest.mark.parametrize("value", ["1_0", "\u0664", "0x4", "4e0", "2,1_0"])
def test_threads_omp_is_read_as_libgomp_reads_it(value: str) -> None:
    # Python's int() takes "1_0" (10) and an Arabic-Indic digit (4); libgomp's strtoul takes
    # neither, says "Invalid value" and starts a thread per core.
    check = check_threads(1, value, cpus=64)
    assert check.verdict == "warn" and f"got {value!r}" in check.fix
    for fine in ("+2", "\t2 ", "02", "2 , 1"):
        assert check_threads(1, fine, cpus=64).verdict == "ok", fine


def test_threads_value_shows_an_empty_omp_num_threads_as_set() -> None:
    # OMP_NUM_THREADS= (set, empty) is not unset: libgomp rejects it.
    check = check_threads(2, "", cpus=8)
    assert "OMP_NUM_THREADS=''" in check.value and "unset" not in check.value
    assert "OMP_NUM_THREADS=unset" in check_threads(2, None, cpus=8).value
    assert "OMP_NUM_THREADS=4," in check_threads(2, "4", cpus=8).value


@pytest.mark.parametrize(("value", "verdict"), [("1,1", "ok"), ("4,2", "ok"), ("8,1", "warn")])
def test_threads_omp_takes_a_list_per_nesting_level_as_openmp_does(
    value: str, verdict: str
) -> None:
    check = check_threads(1, value, cpus=4)
    assert check.verdict == verdict and "must be an integer" not in check.fix
    bad = check_threads(1, "1,0", cpus=4)
    assert bad.verdict == "warn" and "or a comma-separated list of them" in bad.fix


@pytest.mark.parametrize("name", ["MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"])
@pytest.mark.parametrize("value", ["-3", "abc", "0", "", "2,1", "1_0"])
def test_threads_flags_an_invalid_mkl_or_openblas_thread_count(name: str, value: str) -> None:
    # Before: OMP_NUM_THREADS=0 was flagged, MKL_NUM_THREADS=-3 not, though MKL, OpenBLAS
    # and torch ignore it just the same and start one thread per core.
    check = check_threads(2, "2", cpus=8, processes=2, env={name: value})
    if name == "MKL_NUM_THREADS":
        reader = "MKL and torch then ignore it and start"
    else:
        reader = "OpenBLAS then ignores it and starts"
    assert check.verdict == "warn"
    assert f"{name}={value!r}" in check.value or f"{name}={value}," in check.value
    assert check.fix == (
        f"{name} must be an integer >= 1, got {value!r} ({reader} one thread per core): set "
        f"{name}=4"
    )


def test_threads_takes_a_valid_mkl_and_openblas_thread_count() -> None:
    env = {"MKL_NUM_THREADS": "4", "OPENBLAS_NUM_THREADS": " 1 ", "PATH": "/bin"}
    check = check_threads(2, None, cpus=8, env=env)
    assert check.verdict == "ok"
    assert check.value == (
        "torch 2 threads, OMP_NUM_THREADS=unset, MKL_NUM_THREADS=4, "
        "OPENBLAS_NUM_THREADS=' 1 ', 8 usable CPUs, 1 process(es)"
    )
    # Unset, they are not shown: the value reads as before.
    assert check_threads(2, None, cpus=8, env={}) == check_threads(2, None, cpus=8)


def test_threads_names_every_invalid_thread_variable() -> None:
    env = {"MKL_NUM_THREADS": "0", "OPENBLAS_NUM_THREADS": "x"}
    check = check_threads(2, "0", cpus=8, env=env)
    assert check.verdict == "warn"
    assert [part.split(" must ")[0] for part in check.fix.split("; ")] == [
        "OMP_NUM_THREADS",
        "MKL_NUM_THREADS",
        "OPENBLAS_NUM_THREADS",
    ]


def test_load_average_against_the_usable_cpus() -> None:
    over = check_load(25.3, cpus=16)
    assert over.verdict == "warn" and "25.3" in over.value and "16 usable CPUs" in over.value
    assert "1.6x" in over.fix and "taskset" in over.fix and "OMP_NUM_THREADS" in over.fix
    assert check_load(24.0, cpus=16).verdict == "ok"  # 1.5x: busy, not clearly over
    assert check_load(0.3, cpus=2).verdict == "ok"
    assert check_load(None, cpus=2).verdict == "skip"


@pytest.mark.parametrize("cpus", [0, -2, 1.5, True])
def test_cpu_checks_refuse_a_cpu_count_below_one(cpus: object) -> None:
    # Before: check_load(3.0, cpus=0) raised ZeroDivisionError; check_threads and check_blas
    # judged against "0 usable CPUs".
    message = rf"cpus must be an int >= 1, got {cpus!r}"
    with pytest.raises(ValueError, match=message):
        check_load(3.0, cpus=cpus)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=message):
        check_threads(4, None, cpus=cpus)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=message):
        check_blas([_pool("openblas")], "GenuineIntel", cpus=cpus)  # type: ignore[arg-type]


def test_threads_refuses_a_process_or_thread_count_below_one() -> None:
    # Before: processes=0 was silently read as 1, and its value said "0 process(es)".
    with pytest.raises(ValueError, match=r"processes must be an int >= 1, got 0"):
        check_threads(4, None, cpus=4, processes=0)
    with pytest.raises(ValueError, match=r"torch_threads must be an int >= 1, got 0"):
        check_threads(0, None, cpus=4)


@pytest.mark.parametrize("share", [-0.1, 1.5, float("nan")])
def test_steal_refuses_a_share_that_is_no_fraction(share: float) -> None:
    # Before: NaN was "ok" and showed "nan%".
    with pytest.raises(ValueError, match=r"share must be None or a fraction from 0 to 1"):
        check_steal(share)


@pytest.mark.parametrize("share", ["0.2", True, [0.2]])
def test_steal_refuses_a_share_that_is_no_number(share: object) -> None:
    # Before: a string or list raised a bare TypeError from the comparison; True was 100%.
    with pytest.raises(ValueError, match=r"share must be None or a fraction from 0 to 1.*got"):
        check_steal(share)  # type: ignore[arg-type]


def test_steal_reads_a_numpy_share_as_a_python_float() -> None:
    np = pytest.importorskip("numpy")
    check = check_steal(np.float32(0.25))
    assert check.verdict == "warn" and "25.0%" in check.value


@pytest.mark.parametrize("load", [-1.0, float("nan"), float("inf")])
def test_load_refuses_a_load_average_that_is_no_measurement(load: float) -> None:
    with pytest.raises(ValueError, match=rf"load_average must be a finite number >= 0, got {load}"):
        check_load(load, cpus=4)


def test_load_of_a_shared_host_is_judged_against_the_hosts_cpus() -> None:
    # A pod given 8 of a 96-core node's CPUs: the load average is the node's (/proc/loadavg
    # is not namespaced), so a load of 50 is other tenants on other cores, not contention.
    shared = check_load(50.0, cpus=8, host_cpus=96)
    assert shared.verdict == "ok"
    assert "96 CPUs of the host" in shared.value and "8 usable" in shared.value
    over = check_load(150.0, cpus=8, host_cpus=96)
    assert over.verdict == "warn" and "1.6x the host's 96 CPUs" in over.fix
    # Without host_cpus (or with the whole host usable) the rule is the old one.
    assert check_load(50.0, cpus=8).verdict == "warn"
    assert check_load(50.0, cpus=8, host_cpus=8).value == check_load(50.0, cpus=8).value


@pytest.mark.parametrize("host_cpus", [0, 4, 2.5])
def test_load_refuses_fewer_host_cpus_than_usable_ones(host_cpus: object) -> None:
    message = rf"host_cpus must be an int >= cpus \(8\), got {host_cpus!r}"
    with pytest.raises(ValueError, match=message):
        check_load(3.0, cpus=8, host_cpus=host_cpus)  # type: ignore[arg-type]


def test_load_takes_a_numpy_host_cpu_count() -> None:
    # Before: host_cpus=np.int64(96) was refused as not an int.
    np = pytest.importorskip("numpy")
    numpy = check_load(np.float64(50.0), cpus=np.int64(8), host_cpus=np.int64(96))
    assert numpy == check_load(50.0, cpus=8, host_cpus=96)


def test_load_warns_a_quota_job_overloaded_by_its_own_threads() -> None:
    # A job in an 8-CPU quota (or SLURM-bound to 8 of 128 cores) loading them with 40
    # threads: 40 is under 1.5 x 128, so the host-wide load alone said ok (before: ok).
    own = check_load(40.0, cpus=8, host_cpus=128, cpu_pressure=0.65)
    assert own.verdict == "warn"
    assert "CPU pressure 65% (this cgroup's PSI some avg60)" in own.value
    assert "40.0" in own.value and "(8 CPUs) waited for a core 65%" in own.fix
    assert "cpu.max" in own.fix and "OMP_NUM_THREADS" in own.fix
    # A cgroup without a CPU limit is told to run fewer jobs, not to ask for more CPUs.
    free = check_load(4.0, cpus=8, cpu_pressure=0.65)
    assert free.verdict == "warn" and "run fewer jobs" in free.fix and "cpu.max" not in free.fix


def test_load_of_a_pod_on_a_busy_host_whose_cgroup_is_not_stalled_is_ok() -> None:
    pod = check_load(50.0, cpus=8, host_cpus=96, cpu_pressure=0.03)
    assert pod.verdict == "ok" and "CPU pressure 3%" in pod.value
    assert check_load(50.0, cpus=8, host_cpus=96, cpu_pressure=0.2).verdict == "ok"  # at 20 %


def test_load_without_cpu_pressure_keeps_the_load_average_rule() -> None:
    for load, cpus, host in ((40.0, 8, 128), (40.0, 8, None), (3.0, 2, None)):
        old = check_load(load, cpus=cpus, host_cpus=host)
        assert check_load(load, cpus, host_cpus=host, cpu_pressure=None) == old
    assert check_load(40.0, cpus=8, host_cpus=128).verdict == "ok"
    assert check_load(40.0, cpus=8).verdict == "warn"
    # The load average still warns when the whole host is overloaded, pressure or not.
    assert check_load(200.0, cpus=8, host_cpus=128, cpu_pressure=0.0).verdict == "warn"


def test_load_names_a_host_wide_pressure_as_such() -> None:
    host = check_load(4.0, cpus=8, pressure_scope="host", cpu_pressure=0.5)
    assert host.verdict == "warn" and "host-wide PSI" in host.value
    assert "threads on this host waited for a core 50%" in host.fix
    whole = check_load(40.0, cpus=128, host_cpus=128, cpu_pressure=0.5, pressure_scope="host")
    assert whole.verdict == "warn" and "run fewer jobs at once" in whole.fix
    # Without a load average (not that Linux lacks one) the pressure alone is judged.
    assert check_load(None, cpus=8, cpu_pressure=0.5).verdict == "warn"
    assert check_load(None, cpus=8, cpu_pressure=0.05).verdict == "ok"


def test_load_of_a_pod_is_not_warned_on_the_hosts_pressure() -> None:
    # A pod allowed 8 of 128 CPUs whose cgroup reports no PSI (cgroup v1 on a PSI kernel):
    # the host-wide figure counts its neighbours' threads on other cores (before: warn).
    pod = check_load(40.0, cpus=8, host_cpus=128, cpu_pressure=0.5, pressure_scope="host")
    assert pod.verdict == "ok" and pod.fix == ""
    assert "CPU pressure 50% (host-wide PSI" in pod.value
    assert "not judged: 8 of the host's 128 CPUs usable here" in pod.value
    # A host overloaded as a whole still warns, by its load average.
    assert check_load(200.0, 8, host_cpus=128, cpu_pressure=0.5, pressure_scope="host").fix


def _psi(path: Path, avg60: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"some avg10=0.00 avg60={avg60:.2f} avg300=0.00 total=1\n")


def _pressure_of(tmp_path: Path, source: str) -> tuple[float, PressureScope] | None:
    """``cgroup_cpu_pressure()`` of a fake host whose 62 % figure comes from ``source``."""
    root, proc_cgroup, proc_pressure = tmp_path / "cg", tmp_path / "self", tmp_path / "psi"
    if source == "cgroup":  # a container's own cgroup
        proc_cgroup.write_text("0::/job\n")
        _psi(root / "job" / "cpu.pressure", 62.0)
        (root / "job" / "cgroup.type").write_text("domain\n")
    elif source == "root cgroup":  # no container: the root's cpu.pressure is the host's
        proc_cgroup.write_text("0::/\n")
        _psi(root / "cpu.pressure", 62.0)
    else:  # no cgroup figure (cgroup v1): /proc/pressure/cpu
        proc_cgroup.write_text("")
        _psi(proc_pressure, 62.0)
    return cgroup_cpu_pressure(root, proc_cgroup, proc_pressure)


@pytest.mark.parametrize(
    ("source", "value", "fix"),
    [
        (
            "cgroup",
            "CPU pressure 62% (this cgroup's PSI some avg60)",
            "this cgroup's threads waited for a core 62% of the last minute: run fewer jobs",
        ),
        (
            "root cgroup",
            "CPU pressure 62% (host-wide PSI some avg60)",
            "threads on this host waited for a core 62% of the last minute (a host-wide "
            "figure): run fewer jobs",
        ),
        (
            "/proc/pressure",
            "CPU pressure 62% (host-wide PSI some avg60)",
            "threads on this host waited for a core 62% of the last minute (a host-wide "
            "figure): run fewer jobs",
        ),
    ],
)
def test_load_words_each_pressure_source_in_one_bracket(
    tmp_path: Path, source: str, value: str, fix: str
) -> None:
    # Before: "CPU pressure 62% (the host's (host-wide, no cgroup figure) PSI some avg60)",
    # brackets in brackets, and "no cgroup figure" where the root cgroup's was read.
    pressure = _pressure_of(tmp_path, source)
    assert pressure is not None
    check = check_load(None, cpus=8, cpu_pressure=pressure[0], pressure_scope=pressure[1])
    assert check.verdict == "warn" and check.value == value
    assert check.fix.startswith(fix)
    pod = check_load(None, 8, host_cpus=64, cpu_pressure=pressure[0], pressure_scope=pressure[1])
    if pressure[1] == "host":
        assert pod.value == (
            f"{value}, not judged: 8 of the host's 64 CPUs usable here, so other jobs' threads "
            "on other cores count too"
        )


@pytest.mark.parametrize("share", [-0.1, 1.5, float("nan"), "0.3", True])
def test_load_refuses_a_cpu_pressure_that_is_no_fraction(share: object) -> None:
    with pytest.raises(ValueError, match=r"cpu_pressure must be None or a fraction from 0 to 1"):
        check_load(3.0, cpus=8, cpu_pressure=share)  # type: ignore[arg-type]


def test_load_refuses_an_unknown_pressure_scope() -> None:
    with pytest.raises(ValueError, match=r"pressure_scope must be 'cgroup' or 'host', got 'pod'"):
        check_load(3.0, cpus=8, cpu_pressure=0.1, pressure_scope="pod")  # type: ignore[arg-type]


def test_load_takes_a_numpy_cpu_pressure() -> None:
    np = pytest.importorskip("numpy")
    assert check_load(3.0, 8, cpu_pressure=np.float32(0.5)) == check_load(3.0, 8, cpu_pressure=0.5)
