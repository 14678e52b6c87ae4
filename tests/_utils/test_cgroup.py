"""trainperf._utils.cgroup: the readers of the cgroup and PSI files, on fake trees.

Each reader takes the kernel's text as it is: what cannot be read, or is no figure, is None
(or 0 for ``inactive_file``), never an error.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath

import pytest

from trainperf._utils import cgroup


def _write(path: Path, text: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


def test_read_file_strips_and_keeps_bytes_that_are_not_utf8(tmp_path: Path) -> None:
    f = _write(tmp_path / "cgroup", b"0::/caf\xe9.slice\n")
    assert cgroup.read_file(f) == "0::/caf\udce9.slice"  # leads back to the directory
    assert cgroup.read_file(f, errors="replace") == "0::/caf\ufffd.slice"  # to be shown
    assert cgroup.read_file(tmp_path / "missing") is None
    assert cgroup.read_file(tmp_path) is None  # a directory: OSError, not raised


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", 0),
        ("100000", 100000),
        (None, None),
        ("", None),
        ("-1", None),  # v1's "no limit"
        ("max", None),
        ("1.5", None),
        ("\u00b2", None),  # isdigit() takes it, int() does not
        ("\uff11", None),  # a full-width 1: int() takes it, the kernel never writes it
        ("9" * 5000, None),  # past int()'s digit limit
    ],
)
def test_whole_takes_ascii_digits_only(text: str | None, expected: int | None) -> None:
    assert cgroup.whole(text) == expected


@pytest.mark.parametrize(
    ("rel", "expected"),
    [
        ("/", PurePosixPath()),
        ("/user.slice/job_1\n", PurePosixPath("user.slice/job_1")),
        ("/a/./b/../c", PurePosixPath("a/c")),
        ("/../../user.slice", None),  # outside the namespace's root
        ("/a/../../b", None),
    ],
)
def test_in_namespace(rel: str, expected: PurePosixPath | None) -> None:
    assert cgroup.in_namespace(rel) == expected


def test_cgroup_dirs_v2_on_a_host_leaf_first_to_the_mount(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    leaf = root / "system.slice" / "job.scope"
    leaf.mkdir(parents=True)
    proc = _write(tmp_path / "proc-cgroup", "0::/system.slice/job.scope\n")
    assert cgroup.cgroup_dirs("cpu", root, proc) == [leaf, leaf.parent, root]


def test_cgroup_dirs_v1_reads_the_controllers_hierarchy(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    leaf = root / "cpu,cpuacct" / "slurm" / "job_7"
    leaf.mkdir(parents=True)
    (root / "memory").mkdir()
    proc = _write(
        tmp_path / "proc-cgroup",
        "4:memory:/slurm/job_7\n3:cpu,cpuacct:/slurm/job_7\nmalformed\n",
    )
    assert cgroup.cgroup_dirs("cpu", root, proc) == [leaf, leaf.parent, leaf.parent.parent, root]


def test_cgroup_dirs_outside_the_namespace_skip_the_mount_point(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    root.mkdir()
    proc = _write(tmp_path / "proc-cgroup", "0::/../../user.slice\n")
    assert cgroup.cgroup_dirs("cpu", root, proc) == []
    # Unreadable: no leaves, the mount point only.
    assert cgroup.cgroup_dirs("cpu", root, tmp_path / "missing") == [root]


@pytest.mark.parametrize(
    ("cpu_max", "expected"),
    [
        ("200000 100000", 2.0),
        ("50000", 0.5),  # the period left out: 100000
        ("max 100000", None),
        ("0 100000", None),
        ("100000 0", None),  # a zero period is no limit, not a division by zero
        ("1" * 400 + " 1", None),  # past any float
        ("1 " + "1" * 400, None),  # rounds to 0
        ("junk", None),
    ],
)
def test_v2_cpu_share(cpu_max: str, expected: float | None) -> None:
    assert cgroup.v2_cpu_share(cpu_max) == expected


def test_cpu_share_v1() -> None:
    assert cgroup.cpu_share("150000\n", "100000\n") == 1.5
    assert cgroup.cpu_share("-1", "100000") is None  # v1's "no limit"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0-3,8", 5),
        ("7", 1),
        (" 0-1 , 4-5 ", 4),
        ("", None),  # v2: not set
        (None, None),
        ("3-1", None),
        ("a-b", None),
        ("0,,1", None),
        ("0-", None),  # was read as "0": one CPU
        ("-3", None),
    ],
)
def test_cpuset_size(text: str | None, expected: int | None) -> None:
    assert cgroup.cpuset_size(text) == expected


def test_cpu_limit_dir_picks_the_fewest_cpus_the_outermost_of_equals(tmp_path: Path) -> None:
    leaf, middle, top = tmp_path / "leaf", tmp_path / "middle", tmp_path / "top"
    _write(leaf / "cpu.max", "max 100000\n")
    _write(middle / "cpuset.cpus", "0-1\n")
    _write(top / "cpu.max", "400000 100000\n")
    assert cgroup.cpu_limit_dir([leaf, middle, top]) == middle
    _write(top / "cpu.max", "200000 100000\n")  # as few as middle's set: the outer binds
    assert cgroup.cpu_limit_dir([leaf, middle, top]) == top
    assert cgroup.cpu_limit_dir([leaf]) is None
    assert cgroup.cpu_limit_dir([]) is None


def test_in_root_cgroup(tmp_path: Path) -> None:
    assert cgroup.in_root_cgroup(_write(tmp_path / "root", "0::/\n"))
    assert not cgroup.in_root_cgroup(_write(tmp_path / "job", "0::/user.slice\n"))
    assert not cgroup.in_root_cgroup(_write(tmp_path / "v1", "3:cpu:/\n"))
    assert not cgroup.in_root_cgroup(tmp_path / "missing")


def test_is_root_cgroup_has_no_cgroup_type_file(tmp_path: Path) -> None:
    assert cgroup.is_root_cgroup(tmp_path)
    _write(tmp_path / "cgroup.type", "domain\n")
    assert not cgroup.is_root_cgroup(tmp_path)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("some avg10=1.00 avg60=25.50 avg300=3.00 total=1\nfull avg60=90.00\n", 0.255),
        ("full avg10=0.00 avg60=50.00 avg300=0.00 total=0\n", None),
        ("some avg10=1.00 avg60=junk\n", None),
        ("some avg60=150.00\n", None),
        ("\nsome avg60=0.00\n", 0.0),
    ],
)
def test_some_avg60(tmp_path: Path, text: str, expected: float | None) -> None:
    assert cgroup.some_avg60(_write(tmp_path / "cpu.pressure", text)) == expected


def test_some_avg60_of_an_unreadable_file(tmp_path: Path) -> None:
    assert cgroup.some_avg60(tmp_path / "missing") is None


def test_inactive_file(tmp_path: Path) -> None:
    _write(tmp_path / "memory.stat", "anon 5\ninactive_file 4096\nactive_file 1\n")
    assert cgroup.inactive_file(tmp_path, "inactive_file") == 4096
    assert cgroup.inactive_file(tmp_path, "total_inactive_file") == 0
    _write(tmp_path / "memory.stat", "inactive_file junk\n")
    assert cgroup.inactive_file(tmp_path, "inactive_file") == 0
    assert cgroup.inactive_file(tmp_path / "missing", "inactive_file") == 0
