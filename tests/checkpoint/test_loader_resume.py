"""trainperf.checkpoint: exact resume for samplers that draw lazily from a shared generator,
for loaders with persistent workers restored after an end-of-epoch checkpoint, and for
loaders restored with another batch size (:mod:`trainperf.checkpoint._loader_resume`)."""

from __future__ import annotations

import os
import random
import signal
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, Sampler

from trainperf.checkpoint import Checkpointer
from trainperf.checkpoint._loader_resume import tail_pulls
from trainperf.checkpoint._loader_state import loader_state, restore_loader, track
from trainperf.checkpoint._sampler_states import sampler_chain
from trainperf.ddp import distributed_loader

_DATA = list(range(100))


def _lazy_loader() -> DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    sampler = RandomSampler(_DATA, replacement=True, num_samples=100, generator=g)
    return DataLoader(_DATA, batch_size=4, sampler=sampler)


def _batches(loader: DataLoader[Any]) -> list[list[int]]:
    return [b.tolist() for b in loader]


@pytest.mark.parametrize("k", [8, 16])
def test_a_lazily_drawing_sampler_resumes_without_repeats(tmp_path: Path, k: int) -> None:
    # RandomSampler(replacement=True) draws 32 indices at a time from its generator: K=8 and
    # K=16 batches of 4 end exactly on such a draw.
    torch.manual_seed(1)
    straight = _lazy_loader()
    Checkpointer(tmp_path / "ref").restore({"loader": straight})
    reference = _batches(straight)
    torch.manual_seed(1)
    first = _lazy_loader()
    ck = Checkpointer(tmp_path / "run")
    ck.restore({"loader": first})
    got = []
    for i, batch in enumerate(first):
        got.append(batch.tolist())
        if i + 1 == k:
            ck.save({"loader": first}, step=k)
            break
    resumed = _lazy_loader()
    assert Checkpointer(tmp_path / "run").restore({"loader": resumed}) == k
    got += _batches(resumed)
    assert got == reference


def _persistent_loader() -> DataLoader[Any]:
    return DataLoader(
        list(range(40)), batch_size=4, shuffle=True, num_workers=2, persistent_workers=True
    )


def _epochs(loader: DataLoader[Any], n: int) -> list[list[list[int]]]:
    return [_batches(loader) for _ in range(n)]


@pytest.mark.slow
def test_persistent_workers_resume_exactly_after_an_end_of_epoch_checkpoint(
    tmp_path: Path,
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DataLoader's worker-count advice on a small host
        torch.manual_seed(1)
        straight = _persistent_loader()
        Checkpointer(tmp_path / "ref").restore({"loader": straight})
        reference = _epochs(straight, 3)
        torch.manual_seed(1)
        first = _persistent_loader()
        ck = Checkpointer(tmp_path / "run")
        ck.restore({"loader": first})
        got = _epochs(first, 1)
        ck.save({"loader": first}, step=1)  # the usual end-of-epoch checkpoint
        torch.manual_seed(99)  # a fresh process: the restore must set what matters
        resumed = _persistent_loader()
        assert Checkpointer(tmp_path / "run").restore({"loader": resumed}) == 1
        got += _epochs(resumed, 2)
        del straight, first, resumed  # their persistent workers end with them
    assert got == reference


@pytest.mark.slow
def test_a_mid_epoch_checkpoint_after_an_end_of_epoch_resume_replays_the_saved_order(
    tmp_path: Path,
) -> None:
    # Before: the pass after a restore draws its workers' seed from a scratch generator,
    # swapped in while the new pool pulls its first indices, so the sampler's starting
    # states were read from it: a save mid-way through that pass recorded the scratch
    # generator's state, and its resume repeated and skipped samples.
    def loader() -> DataLoader[Any]:
        return DataLoader(
            list(range(40)),
            batch_size=4,
            shuffle=True,
            num_workers=2,
            persistent_workers=True,
            generator=torch.Generator().manual_seed(3),
        )

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DataLoader's worker-count advice on a small host
        straight = loader()
        reference = [b for epoch in _epochs(straight, 2) for b in epoch]
        first = loader()
        Checkpointer(tmp_path).restore({"loader": first})
        got = _batches(first)
        Checkpointer(tmp_path).save({"loader": first}, step=1)  # end of epoch 0
        second = loader()
        assert Checkpointer(tmp_path).restore({"loader": second}) == 1
        for batch in second:
            got.append(batch.tolist())
            if len(got) == 13:  # 3 batches into epoch 1
                Checkpointer(tmp_path).save({"loader": second}, step=2)
                break
        third = loader()
        assert Checkpointer(tmp_path).restore({"loader": third}) == 2
        got += _batches(third)
        del straight, first, second, third  # their persistent workers end with them
    assert got == reference


def _stopped_early(directory: Path, stop: str) -> list[list[int]]:
    """The first 4 of a loader's 7 batches, the loop stopped (by a ``max_steps`` of its own,
    or by a preemption stop) and saved after the inner loop."""
    loader = DataLoader(list(range(20)), batch_size=3, shuffle=True)
    ck = Checkpointer(directory)
    ck.restore({"loader": loader})
    seen: list[list[int]] = []
    with ck.preemption() as preemption:
        for i, batch in enumerate(loader):
            seen.append(batch.tolist())
            if i + 1 == 4:
                if stop == "preemption":
                    os.kill(os.getpid(), signal.SIGTERM)
                    assert preemption.requested
                break
    ck.save({"loader": loader}, step=4)
    return seen


@pytest.mark.parametrize("stop", ["max_steps", "preemption"])
def test_a_pass_the_loop_broke_out_of_resumes_where_it_was_left(tmp_path: Path, stop: str) -> None:
    torch.manual_seed(0)
    reference = _batches(DataLoader(list(range(20)), batch_size=3, shuffle=True))
    torch.manual_seed(0)
    first = _stopped_early(tmp_path, stop)
    loader = DataLoader(list(range(20)), batch_size=3, shuffle=True)
    torch.manual_seed(123)  # the resumed process starts elsewhere: the checkpoint decides
    assert Checkpointer(tmp_path).restore({"loader": loader}) == 4
    assert first + _batches(loader) == reference  # not a batch skipped or repeated


class _GlobalShuffle(Sampler[int]):
    """A custom sampler that shuffles with NumPy's or Python's global generator."""

    def __init__(self, n: int, which: str) -> None:
        self.n, self.which = n, which

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        if self.which == "numpy":
            return iter(np.random.permutation(self.n).tolist())
        order = list(range(self.n))
        random.shuffle(order)
        return iter(order)


def _global_shuffled(
    directory: Path, which: str, total: int, *, stop: int | None = None, seed: int = 0
) -> list[tuple[list[int], float, float]]:
    """Batches, each with a draw from NumPy's and Python's generators (an augmentation in
    the main process), until ``total`` steps, or a save at ``stop``."""
    np.random.seed(seed)
    random.seed(seed)
    torch.manual_seed(seed)
    loader = DataLoader(list(range(20)), batch_size=4, sampler=_GlobalShuffle(20, which))
    ck = Checkpointer(directory)
    step = ck.restore({"loader": loader})
    out: list[tuple[list[int], float, float]] = []
    while step < total:
        for batch in loader:
            out.append((batch.tolist(), float(np.random.rand()), random.random()))
            step += 1
            if step == stop:
                ck.save({"loader": loader}, step=step)
                return out
            if step == total:
                break
    return out


@pytest.mark.parametrize("which", ["numpy", "python"])
def test_a_sampler_shuffling_with_a_global_generator_resumes_exactly(
    tmp_path: Path, which: str
) -> None:
    reference = _global_shuffled(tmp_path / "ref", which, 12)
    got = _global_shuffled(tmp_path / "run", which, 12, stop=2)
    got += _global_shuffled(tmp_path / "run", which, 12, seed=1)  # seeds differ: the file decides
    assert got == reference  # the order, and the loop's own draws after the resume


def test_another_batch_size_resumes_the_saved_order_at_the_consumed_samples(
    tmp_path: Path,
) -> None:
    # Before: the pass restarted in a fresh order ("its batch_size 6 -> 5 changed"), so the
    # saved pass's unseen samples were never seen.
    torch.manual_seed(0)
    saved = DataLoader(list(range(20)), batch_size=6, shuffle=True)  # 4 batches per pass
    ck = Checkpointer(tmp_path)
    ck.restore({"loader": saved})
    it = iter(saved)
    order = [x for _ in range(2) for x in next(it).tolist()]
    ck.save({"loader": saved}, step=2)
    order += [x for b in it for x in b.tolist()]
    resumed = DataLoader(list(range(20)), batch_size=5, shuffle=True)  # 4 batches too
    with pytest.warns(
        UserWarning, match=r"batch size changed from 6 to 5 .*after 2 batches of 5 \(sample 10\)"
    ):
        ck.restore({"loader": resumed})
    rest = _batches(resumed)
    assert [x for b in rest for x in b] == order[10:]  # 12 consumed: the last 2 seen again


class _NoLength(torch.utils.data.Dataset[int]):
    """A map-style dataset whose ``__len__`` raises (the sampler says what to load)."""

    def __getitem__(self, i: int) -> int:
        return i

    def __len__(self) -> int:
        raise NotImplementedError("a stream of unknown length")


def test_a_dataset_whose_len_raises_still_saves_and_resumes(tmp_path: Path) -> None:
    loader = DataLoader(_NoLength(), batch_size=2, sampler=list(range(10)))
    ck = Checkpointer(tmp_path)
    ck.restore({"loader": loader})
    it = iter(loader)
    first = [next(it).tolist(), next(it).tolist()]
    ck.save({"loader": loader}, step=2)
    resumed = DataLoader(_NoLength(), batch_size=2, sampler=list(range(10)))
    assert Checkpointer(tmp_path).restore({"loader": resumed}) == 2
    assert first + _batches(resumed) == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]


class _OwnGenerators(Sampler[int]):
    """A sampler a user wrote, shuffling with generators of its own under its own names."""

    def __init__(self, n: int, kind: str) -> None:
        self.n, self.kind = n, kind
        self.rng: Any = {
            "torch": torch.Generator().manual_seed(0),
            "numpy Generator": np.random.default_rng(0),
            "numpy RandomState": np.random.RandomState(0),
            "random.Random": random.Random(0),
        }[kind]

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        if isinstance(self.rng, torch.Generator):
            return iter(torch.randperm(self.n, generator=self.rng).tolist())
        if isinstance(self.rng, random.Random):
            order = list(range(self.n))
            self.rng.shuffle(order)
            return iter(order)
        return iter(self.rng.permutation(self.n).tolist())


def _own_shuffled(directory: Path, kind: str, *, stop: int | None = None) -> list[list[int]]:
    """12 batches (over 3 passes of 5) of a loader with an :class:`_OwnGenerators`
    sampler, or those until a save at ``stop``."""
    loader = DataLoader(list(range(20)), batch_size=4, sampler=_OwnGenerators(20, kind))
    ck = Checkpointer(directory)
    step = ck.restore({"loader": loader})
    out: list[list[int]] = []
    while step < 12:
        for batch in loader:
            out.append(batch.tolist())
            step += 1
            if step in (stop, 12):
                if step == stop:
                    ck.save({"loader": loader}, step=step)
                return out
    return out


@pytest.mark.parametrize("kind", ["torch", "numpy Generator", "numpy RandomState", "random.Random"])
@pytest.mark.parametrize("stop", [5, 7])  # at a pass's end, and in the middle of the second
def test_a_sampler_shuffling_with_generators_of_its_own_resumes_exactly(
    tmp_path: Path, kind: str, stop: int
) -> None:
    # Before: only an attribute called ``generator`` holding a torch.Generator was recorded,
    # so a resumed pass (and every later one) took the order of the sampler's first pass.
    reference = _own_shuffled(tmp_path / "ref", kind)
    got = _own_shuffled(tmp_path / "run", kind, stop=stop)
    got += _own_shuffled(tmp_path / "run", kind)
    assert got == reference


class _Augmenting(torch.utils.data.Dataset[tuple[int, float]]):
    """A dataset that augments from a generator of its own, in ``__getitem__``."""

    def __init__(self, kind: str) -> None:
        self.rng: Any = {
            "torch": torch.Generator().manual_seed(0),
            "numpy Generator": np.random.default_rng(0),
            "numpy RandomState": np.random.RandomState(0),
            "random.Random": random.Random(0),
        }[kind]

    def __len__(self) -> int:
        return 20

    def __getitem__(self, i: int) -> tuple[int, float]:
        if isinstance(self.rng, torch.Generator):
            return i, float(torch.rand(1, generator=self.rng))
        return i, float(self.rng.random())


def _augmented(
    directory: Path,
    make: Callable[[], DataLoader[Any]],
    *,
    stop: int | None = None,
    total: int = 12,
) -> list[Any]:
    """``total`` batches of indices and augmentations from ``make()``'s loader (an
    :class:`_Augmenting` dataset loaded in this process), or those until a save at ``stop``."""
    loader = make()
    ck = Checkpointer(directory)
    step = ck.restore({"loader": loader})
    out: list[Any] = []
    while step < total:
        for index, noise in loader:
            out.append((index.tolist(), noise.tolist()))
            step += 1
            if step == stop:
                ck.save({"loader": loader}, step=step)
                return out
            if step == total:
                return out
    return out


@pytest.mark.parametrize("kind", ["torch", "numpy Generator", "numpy RandomState", "random.Random"])
@pytest.mark.parametrize("stop", [3, 5])  # in the middle of the first pass, and at its end
def test_a_dataset_augmenting_with_generators_of_its_own_resumes_exactly(
    tmp_path: Path, kind: str, stop: int
) -> None:
    # Before: only the global generators and the sampler's were saved, so a dataset that
    # augments from its own generator started it again from its seed after a resume.
    def make() -> DataLoader[Any]:
        return DataLoader(_Augmenting(kind), batch_size=4, shuffle=True)

    torch.manual_seed(0)
    reference = _augmented(tmp_path / "ref", make)
    torch.manual_seed(0)
    got = _augmented(tmp_path / "run", make, stop=stop)
    got += _augmented(tmp_path / "run", make)
    assert got == reference


def _sharing_loader() -> DataLoader[Any]:
    dataset = _Augmenting("torch")
    return DataLoader(dataset, batch_size=4, shuffle=True, generator=dataset.rng)


def _sharing_lazy_sampler() -> DataLoader[Any]:
    # RandomSampler(replacement=True) draws 32 indices at a time: 40 a pass are drawn at
    # its first pull and at its ninth (after 8 batches of 4).
    dataset = _Augmenting("torch")
    sampler = RandomSampler(dataset, replacement=True, num_samples=40, generator=dataset.rng)
    return DataLoader(dataset, batch_size=4, sampler=sampler)


@pytest.mark.parametrize(
    ("make", "stop", "total"),
    [
        (_sharing_loader, 2, 12),  # in the middle of the first pass
        (_sharing_loader, 5, 12),  # at its last batch: the sampler's tail draw comes after
        (_sharing_lazy_sampler, 8, 25),  # the next pull draws from the shared generator
        (_sharing_lazy_sampler, 10, 25),
    ],
)
def test_a_dataset_generator_the_sampler_shuffles_with_too_resumes_exactly(
    tmp_path: Path, make: Callable[[], DataLoader[Any]], stop: int, total: int
) -> None:
    # Before: the resumed pass's replay of the sampler left the shared generator where the
    # sampler's draws alone put it, discarding the dataset's draws restored with it.
    torch.manual_seed(0)
    reference = _augmented(tmp_path / "ref", make, total=total)
    torch.manual_seed(0)
    got = _augmented(tmp_path / "run", make, stop=stop, total=total)
    got += _augmented(tmp_path / "run", make, total=total)
    assert got == reference


@pytest.mark.parametrize("owns", ["none", "another kind"])
def test_a_dataset_with_other_generators_than_the_saved_ones_warns(
    tmp_path: Path, owns: str
) -> None:
    loader = DataLoader(_Augmenting("torch"), batch_size=4)
    ck = Checkpointer(tmp_path)
    ck.restore({"loader": loader})
    ck.save({"loader": loader}, step=1)
    dataset: Any = list(range(20)) if owns == "none" else _Augmenting("numpy Generator")
    resumed = DataLoader(dataset, batch_size=4)
    with pytest.warns(UserWarning, match=r"dataset owns [01] random generators, the checkpoint 1"):
        ck.restore({"loader": resumed})
    if owns == "another kind":  # left as it was
        assert dataset.rng.random() == np.random.default_rng(0).random()
    first = next(iter(resumed))
    assert (first if owns == "none" else first[0]).tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("generator", [False, True])
def test_a_pass_saved_before_its_first_batch_resumes_with_that_pass(
    tmp_path: Path, generator: bool
) -> None:
    # Before: the pass's iterator had drawn its workers' base seed before the save, but its
    # sampler had not drawn yet, so the resumed run drew the seed again and shuffled otherwise.
    def make() -> DataLoader[Any]:
        gen = torch.Generator().manual_seed(3) if generator else None
        return DataLoader(list(range(20)), batch_size=4, shuffle=True, generator=gen)

    torch.manual_seed(0)
    straight = make()
    Checkpointer(tmp_path / "ref").restore({"loader": straight})
    reference = [_batches(straight) for _ in range(3)]
    torch.manual_seed(0)
    first = make()
    ck = Checkpointer(tmp_path / "run")
    ck.restore({"loader": first})
    got = [_batches(first)]
    it = iter(first)  # the second pass begins: nothing taken from it yet
    ck.save({"loader": first}, step=5)
    del it
    torch.manual_seed(99)
    resumed = make()
    assert Checkpointer(tmp_path / "run").restore({"loader": resumed}) == 5
    got += [_batches(resumed) for _ in range(2)]
    assert got == reference


def _seeded_loader(n: int, batch_size: int, drop_last: bool = False) -> DataLoader[Any]:
    """A loader whose sampler shuffles with a generator of its own: it draws one more
    permutation on its way to StopIteration, which the next pass's order depends on."""
    data = list(range(n))
    sampler = RandomSampler(data, generator=torch.Generator().manual_seed(0))
    return DataLoader(data, batch_size=batch_size, sampler=sampler, drop_last=drop_last)


def _samples(loader: DataLoader[Any]) -> list[int]:
    return [x for b in loader for x in b.tolist()]


@pytest.mark.parametrize(
    ("n", "old", "new", "drop_last"),
    [(16, 4, 2, False), (18, 4, 3, False), (18, 4, 3, True), (16, 4, 8, False)],
)
def test_a_finished_pass_resumed_with_another_batch_size_shuffles_the_next_pass_as_before(
    tmp_path: Path, n: int, old: int, new: int, drop_last: bool
) -> None:
    # Before: the tail of the saved pass was replayed as `position` batches of the new size,
    # short of the sampler's end with a smaller one, so its end-of-pass draw was never made
    # and the next pass came in another order than the uninterrupted run's.
    # The uninterrupted run's next pass, in batches of the new size (drop_last drops other
    # samples), is the same order as in batches of the old one.
    straight, straight_new = _seeded_loader(n, old, drop_last), _seeded_loader(n, new, drop_last)
    _samples(straight), _samples(straight_new)
    reference = _samples(straight_new)
    assert reference[: n - n % old if drop_last else n] == _samples(straight)
    first = _seeded_loader(n, old, drop_last)
    ck = Checkpointer(tmp_path)
    ck.restore({"loader": first})
    for i, _ in enumerate(first):
        if i + 1 == len(first):
            ck.save({"loader": first}, step=i + 1)  # inside the loop, at the pass's last batch
            break
    resumed = _seeded_loader(n, new, drop_last)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert Checkpointer(tmp_path).restore({"loader": resumed}) == len(first)
    assert _samples(resumed) == reference


@pytest.mark.parametrize(("taken", "new"), [(2, 2), (2, 8), (3, 2), (3, 6)])
@pytest.mark.parametrize("shuffle", ["generator", "global"])
def test_a_pass_resumed_with_another_batch_size_is_followed_by_the_uninterrupted_order(
    tmp_path: Path, taken: int, new: int, shuffle: str
) -> None:
    def make(batch_size: int) -> DataLoader[Any]:
        if shuffle == "generator":
            return _seeded_loader(24, batch_size)
        return DataLoader(list(range(24)), batch_size=batch_size, shuffle=True)

    torch.manual_seed(0)
    straight = make(4)
    passes = [_samples(straight) for _ in range(3)]
    torch.manual_seed(0)
    first = make(4)
    ck = Checkpointer(tmp_path)
    ck.restore({"loader": first})
    it = iter(first)
    for _ in range(taken):
        next(it)
    ck.save({"loader": first}, step=taken)
    torch.manual_seed(123)  # a fresh process: the checkpoint decides
    resumed = make(new)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 12 consumed, batch size 8: 4 samples seen again
        Checkpointer(tmp_path).restore({"loader": resumed})
    again = taken * 4 - taken * 4 // new * new
    assert _samples(resumed) == passes[0][taken * 4 - again :]
    assert [_samples(resumed) for _ in range(2)] == passes[1:]


class _LengthGrouped(Sampler[int]):
    """A length-grouped sampler (a bucketing one, as Hugging Face's): one shuffle, each run of
    ``2 * batch_size`` of it sorted, so its order depends on the batch size it was built with."""

    def __init__(self, n: int, batch_size: int) -> None:
        self.n, self.batch_size = n, batch_size

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        perm = torch.randperm(self.n, generator=torch.Generator().manual_seed(0)).tolist()
        run = 2 * self.batch_size
        return iter([i for s in range(0, self.n, run) for i in sorted(perm[s : s + run])])


def _grouped_loader(batch_size: int) -> DataLoader[Any]:
    return DataLoader(
        list(range(24)), batch_size=batch_size, sampler=_LengthGrouped(24, batch_size)
    )


def test_a_sampler_ordered_by_the_batch_size_restarts_its_pass_with_another_one(
    tmp_path: Path,
) -> None:
    # The new sampler orders the samples otherwise: resumed after the 12 samples consumed
    # as if its order were the saved one, samples 1 and 4 would never be seen and 11 and 18
    # twice, silently.
    first = _grouped_loader(4)
    ck = Checkpointer(tmp_path)
    ck.restore({"loader": first})
    it = iter(first)
    for _ in range(3):
        next(it)
    ck.save({"loader": first}, step=3)
    resumed = _grouped_loader(6)
    with pytest.warns(UserWarning, match=r"loader 'loader': .*: the pass restarts"):
        Checkpointer(tmp_path).restore({"loader": resumed})
    assert _samples(resumed) == list(_LengthGrouped(24, 6))


@pytest.mark.parametrize(
    ("make", "pulls"),
    [(_grouped_loader, 6), (lambda batch_size: _seeded_loader(24, batch_size), 12)],
    ids=["a sampler ordered by the batch size", "RandomSampler"],
)
def test_a_finished_pass_replays_its_whole_order_only_for_samplers_the_batch_size_leaves_alone(
    make: Callable[[int], DataLoader[Any]], pulls: int
) -> None:
    # The finished pass drew its sampler's whole order: in batches of 2 that is the new
    # loader's whole pass (12 pulls) only for a sampler whose order the batch size leaves
    # alone; any other one replays the saved position (6 pulls).
    old = make(4)
    track(old)
    for _ in old:
        pass
    saved = loader_state(old)
    assert saved is not None and saved["position"] == 6
    new = make(2)
    assert tail_pulls(new, sampler_chain(new.batch_sampler), saved) == pulls


def _sharded(replicas: int, batch_size: int) -> DataLoader[Any]:
    data = list(range(9))
    sampler = DistributedSampler(data, num_replicas=replicas, rank=0, shuffle=True, seed=1)
    return DataLoader(data, batch_size=batch_size, sampler=sampler)


@pytest.mark.parametrize("batch_size", [1, 2])
def test_another_world_size_of_the_same_shard_size_restarts_the_pass(
    tmp_path: Path, batch_size: int
) -> None:
    # 9 samples on 3 or 4 replicas are 3 per rank either way: unless the world size is
    # recorded, the change goes unseen and the pass resumes in the other world size's order
    # (after its first 2 samples), silently; with another batch size as well, the batch
    # size alone must not be taken for what changed.
    first = _sharded(3, 1)
    ck = Checkpointer(tmp_path)
    ck.restore({"loader": first})
    it = iter(first)
    next(it), next(it)
    ck.save({"loader": first}, step=2)
    resumed = _sharded(4, batch_size)
    with pytest.warns(UserWarning, match=r"loader 'loader': .*: the pass restarts"):
        Checkpointer(tmp_path).restore({"loader": resumed})
    assert _samples(resumed) == _samples(_sharded(4, batch_size))


def test_a_file_without_the_world_size_restarts_a_pass_of_another_batch_size() -> None:
    # Files saved before the world size was recorded cannot tell that it stayed the same.
    old = _seeded_loader(24, 4)
    track(old)
    it = iter(old)
    for _ in range(3):
        next(it)
    saved = loader_state(old)
    assert saved is not None
    saved["shape"] = {k: v for k, v in saved["shape"].items() if k not in ("replicas", "rank")}
    new = _seeded_loader(24, 6)
    with pytest.warns(UserWarning, match=r"loader 'l': .*: the pass restarts"):
        restore_loader(new, saved, "l")
    assert len(_samples(new)) == 24


def test_a_loader_without_a_distributed_sampler_resumes_exactly_on_another_world_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Every rank reads the whole dataset in the same order, whatever the world size: the
    # process group's must not count as the pass's layout (it did: the pass restarted).
    straight = _samples(_seeded_loader(24, 4))
    old = _seeded_loader(24, 4)
    track(old)
    it = iter(old)
    for _ in range(3):
        next(it)
    saved = loader_state(old)  # no process group: world size 1
    assert saved is not None
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 1)
    new = _seeded_loader(24, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        restore_loader(new, saved, "l")
    assert _samples(new) == straight[12:]


@pytest.mark.parametrize(("taken", "new"), [(3, 6), (3, 5)])
def test_distributed_loader_resumes_with_another_batch_size_in_the_saved_order(
    taken: int, new: int
) -> None:
    straight = distributed_loader(list(range(24)), batch_size=4, seed=3)
    passes = [_samples(straight) for _ in range(2)]
    old = distributed_loader(list(range(24)), batch_size=4, seed=3)
    track(old)
    it = iter(old)
    for _ in range(taken):
        next(it)
    saved = loader_state(old)
    resumed = distributed_loader(list(range(24)), batch_size=new, seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 12 consumed, batch size 5: 2 samples seen again
        restore_loader(resumed, saved, "l")
    assert _samples(resumed) == passes[0][taken * 4 // new * new :]
    assert _samples(resumed) == passes[1]
