"""trainperf.ddp._injob: launch inside a torchrun or SLURM job (the basic cases are in
test_launch.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch.distributed as dist

import trainperf.ddp as ddp
from tests.ddp._envs import TORCHRUN
from tests.ddp.test_launch import SCRIPT, _clean_env, _free_port, _run_programs, slurm_envs


def _destroys_group(value: str) -> str:
    dist.destroy_process_group()
    return value


@pytest.mark.timeout(60)
def test_launch_all_gathers_even_when_main_destroyed_the_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The gather used the group main had destroyed: "Default process group has not been
    # initialized".
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    env = {**TORCHRUN, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert ddp.launch_all(_destroys_group, "v", backend="gloo") == ["v"]
    assert ddp.launch(_destroys_group, "w", backend="gloo") == "w"
    assert not dist.is_initialized()


def _torchrun(port: int) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        f"--master-port={port}",
    ]  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("launcher", ["torchrun", "slurm"])
def test_every_rank_gathers_after_main_destroyed_the_group(launcher: str, tmp_path: Path) -> None:
    # Under torchrun the agent keeps the store: a group made again on its first keys read
    # the old group's addresses and failed to connect. Under SLURM rank 0 hosts the store.
    port = _free_port()
    script = [str(SCRIPT), "destroys", str(tmp_path)]
    if launcher == "torchrun":
        runs = _run_programs([_torchrun(port) + script], [_clean_env()], timeout=100)
    else:
        runs = _run_programs([[sys.executable, *script]] * 2, slurm_envs(port), timeout=100)
    for run in runs:
        assert run.returncode == 0, run.stdout
    printed = [line for run in runs for line in run.stdout.splitlines() if "results" in line]
    assert len(printed) == 2, [run.stdout for run in runs]
    assert all(line.endswith("results [0, 10]") for line in printed), printed
