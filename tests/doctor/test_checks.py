"""The host checks (``doctor/_checks.py``) against faked cgroups, limits and variables."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.doctor._fakes import GiB, MiB, limits, write
from trainperf.doctor import (
    Check,
    check_cpus,
    check_memory,
    check_shm,
    check_start_method,
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
    none = limits(shm_total=None, shm_free=None)
    assert check_shm(none, workers=8, platform="darwin").verdict == "skip"
    assert (
        check_shm(limits(shm_total=GiB, shm_free=GiB), workers=1, batch_bytes=MiB).verdict == "ok"
    )


def test_start_method() -> None:
    assert check_start_method("fork", "linux").verdict == "ok"
    spawn = check_start_method("spawn", "darwin")
    assert spawn.verdict == "warn" and "__name__ == '__main__'" in spawn.fix
    assert check_start_method("forkserver", "linux").verdict == "warn"


@pytest.mark.parametrize("method", ["bogus", "Fork", "", None])
def test_start_method_refuses_a_method_multiprocessing_has_not(method: object) -> None:
    # Before: any string but "fork" was judged as spawn, a warning about the main guard.
    match = rf"method must be one of 'fork', 'spawn', 'forkserver', got {method!r}"
    with pytest.raises(ValueError, match=match):
        check_start_method(method, "linux")  # type: ignore[arg-type]


def test_a_check_serialises_itself() -> None:
    check = Check("shm", "warn", "64 MiB", "enlarge /dev/shm")
    assert check.to_dict() == {
        "name": "shm", "verdict": "warn", "value": "64 MiB", "fix": "enlarge /dev/shm"
    }  # fmt: skip
    assert Check("load", "ok", "fine").to_dict()["fix"] == ""


def test_shm_missing_on_linux_fails() -> None:
    # torch hands worker batches over as shm_open() files, which glibc keeps in /dev/shm:
    # without it every worker batch fails ("unable to open shared memory object").
    check = check_shm(limits(shm_total=None, shm_free=None), workers=8, platform="linux")
    assert check.verdict == "fail" and "no /dev/shm" in check.value
    assert "mount a tmpfs at /dev/shm" in check.fix and "num_workers=0" in check.fix


def test_an_unreadable_shm_on_linux_warns_and_names_the_error() -> None:
    # statvfs('/dev/shm') refused (EACCES under a strict seccomp/AppArmor profile) is not a
    # missing /dev/shm: it is probably there, only its size is unknown.
    unreadable = limits(shm_total=None, shm_free=None, shm_error="EACCES: Permission denied")
    check = check_shm(unreadable, workers=8, platform="linux")
    assert check.verdict == "warn"
    assert "could not read /dev/shm" in check.value and "EACCES" in check.value
    assert "df -h /dev/shm" in check.fix
    missing = check_shm(limits(shm_total=None, shm_free=None), workers=8, platform="linux")
    assert missing.verdict == "fail" and "no /dev/shm" in missing.value


def test_a_cgroup_limit_above_the_hosts_memory_is_not_called_no_limit() -> None:
    # memory.max of 512 GiB on a 256 GiB host: the host's memory binds first, but a limit
    # is set, and "no cgroup limit" misreported it.
    check = check_memory(limits(memory_limit=512 * GiB))
    assert check.verdict == "ok" and "no cgroup limit" not in check.value
    assert "cgroup limit 512.0 GiB, above the host's 256.0 GiB" in check.value
    assert "no cgroup limit" in check_memory(limits()).value


def test_shm_with_no_workers_needs_no_shared_memory() -> None:
    # Before: 0 workers counted one worker's batches ("0 workers x 2 batches ... need ~147
    # MiB") and failed a 64 MiB /dev/shm; with num_workers=0 the main process loads batches.
    tiny = check_shm(limits(shm_total=64 * MiB, shm_free=64 * MiB), workers=0)
    assert tiny.verdict == "ok" and tiny.fix == ""
    assert "64 MiB (64 MiB free)" in tiny.value and "0 workers" in tiny.value
    assert "need ~" not in tiny.value
    missing = check_shm(limits(shm_total=None, shm_free=None), workers=0, platform="linux")
    assert missing.verdict == "ok" and "no /dev/shm here" in missing.value
    assert check_shm(limits(shm_total=64 * MiB, shm_free=64 * MiB), workers=1).verdict == "fail"


def test_shm_counts_one_worker_and_one_batch_in_the_singular() -> None:
    # Before: "1 workers x 1 batches of 1 MiB"; plural() gives the noun its number.
    one = check_shm(limits(), workers=1, prefetch_factor=1, batch_bytes=MiB).value
    assert "; 1 worker x 1 batch of 1 MiB need ~1 MiB" in one
    many = check_shm(limits(), workers=8, prefetch_factor=2, batch_bytes=MiB).value
    assert "; 8 workers x 2 batches of 1 MiB need ~16 MiB" in many


@pytest.mark.parametrize("workers", [-1, 2.0, True, None])
def test_shm_refuses_a_worker_count_that_is_not_a_non_negative_int(workers: object) -> None:
    with pytest.raises(ValueError, match=r"workers must be an int >= 0, got "):
        check_shm(limits(), workers=workers)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"prefetch_factor": 0}, r"prefetch_factor must be an int >= 1, got 0"),
        ({"prefetch_factor": 2.5}, r"prefetch_factor must be an int >= 1, got 2\.5"),
        ({"prefetch_factor": None}, r"prefetch_factor must be an int >= 1, got None"),
        ({"batch_bytes": -1}, r"batch_bytes must be an int >= 0, got -1"),
        ({"batch_bytes": "77MB"}, r"batch_bytes must be an int >= 0, got '77MB'"),
    ],
)
def test_shm_refuses_a_prefetch_factor_or_batch_size_out_of_range(
    kwargs: dict[str, object], match: str
) -> None:
    # Before: prefetch_factor=0 made the need 0, so a 64 MiB /dev/shm was called ok for
    # 8 workers of 74 MiB batches.
    tiny = limits(shm_total=64 * MiB, shm_free=64 * MiB)
    with pytest.raises(ValueError, match=match):
        check_shm(tiny, workers=8, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("gpu_count", [-2, 1.5, True, None])
def test_cpus_refuses_a_gpu_count_that_is_not_a_non_negative_int(gpu_count: object) -> None:
    # Before: gpu_count=-2 gave "-16 per GPU (-2 GPU(s))" and a warning to rent more cores.
    with pytest.raises(ValueError, match=rf"gpu_count must be an int >= 0, got {gpu_count!r}"):
        check_cpus(limits(), gpu_count=gpu_count)  # type: ignore[arg-type]


def test_host_checks_take_numpy_counts_as_python_ones() -> None:
    np = pytest.importorskip("numpy")
    tiny = limits(shm_total=GiB, shm_free=GiB)
    numpy = check_shm(tiny, np.int64(8), batch_bytes=np.int64(MiB), prefetch_factor=np.int64(4))
    assert numpy == check_shm(tiny, 8, batch_bytes=MiB, prefetch_factor=4)
    assert check_cpus(limits(), gpu_count=np.int64(16)) == check_cpus(limits(), gpu_count=16)


def test_a_cpu_quota_below_one_cpu_is_a_warning(tmp_path: Path) -> None:
    # "50000 100000" is half a core's time: 1 usable CPU (rounded up so work can run), but
    # every thread is throttled; before, check_cpus called that ok ("1 per GPU" with a GPU).
    write(tmp_path / "cpu.max", "50000 100000\n")
    faked = host_limits(cgroup_root=tmp_path, proc_cgroup=tmp_path / "none", shm_path=tmp_path)
    alone = check_cpus(faked, gpu_count=0)
    assert alone.verdict == "warn" and "cgroup quota 0.5" in alone.value
    assert "0.5 of one CPU" in alone.fix and "--cpus" in alone.fix
    fed = check_cpus(faked, gpu_count=1)
    assert fed.verdict == "warn" and "0.5 per GPU" in fed.value
    assert check_cpus(limits(cpu_quota=1.0, cpus=1), gpu_count=0).verdict == "ok"
    # The os.cpu_count() note the ok verdict gives stays beside the throttling (it was lost).
    hidden = check_cpus(limits(cpus_host=8, cpus_affinity=8, cpu_quota=0.5, cpus=1), gpu_count=0)
    assert hidden.verdict == "warn" and "os.cpu_count() says 8 but only 1" in hidden.fix


def test_no_memory_available_is_a_warning_whatever_the_limit() -> None:
    # memory.max 0 (or a host reporting 0 B) left 0 of 0 B: under min(2 GiB, 10 %) of 0 is
    # never true, so this was ok.
    zero = check_memory(limits(memory_limit=0, memory_available=0))
    assert zero.verdict == "warn" and "0 B available" in zero.value
    assert check_memory(limits(memory_total=0, memory_available=0)).verdict == "warn"
