from __future__ import annotations

import os
from pathlib import Path

import pytest

from trainperf import limits
from trainperf.limits import (
    HostLimits,
    cgroup_cpu_pressure,
    cgroup_cpu_quota,
    cgroup_memory_limit,
    host_limits,
)


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_quota_and_unlimited(tmp_path: Path) -> None:
    write(tmp_path / "cpu.max", "400000 100000\n")
    assert cgroup_cpu_quota(tmp_path, tmp_path / "none") == 4.0
    write(tmp_path / "cpu.max", "max 100000\n")
    assert cgroup_cpu_quota(tmp_path, tmp_path / "none") is None
    write(tmp_path / "cpu.max", "50000 0\n")  # malformed: no limit, not a division by zero
    assert cgroup_cpu_quota(tmp_path, tmp_path / "none") is None


def test_cgroup_v2_nested_path_from_proc_self_cgroup(tmp_path: Path) -> None:
    write(tmp_path / "proc_cgroup", "0::/job/step0\n")
    write(tmp_path / "root" / "job" / "step0" / "cpu.max", "150000 100000\n")
    assert cgroup_cpu_quota(tmp_path / "root", tmp_path / "proc_cgroup") == 1.5


def test_cgroup_v1_quota(tmp_path: Path) -> None:
    write(tmp_path / "proc_cgroup", "3:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n")
    write(tmp_path / "root" / "cpu,cpuacct" / "cpu.cfs_quota_us", "300000\n")
    write(tmp_path / "root" / "cpu,cpuacct" / "cpu.cfs_period_us", "100000\n")
    assert cgroup_cpu_quota(tmp_path / "root", tmp_path / "proc_cgroup") == 3.0
    write(tmp_path / "root" / "cpu,cpuacct" / "cpu.cfs_quota_us", "-1\n")
    assert cgroup_cpu_quota(tmp_path / "root", tmp_path / "proc_cgroup") is None


def test_cgroup_memory_v1_and_v2(tmp_path: Path) -> None:
    v1 = tmp_path / "v1"
    write(v1 / "memory" / "memory.limit_in_bytes", "9223372036854771712\n")
    write(v1 / "memory" / "memory.usage_in_bytes", "1000\n")
    write(tmp_path / "pc1", "4:memory:/x\n")
    assert cgroup_memory_limit(v1, tmp_path / "pc1") == (None, 1000)
    write(v1 / "memory" / "memory.limit_in_bytes", "2147483648\n")
    assert cgroup_memory_limit(v1, tmp_path / "pc1") == (2147483648, 1000)
    v2 = tmp_path / "v2"
    write(v2 / "memory.max", "max\n")
    assert cgroup_memory_limit(v2, tmp_path / "none") == (None, None)


def test_reclaimable_file_cache_is_not_counted_as_used(tmp_path: Path) -> None:
    # A container with a 16 GiB limit that has read its dataset: 15.5 GiB "used", 14 GiB of
    # it inactive page cache that the kernel frees before any OOM kill.
    g = 2**30
    write(tmp_path / "memory.max", str(16 * g))
    write(tmp_path / "memory.current", str(31 * g // 2))
    write(tmp_path / "memory.stat", f"anon {g // 2}\nfile {15 * g}\ninactive_file {14 * g}\n")
    assert cgroup_memory_limit(tmp_path, tmp_path / "none") == (16 * g, 3 * g // 2)
    got = host_limits(cgroup_root=tmp_path, proc_cgroup=tmp_path / "none", shm_path=tmp_path)
    # The cgroup leaves 14.5 GiB (it left 0.5); the host's own available memory caps it.
    expected = min(psutil_available(), 29 * g // 2)
    assert abs(got.memory_available - expected) < 256 * 2**20, (got.memory_available, expected)
    v1 = tmp_path / "v1" / "memory"
    write(tmp_path / "pc1", "4:memory:/\n")
    write(v1 / "memory.limit_in_bytes", str(16 * g))
    write(v1 / "memory.usage_in_bytes", str(31 * g // 2))
    write(v1 / "memory.stat", f"inactive_file {g}\ntotal_inactive_file {14 * g}\n")
    assert cgroup_memory_limit(tmp_path / "v1", tmp_path / "pc1") == (16 * g, 3 * g // 2)


def psutil_available() -> int:
    import psutil

    return int(psutil.virtual_memory().available)


def test_host_limits_caps_cpus_and_memory_by_cgroup(tmp_path: Path) -> None:
    write(tmp_path / "cpu.max", "100000 100000\n")
    write(tmp_path / "memory.max", str(512 * 2**20))
    write(tmp_path / "memory.current", str(500 * 2**20))
    got = host_limits(cgroup_root=tmp_path, proc_cgroup=tmp_path / "none", shm_path=tmp_path)
    assert got.cpu_quota == 1.0
    assert got.cpus == 1
    assert got.memory_limit == 512 * 2**20
    assert got.memory_available == 12 * 2**20
    assert got.shm_total is not None and got.shm_total > 0


def test_host_limits_missing_shm_is_none(tmp_path: Path) -> None:
    got = host_limits(cgroup_root=tmp_path, proc_cgroup=tmp_path / "x", shm_path=tmp_path / "no")
    assert got.shm_total is None and got.shm_free is None
    assert got.cpu_quota is None
    assert got.cpus == got.cpus_affinity


def test_fractional_quota_rounds_down_but_never_to_zero(tmp_path: Path) -> None:
    write(tmp_path / "cpu.max", "50000 100000\n")
    got = host_limits(cgroup_root=tmp_path, proc_cgroup=tmp_path / "none")
    assert got.cpus == 1


def test_usable_cpus_divides_among_local_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = HostLimits(32, 16, None, 16, 2**35, None, 2**34, None, None)
    monkeypatch.setattr(limits, "host_limits", lambda: fake)
    assert limits.usable_cpus() == 16
    assert limits.usable_cpus(4) == 4
    assert limits.usable_cpus(64) == 1
    with pytest.raises(ValueError, match="local_ranks must be an int >= 1, got 0"):
        limits.usable_cpus(0)


def test_limits_on_a_parent_cgroup_bind(tmp_path: Path) -> None:
    # SLURM-like: the job cgroup has the limits, the step (leaf) says "max".
    write(tmp_path / "proc_cgroup", "0::/job/step0\n")
    root = tmp_path / "root"
    write(root / "job" / "cpu.max", "200000 100000\n")
    write(root / "job" / "memory.max", str(4 * 2**30))
    write(root / "job" / "memory.current", str(2**30))
    write(root / "job" / "step0" / "cpu.max", "max 100000\n")
    write(root / "job" / "step0" / "memory.max", "max\n")
    write(root / "job" / "step0" / "memory.current", str(2**29))
    assert cgroup_cpu_quota(root, tmp_path / "proc_cgroup") == 2.0
    assert cgroup_memory_limit(root, tmp_path / "proc_cgroup") == (4 * 2**30, 2**30)


def test_memory_level_with_the_least_room_binds_not_the_smallest_limit(tmp_path: Path) -> None:
    # The job's 32 GiB are shared by its steps: 30 GiB used there leaves 2 GiB, although this
    # step's own (equal) limit has 27 GiB free.
    write(tmp_path / "proc_cgroup", "0::/job/step0\n")
    root = tmp_path / "root"
    write(root / "job" / "memory.max", str(32 * 2**30))
    write(root / "job" / "memory.current", str(30 * 2**30))
    write(root / "job" / "step0" / "memory.max", str(32 * 2**30))
    write(root / "job" / "step0" / "memory.current", str(5 * 2**30))
    assert cgroup_memory_limit(root, tmp_path / "proc_cgroup") == (32 * 2**30, 30 * 2**30)
    # A smaller limit with more room left does not bind either.
    write(root / "job" / "step0" / "memory.max", str(8 * 2**30))
    assert cgroup_memory_limit(root, tmp_path / "proc_cgroup") == (32 * 2**30, 30 * 2**30)
    write(root / "job" / "memory.current", str(6 * 2**30))  # now the step has less room: 3 GiB
    assert cgroup_memory_limit(root, tmp_path / "proc_cgroup") == (8 * 2**30, 5 * 2**30)


@pytest.mark.parametrize("path", ["/../../user.slice/session-1.scope", "/..", "/a/../../b"])
def test_a_cgroup_outside_the_namespace_root_reads_no_other_cgroups_limit(
    tmp_path: Path, path: str
) -> None:
    # The mount shows the namespace's root (another cgroup: this process sits beside or
    # above it), so its limits are not this process's: unknown counts as none.
    write(tmp_path / "proc_cgroup", f"0::{path}\n")
    root = tmp_path / "sys" / "fs" / "cgroup"
    write(root / "cpu.max", "100000 100000\n")
    write(root / "memory.max", str(2**30))
    write(root / "memory.current", str(2**29))
    write(tmp_path / "sys" / "fs" / "cpu.max", "50000 100000\n")  # what root/.. would read
    assert cgroup_cpu_quota(root, tmp_path / "proc_cgroup") is None
    assert cgroup_memory_limit(root, tmp_path / "proc_cgroup") == (None, None)


def test_a_cgroup_path_with_dot_dot_inside_the_namespace_is_normalised(tmp_path: Path) -> None:
    write(tmp_path / "proc_cgroup", "0::/job/../job/step0\n")
    root = tmp_path / "root"
    write(root / "job" / "cpu.max", "200000 100000\n")
    assert cgroup_cpu_quota(root, tmp_path / "proc_cgroup") == 2.0


def test_a_v1_cpu_line_inside_the_namespace_is_read_when_the_v2_line_is_not(
    tmp_path: Path,
) -> None:
    write(tmp_path / "proc_cgroup", "3:cpu,cpuacct:/docker/abc\n0::/../elsewhere\n")
    write(tmp_path / "root" / "cpu,cpuacct" / "docker" / "abc" / "cpu.cfs_quota_us", "300000\n")
    write(tmp_path / "root" / "cpu,cpuacct" / "docker" / "abc" / "cpu.cfs_period_us", "100000\n")
    assert cgroup_cpu_quota(tmp_path / "root", tmp_path / "proc_cgroup") == 3.0


def test_tightest_of_nested_limits_wins(tmp_path: Path) -> None:
    write(tmp_path / "proc_cgroup", "0::/a/b\n")
    root = tmp_path / "root"
    write(root / "a" / "cpu.max", "800000 100000\n")
    write(root / "a" / "b" / "cpu.max", "300000 100000\n")
    assert cgroup_cpu_quota(root, tmp_path / "proc_cgroup") == 3.0


def test_usable_cpus_divides_unless_slurm_bound_each_task() -> None:
    from trainperf.limits import usable_cpus

    whole = HostLimits(64, 32, None, 32, 2**34, None, 2**33, None, None)
    bound = HostLimits(64, 8, None, 8, 2**34, None, 2**33, None, None)
    slurm = {"SLURM_NTASKS_PER_NODE": "4", "SLURM_CPUS_PER_TASK": "8"}
    assert usable_cpus(4, limits=whole, env={}) == 8  # torchrun: 4 ranks share 32 CPUs
    assert usable_cpus(4, limits=bound, env=slurm) == 8  # srun bound each task to its 8
    assert usable_cpus(4, limits=whole, env=slurm) == 8  # --cpu-bind=none: all 32, shared
    # One SLURM task that starts 4 ranks itself (trainperf.ddp.launch): they share its CPUs.
    one_task = {"SLURM_NTASKS_PER_NODE": "1", "SLURM_CPUS_PER_TASK": "8"}
    assert usable_cpus(4, limits=bound, env=one_task) == 2


def test_local_world_size_reads_torchrun_then_slurm() -> None:
    from trainperf.limits import local_world_size

    assert local_world_size({"LOCAL_WORLD_SIZE": "8", "SLURM_NTASKS_PER_NODE": "2"}) == 8
    assert local_world_size({"SLURM_NTASKS_PER_NODE": "4(x2)"}) == 4
    assert local_world_size({}) == 1
    with pytest.raises(ValueError, match=r"LOCAL_WORLD_SIZE must be a whole number >= 1.*'zero'"):
        local_world_size({"LOCAL_WORLD_SIZE": "zero"})
    with pytest.raises(ValueError, match=r"SLURM_NTASKS_PER_NODE.*got '0'"):
        local_world_size({"SLURM_NTASKS_PER_NODE": "0"})


def test_usable_cpus_reads_slurm_by_the_one_rule() -> None:
    from trainperf.limits import usable_cpus

    bound = HostLimits(64, 8, None, 8, 2**34, None, 2**33, None, None)
    env = {"SLURM_TASKS_PER_NODE": "4(x2),3", "SLURM_NODEID": "2", "SLURM_CPUS_PER_TASK": "8"}
    assert usable_cpus(3, limits=bound, env=env) == 8  # this node's 3 tasks, bound to 8 each
    assert usable_cpus(4, limits=bound, env=env) == 2  # 4 ranks are not this node's tasks
    with pytest.raises(ValueError, match=r"SLURM_CPUS_PER_TASK must be a whole number >= 1 .*'8c'"):
        usable_cpus(3, limits=bound, env={**env, "SLURM_CPUS_PER_TASK": "8c"})
    with pytest.raises(ValueError, match=r"SLURM_TASKS_PER_NODE must look like .*'4\(x'"):
        usable_cpus(3, limits=bound, env={**env, "SLURM_TASKS_PER_NODE": "4(x"})
    # One rank shares nothing, so nothing is read.
    assert usable_cpus(1, limits=bound, env={"SLURM_CPUS_PER_TASK": "8c"}) == 8


def test_local_world_size_takes_world_size_without_local_world_size() -> None:
    from trainperf.limits import local_world_size

    assert local_world_size({"WORLD_SIZE": "2"}) == 2
    # A job script's WORLD_SIZE=$SLURM_NTASKS is the whole job: SLURM's per-node count wins.
    assert local_world_size({"WORLD_SIZE": "16", "SLURM_NTASKS_PER_NODE": "8"}) == 8
    assert local_world_size({"SLURM_TASKS_PER_NODE": "4(x2),3", "SLURM_NODEID": "2"}) == 3


def test_an_unreadable_shm_says_why_and_a_missing_one_does_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def denied(path: object) -> object:
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(limits.shutil, "disk_usage", denied)
    got = host_limits(cgroup_root=tmp_path, proc_cgroup=tmp_path / "x", shm_path=tmp_path)
    assert got.shm_total is None and got.shm_free is None
    assert got.shm_error is not None and "EACCES" in got.shm_error
    assert "Permission denied" in got.shm_error
    assert "unreadable" in str(got) and "EACCES" in str(got)
    monkeypatch.undo()
    none = tmp_path / "no"
    missing = host_limits(cgroup_root=tmp_path, proc_cgroup=tmp_path / "x", shm_path=none)
    assert missing.shm_error is None and "/dev/shm: none" in str(missing)


def test_usable_cpus_of_a_numpy_count_is_a_python_int() -> None:
    # Before: usable_cpus(np.int64(2)) returned an np.int64 (32 // np.int64(2)).
    np = pytest.importorskip("numpy")
    whole = HostLimits(32, 32, None, 32, 2**34, None, 2**33, None, None)
    for count in (1, 2):
        cpus = limits.usable_cpus(np.int64(count), limits=whole, env={})
        assert type(cpus) is int and cpus == limits.usable_cpus(count, limits=whole, env={})


def psi(avg60: float) -> str:
    """A PSI file's text (``/proc/pressure/cpu``, a cgroup's ``cpu.pressure``)."""
    return (
        f"some avg10={avg60:.2f} avg60={avg60:.2f} avg300={avg60:.2f} total=1234\n"
        "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
    )


def write_psi(path: Path, avg60: float) -> Path:
    write(path, psi(avg60))
    return path


def test_cpu_pressure_is_the_cgroup_whose_cpu_limit_binds(tmp_path: Path) -> None:
    # A SLURM job given 8 CPUs: the quota is on the job, doctor runs in an idle step of its
    # own while the training step waits for cores. The job's pressure counts both steps.
    root = tmp_path / "root"
    write(tmp_path / "pc", "0::/job/step0\n")
    write(root / "job" / "cpu.max", "800000 100000\n")
    write_psi(root / "job" / "cpu.pressure", 45.0)
    write_psi(root / "job" / "step0" / "cpu.pressure", 0.5)
    write_psi(root / "cpu.pressure", 90.0)  # the host's root: other jobs too
    host = write_psi(tmp_path / "host", 90.0)
    assert cgroup_cpu_pressure(root, tmp_path / "pc", host) == (0.45, "cgroup")
    # A CPU set binds as a quota does, the outermost of equal ones (job and step both 8 CPUs).
    (root / "job" / "cpu.max").write_text("max 100000\n")
    write(root / "job" / "cpuset.cpus", "0-3,8-11\n")
    write(root / "job" / "step0" / "cpuset.cpus", "0-3,8-11\n")
    assert cgroup_cpu_pressure(root, tmp_path / "pc", host) == (0.45, "cgroup")
    # Without any limit the process's own cgroup is read.
    (root / "job" / "cpuset.cpus").write_text("\n")
    (root / "job" / "step0" / "cpuset.cpus").write_text("\n")
    assert cgroup_cpu_pressure(root, tmp_path / "pc", host) == (0.005, "cgroup")


def test_cpu_pressure_falls_back_to_the_hosts_then_to_none(tmp_path: Path) -> None:
    write(tmp_path / "pc", "0::/pod\n")
    (tmp_path / "root" / "pod").mkdir(parents=True)  # no PSI in the cgroup (cgroup v1, psi=0)
    host = write_psi(tmp_path / "pressure_cpu", 12.5)
    assert cgroup_cpu_pressure(tmp_path / "root", tmp_path / "pc", host) == (0.125, "host")
    missing = tmp_path / "missing"
    assert cgroup_cpu_pressure(tmp_path / "root", tmp_path / "pc", missing) is None
    write(host, "some avg10=1.00 avg60=junk avg300=1.00 total=1\n")  # malformed: unknown
    assert cgroup_cpu_pressure(tmp_path / "root", tmp_path / "pc", host) is None


def test_cpu_pressure_of_the_root_cgroup_is_host_wide(tmp_path: Path) -> None:
    # No container: /proc/self/cgroup is "0::/", so the cgroup read is the host's root, whose
    # cpu.pressure counts every thread on the host. Before: labelled "cgroup".
    write(tmp_path / "pc", "0::/\n")
    write(tmp_path / "root" / "cgroup.controllers", "cpu memory\n")
    write_psi(tmp_path / "root" / "cpu.pressure", 40.0)
    got = cgroup_cpu_pressure(tmp_path / "root", tmp_path / "pc", tmp_path / "missing")
    assert got == (0.4, "host")
    # The same on a hybrid host, where the v2 root is mounted at unified/.
    write(tmp_path / "pc", "1:cpu,cpuacct:/\n0::/\n")
    (tmp_path / "root" / "cpu.pressure").unlink()
    write_psi(tmp_path / "root" / "unified" / "cpu.pressure", 40.0)
    got = cgroup_cpu_pressure(tmp_path / "root", tmp_path / "pc", tmp_path / "missing")
    assert got == (0.4, "host")


def test_cpu_pressure_of_a_namespaced_containers_top_cgroup_is_its_own(tmp_path: Path) -> None:
    # Docker's private cgroup namespace also shows "0::/", but the mount is the container's
    # cgroup, which (not being the real root) has a cgroup.type file.
    write(tmp_path / "pc", "0::/\n")
    write(tmp_path / "root" / "cgroup.type", "domain\n")
    write_psi(tmp_path / "root" / "cpu.pressure", 40.0)
    got = cgroup_cpu_pressure(tmp_path / "root", tmp_path / "pc", tmp_path / "missing")
    assert got == (0.4, "cgroup")


def test_cpu_pressure_reads_the_unified_hierarchy_of_a_hybrid_host(tmp_path: Path) -> None:
    write(tmp_path / "pc", "4:cpu,cpuacct:/docker/abc\n0::/docker/abc\n")
    write(tmp_path / "root" / "cpu,cpuacct" / "docker" / "abc" / "cpu.cfs_quota_us", "-1\n")
    write_psi(tmp_path / "root" / "unified" / "docker" / "abc" / "cpu.pressure", 30.0)
    got = cgroup_cpu_pressure(tmp_path / "root", tmp_path / "pc", tmp_path / "missing")
    assert got == (0.3, "cgroup")


@pytest.mark.parametrize(
    ("name", "content"),
    [
        ("cpu.max", b"\xff\xfe 100000\n"),  # not UTF-8
        ("cpu.max", ("1" + "0" * 400 + " 1\n").encode()),  # past a float
        ("cpu.max", ("1 " + "9" * 400 + "\n").encode()),  # a share that rounds to 0
        ("cpu.max", "\uff11\uff10\uff10 1\n".encode()),  # full-width digits
        ("memory.max", b"\xff\n"),
        ("memory.max", "\u00b2\n".encode()),  # a digit to str.isdigit(), not to int()
        ("memory.max", ("9" * 5000 + "\n").encode()),  # past int()'s digit limit
        ("memory.current", "\u00b2\n".encode()),
        ("memory.stat", "inactive_file \u00b2\n".encode()),
        ("cpuset.cpus", "\u00b2\n".encode()),
        ("cpu.pressure", b"\xff\n"),
        ("cpu.pressure", b"full avg60=1.00\n\nsome avg60=2.00\n"),  # a blank line inside
    ],
)
def test_garbage_in_a_cgroup_file_reads_as_no_limit_not_an_error(
    tmp_path: Path, name: str, content: bytes
) -> None:
    # doctor reads these on whatever host it runs on: a malformed file is no limit, not a
    # traceback out of trainperf doctor.
    root = tmp_path / "root"
    write(root / "memory.max", "4294967296\n")
    write(root / "memory.current", "1073741824\n")
    (root / name).write_bytes(content)
    write(tmp_path / "pc", "0::/\n")
    got = host_limits(cgroup_root=root, proc_cgroup=tmp_path / "pc", shm_path=tmp_path)
    assert got.cpu_quota is None  # every cpu.max above is malformed
    assert got.memory_limit == (None if name == "memory.max" else 4294967296)
    pressure = cgroup_cpu_pressure(root, tmp_path / "pc", tmp_path / "none")
    # The blank line is skipped and the "some" line after it read; the rest give none.
    blank_line_inside = b"\n\n" in content
    assert pressure == ((0.02, "host") if blank_line_inside else None)  # the root cgroup


def test_a_proc_self_cgroup_that_is_not_utf8_is_read(tmp_path: Path) -> None:
    # cgroup names are bytes: a non-UTF-8 one must still lead to its directory.
    name = os.fsdecode(b"job\xff")
    write(tmp_path / "root" / name / "cpu.max", "150000 100000\n")
    (tmp_path / "pc").write_bytes(b"0::/job\xff\n")
    assert cgroup_cpu_quota(tmp_path / "root", tmp_path / "pc") == 1.5


def test_host_cpus_are_never_fewer_than_the_affinity_mask(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # os.cpu_count() can be None (counted as 1) or, under LXCFS, the container's view of
    # /sys while sched_getaffinity gives the host's mask: a host has at least those CPUs.
    monkeypatch.setattr(os, "cpu_count", lambda: None)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    got = host_limits(cgroup_root=tmp_path, proc_cgroup=tmp_path / "none", shm_path=tmp_path)
    assert (got.cpus_host, got.cpus_affinity, got.cpus) == (3, 3, 3)
