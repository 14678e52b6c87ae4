"""trainperf.ddp: launching, environment detection and the helpers ranks use.

Faults (a rank raising, dying, hanging; signals to the launcher) are in test_ddp_faults.py.
Multi-process tests use gloo on CPU; spawn costs a few seconds per launch here, so each
launch checks several things at once.
"""

from __future__ import annotations

import functools
import json
import os
import pickle
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import trainperf.ddp as ddp
from tests.ddp import _workers as workers
from tests.ddp._distributed import FORK, fast_start_method, spawn
from trainperf.ddp import _env, _launch
from trainperf.errors import DeviceError, LaunchError
from trainperf.limits import usable_cpus

TESTS = Path(__file__).parent


def _gloo_fast() -> dict[str, Any]:
    return {"backend": "gloo", "start_method": fast_start_method()}


SCRIPT = TESTS / "_script.py"


def _free_port() -> int:
    # Only for tests that must hand the same port to several programs up front.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _clear_launcher_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name in _env.TORCHRUN_VARS or name.startswith("SLURM_") or name == "LOCAL_WORLD_SIZE":
            monkeypatch.delenv(name)


@pytest.fixture(autouse=True)
def _no_launcher_env(monkeypatch: pytest.MonkeyPatch) -> None:
    _clear_launcher_env(monkeypatch)


# ------------------------------------------------------------------ launch: the happy path


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("world", "start_method"), [(2, FORK), (4, "spawn")])
def test_ddp_training_matches_single_process_on_the_concatenated_batch(
    world: int, start_method: str
) -> None:
    results = spawn(workers.train_and_reduce, world, start_method=start_method)

    assert sorted(results) == list(range(world))
    reference = workers.reference_training(world)
    for rank, r in results.items():
        assert r["rank"] == rank and r["local_rank"] == rank and r["world_size"] == world
        assert r["is_main"] is (rank == 0)
        assert r["wrapped"] == "DistributedDataParallel"
        assert r["env"] == {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
        }
        assert r["master_port"] == results[0]["master_port"]
        assert r["pid"] != os.getpid()
        if "OMP_NUM_THREADS" not in os.environ:
            assert r["threads"] == usable_cpus(world)
        assert r["steps"] == workers.EPOCHS * workers.N_SAMPLES // (workers.BATCH * world)
        assert r["next_epoch"] == workers.EPOCHS
        assert r["sum"] == world * (world + 1) / 2
        assert r["mean"] == pytest.approx([(world - 1) / 2, 10 * (world - 1) / 2])
        for name, value in r["params"].items():
            torch.testing.assert_close(value, results[0]["params"][name], rtol=0, atol=0)
            torch.testing.assert_close(value, reference[name], rtol=1e-5, atol=1e-6)
    # The reference really moved away from the initial weights.
    initial = workers.make_model().state_dict()
    assert not torch.allclose(reference["0.weight"], initial["0.weight"])
    # The launcher's own process is untouched.
    assert not dist.is_initialized()
    assert "RANK" not in os.environ


@pytest.mark.timeout(60)
def test_launch_returns_rank0_value_and_passes_args() -> None:
    assert ddp.launch(workers.add, 2, 3, scale=10, nprocs=2, **_gloo_fast()) == 50
    assert ddp.launch_all(workers.add, 2, 3, nprocs=3, **_gloo_fast()) == [5, 10, 15]
    if torch.cuda.device_count() == 0:
        # Defaults on a machine without GPUs: one gloo rank.
        defaults = ddp.launch_all(workers.backend_and_group, start_method=fast_start_method())
        assert defaults == [("gloo", 1)]


@pytest.mark.timeout(60)
def test_launch_binds_the_given_master_port_and_fails_fast_when_taken(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    port = _free_port()
    monkeypatch.setenv("MASTER_PORT", str(port))
    results = spawn(workers.train_and_reduce, 2, start_method="fork")
    assert results[1]["master_port"] == str(port)

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        monkeypatch.setenv("MASTER_PORT", str(busy))
        with pytest.raises(LaunchError, match=rf"cannot listen on 127\.0\.0\.1:{busy}"):
            ddp.launch(workers.add, 1, 2, nprocs=2, **_gloo_fast())

    monkeypatch.setenv("MASTER_PORT", "http")
    with pytest.raises(ValueError, match="MASTER_PORT must be an integer"):
        ddp.launch(workers.add, 1, 2, nprocs=2, **_gloo_fast())


# --------------------------------------------------------- launch: refused before starting


def _nested_main() -> None:
    pass


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"nprocs": 0}, ValueError, r"nprocs must be an integer >= 1, got 0"),
        ({"nprocs": -2}, ValueError, r"nprocs must be an integer >= 1, got -2"),
        ({"nprocs": "2"}, ValueError, r"nprocs must be an integer >= 1, got '2'"),
        ({"nprocs": True}, ValueError, r"nprocs must be an integer >= 1, got True"),
        ({"backend": "mpi"}, ValueError, r"backend must be one of \('nccl', 'gloo'\)"),
        ({"start_method": "forkserver"}, ValueError, r"start_method must be one of"),
        ({"timeout": timedelta(0)}, ValueError, r"timeout must be a positive timedelta"),
        ({"timeout": -1.0}, ValueError, r"timeout must be a positive timedelta"),
        ({"max_restarts": -1}, ValueError, r"max_restarts must be an integer >= 0"),
    ],
)
def test_launch_rejects_bad_options(kwargs: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        ddp.launch(workers.add, 1, 2, **{"start_method": "fork", "backend": "gloo", **kwargs})


def test_launch_rejects_what_spawn_cannot_send(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(TypeError, match="main must be callable, got int"):
        ddp.launch(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"define main at module top level.*start_method='fork'"):
        ddp.launch(lambda: None, nprocs=2, backend="gloo")

    def local() -> None:
        pass

    with pytest.raises(ValueError, match=r"'.*local' cannot be pickled.*module top level"):
        ddp.launch(local, nprocs=2, backend="gloo")
    with pytest.raises(ValueError, match=r"args and kwargs of main|cannot be pickled"):
        ddp.launch(workers.add, 1, lambda: 2, nprocs=2, backend="gloo")

    # A function from a notebook/REPL pickles by name but spawned workers cannot import it.
    main_module = sys.modules["__main__"]
    monkeypatch.setattr(_nested_main, "__module__", "__main__")
    monkeypatch.setattr(_nested_main, "__qualname__", "repl_main")
    monkeypatch.setattr(main_module, "repl_main", _nested_main, raising=False)
    monkeypatch.delattr(main_module, "__file__", raising=False)
    with pytest.raises(ValueError, match=r"interactive session.*start_method='fork'"):
        ddp.launch(_nested_main, nprocs=2, backend="gloo")


def test_launch_refuses_nccl_without_enough_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ValueError, match=r"backend='nccl' needs CUDA GPUs.*backend='gloo'"):
        ddp.launch(workers.add, 1, 2, backend="nccl")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"nprocs=2 with backend='nccl' needs 2 GPUs, but 1 is"):
        ddp.launch(workers.add, 1, 2, nprocs=2, backend="nccl")
    with pytest.raises(ValueError, match=r"nprocs=2 with backend='nccl' needs 2 GPUs"):
        ddp.launch(workers.add, 1, 2, nprocs=2)  # auto picks nccl when a GPU is visible


def test_fork_refused_where_the_platform_has_none(monkeypatch: pytest.MonkeyPatch) -> None:
    import multiprocessing

    monkeypatch.setattr(multiprocessing, "get_all_start_methods", lambda: ["spawn"])
    with pytest.raises(ValueError, match=r"start_method='fork' is not available"):
        ddp.launch(workers.add, 1, 2, nprocs=2, backend="gloo", start_method="fork")


def test_a_local_rank_without_its_gpu_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from trainperf.ddp._worker import rank_device

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert rank_device(1) == torch.device("cuda", 1)
    with pytest.raises(ValueError, match=r"local rank 2 has no GPU: only 2 visible"):
        rank_device(2)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # one GPU bound per task
    assert rank_device(3) == torch.device("cuda", 0)


def test_fork_refused_once_cuda_is_initialised(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(_launch, "cuda_driver_loaded", lambda: True)
    with pytest.raises(DeviceError, match=r"backend='nccl': CUDA's driver is already loaded"):
        ddp.launch(workers.add, 1, 2, nprocs=2, backend="nccl", start_method="fork")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(DeviceError, match=r"start_method='fork' cannot be used once CUDA"):
        ddp.launch(workers.add, 1, 2, nprocs=2, backend="gloo", start_method="fork")


# -------------------------------------------------------------- environment detection


TORCHRUN = {
    "RANK": "3",
    "WORLD_SIZE": "4",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "10.1.2.3",
    "MASTER_PORT": "29500",
}
SLURM = {
    "SLURM_PROCID": "5",
    "SLURM_NTASKS": "8",
    "SLURM_LOCALID": "1",
    "SLURM_TASKS_PER_NODE": "4(x2)",
    "SLURM_JOB_NODELIST": "node[07-08],gpu3",
    "SLURM_JOB_ID": "4242",
}


def test_detect_torchrun_and_slurm() -> None:
    assert _env.detect({}) is None
    assert _env.detect({"MASTER_PORT": "1234"}) is None  # choosing a port is not a job
    assert _env.detect(TORCHRUN) == _env.DistributedEnv("torchrun", 3, 4, 1, 2, "10.1.2.3", 29500)
    assert _env.detect(SLURM) == _env.DistributedEnv(
        "slurm", 5, 8, 1, 4, "node07", _env.SLURM_PORT_BASE + 4242
    )
    assert _env.detect({**SLURM, "MASTER_PORT": "23456", "MASTER_ADDR": "head"}) == (
        _env.DistributedEnv("slurm", 5, 8, 1, 4, "head", 23456)
    )
    step = {**SLURM, "SLURM_STEP_NODELIST": "gpu[10-11]", "SLURM_NTASKS_PER_NODE": "3"}
    assert _env.detect(step) == _env.DistributedEnv(
        "slurm", 5, 8, 1, 3, "gpu10", _env.SLURM_PORT_BASE + 4242
    )
    # A one-task SLURM job is a workstation: launch spawns locally.
    assert _env.detect({**SLURM, "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}) is None
    # torchrun inside an srun step: torchrun's variables win.
    assert _env.detect({**SLURM, **TORCHRUN}).source == "torchrun"  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"RANK": "0"}, r"RANK=0 is set but WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT"),
        ({k: v for k, v in TORCHRUN.items() if k != "MASTER_PORT"}, r"but MASTER_PORT is not"),
        ({**TORCHRUN, "RANK": "4"}, r"RANK must be < WORLD_SIZE=4, got RANK=4"),
        ({**TORCHRUN, "WORLD_SIZE": "four"}, r"WORLD_SIZE must be an integer, got 'four'"),
        ({**TORCHRUN, "WORLD_SIZE": "0"}, r"WORLD_SIZE must be >= 1"),
        ({**TORCHRUN, "LOCAL_RANK": "2"}, r"LOCAL_RANK must be < LOCAL_WORLD_SIZE=2"),
        ({**TORCHRUN, "MASTER_PORT": "70000"}, r"MASTER_PORT must be a port in 1\.\.65535"),
        ({"SLURM_PROCID": "0"}, r"SLURM_NTASKS is not set"),
        ({k: v for k, v in SLURM.items() if k != "SLURM_LOCALID"}, r"SLURM_LOCALID is not set"),
        ({**SLURM, "SLURM_PROCID": "8"}, r"SLURM_PROCID must be < SLURM_NTASKS=8"),
        ({k: v for k, v in SLURM.items() if k != "SLURM_JOB_NODELIST"}, r"SLURM_JOB_NODELIST"),
        ({k: v for k, v in SLURM.items() if k != "SLURM_JOB_ID"}, r"SLURM_JOB_ID or MASTER_PORT"),
        ({**SLURM, "SLURM_JOB_ID": "x1"}, r"SLURM_JOB_ID must be an integer, got 'x1'"),
        ({**SLURM, "SLURM_TASKS_PER_NODE": "many"}, r"SLURM_TASKS_PER_NODE must look like"),
        ({**SLURM, "SLURM_JOB_NODELIST": "node[1-2"}, r"unbalanced '\['"),
    ],
)
def test_detect_rejects_inconsistent_environments(env: dict[str, str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _env.detect(env)


def test_expand_nodelist() -> None:
    assert ddp.expand_nodelist("node[01-04,07],gpu3") == [
        "node01",
        "node02",
        "node03",
        "node04",
        "node07",
        "gpu3",
    ]
    assert ddp.expand_nodelist("a1,b[9-10]") == ["a1", "b9", "b10"]
    assert ddp.expand_nodelist("r[1-2]-n[1,3]") == ["r1-n1", "r1-n3", "r2-n1", "r2-n3"]
    with pytest.raises(ValueError, match=r"unbalanced '\]'"):
        ddp.expand_nodelist("node1-2]")
    with pytest.raises(ValueError, match=r"bad range 'a-b'"):
        ddp.expand_nodelist("node[a-b]")
    with pytest.raises(ValueError, match="SLURM node list is empty"):
        ddp.expand_nodelist(" , ")


def _in_process_main(tag: str) -> dict[str, Any]:
    return {
        "tag": tag,
        "pid": os.getpid(),
        "initialised": dist.is_initialized(),
        "world": ddp.world_size(),
        "rank": ddp.rank(),
        "env": os.environ.get("MASTER_ADDR"),
    }


@pytest.mark.timeout(60)
def test_launch_inside_a_job_runs_main_in_this_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # leave this process's thread count alone
    port = _free_port()
    env = {**TORCHRUN, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    result = ddp.launch(_in_process_main, "t", nprocs=8, backend="gloo")
    assert result == {
        "tag": "t",
        "pid": os.getpid(),
        "initialised": True,
        "world": 1,
        "rank": 0,
        "env": "127.0.0.1",
    }
    assert not dist.is_initialized()  # destroyed afterwards
    assert ddp.launch_all(_in_process_main, "u", backend="gloo")[0]["tag"] == "u"

    monkeypatch.delenv("MASTER_ADDR")
    with pytest.raises(ValueError, match=r"but MASTER_ADDR is not"):
        ddp.launch(_in_process_main, "t")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("WORLD_SIZE", "0")
    with pytest.raises(ValueError, match=r"WORLD_SIZE must be >= 1"):
        ddp.launch(_in_process_main, "t")


def _run_programs(
    commands: list[list[str]], envs: list[dict[str, str]], timeout: float
) -> list[subprocess.CompletedProcess[str]]:
    procs = [
        subprocess.Popen(
            cmd, env=env, cwd=TESTS, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for cmd, env in zip(commands, envs, strict=True)
    ]
    done = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(p.args, p.returncode, out))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return done


def _clean_env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in _env.TORCHRUN_VARS and not k.startswith(("SLURM_", "PYTEST_"))
    }
    env["PYTHONUNBUFFERED"] = "1"
    return env


@pytest.mark.timeout(150)
def test_two_torchrun_nodes_on_loopback_with_c10d_rendezvous(tmp_path: Path) -> None:
    port = _free_port()
    command = [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes=2", "--nproc-per-node=2",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=trainperf-test",
        "--max-restarts=0", "--monitor-interval=0.5",
        str(SCRIPT), "all_reduce", str(tmp_path),
    ]  # fmt: skip
    runs = _run_programs([command, command], [_clean_env(), _clean_env()], timeout=120)
    for run in runs:
        assert run.returncode == 0, run.stdout
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert [r["rank"] for r in records] == [0, 1, 2, 3]
    assert {r["world_size"] for r in records} == {4}
    assert sorted(r["local_rank"] for r in records) == [0, 0, 1, 1]
    assert {r["sum"] for r in records} == {10.0}
    assert len({r["pid"] for r in records}) == 4


@pytest.mark.timeout(90)
def test_slurm_job_step_simulated_by_two_programs(tmp_path: Path) -> None:
    port = _free_port()
    envs = []
    for task in range(2):
        env = _clean_env()
        env.update(
            SLURM_PROCID=str(task),
            SLURM_NTASKS="2",
            SLURM_LOCALID=str(task),
            SLURM_TASKS_PER_NODE="2",
            SLURM_JOB_NODELIST="localhost",
            SLURM_JOB_ID="99",
            MASTER_PORT=str(port),
        )
        envs.append(env)
    command = [sys.executable, str(SCRIPT), "all_reduce", str(tmp_path)]
    runs = _run_programs([command, command], envs, timeout=60)
    for run in runs:
        assert run.returncode == 0, run.stdout
        assert "result 3" in run.stdout
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [(r["rank"], r["world_size"], r["sum"]) for r in records] == [(0, 2, 3.0), (1, 2, 3.0)]
    # Each task ran main itself: no workers were spawned below it.
    assert {r["pid"] for r in records}.isdisjoint({os.getpid()})


# ---------------------------------------------------------------------------- helpers


def test_helpers_without_a_process_group(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (ddp.rank(), ddp.local_rank(), ddp.world_size(), ddp.is_main_process()) == (
        0,
        0,
        1,
        True,
    )
    ddp.barrier()
    x = torch.tensor([1, 2])
    mean = ddp.all_reduce_mean(x)
    assert mean.dtype == torch.get_default_dtype() and mean.tolist() == [1.0, 2.0]
    y = torch.tensor([0.5])
    assert ddp.all_reduce_mean(y) is not y
    with pytest.raises(TypeError, match=r"all_reduce_mean needs a torch\.Tensor, got float"):
        ddp.all_reduce_mean(0.5)  # type: ignore[arg-type]

    ddp.print0("hello", 1)
    assert capsys.readouterr().out == "hello 1\n"
    # Before the process group exists (torchrun sets these), the environment says who we are.
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert (ddp.rank(), ddp.local_rank(), ddp.world_size(), ddp.is_main_process()) == (
        1,
        1,
        2,
        False,
    )
    ddp.print0("hidden")
    assert capsys.readouterr().out == ""
    monkeypatch.setenv("RANK", "garbage")
    assert ddp.rank() == 0

    model = nn.Linear(3, 1)
    assert ddp.wrap_model(model) is model
    with pytest.raises(ValueError, match=r"already wrapped in DataParallel.*unwrap_model"):
        ddp.wrap_model(nn.DataParallel(model))


def test_helpers_in_a_one_rank_process_group(capsys: pytest.CaptureFixture[str]) -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        net = ddp.wrap_model(nn.Linear(3, 1), find_unused_parameters=True)
        assert isinstance(net, nn.parallel.DistributedDataParallel)
        assert net.device_ids is None  # CPU: DDP refuses device_ids
        assert net.find_unused_parameters is True
        with pytest.raises(ValueError, match="already wrapped in DistributedDataParallel"):
            ddp.wrap_model(net)
        assert ddp.all_reduce_mean(torch.tensor([4.0, 6.0])).tolist() == [4.0, 6.0]
        ddp.barrier()
        ddp.print0("only", "me", sep="-")
        assert capsys.readouterr().out == "only-me\n"
    finally:
        dist.destroy_process_group()


def test_distributed_loader_shards_and_reshuffles(monkeypatch: pytest.MonkeyPatch) -> None:
    data = list(range(10))
    monkeypatch.setenv("WORLD_SIZE", "2")
    shards = {}
    for r in (0, 1):
        monkeypatch.setenv("RANK", str(r))
        loader = ddp.distributed_loader(data, batch_size=5, shuffle=False)
        shards[r] = [b.tolist() for b in loader]
    assert shards == {0: [[0, 2, 4, 6, 8]], 1: [[1, 3, 5, 7, 9]]}

    monkeypatch.setenv("RANK", "0")
    loader = ddp.distributed_loader(data, batch_size=5, seed=3)
    assert isinstance(loader, torch.utils.data.DataLoader) and loader.epoch == 0
    epoch0 = [b.tolist() for b in loader]
    epoch1 = [b.tolist() for b in loader]
    assert loader.epoch == 2
    assert epoch0 != epoch1  # the shuffle changes by itself every epoch
    loader.set_epoch(0)
    assert [b.tolist() for b in loader] == epoch0  # and can be replayed
    other_seed = [b.tolist() for b in ddp.distributed_loader(data, batch_size=5, seed=4)]
    assert other_seed != epoch0

    # Padding: 5 samples over 2 ranks gives each rank 3 unless drop_last.
    assert len(list(ddp.distributed_loader(list(range(5)), 1, shuffle=False))) == 3
    assert len(list(ddp.distributed_loader(list(range(5)), 1, drop_last=True))) == 2

    with pytest.raises(ValueError, match="batch_size must be an integer >= 1, got 0"):
        ddp.distributed_loader(data, 0)
    with pytest.raises(ValueError, match="remove batch_sampler, sampler"):
        ddp.distributed_loader(data, 2, sampler=None, batch_sampler=None)
    with pytest.raises(ValueError, match="epoch must be an integer >= 0, got -1"):
        loader.set_epoch(-1)


def _record_worker(worker_id: int) -> None:
    info = torch.utils.data.get_worker_info()
    assert info is not None
    info.dataset.seen = worker_id  # type: ignore[union-attr]


class _Square(torch.utils.data.Dataset[int]):
    seen = -1

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        return i * i * 100 + self.seen


@pytest.mark.timeout(60)
def test_distributed_loader_workers_keep_the_users_worker_init_fn() -> None:
    loader = ddp.distributed_loader(
        _Square(), batch_size=4, shuffle=False, num_workers=1, worker_init_fn=_record_worker
    )
    # The user's worker_init_fn ran in the worker (seen = 0), after ours.
    assert [b.tolist() for b in loader] == [[0, 100, 400, 900]]
    assert loader.worker_init_fn is not _record_worker  # wrapped to die with the rank
    assert pickle.loads(pickle.dumps(loader.worker_init_fn)).user_fn is _record_worker


def test_data_parallel_rejects_an_empty_device_list_with_or_without_cuda() -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"device_ids must name at least one GPU, got \[\]"):
        ddp.data_parallel(model, device_ids=[])
    with pytest.raises(ValueError, match=r"must name at least one GPU.*pass None"):
        ddp.data_parallel(model, device_ids=())


@pytest.mark.skipif(torch.cuda.device_count() > 0, reason="checks the behaviour without GPUs")
def test_data_parallel_without_gpus() -> None:
    model = nn.Linear(2, 2)
    assert ddp.data_parallel(model) is model
    with pytest.raises(ValueError, match=r"device_ids=\[0\] given, but no CUDA GPU is visible"):
        ddp.data_parallel(model, device_ids=[0])


@pytest.mark.requires_cuda
def test_data_parallel_moves_the_model_to_the_first_device_and_warns_once() -> None:
    import trainperf.ddp._helpers as helpers

    helpers._dp_warned = False
    last = torch.cuda.device_count() - 1
    with pytest.warns(UserWarning, match="DistributedDataParallel is faster"):
        dp = ddp.data_parallel(nn.Linear(2, 2), device_ids=[last])
    assert isinstance(dp, nn.DataParallel)
    assert next(dp.parameters()).device == torch.device("cuda", last)
    out = dp(torch.randn(4, 2, device=f"cuda:{last}"))
    assert out.shape == (4, 2)
    with pytest.raises(ValueError, match="must name at least one GPU"):
        ddp.data_parallel(nn.Linear(2, 2), device_ids=[])
    with pytest.raises(ValueError, match=r"are not visible GPUs"):
        ddp.data_parallel(nn.Linear(2, 2), device_ids=[last + 1])


@pytest.mark.requires_cuda
@pytest.mark.timeout(120)
def test_nccl_launch_on_every_visible_gpu() -> None:
    n = torch.cuda.device_count()
    results = spawn(workers.train_and_reduce, n, backend="nccl")
    reference = workers.reference_training(n)
    for rank, r in results.items():
        assert r["sum"] == n * (n + 1) / 2
        for name, value in r["params"].items():
            torch.testing.assert_close(value, reference[name], rtol=1e-4, atol=1e-5)
        assert r["wrapped"] == "DistributedDataParallel" and r["rank"] == rank


def test_module_exports() -> None:
    assert ddp.__all__ == sorted(ddp.__all__)
    for name in ddp.__all__:
        assert hasattr(ddp, name), name
    # Picklable by reference: the workers need these.
    assert pickle.loads(pickle.dumps(functools.partial(workers.add, 1))).func is workers.add
