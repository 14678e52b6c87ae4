"""``diagnose(dist=True)`` (``doctor/_dist.py``): gathering, GPU branch on fakes, gloo for real."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.doctor._fakes import gpu, limits, write
from trainperf.doctor import (
    AllReduceSweep,
    Check,
    GpuLink,
    IommuGroup,
    LoopbackBaseline,
    SweepRow,
    diagnose,
)
from trainperf.errors import LaunchError
from trainperf.limits import host_limits

dist = importlib.import_module("trainperf.doctor._dist")
device_module = importlib.import_module("trainperf.device")
MiB = 2**20
DIST_NAMES = ["all_reduce", "nccl_shm", "nccl_env", "ifname", "hostname", "iommu", "p2p"]


def by_name(checks: Sequence[Check]) -> dict[str, Check]:
    return {c.name: c for c in checks}


# --------------------------------------------------------------------------- reading the host


def test_read_interfaces_has_loopback_with_its_address() -> None:
    interfaces = dist.read_interfaces()
    assert "127.0.0.1" in interfaces["lo"]


def test_resolve_a_name_and_a_name_that_is_not_there() -> None:
    assert "127.0.0.1" in (dist.resolve("127.0.0.1") or [])
    assert dist.resolve("no-such-host.invalid") is None  # .invalid never resolves (RFC 2606)


def test_read_iommu_groups_from_a_fake_sysfs(tmp_path: Path) -> None:
    groups, pci = tmp_path / "iommu_groups", tmp_path / "pci"
    write(groups / "2" / "type", "DMA-FQ\n")
    (groups / "2" / "devices" / "0000:17:00.0").mkdir(parents=True)
    (groups / "2" / "devices" / "0000:17:00.1").mkdir(parents=True)
    write(groups / "10" / "type", "identity\n")
    (groups / "10" / "devices" / "0000:00:01.0").mkdir(parents=True)
    (groups / "3" / "devices").mkdir(parents=True)  # an old kernel: no type file
    write(pci / "0000:17:00.0" / "vendor", "0x10de\n")
    write(pci / "0000:17:00.0" / "class", "0x030200\n")  # 3D controller: a GPU
    write(pci / "0000:17:00.1" / "vendor", "0x10de\n")
    write(pci / "0000:17:00.1" / "class", "0x040300\n")  # its audio function
    write(pci / "0000:00:01.0" / "vendor", "0x8086\n")
    assert dist.read_iommu_groups(groups, pci) == [
        IommuGroup("2", "DMA-FQ", ("0000:17:00.0",)),
        IommuGroup("3", None, ()),
        IommuGroup("10", "identity", ()),
    ]
    assert dist.read_iommu_groups(tmp_path / "absent", pci) == []


def fake_lspci(tmp_path: Path, text: str) -> Path:
    script = tmp_path / "bin" / "lspci"
    write(script, f"#!/bin/sh\ncat <<'END'\n{text}END\n")
    script.chmod(0o755)
    return script.parent


def test_read_acs_runs_lspci(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lspci = "00:01.0 PCI bridge: X\n\t\tACSCtl:\tSrcValid+ TransBlk-\n"
    monkeypatch.setenv("PATH", f"{fake_lspci(tmp_path, lspci)}{os.pathsep}{os.environ['PATH']}")
    assert dist.read_acs() == (["00:01.0"], "")


def test_read_acs_without_lspci_or_without_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    bridges, note = dist.read_acs()
    assert bridges is None and "lspci not installed" in note
    monkeypatch.undo()
    bin_dir = fake_lspci(tmp_path, "00:01.0 PCI bridge: X\n")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    bridges, note = dist.read_acs()
    assert bridges is None and "needs root" in note


def test_host_checks_name_a_bogus_nccl_socket_ifname() -> None:
    checks = dist.host_dist_checks(
        env={"NCCL_SOCKET_IFNAME": "bogus0"}, limits=host_limits(), gpus=[], ranks=2,
        backend="gloo", read_lspci=False,
    )  # fmt: skip
    assert [c.name for c in checks] == DIST_NAMES[1:-1]
    ifname = by_name(checks)["ifname"]
    assert ifname.verdict == "fail" and "'bogus0'" in ifname.value


def test_host_checks_size_dev_shm_for_the_ranks() -> None:
    checks = dist.host_dist_checks(
        env={}, limits=limits(shm_free=64 * MiB), gpus=[gpu(i) for i in range(8)], ranks=8,
        backend="nccl", read_lspci=False,
    )  # fmt: skip
    shm = by_name(checks)["nccl_shm"]
    assert shm.verdict == "fail" and "8 ranks" in shm.value


# --------------------------------------------------------------------------- the GPU branch, faked


class FakeSweeps:
    """Stands in for all_reduce_sweep: records each call, answers from a list."""

    def __init__(self, *answers: float | Exception) -> None:
        self.answers = list(answers)
        self.calls: list[dict[str, Any]] = []

    def __call__(self, **kwargs: Any) -> AllReduceSweep:
        self.calls.append(kwargs)
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        row = SweepRow(64 * MiB, 10, 0.001, answer, answer)
        setting = ", ".join(f"{k}={v}" for k, v in (kwargs.get("env") or {}).items())
        return AllReduceSweep(
            kwargs["backend"], kwargs["nprocs"], "cuda", (row,), setting or "as configured"
        )


@pytest.fixture
def gpu_host(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    gpus = [gpu(i) for i in range(4)]
    links = [GpuLink(i, 12, 25.0, 4, 16) for i in range(4)]  # 300 GB/s each way
    monkeypatch.setattr(dist, "read_gpu_links", lambda found: links)
    monkeypatch.setattr(dist, "read_p2p_blocked", lambda found: [])
    monkeypatch.setattr(dist, "read_acs", lambda run_lspci=True: ([], ""))
    return gpus


def run_dist(
    gpus: list[Any],
    sweeps: FakeSweeps,
    monkeypatch: pytest.MonkeyPatch,
    env: Mapping[str, str] | None = None,
) -> tuple[dict[str, Check], list[AllReduceSweep]]:
    monkeypatch.setattr(dist, "all_reduce_sweep", sweeps)
    checks, done = dist.dist_checks(env=dict(env or {}), limits=limits(), gpus=gpus)
    assert [c.name for c in checks] == DIST_NAMES
    return by_name(checks), done


def test_gpu_host_runs_nccl_per_gpu_then_without_p2p(
    gpu_host: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    sweeps = FakeSweeps(240.0, 20.0)
    checks, done = run_dist(gpu_host, sweeps, monkeypatch)
    first, second = sweeps.calls
    assert (first["backend"], first["nprocs"], first["env"]) == ("nccl", 4, None)
    assert second["env"] == {"NCCL_P2P_DISABLE": "1"} and second["sizes"] == (64 * MiB, 256 * MiB)
    assert (
        checks["all_reduce"].verdict == "ok"
        and "80% of NVLink 12 links" in checks["all_reduce"].value
    )
    assert (
        checks["p2p"].verdict == "ok"
        and "P2P 240.0 GB/s vs NCCL_P2P_DISABLE=1 20.0" in checks["p2p"].value
    )
    assert [s.setting for s in done] == ["as configured", "NCCL_P2P_DISABLE=1"]


def test_gpu_host_where_p2p_hangs_but_works_without(
    gpu_host: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    hang = LaunchError("rank 2 of 4 raised DistBackendError: Watchdog caught collective "
                       "operation timeout\nTraceback (most recent call last): ...")  # fmt: skip
    checks, done = run_dist(gpu_host, FakeSweeps(hang, 12.0), monkeypatch)
    assert checks["all_reduce"].verdict == "fail"
    assert "Watchdog caught" in checks["all_reduce"].value
    assert "Traceback" not in checks["all_reduce"].value
    assert checks["p2p"].verdict == "fail" and "NCCL_P2P_DISABLE=1" in checks["p2p"].fix
    assert len(done) == 1


@pytest.mark.parametrize(
    ("raw", "already_off"),
    [("1", True), ("01", True), ("1abc", True), ("0x1", True), ("0", False), ("00", False),
     ("abc", False), ("", False), ("99999999999999999999", False), ("2", False), ("-1", False)],
)  # fmt: skip
def test_the_p2p_rerun_reads_nccl_p2p_disable_as_nccl_does(raw: str, already_off: bool) -> None:
    overrides, other_is_off = dist._p2p_overrides({"NCCL_P2P_DISABLE": raw})
    assert other_is_off is not already_off
    assert overrides["NCCL_P2P_DISABLE"] == ("0" if already_off else "1")


def test_the_p2p_rerun_reads_an_old_style_p2p_level_as_nccl_does() -> None:
    assert dist._p2p_overrides({"NCCL_P2P_LEVEL": "00"})[1] is False  # level 0: LOC, P2P off
    assert dist._p2p_overrides({"NCCL_P2P_LEVEL": "02"})[1] is True


def test_gpu_host_with_p2p_already_off_compares_with_p2p_on(
    gpu_host: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    sweeps = FakeSweeps(12.0, 200.0)
    env = {"NCCL_P2P_DISABLE": "1"}
    checks, _ = run_dist(gpu_host, sweeps, monkeypatch, env)
    assert sweeps.calls[1]["env"] == {"NCCL_P2P_DISABLE": "0", "NCCL_P2P_LEVEL": None}
    assert "P2P 200.0 GB/s vs NCCL_P2P_DISABLE=1 12.0" in checks["p2p"].value
    assert checks["all_reduce"].verdict == "fail"  # 12 of 300 GB/s: 4 %
    assert checks["nccl_env"].verdict == "warn"


def test_one_gpu_runs_two_gloo_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    sweeps = FakeSweeps(0.5)
    monkeypatch.setattr(dist, "measure_loopback", lambda: LoopbackBaseline(1.0, 4.0))
    checks, _ = run_dist([gpu(0)], sweeps, monkeypatch)
    assert (sweeps.calls[0]["backend"], sweeps.calls[0]["nprocs"]) == ("gloo", 2)
    assert "50% of loopback TCP 1.00 GB/s" in checks["all_reduce"].value
    assert checks["p2p"].verdict == "skip"


@pytest.mark.parametrize("count", [0, 1])
def test_nccl_shm_is_a_skip_on_a_host_with_fewer_than_two_gpus(count: int) -> None:
    # The 2 gloo ranks are CPU ranks; NCCL runs one rank per GPU, so at most one here.
    checks = dist.host_dist_checks(
        env={}, limits=limits(shm_free=16 * MiB), gpus=[gpu(i) for i in range(count)],
        ranks=2, backend="gloo", read_lspci=False,
    )  # fmt: skip
    shm = by_name(checks)["nccl_shm"]
    assert shm.verdict == "skip" and "NCCL with 2 ranks" not in shm.fix
    assert f"{count} GPU" in shm.value and "/dev/shm 16 MiB free" in shm.value


# --------------------------------------------------------------------------- for real, on gloo


@pytest.mark.slow
def test_diagnose_dist_runs_gloo_ranks_end_to_end(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device_module, "gpus", lambda **_: [])  # a CPU host, even on a GPU one
    report = diagnose(env={"NCCL_SOCKET_IFNAME": "bogus0"}, dist=True)
    names = [c.name for c in report.checks]
    assert names[-len(DIST_NAMES) :] == DIST_NAMES and names[0] == "gpus"
    checks = by_name(report.checks)
    assert checks["all_reduce"].verdict in ("ok", "warn")  # speed depends on the host's load
    assert "gloo, 2 ranks on cpu: peak bus bandwidth" in checks["all_reduce"].value
    assert checks["ifname"].verdict == "fail" and "'bogus0'" in checks["ifname"].value
    (sweep,) = report.sweeps
    assert sweep.backend == "gloo" and [r.size_bytes for r in sweep.rows] == [
        MiB,
        4 * MiB,
        16 * MiB,
        64 * MiB,
    ]
    data = json.loads(json.dumps(report.to_dict()))
    assert data["all_reduce"][0]["world_size"] == 2
    assert str(report).count("all_reduce sweep: gloo, 2 ranks") == 1


def _can_mount_in_a_namespace() -> str | None:
    unshare = shutil.which("unshare")
    if unshare is None or sys.platform != "linux":
        return "needs unshare (util-linux) on Linux"
    probe = subprocess.run(
        [unshare, "-m", "--propagation", "private", "sh", "-c",
         "mount -t tmpfs -o size=1m tmpfs /mnt"],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    return None if probe.returncode == 0 else f"no private mount namespace: {probe.stderr.strip()}"


@pytest.mark.slow
def test_a_small_dev_shm_is_detected_in_a_private_mount_namespace() -> None:
    why = _can_mount_in_a_namespace()
    if why is not None:
        pytest.skip(why)
    # The tmpfs is mounted over /dev/shm in a mount namespace of its own: it vanishes with
    # the command, and the host's /dev/shm never changes.
    command = (
        "mount -t tmpfs -o size=16m tmpfs /dev/shm && "
        f"exec {sys.executable} -m trainperf doctor --dist --json"
    )
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # a CPU host: 2 gloo ranks
    done = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", command],
        capture_output=True, text=True, timeout=300, check=False, env=env,
    )  # fmt: skip
    document = json.loads(done.stdout)
    checks = {c["name"]: c for c in document["checks"]}
    # No GPU: NCCL would run no two ranks here, so its shared memory is not judged.
    assert checks["nccl_shm"]["verdict"] == "skip", checks["nccl_shm"]
    assert "/dev/shm 16 MiB free" in checks["nccl_shm"]["value"]
    assert checks["shm"]["verdict"] == "fail"  # DataLoader workers: under one batch
    assert done.returncode == 1
    assert host_limits().shm_total != 16 * MiB  # outside, /dev/shm is as it was


def test_launcher_variables_are_recognised() -> None:
    assert dist.launcher_running({}) is None
    assert dist.launcher_running({"LOCAL_RANK": "3"}) == "LOCAL_RANK=3"
    step = {"SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_STEP_ID": "0"}
    assert dist.launcher_running(step).startswith("SLURM_PROCID=1, SLURM_NTASKS=4")  # type: ignore[union-attr]
    assert dist.launcher_running({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}) is None


def test_a_slurm_process_counts_as_launched_as_launch_would_join_its_step() -> None:
    # Before: any SLURM_PROCID with SLURM_NTASKS != 1 skipped the sweep, also where
    # launch() starts its own ranks: `srun --preserve-env -n 1` in a job of 4
    # (SLURM_NTASKS is the job's there). The rule is launch()'s own (ddp._env.detect).
    step = {
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_STEP_ID": "0",
        "SLURM_NTASKS": "4",
        "SLURM_TASKS_PER_NODE": "4",
        "SLURM_JOB_ID": "7",
        "SLURM_JOB_NODELIST": "n1",
    }
    assert dist.launcher_running({**step, "SLURM_STEP_NUM_TASKS": "1"}) is None
    two = {**step, "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "2"}
    assert dist.launcher_running(two) == "SLURM_PROCID=0, SLURM_STEP_NUM_TASKS=2"
    # The batch script of a job of 4 (salloc's or sbatch's step id): launch() refuses it,
    # naming the fix; the sweep is skipped with that reason.
    script = dist.launcher_running({**step, "SLURM_STEP_ID": "4294967291"})
    assert script is not None and "launch() refuses it" in script and "srun" in script
    # Variables launch() cannot read: skipped too.
    assert dist.launcher_running({**two, "SLURM_STEP_NUM_TASKS": "two"}) is not None
    assert dist.launcher_running({"SLURM_NTASKS": "4"}) is None  # no task of a job
    assert dist.launcher_running({"RANK": " ", "LOCAL_RANK": ""}) is None  # blank, as launch()


def test_inside_a_launched_job_the_sweep_is_skipped(
    gpu_host: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    sweeps = FakeSweeps()
    checks, done = run_dist(gpu_host, sweeps, monkeypatch)
    assert sweeps.calls == [] and done == []
    assert (
        checks["all_reduce"].verdict == "skip"
        and "RANK=0, WORLD_SIZE=4" in checks["all_reduce"].value
    )
    assert "outside torchrun/srun" in checks["all_reduce"].fix
    assert checks["p2p"].verdict == "skip"


def test_host_checks_pass_on_why_dev_shm_could_not_be_read() -> None:
    unreadable = limits(shm_total=None, shm_free=None, shm_error="EACCES: Permission denied")
    checks = dist.host_dist_checks(
        env={}, limits=unreadable, gpus=[gpu(i) for i in range(8)], ranks=8, backend="nccl",
        read_lspci=False,
    )  # fmt: skip
    shm = by_name(checks)["nccl_shm"]
    assert shm.verdict == "warn" and "EACCES" in shm.value
