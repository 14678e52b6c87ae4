"""trainperf.ddp._launch: launching workers, options refused before starting, running inside a
torchrun or SLURM job, restarts.

Multi-process tests use gloo on CPU; spawn costs a few seconds per launch here, so each
launch checks several things at once. Faults inside the group are in test_group.py,
test_procs.py and test_worker.py.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import pickle
import re
import socket
import subprocess
import sys
import threading
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import torch
import torch.distributed as dist

import trainperf.ddp as ddp
from tests.ddp import _workers as workers
from tests.ddp._distributed import FORK, LONG, fast_start_method, launch_fork, spawn
from tests.ddp._envs import TORCHRUN
from trainperf.ddp import _env, _launch, _launch_checks
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


# ------------------------------------------------------------------ launch: the happy path


@pytest.mark.slow
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
@pytest.mark.parametrize("start_method", ["spawn", FORK])
def test_each_rank_gets_its_own_copy_of_a_tensor_argument_unless_it_was_shared(
    start_method: str,
) -> None:
    copied, shared = torch.zeros(2), torch.zeros(2).share_memory_()
    seen = ddp.launch_all(
        workers.change_on_rank0, copied, shared, nprocs=2, backend="gloo", start_method=start_method
    )
    # Rank 0's change stays its own, as under torchrun (spawn shared every tensor: a model
    # passed in had one set of parameters, stepped by every rank's optimizer).
    assert [s[0] for s in seen] == [[100.0, 100.0], [0.0, 0.0]]
    assert copied.tolist() == [0.0, 0.0]
    # share_memory_() asked for one copy for all (forked ranks share its mapping too).
    assert [s[1] for s in seen] == [[100.0, 100.0], [100.0, 100.0]]
    assert shared.tolist() == [100.0, 100.0]


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
    with pytest.raises(ValueError, match=r"MASTER_PORT must be a port in 1\.\.65535, got 'http'"):
        ddp.launch(workers.add, 1, 2, nprocs=2, **_gloo_fast())


# --------------------------------------------------------- launch: refused before starting


def _nested_main() -> None:
    pass


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"nprocs": 0}, ValueError, r"nprocs must be an int >= 1, got 0"),
        ({"nprocs": -2}, ValueError, r"nprocs must be an int >= 1, got -2"),
        ({"nprocs": "2"}, ValueError, r"nprocs must be an int >= 1, got '2'"),
        ({"nprocs": True}, ValueError, r"nprocs must be an int >= 1, got True"),
        ({"backend": "mpi"}, ValueError, r"backend must be one of \('nccl', 'gloo'\)"),
        ({"start_method": "forkserver"}, ValueError, r"start_method must be one of"),
        ({"timeout": timedelta(0)}, ValueError, r"timeout must be a positive timedelta"),
        ({"timeout": -1.0}, ValueError, r"timeout must be a positive number of seconds"),
        ({"max_restarts": -1}, ValueError, r"max_restarts must be an int >= 0, got -1"),
    ],
)
def test_launch_rejects_bad_options(kwargs: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        ddp.launch(workers.add, 1, 2, **{"start_method": "fork", "backend": "gloo", **kwargs})


@pytest.mark.parametrize("number", [np.int64, int])
def test_launch_hands_numpy_options_to_the_ranks_as_python_numbers(
    monkeypatch: pytest.MonkeyPatch, number: type
) -> None:
    # max_restarts passed its check as a NumPy integer and went on to the ranks as one.
    handed: dict[str, Any] = {}

    def record(*args: Any, **kwargs: Any) -> dict[int, str]:
        handed.update(kwargs)
        return {0: "ran"}

    monkeypatch.setattr(_launch, "_spawn", record)
    options = {"nprocs": 1, "max_restarts": 2, "timeout": 60, "grace_s": 5, "hang_timeout": 30}
    result = ddp.launch(
        workers.add,
        1,
        2,
        backend="gloo",
        start_method="fork",
        **{name: number(value) for name, value in options.items()},
    )
    assert result == "ran"
    assert handed["max_restarts"] == 2 and type(handed["max_restarts"]) is int
    assert (handed["nprocs"], handed["timeout"]) == (1, timedelta(seconds=60))
    assert type(handed["nprocs"]) is int
    assert [type(handed[name]) for name in ("grace_s", "hang_timeout")] == [float, float]


@pytest.mark.parametrize("nprocs", [0, -2, "2", True, 1.5])
def test_launch_inside_a_job_rejects_a_bad_nprocs_before_ignoring_it(
    monkeypatch: pytest.MonkeyPatch, nprocs: object
) -> None:
    # Inside a running job nprocs is ignored, but it was never checked either: nprocs=0 or
    # "2" only got the "ignores nprocs" warning, and main ran.
    env = {**TORCHRUN, "RANK": "0", "LOCAL_RANK": "0"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(_launch_checks, "_warned_ignored_nprocs", [False])
    monkeypatch.setattr(_launch, "run_in_process", lambda *a, **k: "main ran")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # refused outright: no "ignores nprocs" warning first
        with pytest.raises(ValueError, match=rf"nprocs must be an int >= 1, got {nprocs!r}"):
            ddp.launch(workers.add, 1, 2, nprocs=nprocs, backend="gloo")  # type: ignore[arg-type]


@pytest.mark.parametrize("nprocs", [0, "2", True, 2.0])
def test_a_bad_nprocs_says_what_to_pass_and_what_leaving_it_out_does(nprocs: object) -> None:
    # "nprocs must be an int >= 1, got True" named no fix.
    with pytest.raises(
        ValueError,
        match=rf"^nprocs must be an int >= 1, got {re.escape(repr(nprocs))}.*; pass the "
        r"number of worker processes as an int, e\.g\. nprocs=2, or leave nprocs out for one "
        r"per visible GPU \(1 without GPUs\)",
    ):
        ddp.launch(workers.add, 1, 2, nprocs=nprocs, backend="gloo", start_method="fork")


_NUMERIC_TIMEOUT = r"timeout must be a positive number of seconds \(or a positive timedelta\)"


@pytest.mark.parametrize(
    ("timeout", "match"),
    [
        (float("nan"), _NUMERIC_TIMEOUT + ", got nan"),
        (float("inf"), _NUMERIC_TIMEOUT + ", got inf"),
        (-1, _NUMERIC_TIMEOUT + ", got -1"),
        (0, _NUMERIC_TIMEOUT + ", got 0"),
        (0.0, _NUMERIC_TIMEOUT + ", got 0.0"),
        ("30", _NUMERIC_TIMEOUT + ", got '30'"),
        (1e300, r"timeout=1e\+300 is longer than torch\.distributed can wait"),
        # Accepted before, then a start-up that hung for ever (100,000 days) or failed at
        # once with a negative timeout (1e10 s).
        (timedelta(days=100_000), r"at most 36500 days\); pass a shorter one, and hang_"),
        (1e10, r"timeout=10000000000\.0 is longer than torch\.distributed can wait"),
        (timedelta(0), r"timeout must be a positive timedelta \(or a positive number of second"),
        (timedelta(seconds=-1), r"timeout must be a positive timedelta.*got datetime\.timedelta"),
        # Accepted before, then "cannot start the rendezvous store ... timed out after 0ms"
        # (1e-9 rounded to timedelta(0), itself refused) or after a few ms.
        (1e-9, r"timeout=1e-09 is shorter than 1 s.*pass at least timeout=1"),
        (0.005, r"timeout=0.005 is shorter than 1 s"),
        (timedelta(milliseconds=999), r"timeout=datetime.timedelta\(microseconds=999000\) is sh"),
    ],
)
def test_launch_rejects_a_timeout_that_is_not_finite_and_positive(
    timeout: object, match: str
) -> None:
    # Refused on entry, as ValueError, before any rank starts (nan and inf used to escape as a
    # raw "cannot convert float NaN to integer" and an OverflowError).
    with pytest.raises(ValueError, match=match):
        ddp.launch(workers.add, 1, 2, start_method="fork", backend="gloo", timeout=timeout)  # type: ignore[arg-type]


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
    # A script piped on stdin (python - < train.py) has a __file__ that is no file.
    monkeypatch.setattr(main_module, "__file__", "<stdin>", raising=False)
    with pytest.raises(ValueError, match=r"piped on stdin.*start_method='fork'"):
        ddp.launch(_nested_main, nprocs=2, backend="gloo")


def test_an_argument_spawn_cannot_pickle_is_named_with_its_type() -> None:
    # The error said "they cannot be pickled", leaving the user to find which one.
    with pytest.raises(
        ValueError,
        match=r"and args\[1\] \(function\) cannot be pickled \(\w+Error: .*lambda.*\): "
        r"pass a picklable value .*start_method='fork'",
    ):
        ddp.launch(workers.add, 1, lambda: 2, nprocs=1, backend="gloo")
    with pytest.raises(
        ValueError, match=r"and kwargs\['scale'\] \(_thread\.lock\) cannot be pickled \(TypeError"
    ):
        ddp.launch(workers.add, 1, 2, scale=threading.Lock(), nprocs=1, backend="gloo")


def _mp_spawn_style(rank: int, cfg: dict[str, int]) -> None:
    pass


@pytest.mark.parametrize(
    ("main", "args", "kwargs", "match"),
    [
        # torch.multiprocessing.spawn's habit: args=(...) went to main as a keyword, and each
        # rank, once started, failed with "got an unexpected keyword argument 'args'".
        (
            _mp_spawn_style,
            (),
            {"args": ({"lr": 1},)},
            r"launch\(\) cannot call _mp_spawn_style\(rank, cfg\) with these arguments "
            r"\(missing a required argument: 'rank'\): .*launch\(main, cfg, nprocs=2\), "
            r"not args=\(cfg,\).*ddp\.rank\(\)",
        ),
        (
            workers.add,
            (1, 2, 3),
            {},
            r"cannot call add\(a, b, \*, scale=1\) with these arguments \(too many positional "
            r"arguments\): pass main's arguments after it",
        ),
    ],
)
def test_arguments_main_cannot_take_are_refused_before_any_rank_starts(
    main: Any, args: tuple[Any, ...], kwargs: dict[str, Any], match: str
) -> None:
    with pytest.raises(TypeError, match=match) as info:
        ddp.launch(main, *args, nprocs=2, backend="gloo", start_method="fork", **kwargs)
    assert isinstance(info.value.__cause__, TypeError)


async def _async_main(x: int) -> int:
    return x


def _generator_main(x: int) -> Any:
    yield x


async def _async_generator_main(x: int) -> Any:
    yield x


class _AsyncCallable:
    async def __call__(self, x: int) -> int:
        return x


_ASYNC_FIX = r"def main\(\.\.\.\): asyncio\.run\(amain\(\.\.\.\)\)"


@pytest.mark.parametrize(
    ("main", "match"),
    [
        (_async_main, r"main='_async_main' is an async def function: .*" + _ASYNC_FIX),
        (functools.partial(_async_main, 1), r"main='_async_main' is an async def function"),
        (_generator_main, r"main='_generator_main' is a generator function: .*return a value"),
        (_async_generator_main, r"main='_async_generator_main' is an async generator function"),
        (_AsyncCallable(), r"main='_AsyncCallable' is an async def function"),
    ],
)
@pytest.mark.parametrize("job", [False, True], ids=["launcher", "torchrun"])
@pytest.mark.parametrize("entry", [ddp.launch, ddp.launch_all])
def test_an_async_or_generator_main_is_refused_before_any_rank_starts(
    monkeypatch: pytest.MonkeyPatch, main: Any, match: str, job: bool, entry: Any
) -> None:
    # Each rank called main, got a coroutine (or generator) whose body never ran, and
    # failed pickling it back: "cannot pickle 'coroutine' object", plus "coroutine was
    # never awaited". Inside a torchrun job launch() returned the coroutine itself.
    if job:
        env = {**TORCHRUN, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
        for name, value in {**env, "LOCAL_WORLD_SIZE": "1"}.items():
            monkeypatch.setenv(name, value)
    monkeypatch.setattr(_launch, "run_in_process", lambda *a, **k: pytest.fail("main ran"))
    monkeypatch.setattr(_launch, "_spawn", lambda *a, **k: pytest.fail("ranks started"))
    args = () if isinstance(main, functools.partial) else (1,)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "coroutine ... was never awaited"
        with pytest.raises(TypeError, match=match):
            entry(main, *args, nprocs=1, backend="gloo", start_method="fork")


@pytest.mark.timeout(60)
def test_a_decorated_main_is_called_as_its_wrapper_takes_arguments() -> None:
    # functools.wraps makes inspect.signature report the wrapped function's parameters:
    # a wrapper that supplies them itself must not be refused for lacking them.
    assert ddp.launch_all(
        workers.decorated_rank, nprocs=2, backend="gloo", start_method=fast_start_method()
    ) == [0, 1]


class _Trainer:
    def __init__(self) -> None:
        self.lock = threading.Lock()

    def fit(self) -> int:
        return 1


def test_a_method_main_whose_object_cannot_be_pickled_is_named_as_such() -> None:
    # The method is at module top level: the error told users to move it there.
    with pytest.raises(
        ValueError,
        match=r"main='_Trainer\.fit' is a method of a _Trainer object that cannot be pickled "
        r"\(TypeError: cannot pickle '_thread.lock' object\): make that object picklable",
    ):
        ddp.launch(_Trainer().fit, nprocs=2, backend="gloo")


def test_a_partial_main_is_checked_for_what_it_binds() -> None:
    # A partial of a top-level function pickles by name: only its bound values can fail,
    # and the error says so (it used to say "define main at module top level").
    with pytest.raises(
        ValueError,
        match=r"main=functools\.partial\(add, \.\.\.\) binds arguments that cannot be pickled "
        r"\((PicklingError|AttributeError): Can't pickle .*\): pass picklable values",
    ):
        ddp.launch(functools.partial(workers.add, lambda: 1), 2, nprocs=2, backend="gloo")
    with pytest.raises(ValueError, match=r"<lambda>' cannot be pickled.*module top level"):
        ddp.launch(functools.partial(lambda a: a, 1), nprocs=2, backend="gloo")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_partial_main_may_bind_a_queue_as_arguments_may() -> None:
    # A Queue pickles only while a process starts: the check before starting refused it
    # with multiprocessing's bare RuntimeError ("Queue objects should only be shared
    # between processes through inheritance"), though the start itself sends it fine.
    import multiprocessing

    queue = multiprocessing.get_context("spawn").Queue()
    try:
        main = functools.partial(workers.put_rank, queue)
        assert ddp.launch_all(main, nprocs=2, backend="gloo", start_method="spawn") == ["put"] * 2
        assert sorted(queue.get(timeout=10) for _ in range(2)) == [0, 1]
    finally:
        queue.close()
        queue.join_thread()


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


def test_fork_refused_once_cuda_is_initialised(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(_launch_checks, "cuda_driver_loaded", lambda: True)
    with pytest.raises(DeviceError, match=r"backend='nccl': CUDA's driver is already loaded"):
        ddp.launch(workers.add, 1, 2, nprocs=2, backend="nccl", start_method="fork")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(DeviceError, match=r"start_method='fork' cannot be used once CUDA"):
        ddp.launch(workers.add, 1, 2, nprocs=2, backend="gloo", start_method="fork")


def test_cuda_driver_loaded_reads_maps_that_are_not_utf8(tmp_path: Path) -> None:
    # A mapped file whose path is not UTF-8 made launch(fork, nccl) fail with
    # UnicodeDecodeError instead of checking for CUDA's driver.
    maps = tmp_path / "maps"
    maps.write_bytes(b"7f00-7f80 r-xp 0 08:01 1 /data/caf\xe9/libcuda.so.1\n")
    assert _launch_checks.cuda_driver_loaded(maps)
    maps.write_bytes(b"7f00-7f80 r-xp 0 08:01 1 /data/caf\xe9/libx.so\n")
    assert not _launch_checks.cuda_driver_loaded(maps)


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
    monkeypatch.setattr(_launch_checks, "_warned_ignored_nprocs", [False])
    with pytest.warns(UserWarning, match=r"launch\(\) ignores nprocs=8"):
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
    with pytest.raises(ValueError, match=r"WORLD_SIZE must be a whole number >= 1 .*, got '0'"):
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


def slurm_envs(port: int, tasks: int = 2) -> list[dict[str, str]]:
    """The environments of a SLURM job step of ``tasks`` tasks on this host."""
    envs = []
    for task in range(tasks):
        env = _clean_env()
        env.update(
            SLURM_PROCID=str(task),
            SLURM_NTASKS=str(tasks),
            SLURM_LOCALID=str(task),
            SLURM_TASKS_PER_NODE=str(tasks),
            SLURM_JOB_NODELIST="localhost",
            SLURM_JOB_ID="99",
            MASTER_PORT=str(port),
        )
        envs.append(env)
    return envs


def _clean_env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in _env.TORCHRUN_VARS and not k.startswith(("SLURM_", "PYTEST_"))
    }
    env["PYTHONUNBUFFERED"] = "1"
    return env


@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_slurm_job_step_simulated_by_two_programs(tmp_path: Path) -> None:
    envs = slurm_envs(_free_port())
    command = [sys.executable, str(SCRIPT), "all_reduce", str(tmp_path)]
    runs = _run_programs([command, command], envs, timeout=60)
    for run in runs:
        assert run.returncode == 0, run.stdout
        assert "result 3" in run.stdout
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [(r["rank"], r["world_size"], r["sum"]) for r in records] == [(0, 2, 3.0), (1, 2, 3.0)]
    # Each task ran main itself: no workers were spawned below it.
    assert {r["pid"] for r in records}.isdisjoint({os.getpid()})


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_an_srun_preserve_env_step_of_two_tasks_in_a_job_of_four_runs_two_ranks(
    tmp_path: Path,
) -> None:
    # `srun --preserve-env -n 2` keeps the job's SLURM_NTASKS=4: rank 0 waited in the
    # rendezvous for ranks 2 and 3, which the step never starts, until timeout.
    envs = slurm_envs(_free_port())
    for env in envs:
        env.update(
            SLURM_NTASKS="4",
            SLURM_NPROCS="4",
            SLURM_TASKS_PER_NODE="4",
            SLURM_STEP_ID="1",
            SLURM_STEP_NUM_TASKS="2",
            SLURM_STEP_TASKS_PER_NODE="2",
        )
    command = [sys.executable, str(SCRIPT), "all_reduce", str(tmp_path)]
    runs = _run_programs([command, command], envs, timeout=60)
    for run in runs:
        assert run.returncode == 0, run.stdout
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [(r["rank"], r["world_size"], r["sum"]) for r in records] == [(0, 2, 3.0), (1, 2, 3.0)]


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_max_restarts_reruns_the_whole_group(tmp_path: Path) -> None:
    marker = tmp_path / "failed-once"
    assert launch_fork(workers.fail_first_attempt, str(marker), max_restarts=1, timeout=LONG) == 2
    assert marker.exists()

    with pytest.raises(LaunchError, match=r"^rank [01] of 2 \(attempt 3 of 3\) raised KeyError"):
        launch_fork(workers.always_fail, max_restarts=2)
    with pytest.raises(LaunchError, match=r"^rank [01] of 2 raised KeyError: 'always'"):
        launch_fork(workers.always_fail)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_the_spawn_path_reports_failures_too() -> None:
    with pytest.raises(LaunchError, match=r"^rank 1 of 2 raised ValueError: deliberate"):
        ddp.launch(workers.raise_on_rank, 1, nprocs=2, backend="gloo", timeout=LONG)


_UNGUARDED = """\
import trainperf.ddp as ddp


def main():
    return 1


# No __main__ guard; and a restart could not help, so there must be none.
print("result", ddp.launch(main, nprocs=2, backend="gloo", max_restarts=1))
"""


def _processes_with(marker: str) -> list[int]:
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("TRAINPERF_TEST_MARKER") == marker:
                found.append(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_script_without_the_main_guard_is_told_to_add_it(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(_UNGUARDED)
    env = _clean_env()
    marker = f"unguarded-{os.getpid()}-{time.time_ns()}"
    env["TRAINPERF_TEST_MARKER"] = marker  # inherited by every process the script starts
    run = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    assert "LaunchError: rank" in out and "could not start" in out, out
    assert 'if __name__ == "__main__":' in out and 'start_method="fork"' in out, out
    assert str(script) in out, out
    # Neither Python's bootstrapping traceback from the workers nor the wrong diagnosis.
    assert "bootstrapping phase" not in out and "crash in native code" not in out, out
    assert out.count("Traceback (most recent call last)") == 1, out
    assert "(attempt 1 of 2)" in out and "attempt 2" not in out and "restarting" not in out
    deadline = time.monotonic() + 10
    while _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _processes_with(marker) == []


_LAUNCHES_AT_IMPORT = """\
import trainperf.ddp as ddp


def main():
    return 1


# At a module's top level: each spawned worker imports this module to load main.
RESULT = ddp.launch(main, nprocs=1, backend="gloo", start_method="spawn", max_restarts=1)
"""


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_module_that_launches_when_imported_is_refused_in_the_worker(tmp_path: Path) -> None:
    # The script has its guard, but main's module calls launch() at import: each spawned
    # worker imported it to load main, launched workers of its own, and so on without end.
    (tmp_path / "trainlib.py").write_text(_LAUNCHES_AT_IMPORT)
    script = tmp_path / "train.py"
    script.write_text('if __name__ == "__main__":\n    import trainlib\n')
    env = _clean_env()
    marker = f"relaunch-{os.getpid()}-{time.time_ns()}"
    env["TRAINPERF_TEST_MARKER"] = marker
    try:
        run = subprocess.run(
            [sys.executable, str(script)],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        for pid in _processes_with(marker):  # a chain of nested launches, on failure
            with contextlib.suppress(psutil.NoSuchProcess):
                psutil.Process(pid).kill()
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    assert (
        "LaunchError: rank 0 of 1 (attempt 1 of 2) could not load main: raised RuntimeError: "
        "launch() called while this spawned worker imported a module to load main" in out
    ), out
    assert str(tmp_path / "trainlib.py") in out and 'if __name__ == "__main__":' in out, out
    assert "must be importable there" not in out, out  # the advice for a missing module
    assert "attempt 2" not in out and "restarting" not in out, out
    deadline = time.monotonic() + 10
    while _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _processes_with(marker) == []


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


def test_a_hang_timeout_the_collectives_timeout_comes_before_is_warned_about() -> None:
    with pytest.warns(UserWarning, match=r"hang_timeout=300 s is not below timeout=5 s") as w:
        assert ddp.launch(workers.add, 1, 2, nprocs=2, backend="gloo", start_method="fork",
                          timeout=5.0) == 3  # fmt: skip
    assert w[0].filename == __file__  # the caller's line


def test_launch_outside_the_main_thread_says_signals_will_not_stop_the_ranks() -> None:
    import threading

    caught: list[warnings.WarningMessage] = []
    results: list[int] = []

    def run() -> None:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            results.append(ddp.launch(workers.add, 1, 2, nprocs=2, backend="gloo",
                                      start_method="fork"))  # fmt: skip
        caught.extend(seen)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(60)
    assert results == [3]
    texts = [str(w.message) for w in caught]
    assert any("launch() called outside the main thread" in t for t in texts), texts
    assert [w.filename for w in caught if "main thread" in str(w.message)] == [__file__]
