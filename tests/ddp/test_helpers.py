"""trainperf.ddp._helpers: rank(), world_size(), reductions, wrap_model, distributed_loader,
with and without a process group."""

from __future__ import annotations

import multiprocessing
import pickle
import sys
import warnings
from collections.abc import Iterator

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DistributedSampler

import trainperf.ddp as ddp

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
    # A malformed value is an error naming it, never a silent default.
    monkeypatch.setenv("RANK", "garbage")
    with pytest.raises(ValueError, match=r"RANK must be a whole number >= 0 .*, got 'garbage'"):
        ddp.rank()
    monkeypatch.setenv("WORLD_SIZE", "-1")
    with pytest.raises(ValueError, match=r"WORLD_SIZE must be a whole number >= 1 .*'-1'"):
        ddp.world_size()
    monkeypatch.setenv("LOCAL_RANK", "1.5")
    with pytest.raises(ValueError, match=r"LOCAL_RANK must be a whole number >= 0 .*'1\.5'"):
        ddp.local_rank()
    monkeypatch.delenv("RANK")
    assert ddp.rank() == 0  # unset is the default

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
    # drop_last drops a rank's short last batch too: 10 samples, 2 ranks, batches of 4.
    sizes = [len(b) for b in ddp.distributed_loader(list(range(10)), 4, drop_last=True)]
    assert sizes == [4]
    assert [len(b) for b in ddp.distributed_loader(list(range(10)), 4)] == [4, 1]

    with pytest.raises(ValueError, match="batch_size must be an int >= 1, got 0"):
        ddp.distributed_loader(data, 0)
    with pytest.raises(ValueError, match="seed must be an int >= 0, got '1'"):
        ddp.distributed_loader(data, 2, seed="1")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_workers must be an int >= 0, got '2'"):
        ddp.distributed_loader(data, 2, num_workers="2")

    class Stream(torch.utils.data.IterableDataset[int]):
        def __iter__(self) -> Iterator[int]:
            return iter(range(4))

    with pytest.raises(TypeError, match="got Stream, an IterableDataset: DistributedSampler"):
        ddp.distributed_loader(Stream(), 2)
    with pytest.raises(ValueError, match="remove batch_sampler, sampler"):
        ddp.distributed_loader(data, 2, sampler=None, batch_sampler=None)
    with pytest.raises(ValueError, match="epoch must be an int >= 0, got -1"):
        loader.set_epoch(-1)


@pytest.mark.parametrize("number", [np.int64, np.uint8, int])
def test_distributed_loader_takes_numpy_integers_as_python_ints(number: type) -> None:
    # The checks accepted a NumPy batch_size, then BatchSampler refused it ("batch_size
    # should be a positive integer value"); seed and set_epoch's epoch were kept as NumPy.
    data = list(range(12))
    loader = ddp.distributed_loader(data, number(4), seed=number(3), num_workers=number(0))
    loader.set_epoch(number(2))
    sampler = loader.distributed_sampler
    assert [type(v) for v in (loader.batch_size, loader.num_workers, sampler.seed)] == [int] * 3
    assert type(sampler.epoch) is int and loader.epoch == 2
    reference = ddp.distributed_loader(data, 4, seed=3)
    reference.set_epoch(2)
    assert [b.tolist() for b in loader] == [b.tolist() for b in reference]
    assert type(sampler.epoch) is int and loader.epoch == 3


@pytest.mark.parametrize(
    ("given", "kept"),
    [
        ({"prefetch_factor": np.int64(3), "timeout": np.float64(1.5)}, (3, 1.5)),
        ({"prefetch_factor": np.uint8(3), "timeout": np.int64(5)}, (3, 5)),
    ],
)
def test_distributed_loader_takes_numpy_prefetch_factor_and_timeout_as_python_numbers(
    given: dict[str, object], kept: tuple[int, float]
) -> None:
    # batch_size, seed and num_workers were converted, but prefetch_factor and timeout went to
    # DataLoader as NumPy scalars (loader.timeout an np.float64 that json.dumps refuses).
    loader = ddp.distributed_loader(list(range(4)), 2, num_workers=np.int64(1), **given)
    assert (loader.prefetch_factor, loader.timeout) == kept
    assert (type(loader.prefetch_factor), type(loader.timeout)) == tuple(type(v) for v in kept)


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"num_workers": 1, "prefetch_factor": 0}, "prefetch_factor must be None or an int >= 1"),
        ({"prefetch_factor": "2"}, r"prefetch_factor must be None or an int >= 1, got '2'"),
        ({"timeout": float("nan")}, r"timeout must be a finite number of seconds >= 0 \(0: no"),
        ({"timeout": -1}, r"timeout must be a finite number of seconds >= 0 .*, got -1"),
    ],
)
def test_distributed_loader_refuses_a_bad_prefetch_factor_or_timeout(
    given: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        ddp.distributed_loader(list(range(4)), 2, **given)


@pytest.mark.parametrize(
    "given", [{"prefetch_factor": 2}, {"num_workers": 0, "prefetch_factor": 2}]
)
def test_distributed_loader_says_prefetch_factor_needs_workers(given: dict[str, object]) -> None:
    # DataLoader's own: "prefetch_factor option could only be specified in
    # multiprocessing.let num_workers > 0 to enable multiprocessing, ...".
    match = r"prefetch_factor=2 needs num_workers > 0 .*: pass num_workers= with it, or leave"
    with pytest.raises(ValueError, match=match):
        ddp.distributed_loader(list(range(4)), 2, **given)
    loader = ddp.distributed_loader(list(range(4)), 2, prefetch_factor=None)  # None: fine
    assert loader.num_workers == 0 and loader.prefetch_factor is None


@pytest.mark.parametrize("through", ["sampler", "distributed_sampler"])
def test_the_samplers_own_set_epoch_checks_and_converts_the_epoch(through: str) -> None:
    # loader.sampler.set_epoch(e) (the usual DistributedSampler call) skipped
    # DistributedLoader.set_epoch's check: a NumPy epoch was stored as given, -1 accepted.
    loader = ddp.distributed_loader(list(range(8)), 4, seed=1)
    sampler = getattr(loader, through)
    sampler.set_epoch(np.int64(2))
    assert type(sampler.epoch) is int and loader.epoch == 2
    with pytest.raises(ValueError, match="epoch must be an int >= 0, got -1"):
        sampler.set_epoch(-1)
    with pytest.raises(ValueError, match=r"epoch must be an int >= 0, got 1\.0 \(pass int"):
        sampler.set_epoch(1.0)
    assert loader.epoch == 2


def test_a_stray_rank_without_a_world_size_is_refused_with_the_variables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # DistributedSampler said only "Invalid rank 1, rank should be in the interval [0, 0]".
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(ValueError, match=r"rank 1 is not below the world size 1: .*RANK='1', W"):
        ddp.distributed_loader(list(range(4)), 2)
    monkeypatch.delenv("RANK")
    loader = ddp.distributed_loader(list(range(4)), 2)  # built as rank 0 of 1, then iterated
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"rank 2 is not below the world size 2: .*WORLD_SIZE='2'"):
        list(loader)


def test_a_loader_built_before_the_ranks_started_shards_in_each(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Built in one process (a notebook cell), iterated in each rank: it was rank 0 of 1's
    # whole dataset in every rank.
    loader = ddp.distributed_loader(list(range(10)), batch_size=5, shuffle=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert len(loader) == 1 and [b.tolist() for b in loader] == [[1, 3, 5, 7, 9]]


@pytest.mark.slow  # about 2 s: two ranks
def test_a_loader_handed_to_launch_gives_each_rank_its_shard() -> None:
    from tests.ddp import _workers as workers
    from tests.ddp._distributed import fast_start_method

    loader = ddp.distributed_loader(list(range(8)), batch_size=2, seed=1)
    got = ddp.launch_all(workers.samples_of, loader, nprocs=2, backend="gloo",
                         start_method=fast_start_method())  # fmt: skip
    (len0, first), (len1, second) = got
    assert len0 == len1 == 2 and len(first) == len(second) == 4
    assert sorted(first + second) == list(range(8))


@pytest.mark.slow  # about 10 s: spawned ranks import torch
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork is Linux's default")
def test_spawned_ranks_start_their_own_children_as_the_launching_process_would() -> None:
    # Spawn made spawn the ranks' default too: a dataset class defined in main could not be
    # pickled for the DataLoader's workers (it works under torchrun), and each epoch's
    # workers imported torch again.
    from tests.ddp import _workers as workers

    got = ddp.launch_all(workers.local_dataset_in_workers, nprocs=2, backend="gloo",
                         start_method="spawn")  # fmt: skip
    expected = multiprocessing.get_start_method(True) or multiprocessing.get_all_start_methods()[0]
    assert got == [(expected, [0, 1, 2, 3])] * 2


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork is Linux's")
def test_forked_ranks_keep_fork_for_their_children() -> None:
    # Only spawned ranks take the launching process's default: a forked rank given a fork
    # server it cannot use (the launcher's) failed every DataLoader with workers.
    from tests.ddp import _workers as workers

    saved = multiprocessing.get_start_method(allow_none=True)
    multiprocessing.set_start_method("forkserver", force=True)  # the launcher's default
    try:
        got = ddp.launch_all(
            workers.start_method_here, nprocs=2, backend="gloo", start_method="fork"
        )
    finally:
        multiprocessing.set_start_method(saved, force=True)
    assert got == ["fork", "fork"]


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


SRUN_TASK = {"SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0"}
BATCH_SCRIPT = {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0"}


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        (SRUN_TASK, (3, 1, 8, False)),  # one task of an srun step: SLURM's numbers
        ({**SRUN_TASK, "RANK": "5", "LOCAL_RANK": "2", "WORLD_SIZE": "16"}, (5, 2, 16, False)),
        ({**SRUN_TASK, "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}, (0, 0, 1, True)),  # sbatch
        ({"SLURM_LOCALID": "1"}, (0, 0, 1, True)),  # not in an srun step
        # A script the batch script of a --ntasks=4 job runs directly is one process.
        (BATCH_SCRIPT, (0, 0, 1, True)),
        ({**BATCH_SCRIPT, "SLURM_STEP_ID": "4294967294"}, (0, 0, 1, True)),
        # `srun --preserve-env -n 4` in an 8-task job: SLURM_NTASKS stays the job's, and a
        # sampler split the data 8 ways, so half of it was never read.
        ({**SRUN_TASK, "SLURM_STEP_NUM_TASKS": "4"}, (3, 1, 4, False)),
        ({**SRUN_TASK, "SLURM_STEP_NUM_TASKS": "1", "SLURM_PROCID": "0"}, (0, 0, 1, True)),
    ],
)
def test_an_srun_task_knows_its_rank_before_any_process_group(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], expected: tuple[int, int, int, bool]
) -> None:
    # Under srun, torch.cuda.set_device(ddp.local_rank()) put every task on GPU 0, and
    # `if ddp.is_main_process(): prepare()` ran on every task.
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEPID")
    for name in (*names, "SLURM_STEP_ID", "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("SLURM_LOCALID", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert (ddp.rank(), ddp.local_rank(), ddp.world_size(), ddp.is_main_process()) == expected


@pytest.mark.parametrize(
    ("n", "batch_size", "shard"),
    [(1, 1, "0 samples"), (3, 2, "1 sample, fewer than batch_size=2"), (0, 1, "0 samples")],
)
def test_a_loader_that_yields_no_batch_on_a_rank_is_warned_about_once(
    monkeypatch: pytest.MonkeyPatch, n: int, batch_size: int, shard: str
) -> None:
    # drop_last with fewer samples per rank than a batch: every epoch was silently empty.
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    loader = ddp.distributed_loader(list(range(n)), batch_size=batch_size, drop_last=n > 0)
    with pytest.warns(UserWarning, match=rf"yields no batch on rank 1 of 2: its shard .*{shard}"):
        assert list(loader) == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert list(loader) == []  # said once per loader
        assert len(list(ddp.distributed_loader(list(range(4)), batch_size=2, drop_last=True))) == 1


def test_a_sampler_without_a_length_still_iterates() -> None:
    # DataLoader never asks a sampler for its length, so neither may the empty-shard check:
    # a streaming DistributedSampler whose __len__ raises TypeError must still iterate.
    class Endless(DistributedSampler[int]):
        def __len__(self) -> int:
            raise TypeError("endless sampler has no length")

    data = list(range(8))
    loader = ddp.DistributedLoader(data, 2, Endless(data, num_replicas=1, rank=0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(list(loader)) == 4


def _shards_with_a_rank_0_peek(monkeypatch: pytest.MonkeyPatch, set_after: bool) -> dict:
    shards = {}
    for r in (0, 1):
        monkeypatch.setenv("RANK", str(r))
        monkeypatch.setenv("WORLD_SIZE", "2")
        loader = ddp.distributed_loader(list(range(8)), 2, seed=0)
        loader.set_epoch(0)
        if r == 0:
            next(iter(loader))  # a look at one batch, on rank 0 only
        if set_after:
            loader.set_epoch(0)
        shards[r] = sorted(i for b in loader for i in b.tolist())
    return shards


def test_a_peek_on_one_rank_that_puts_its_shuffle_out_of_step_is_warned(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A rank-0-only next(iter(loader)) between set_epoch and the loop counted as that
    # rank's pass: it trained on the next epoch's shuffle, its shard overlapping the other
    # rank's, and nothing said so.
    with pytest.warns(UserWarning, match=r"rank 0's DistributedLoader .* counted as epoch 0, "):
        shards = _shards_with_a_rank_0_peek(monkeypatch, set_after=False)
    assert set(shards[0]) & set(shards[1])  # what the warning is about
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # set_epoch after the peek: in step, no warning
        shards = _shards_with_a_rank_0_peek(monkeypatch, set_after=True)
    assert sorted(shards[0] + shards[1]) == list(range(8))


@pytest.mark.parametrize("samples", [6, 7])  # 7: a short last batch that drop_last drops
def test_whole_passes_and_len_bounded_loops_leave_no_pass_open(samples: int) -> None:
    loader = ddp.distributed_loader(list(range(samples)), 2, seed=0, drop_last=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            list(loader)
        for _ in range(2):  # never asks past the last batch
            _ = [b for _, b in zip(range(len(loader)), loader, strict=False)]
    assert loader.epoch == 4
    next(iter(loader))
    with pytest.warns(UserWarning, match="right before each epoch's loop"):
        next(iter(loader))
    next(iter(loader))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per loader
        list(loader)


def test_a_sampler_pickled_before_its_epoch_became_a_property_loads() -> None:
    loader = ddp.distributed_loader(list(range(8)), 2, seed=0)
    loader.set_epoch(3)
    sampler = loader.distributed_sampler
    state = dict(sampler.__dict__)
    state["epoch"] = state.pop("_epoch")  # as such a pickle holds it
    old = object.__new__(type(sampler))
    old.__setstate__(state)
    assert old.epoch == 3 and list(old) == list(pickle.loads(pickle.dumps(sampler)))
