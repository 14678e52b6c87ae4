"""trainperf.ddp._worker: what runs inside each worker (its GPU, a clean exit, a stuck peer)."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import io
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

import trainperf.ddp as ddp
from tests.ddp import _workers as workers
from tests.ddp._distributed import LONG, fast_start_method, launch_fork
from trainperf.ddp._worker import WorkerSpec
from trainperf.errors import LaunchError


def test_a_local_rank_without_its_gpu_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from trainperf.ddp._worker import rank_device

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert rank_device(1) == torch.device("cuda", 1)
    with pytest.raises(ValueError, match=r"3 ranks run on this node \(this is local rank 2\)"):
        rank_device(2)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # one GPU bound per task
    assert rank_device(3) == torch.device("cuda", 0)


def test_more_local_ranks_than_gpus_are_refused_on_every_rank(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # torchrun --nproc-per-node=3 on 2 GPUs: ranks 0 and 1 took their GPUs and waited for
    # rank 2, which alone said it had none.
    from trainperf.ddp._worker import rank_device

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    with pytest.raises(
        ValueError,
        match=r"3 ranks run on this node \(this is local rank 0\) but only 2 GPUs are "
        r"visible \(CUDA_VISIBLE_DEVICES='4,5'\).*at most 2 processes per node.*or use "
        r"backend='gloo'",
    ):
        rank_device(0, local_world_size=3)
    assert rank_device(1, local_world_size=2) == torch.device("cuda", 1)


@pytest.mark.timeout(60)
def test_sys_exit_zero_counts_as_returning_none() -> None:
    assert ddp.launch_all(
        workers.sys_exit_on_rank, 1, 0, nprocs=2, backend="gloo", start_method=fast_start_method()
    ) == [0, None]


@pytest.mark.parametrize("code", [None, 0, False, 0.0, -0.0, 0j, "0", "", 1, True, 3])
def test_a_sys_exit_is_clean_exactly_when_python_would_exit_0(code: object) -> None:
    # sys.exit(0.0) counted as returning None (0.0 == 0), though Python exits 1 for it:
    # only None and an int equal to 0 (False included) end a process with status 0 (256,
    # 0 in 8 bits, is left out here: see the test below).
    from trainperf.ddp._worker import clean_exit_call

    python = subprocess.run(
        [sys.executable, "-c", f"import sys; sys.exit({code!r})"], capture_output=True, check=False
    )
    assert (clean_exit_call(SystemExit(code)) is not None) is (python.returncode == 0)


def test_sys_exit_256_is_a_failure_though_its_status_wraps_to_0() -> None:
    from trainperf.ddp._worker import clean_exit_call

    assert clean_exit_call(SystemExit(256)) is None
    assert clean_exit_call(SystemExit(-256)) is None


def test_main_that_calls_sys_exit_0_0_fails_and_one_that_calls_sys_exit_false_returns() -> None:
    from trainperf.ddp._worker import call_main

    with pytest.raises(SystemExit, match=r"^0\.0$"):
        call_main(sys.exit, (0.0,), {})
    assert call_main(sys.exit, (False,), {}) == (None, "sys.exit(False)")


@pytest.mark.timeout(60)
def test_a_rank_that_calls_sys_exit_0_0_is_a_failure_as_python_says() -> None:
    with pytest.raises(LaunchError, match=r"^rank 1 of 2 called sys\.exit\(0\.0\)"):
        ddp.launch_all(
            workers.sys_exit_on_rank,
            1,
            0.0,
            nprocs=2,
            backend="gloo",
            start_method=fast_start_method(),
        )


@pytest.mark.timeout(60)
def test_a_peer_that_called_sys_exit_0_is_named_as_such_not_as_returned_from_main() -> None:
    # Rank 1 calls sys.exit(0) while rank 0 waits in an all_reduce: the LaunchError said
    # rank 1 had "already returned from main", which its code never did.
    with pytest.raises(LaunchError, match=r"^rank 0 of 2 raised RuntimeError") as info:
        launch_fork(workers.sys_exit_early_on_rank, 1, timeout=LONG)
    text = str(info.value)
    assert "Already returned from main" not in text, text
    assert "Called sys.exit(0) in main: rank 1 (a collective that not every rank" in text, text


@pytest.mark.timeout(60)
def test_sys_exit_0_finishes_the_background_saves_before_the_rank_reports(
    tmp_path: Path,
) -> None:
    # Returning from main waits for them; sys.exit(0) reported at once, and the launcher,
    # with every result in, gives a rank seconds to exit before it kills the writer.
    assert launch_fork(workers.sys_exit_with_a_save_running, str(tmp_path), timeout=LONG) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["saved0", "saved1"]


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_rank_stuck_in_a_collective_fails_within_the_timeout() -> None:
    # Rank 1 stays alive but never joins: rank 0 must give up after `timeout`, not hang.
    with pytest.raises(LaunchError, match=r"^rank 0 of 2 raised RuntimeError: .*[Tt]imed out"):
        launch_fork(workers.stuck_on_rank, 1, timeout=timedelta(seconds=3))


_ELSEWHERE = """\
def main():
    return "ran"
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_main_spawned_workers_cannot_import_is_named_with_the_import_error(
    tmp_path: Path,
) -> None:
    # A module loaded from a file path: the launcher can pickle main by name, but a new
    # interpreter cannot import it (#20.13; it used to be "exited with code 1 without
    # reporting an error", the ModuleNotFoundError only on stderr).
    name = f"tp_elsewhere_{os.getpid()}"
    path = tmp_path / f"{name}.py"
    path.write_text(_ELSEWHERE)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        with pytest.raises(
            LaunchError,
            match=rf"^rank [01] of 2 \(attempt 1 of 2\) could not load main: raised "
            rf"ModuleNotFoundError: No module named '{name}'",
        ) as info:
            ddp.launch(module.main, nprocs=2, backend="gloo", start_method="spawn", max_restarts=1)
    finally:
        del sys.modules[name]
    text = str(info.value)
    assert f"imports main's module ({name}) by name" in text
    assert "start_method='fork'" in text
    assert "Traceback from rank" in text and "ModuleNotFoundError" in text
    assert "without reporting an error" not in text


def _round_trip(*args: object) -> tuple[object, ...]:
    import pickle

    from trainperf.ddp._worker_pickle import _pack

    main, copied, kwargs = pickle.loads(_pack((workers.add, args, {})))
    assert main is workers.add and kwargs == {}
    return tuple(copied)


def test_arguments_reach_a_rank_as_copies_with_their_views_and_parameters_intact() -> None:
    flat = torch.zeros(1_000_000)
    weight = torch.nn.Parameter(torch.ones(3))
    sparse = torch.eye(3).to_sparse()
    base, view, param, sparse_copy = _round_trip(flat, flat[:10], weight, sparse)
    assert isinstance(base, torch.Tensor) and isinstance(view, torch.Tensor)
    base[0] = 7.0  # a view of the same buffer in the rank, as in the launcher
    assert view[0] == 7.0 and flat[0] == 0.0  # and a copy of the launcher's
    assert isinstance(param, torch.nn.Parameter) and param.requires_grad
    assert isinstance(sparse_copy, torch.Tensor) and torch.equal(
        sparse_copy.to_dense(), torch.eye(3)
    )

    from trainperf.ddp._worker_pickle import _pack

    one = len(_pack((workers.add, (flat,), {})))
    assert len(_pack((workers.add, (flat, *[flat[i : i + 10] for i in range(5)]), {}))) < 1.1 * one


def test_an_exception_class_of_a_spawned_script_is_named_as_the_user_wrote_it() -> None:
    from trainperf.ddp._worker import _describe

    mp_main = type("MyErr", (Exception,), {"__module__": "__mp_main__"})
    assert _describe(1, mp_main("boom")).type_name == "__main__.MyErr"
    assert _describe(1, ValueError("x")).type_name == "ValueError"


def _as_a_worker_gets_it(spec: WorkerSpec) -> WorkerSpec:
    import pickle
    from multiprocessing.reduction import ForkingPickler

    rebuilt: WorkerSpec = pickle.loads(ForkingPickler.dumps(spec))
    return rebuilt


def _spec(main: object, args: tuple[object, ...], kwargs: dict[str, object]) -> WorkerSpec:
    return WorkerSpec(
        main,
        args,
        kwargs,
        "gloo",
        1,
        "127.0.0.1",
        1,
        "p/",
        LONG,
        None,
        os.getpid(),
        False,  # type: ignore[arg-type]
    )


def test_an_argument_that_cannot_be_unpickled_in_the_worker_is_named() -> None:
    # Was reported as "could not load main" with advice about importing main's module.
    bad = workers.TwoPartError(1, 2)
    positional = _as_a_worker_gets_it(_spec(workers.add, (1, bad), {"scale": 3}))
    with pytest.raises(TypeError, match=r"missing 1 required positional argument: 'b'"):
        positional.load()
    assert positional.failed_argument() == "args[1] (tests.ddp._workers.TwoPartError)"
    keyword = _as_a_worker_gets_it(_spec(workers.add, (1, 2), {"scale": bad}))
    with pytest.raises(TypeError):
        keyword.load()
    assert keyword.failed_argument() == "kwargs['scale'] (tests.ddp._workers.TwoPartError)"
    # main itself (here a partial holding the bad value) is still main's failure.
    own = _as_a_worker_gets_it(_spec(functools.partial(workers.add, bad), (1,), {}))
    with pytest.raises(TypeError):
        own.load()
    assert own.failed_argument() is None
    good = _as_a_worker_gets_it(_spec(workers.add, (1, 2), {"scale": 3}))
    assert good.load() == (workers.add, (1, 2), {"scale": 3})


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_spawned_rank_names_the_argument_it_could_not_unpickle() -> None:
    with pytest.raises(LaunchError) as info:
        ddp.launch(workers.add, 1, workers.TwoPartError(1, 2), nprocs=1, backend="gloo")
    text = str(info.value)
    assert text.startswith(
        "rank 0 of 1 could not unpickle main's args[1] (tests.ddp._workers.TwoPartError): "
        "raised TypeError: TwoPartError.__init__() missing 1 required positional argument: 'b'"
    ), text
    assert "could not load main" not in text and "imports main's module" not in text
    assert "Fix: each spawned worker unpickles main's arguments" in text


class _Exited(BaseException):
    """What the stand-in for ``os._exit`` raises, so the test process lives on."""


def _closed_stream() -> io.TextIOWrapper:
    # A real file, as sys.stderr is: a closed StringIO's flush() does not raise.
    stream = open(os.devnull, "w")  # noqa: SIM115
    stream.close()
    return stream


@pytest.mark.parametrize("stderr", [_closed_stream, lambda: None], ids=["closed", "none"])
def test_a_failed_rank_still_leaves_through_os_exit_when_main_closed_sys_stderr(
    monkeypatch: pytest.MonkeyPatch, stderr: Any
) -> None:
    # sys.stderr.flush() raised before os._exit: the rank went through a normal interpreter
    # shutdown instead, which can hang (atexit, NCCL teardown) until the launcher kills it.
    from trainperf.ddp import _worker

    codes: list[int] = []

    def fake_exit(code: int) -> None:
        codes.append(code)
        raise _Exited

    monkeypatch.setattr(_worker.os, "_exit", fake_exit)
    monkeypatch.setattr(sys, "stderr", stderr())
    with pytest.raises(_Exited):
        _worker._exit_now(1)
    assert codes == [1]


@pytest.mark.timeout(60)
def test_a_rank_whose_main_closed_sys_stderr_still_exits_0_when_teardown_fails(
    caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    # The warning about a failed destroy_process_group was print()ed to the closed
    # sys.stderr, which raised: a rank whose main had returned exited with code 1.
    with caplog.at_level("WARNING", logger="trainperf.ddp"):
        assert launch_fork(workers.close_stderr_and_break_teardown, 7, nprocs=1) == 7
    assert "returned from main, then" not in caplog.text
    err = capfd.readouterr().err
    assert "rank 0: destroy_process_group failed after main returned" in err
    assert "RuntimeError: destroy_process_group broke" in err


@pytest.mark.timeout(60)
def test_a_rank_without_hang_detection_still_runs_main_when_sys_stderr_is_closed(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    # The "hang detection is off" notice was print()ed to sys.stderr: a forked rank that
    # inherited a closed one raised there and exited before main ran.
    from trainperf.ddp import _worker

    def no_tracker(spec: WorkerSpec, rank: int) -> None:
        raise OSError("no stacks signal here")

    if fast_start_method() != "fork":
        pytest.skip("needs fork: the rank must inherit this process's stand-ins")
    monkeypatch.setattr(_worker, "_track", no_tracker)
    monkeypatch.setattr(sys, "stderr", _closed_stream())
    assert launch_fork(workers.add, 3, 4, nprocs=1) == 7
    err = capfd.readouterr().err
    assert "rank 0: hang detection is off (OSError('no stacks signal here'))" in err


def test_a_launch_while_a_worker_loads_main_is_refused_and_remembered() -> None:
    # main's module calling launch() at import: each spawned worker would start its own.
    from trainperf.ddp import _worker_reimport

    try:
        with (
            _worker_reimport.loading_main(),
            pytest.raises(RuntimeError, match=r"calls launch\(\) when it is imported"),
        ):
            ddp.launch(workers.add, 1, 2, nprocs=1, backend="gloo")
        assert _worker_reimport.relaunched()
    finally:
        _worker_reimport._relaunched.clear()
    assert ddp.launch(workers.add, 1, 2, nprocs=1, backend="gloo", start_method="fork") == 3


@pytest.mark.timeout(60)
def test_a_rank_reports_its_failure_even_when_a_dataloader_worker_exits_meanwhile(
    capfd: pytest.CaptureFixture[str],
) -> None:
    # DataLoader's SIGCHLD handler raised inside the failure report: the report was lost
    # and multiprocessing printed a traceback of trainperf's own frames.
    with pytest.raises(LaunchError, match=r"rank 0 of 1 raised ValueError: its own failure"):
        launch_fork(workers.raise_while_a_child_exits_during_the_report, nprocs=1)
    err = capfd.readouterr().err
    assert "_report_failure" not in err and "Process trainperf-rank0" not in err, err


def _a_generator() -> Any:
    yield 1


def _unsendable(value: object) -> Any:
    """The Failure a rank reports when sending ``value`` back as main's result raises the
    TypeError of a value that cannot be pickled."""
    import multiprocessing

    from trainperf.ddp import _worker

    ours, theirs = multiprocessing.Pipe()
    try:
        with pytest.raises(TypeError) as info:
            _worker._send_result(ours, 0, value, None)
    finally:
        ours.close()
        theirs.close()
    return _worker._describe(0, info.value)


@pytest.mark.parametrize(
    ("make", "type_name"),
    [
        (lambda path: lambda: None, "function"),
        (lambda path: open(path, "w"), "_io.TextIOWrapper"),  # noqa: SIM115
        (lambda path: _a_generator(), "generator"),
    ],
)
def test_a_return_value_that_cannot_be_pickled_is_named_with_the_fix_and_no_internal_frames(
    tmp_path: Path, make: Any, type_name: str
) -> None:
    # The report showed only trainperf's frames (_send_result, _send) under "Traceback from
    # rank 0", which told the user nothing about what to return instead.

    from trainperf.ddp._failures import summarize

    payload = make(tmp_path / "log.txt")
    try:
        failure = _unsendable(payload)
    finally:
        if hasattr(payload, "close"):
            payload.close()
    assert failure.traceback == ""
    assert failure.type_name == "TypeError"
    summary = summarize(failure)
    assert summary.startswith("raised TypeError: main returned a value that cannot be pickled")
    assert f"cannot be pickled to send it back to the launcher: its type is {type_name};" in summary
    assert "return plain data (numbers, tensors, dicts/lists of them)" in summary
    assert "or save it to a file in main and return the path" in summary  # not cut off


def test_a_fork_launch_from_a_process_with_a_process_group_is_refused_before_any_rank_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each forked rank inherited the group and failed in launch's own set-up, and
    # max_restarts started the whole group again for the same failure.
    import multiprocessing

    import torch.distributed as dist

    from trainperf.ddp import _launch

    if "fork" not in multiprocessing.get_all_start_methods():
        pytest.skip("needs fork: the refusal is of start_method='fork'")
    started: list[Any] = []
    monkeypatch.setattr(_launch, "_spawn", lambda *a, **kw: started.append(a) or {0: None})
    store = f"file://{tmp_path / 'store'}"
    dist.init_process_group("gloo", init_method=store, rank=0, world_size=1)
    try:
        with pytest.raises(
            RuntimeError,
            match=r"this process already has a default process group .*: call "
            r"dist\.destroy_process_group\(\) before launch\(\), or use start_method='spawn'",
        ):
            ddp.launch(
                workers.add, 1, 2, nprocs=1, backend="gloo", start_method="fork", max_restarts=2
            )
    finally:
        dist.destroy_process_group()
    assert started == []  # refused in the launching process: no rank was started


class _BrokenGetstate:
    def __getstate__(self) -> dict[str, Any]:
        return {"loss": self.los}  # type: ignore[attr-defined]  # the user's own bug


def test_a_return_value_whose_own_getstate_fails_is_reported_with_its_traceback() -> None:
    # The report's traceback was blanked for every unpicklable result, so the frame of the
    # user's own __getstate__, where the bug is, was lost.

    failure = _unsendable(_BrokenGetstate())
    assert failure.message.startswith("main returned a value that cannot be pickled")
    assert "AttributeError: '_BrokenGetstate' object has no attribute 'los'" in failure.message
    assert f'File "{__file__}"' in failure.traceback, failure.traceback
    assert "in __getstate__" in failure.traceback
    assert "AttributeError: '_BrokenGetstate' object has no attribute 'los'" in failure.traceback
    assert "_send_result" not in failure.traceback  # trainperf's own frames left out


@pytest.mark.timeout(60)
def test_a_failure_in_launchs_own_setup_gets_no_hint_meant_for_main(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # launch's own init_process_group failing "twice!" was told to remove main's call.
    from trainperf.ddp import _worker

    if fast_start_method() != "fork":
        pytest.skip("needs fork: the rank must inherit this process's stand-in")

    def setup(spec: WorkerSpec, rank: int) -> None:
        raise ValueError("trying to initialize the default process group twice!")

    monkeypatch.setattr(_worker, "_setup", setup)
    with pytest.raises(LaunchError, match=r"raised ValueError: trying to initialize") as info:
        launch_fork(workers.add, 1, 2, nprocs=1)
    assert "launch() already set up the process group for main" not in str(info.value)


@pytest.mark.parametrize("child_start_method", [None, "spawn"])
def test_a_process_group_set_up_while_a_spawned_rank_imported_main_is_refused(
    monkeypatch: pytest.MonkeyPatch, child_start_method: str | None
) -> None:
    # torch said only "initialize the default process group twice!", in launch's own call.
    import torch.distributed as dist

    from trainperf.ddp import _worker

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    spec = _spec_started_by(child_start_method)
    with pytest.raises(RuntimeError, match="set up while this rank imported main's module"):
        _worker._refuse_a_group_already_there(spec)
    # A forked rank's group was inherited, and the launching process refused that already.
    _worker._refuse_a_group_already_there(_spec_started_by("keep"))


def _spec_started_by(child_start_method: str | None) -> WorkerSpec:
    return WorkerSpec(
        main=None, args=(), kwargs={}, backend="gloo", world_size=1, master_addr="127.0.0.1",
        master_port=1, store_prefix="", timeout=timedelta(seconds=1), threads=None,
        parent_pid=os.getpid(), send_result_from_all=False, child_start_method=child_start_method,
    )  # fmt: skip


_SETS_UP_A_GROUP = """
import multiprocessing
import tempfile

import torch.distributed as dist

if multiprocessing.parent_process() is not None:  # in the spawned rank only
    store = "file://" + tempfile.mkdtemp() + "/store"
    dist.init_process_group("gloo", init_method=store, rank=0, world_size=1)


def main():
    return 1
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_group_set_up_while_a_spawned_rank_imports_main_is_not_restarted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The refusal was a "setup" failure, so max_restarts ran the group again to fail the same.
    (tmp_path / "sets_up_a_group.py").write_text(_SETS_UP_A_GROUP)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("sets_up_a_group")
    with pytest.raises(LaunchError) as info:
        ddp.launch(module.main, nprocs=1, backend="gloo", start_method="spawn", max_restarts=1)
    said = str(info.value)
    assert "set up while this rank imported main's module" in said, said
    assert "(attempt 1 of 2)" in said and "attempt 2 of 2" not in said, said


class _ReduceRaises:
    def __init__(self, error: Exception) -> None:
        self.error = error

    def __reduce__(self) -> Any:
        raise self.error


def _too_deep() -> list[Any]:
    deep: list[Any] = []
    for _ in range(sys.getrecursionlimit() * 20):
        deep = [deep]
    return deep


@pytest.mark.parametrize(
    ("make", "error"),
    [
        (lambda: _ReduceRaises(ValueError("no state yet")), "ValueError: no state yet"),
        (lambda: _ReduceRaises(RuntimeError("closed")), "RuntimeError: closed"),
        (_too_deep, "RecursionError: "),
    ],
    ids=["value-error", "runtime-error", "too-deep"],
)
def test_a_result_whose_pickling_raises_any_error_is_an_unsendable_result(
    make: Any, error: str
) -> None:
    # Only PicklingError, TypeError and AttributeError were caught: a __reduce__ raising
    # ValueError, or a result too deep to pickle, failed as main's own error (restarted).

    from trainperf.ddp._group_exits import reported

    failure = _unsendable(make())
    assert failure.stage == "result"
    assert failure.message.startswith("main returned a value that cannot be pickled")
    assert f"({error}" in failure.message, failure.message
    _, repeats = reported(failure, None)
    assert repeats


def test_a_result_that_cannot_reach_a_gone_launcher_is_not_called_unpicklable() -> None:
    # A dead pipe (the launcher gone) is no fault of the value.
    import multiprocessing

    from trainperf.ddp import _worker

    ours, theirs = multiprocessing.Pipe()
    theirs.close()
    try:
        with pytest.raises(OSError):
            _worker._send_result(ours, 0, [1, 2], None)
    finally:
        ours.close()
