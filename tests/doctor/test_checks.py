"""The host checks (``doctor/_checks.py``) against faked cgroups, limits and variables."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.doctor._fakes import GiB, MiB, _pool, limits, write
from trainperf.doctor import (
    Check,
    check_blas,
    check_cpus,
    check_load,
    check_memory,
    check_shm,
    check_start_method,
    check_threads,
    check_visible_devices,
)
from trainperf.limits import host_limits


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


@pytest.mark.parametrize(("value", "verdict"), [("1,1", "ok"), ("4,2", "ok"), ("8,1", "warn")])
def test_threads_omp_takes_a_list_per_nesting_level_as_openmp_does(
    value: str, verdict: str
) -> None:
    check = check_threads(1, value, cpus=4)
    assert check.verdict == verdict and "must be an integer" not in check.fix
    bad = check_threads(1, "1,0", cpus=4)
    assert bad.verdict == "warn" and "or a comma-separated list of them" in bad.fix


def test_load_average_against_the_usable_cpus() -> None:
    over = check_load(25.3, cpus=16)
    assert over.verdict == "warn" and "25.3" in over.value and "16 usable CPUs" in over.value
    assert "1.6x" in over.fix and "taskset" in over.fix and "OMP_NUM_THREADS" in over.fix
    assert check_load(24.0, cpus=16).verdict == "ok"  # 1.5x: busy, not clearly over
    assert check_load(0.3, cpus=2).verdict == "ok"
    assert check_load(None, cpus=2).verdict == "skip"


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
        ("abc", None, 0, "ok", "hides every GPU"),  # no GPU to hide: CUDA sees none either way
        ("NoDevFiles", None, 0, "ok", "hides every GPU"),  # SLURM's value for a GPU-less job
        ("NoDevFiles", None, 2, "warn", "unset CUDA_VISIBLE_DEVICES"),
        ("abc", None, 2, "fail", "'abc' is neither an index nor a GPU- or MIG- UUID"),
        ("0,abc", None, 2, "fail", "'abc' is not an index, as the first entry sets:"),
        ("0,GPU-8d3b", None, 2, "fail", "entries cannot mix indices, GPU- and MIG- UUIDs"),
        ("GPU-8d3b,MIG-1a2b", None, 2, "fail", "entries cannot mix"),
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


@pytest.mark.parametrize("visible", ["0,-1", "0,0", "0,abc", "3", "GPU-8d3b,GPU-8d3b", "0,GPU-1"])
def test_visible_devices_on_a_host_without_gpus_is_not_a_failure(visible: str) -> None:
    # No GPU to show or hide: CUDA sees none whatever the list says, so doctor must not exit 1.
    check = check_visible_devices(visible, None, gpu_count=0)
    assert check.verdict == "ok" and "no GPU here" in check.value
    assert "are visible" not in check.value + check.fix


@pytest.mark.parametrize(
    ("visible", "order", "verdict", "needle"),
    [
        ("0,-1", "PCI_BUS_ID", "ok", "the list ends at '-1'"),  # CUDA's documented terminator
        ("0,2,-1,1", "PCI_BUS_ID", "ok", "CUDA ignores '1' after it"),  # CUDA's docs' example
        ("1,-1", None, "warn", "CUDA_DEVICE_ORDER=PCI_BUS_ID"),  # the usual order advice
        ("0,0,-1", "PCI_BUS_ID", "fail", "listed twice"),  # what precedes it still counts
        ("0,7,-1", "PCI_BUS_ID", "fail", "index 7 does not exist"),
        ("0,-x", "PCI_BUS_ID", "fail", "'-x' is not an index"),  # junk, not a terminator
    ],
)
def test_visible_devices_a_negative_entry_ends_the_list_on_purpose(
    visible: str, order: str, verdict: str, needle: str
) -> None:
    check = check_visible_devices(visible, order, gpu_count=4)
    assert check.verdict == verdict
    assert needle in check.value + check.fix


def test_visible_devices_says_unset_for_an_unset_variable() -> None:
    check = check_visible_devices(None, None, gpu_count=2)
    assert "CUDA_VISIBLE_DEVICES=unset, CUDA_DEVICE_ORDER=unset" in check.value
    assert "None" not in check.value


@pytest.mark.parametrize(
    ("visible", "shown", "verdict"),
    [
        ("GPU-9999", 0, "fail"),  # matches no card
        ("GPU-1111,GPU-1111aaaa", 0, "fail"),  # one card twice: CUDA shows none
        ("GPU-1111,GPU-9999", 1, "fail"),  # CUDA stops at the second
        ("GPU-1111,GPU-2222", 2, "ok"),
        ("GPU-1111,GPU-2222", None, "ok"),  # the cards could not be listed: not judged
        ("MIG-1111", 0, "fail"),
    ],
)
def test_visible_devices_checks_uuids_against_the_gpus_they_make_visible(
    visible: str, shown: int | None, verdict: str
) -> None:
    check = check_visible_devices(visible, None, 2, shown=shown)
    assert check.verdict == verdict
    if verdict == "fail":
        assert f"only {shown} of its" in check.fix and "nvidia-smi -L" in check.fix


def test_a_check_serialises_itself() -> None:
    check = Check("shm", "warn", "64 MiB", "enlarge /dev/shm")
    assert check.to_dict() == {
        "name": "shm", "verdict": "warn", "value": "64 MiB", "fix": "enlarge /dev/shm"
    }  # fmt: skip
    assert Check("load", "ok", "fine").to_dict()["fix"] == ""
