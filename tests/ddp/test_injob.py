"""trainperf.ddp._injob: launch inside a torchrun or SLURM job (the basic cases are in
test_launch.py)."""

from __future__ import annotations

import itertools
import operator
import re
import sys
import warnings
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

import trainperf.ddp as ddp
from tests.ddp._envs import TORCHRUN
from tests.ddp.test_launch import SCRIPT, _clean_env, _free_port, _run_programs, slurm_envs
from trainperf.ddp import _injob, _launch_checks
from trainperf.ddp._env import DistributedEnv
from trainperf.ddp._injob import _gather_store, _must_regroup
from trainperf.errors import DeviceError, LaunchError


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


def _one_rank_job(monkeypatch: pytest.MonkeyPatch) -> None:
    """The variables torchrun gives the one rank of a one-process job."""
    env = {**TORCHRUN, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), OMP_NUM_THREADS="2")
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def _returns_a_lambda() -> object:
    return lambda: 1


@pytest.mark.timeout(60)
def test_a_value_launch_all_cannot_gather_is_refused_on_its_rank(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # all_gather_object failed inside the gather ("Can't pickle local object"), leaving the
    # other ranks in it: gloo said "Connection reset by peer", NCCL waited for the timeout.
    _one_rank_job(monkeypatch)
    with pytest.raises(TypeError, match=r"main returned a value that cannot be pickled to gat"):
        ddp.launch_all(_returns_a_lambda, backend="gloo")
    assert not dist.is_initialized()


def _exits(code: object) -> int:
    sys.exit(code)  # type: ignore[arg-type]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("code", [0, None])
def test_a_clean_sys_exit_in_main_counts_as_returning_none_inside_a_job(
    code: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    # launch's own spawner counts sys.exit(0) as returning None; inside a job it was a
    # failure: SystemExit left launch_all, and the other ranks said "main failed on rank(s)
    # [1] ... raised SystemExit: 0".
    _one_rank_job(monkeypatch)
    assert ddp.launch_all(_exits, code, backend="gloo") == [None]
    assert ddp.launch(_exits, code, backend="gloo") is None
    with pytest.raises(SystemExit, match=r"^3$"):
        ddp.launch_all(_exits, 3, backend="gloo")  # a failure, as before
    assert not dist.is_initialized()


@pytest.mark.timeout(60)
def test_sys_exit_0_0_in_main_is_a_failure_inside_a_job(monkeypatch: pytest.MonkeyPatch) -> None:
    # 0.0 == 0, so it counted as returning None; Python itself exits 1 for sys.exit(0.0).
    _one_rank_job(monkeypatch)
    with pytest.raises(SystemExit, match=r"^0\.0$"):
        ddp.launch_all(_exits, 0.0, backend="gloo")
    assert ddp.launch_all(_exits, False, backend="gloo") == [None]
    assert not dist.is_initialized()


def _keywords(
    watch: object = None, main: object = None, fn: object = None, args: object = None
) -> dict[str, object]:
    return {"watch": watch, "main": main, "fn": fn, "args": args}


@pytest.mark.timeout(60)
def test_main_takes_keywords_named_like_the_wrappers_parameters_inside_a_job(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # launch(train, watch=True) failed with "_watched() got multiple values for argument
    # 'watch'" (main ran under functools.partial(_watched, watch, main)), and main= with
    # "launch() got multiple values for argument 'main'".
    _one_rank_job(monkeypatch)
    given = {"watch": True, "main": 1, "fn": 2, "args": 3}
    assert ddp.launch(_keywords, backend="gloo", **given) == given
    assert ddp.launch_all(_keywords, backend="gloo", **given) == [given]
    assert not dist.is_initialized()


def _torchrun(port: int) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        f"--master-port={port}",
    ]  # fmt: skip


def _run_script(launcher: str, mode: str, tmp_path: Path) -> list[str]:
    """Run ``_script.py MODE`` on 2 ranks under ``launcher``; the lines they printed."""
    port = _free_port()
    script = [str(SCRIPT), mode, str(tmp_path)]
    if launcher == "torchrun":
        runs = _run_programs([_torchrun(port) + script], [_clean_env()], timeout=100)
    else:
        runs = _run_programs([[sys.executable, *script]] * 2, slurm_envs(port), timeout=100)
    for run in runs:
        assert run.returncode == 0, run.stdout
    return [line for run in runs for line in run.stdout.splitlines() if "results" in line]


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("launcher", ["torchrun", "slurm"])
def test_every_rank_gathers_after_main_destroyed_the_group(launcher: str, tmp_path: Path) -> None:
    # Under torchrun the agent keeps the store: a group made again on its first keys read
    # the old group's addresses and failed to connect. Under SLURM rank 0 hosts the store.
    printed = _run_script(launcher, "destroys", tmp_path)
    assert len(printed) == 2, printed
    assert all(line.endswith("results [0, 10]") for line in printed), printed


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("launcher", ["torchrun", "slurm"])
def test_every_rank_gathers_after_main_destroyed_the_group_on_rank_0_only(
    launcher: str, tmp_path: Path
) -> None:
    # Rank 0 made a group again (waiting on the store for rank 1) while rank 1 gathered on
    # the old group: rank 1 failed with "Connection reset by peer" and rank 0 waited for the
    # whole timeout (30 minutes by default) before failing too.
    printed = _run_script(launcher, "destroys_on_rank0", tmp_path)
    assert len(printed) == 2, printed
    assert all(line.endswith("results [0, 10]") for line in printed), printed


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_every_rank_gathers_none_from_a_rank_whose_main_called_sys_exit_0(
    tmp_path: Path,
) -> None:
    # Rank 0 failed with "main failed on rank(s) [1] ... raised SystemExit: 0".
    printed = _run_script("slurm", "exits_on_rank1", tmp_path)
    assert len(printed) == 2, printed  # rank 1 too: launch_all returned there
    assert all(line.endswith("results [0, None]") for line in printed), printed


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("mode", "said"),
    [
        ("fails_on_rank1", r"rank 1 raised ValueError: rank 1's main broke"),
        # the seconds as measured: more than the hang_timeout on a loaded machine
        ("hangs_on_rank1", r"rank 1 was ended by a hang: no progress on any of 2 ranks for \d+ s"),
    ],
)
def test_the_ranks_that_returned_learn_at_once_that_main_failed_on_another(
    mode: str, said: str, tmp_path: Path
) -> None:
    # Rank 0 waited for rank 1's value for the whole timeout (30 minutes by default; srun
    # keeps the other tasks running), then said only that rank 1 "did not" return; after
    # a hang too, though the verdict said every rank exits.
    runs = _run_programs(
        [[sys.executable, str(SCRIPT), mode, str(tmp_path)]] * 2,
        slurm_envs(_free_port()),
        timeout=50,  # below the script's timeout=60: a rank that waits it out fails here
    )
    rank0 = next(line for line in runs[0].stdout.splitlines() if "error on rank 0" in line)
    assert "main failed on rank(s) [1]" in rank0, runs[0].stdout
    assert re.search(said, runs[0].stdout), runs[0].stdout
    if mode == "fails_on_rank1":
        assert "error on rank 1: rank 1's main broke" in runs[1].stdout
    else:
        assert runs[1].returncode == 124, runs[1].stdout


# ------------------------------------------- _must_regroup: the ranks agree on the store

RANK0_OF_2 = DistributedEnv("slurm", 0, 2, 0, 2, "127.0.0.1", 29500)


@pytest.fixture
def own_group() -> Iterator[None]:
    """A one-rank gloo group standing for this rank's live group in a job of two."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _store_where_rank_1(destroyed: bool) -> dist.Store:
    store = _gather_store(dist.HashStore())
    if destroyed:
        store.add("destroyed", 1)
    store.set("reported/1", "1")
    return store


def test_a_rank_whose_group_main_destroyed_regroups() -> None:
    assert not dist.is_initialized()
    assert _must_regroup(RANK0_OF_2, timedelta(seconds=5), _store_where_rank_1(False))


@pytest.mark.usefixtures("own_group")
def test_a_live_group_is_destroyed_when_another_rank_destroyed_its_own() -> None:
    assert _must_regroup(RANK0_OF_2, timedelta(seconds=5), _store_where_rank_1(True))
    assert not dist.is_initialized()


@pytest.mark.usefixtures("own_group")
def test_live_groups_everywhere_gather_on_the_group_main_left() -> None:
    assert not _must_regroup(RANK0_OF_2, timedelta(seconds=5), _store_where_rank_1(False))
    assert dist.is_initialized()


def test_a_rank_that_never_reports_is_named_after_the_timeout() -> None:
    store = _gather_store(dist.HashStore())
    with pytest.raises(LaunchError, match=r"rank 0 returned from main, but rank\(s\) \[1\] did"):
        _must_regroup(RANK0_OF_2, timedelta(seconds=0.2), store)


def test_a_rank_whose_main_failed_stops_the_others_waiting_and_is_named() -> None:
    from trainperf.ddp._injob import _post_failure, _raised

    store = _gather_store(dist.HashStore())
    rank1 = DistributedEnv("slurm", 1, 2, 1, 2, "127.0.0.1", 29500)
    _post_failure(rank1, store, _raised(ValueError("no data\nsecond line")))
    with pytest.raises(LaunchError, match=r"(?s)failed on rank\(s\) \[1\].*rank 1 raised Value"):
        _must_regroup(RANK0_OF_2, timedelta(minutes=30), store)


def test_a_rank_that_called_sys_exit_is_named_so_and_a_failing_exit_as_a_call() -> None:
    from trainperf.ddp._injob import _post_failure, _raised

    store = _gather_store(dist.HashStore())
    rank1 = DistributedEnv("slurm", 1, 2, 1, 2, "127.0.0.1", 29500)
    _post_failure(rank1, store, _raised(SystemExit("no data")))
    with pytest.raises(
        LaunchError,
        match=r"(?s)rank 0 called sys.exit\(0\), but main failed on rank\(s\) \[1\].*"
        r"rank 1 called sys.exit\('no data'\)",
    ):
        _must_regroup(RANK0_OF_2, timedelta(minutes=30), store, "called sys.exit(0)")
    with pytest.raises(LaunchError, match=r"rank 0 called sys.exit\(\), but rank\(s\) \[1\] did"):
        _must_regroup(
            RANK0_OF_2, timedelta(seconds=0.2), _gather_store(dist.HashStore()), "called sys.exit()"
        )


class _GoneStore:
    """A store whose host exited: every call fails."""

    def add(self, key: str, amount: int) -> int:
        raise dist.DistNetworkError("Connection reset by peer")

    def set(self, key: str, value: str) -> None:
        raise dist.DistNetworkError("Connection reset by peer")

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        raise dist.DistNetworkError("Connection reset by peer")

    def check(self, keys: list[str]) -> bool:
        raise dist.DistNetworkError("Connection reset by peer")


@pytest.mark.parametrize("live_group", [False, True])
def test_an_unreachable_store_is_a_launch_error(
    live_group: bool, request: pytest.FixtureRequest
) -> None:
    if live_group:
        request.getfixturevalue("own_group")
    with pytest.raises(LaunchError, match="store that gathers every rank's value became unr"):
        _must_regroup(RANK0_OF_2, timedelta(seconds=5), _GoneStore())


def test_each_gather_and_each_torchrun_restart_has_keys_of_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = dist.HashStore()  # torchrun's agent keeps its store across restarts
    monkeypatch.setattr(_injob, "_gathers", itertools.count())  # a new worker process
    _gather_store(store).set("reported/0", "1")
    assert not _gather_store(store).check(["reported/0"])  # the next launch_all
    monkeypatch.setattr(_injob, "_gathers", itertools.count())
    assert _gather_store(store).check(["reported/0"])  # the same gather: the same keys
    monkeypatch.setattr(_injob, "_gathers", itertools.count())
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert not _gather_store(store).check(["reported/0"])


@pytest.mark.timeout(60)
def test_an_nprocs_the_running_job_ignores_is_warned_about_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A launch() inside a launched rank (or under torchrun) runs main in this process: an
    # explicit nprocs=3 was silently ignored, and the caller believed 3 ranks had run.
    _one_rank_job(monkeypatch)
    monkeypatch.setattr(_launch_checks, "_warned_ignored_nprocs", [False])
    with pytest.warns(UserWarning) as caught:
        assert ddp.launch(operator.add, 2, 3, nprocs=3, backend="gloo") == 5
        assert ddp.launch(operator.add, 2, 3, nprocs=3, backend="gloo") == 5
    ignored = [str(w.message) for w in caught if "nprocs" in str(w.message)]
    assert len(ignored) == 1, ignored
    assert re.match(
        r"launch\(\) ignores nprocs=3: this process is rank 0 of a job already "
        r"running 1 process on this node",
        ignored[0],
    ), ignored[0]
    monkeypatch.setattr(_launch_checks, "_warned_ignored_nprocs", [False])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the running job's own size, or none: no warning
        assert ddp.launch(operator.add, 2, 3, nprocs=1, backend="gloo") == 5
        assert ddp.launch(operator.add, 2, 3, backend="gloo") == 5
    assert not dist.is_initialized()


# ------------------------------------------------ NCCL ranks of one node on one visible GPU


def _one_gpu_each(
    monkeypatch: pytest.MonkeyPatch, peer_uuid: str, visible: int = 1
) -> list[object]:
    """``visible`` GPUs (this rank's is "GPU-a"); NCCL's group stood for by gloo, where local
    rank 1 of 2 says its card is ``peer_uuid``. Returns the device_id the group was asked
    for."""
    import socket
    import types

    import torch

    asked: list[object] = []
    real_init = dist.init_process_group

    def init(backend: str, **kwargs: object) -> None:
        asked.append(kwargs["device_id"])
        real_init("gloo", store=dist.HashStore(), rank=0, world_size=1)
        key = f"trainperf/gpu/0/{socket.gethostname()}/1"
        _injob._default_store().set(key, peer_uuid)

    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    props = types.SimpleNamespace(uuid="GPU-a")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    monkeypatch.setattr(dist, "init_process_group", init)
    return asked


def test_nccl_ranks_sharing_the_one_gpu_each_sees_are_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # torchrun --nproc-per-node=2 with CUDA_VISIBLE_DEVICES=0: both ranks went to cuda:0.
    asked = _one_gpu_each(monkeypatch, "GPU-a")
    with pytest.raises(DeviceError, match=r"local ranks 0, 1 on .* share one GPU: 2 ranks"):
        _injob._init_group(RANK0_OF_2, "nccl", timedelta(seconds=5))
    assert asked == [None]  # NCCL's eager start would fail first, without the fix
    assert not dist.is_initialized()  # the group it made is destroyed


def test_ranks_that_see_several_gpus_post_their_card_and_start_lazily(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Every rank of a node with several posts its card, whatever it sees: a rank seeing 2
    # GPUs beside one seeing 1 (CUDA_VISIBLE_DEVICES differs on the node) that posted
    # nothing and started NCCL eagerly left the other waiting on the store for its card.
    import socket

    asked = _one_gpu_each(monkeypatch, "GPU-b", visible=2)
    try:
        _injob._init_group(RANK0_OF_2, "nccl", timedelta(seconds=5))
        assert asked == [None]
        key = f"trainperf/gpu/0/{socket.gethostname()}/0"
        assert _injob._default_store().get(key) == b"GPU-a"
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("visible", [1, 2])
def test_a_lone_rank_on_its_node_starts_nccl_eagerly(
    visible: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    asked = _one_gpu_each(monkeypatch, "GPU-b", visible=visible)
    alone = DistributedEnv("slurm", 0, 2, 0, 1, "127.0.0.1", 29500)  # one rank per node
    try:
        _injob._init_group(alone, "nccl", timedelta(seconds=5))
        assert asked == [torch.device("cuda", 0)]  # no store check: NCCL's eager start kept
    finally:
        dist.destroy_process_group()


def test_nccl_ranks_with_a_bound_gpu_each_start(monkeypatch: pytest.MonkeyPatch) -> None:
    _one_gpu_each(monkeypatch, "GPU-b")  # the scheduler gave each task its own card
    try:
        _injob._init_group(RANK0_OF_2, "nccl", timedelta(seconds=5))
        assert dist.is_initialized()
    finally:
        dist.destroy_process_group()
