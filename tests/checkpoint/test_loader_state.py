"""trainperf.checkpoint._loader_state: a tracked DataLoader resumed mid-epoch yields exactly
what the uninterrupted one would have, without loading the batches it skips."""

from __future__ import annotations

import copy
import itertools
import pickle
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

from trainperf.checkpoint._loader_state import loader_state, restore_loader, track
from trainperf.ddp import DistributedLoader, distributed_loader
from trainperf.loader import TunedDataLoader

DATA = TensorDataset(torch.arange(40))


class Recording(Dataset[torch.Tensor]):
    """Remembers every index it was asked for (in this process)."""

    def __init__(self) -> None:
        self.asked: list[int] = []

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> torch.Tensor:
        self.asked.append(i)
        return torch.tensor(i)


def _values(batch: Any) -> list[int]:
    t = batch[0] if isinstance(batch, (list, tuple)) else batch
    return [int(v) for v in t.reshape(-1).tolist()]


def _run(
    loader: DataLoader[Any], epochs: int, stop: tuple[int, int] | None
) -> tuple[list[Any], Any]:
    """Batches and interleaved torch draws (a dropout's) over ``epochs``; the loader's state
    and torch's at epoch/batch ``stop`` too."""
    seen: list[Any] = []
    saved = None
    for epoch in range(epochs):
        for i, batch in enumerate(loader):
            seen += [_values(batch), torch.rand(1).item()]
            if stop == (epoch, i):
                saved = (copy.deepcopy(loader_state(loader)), torch.get_rng_state(), len(seen))
    return seen, saved


def _resume_matches(make: Callable[[], DataLoader[Any]], stop: tuple[int, int] = (1, 3)) -> None:
    torch.manual_seed(0)
    loader = make()
    track(loader)
    straight, saved = _run(loader, 3, stop=stop)
    assert saved is not None
    state, torch_state, n = saved
    torch.manual_seed(12345)  # another process, seeded otherwise: restore must fix it all
    fresh = make()
    restore_loader(fresh, state, "loader")
    torch.set_rng_state(torch_state)  # Checkpointer.restore does this too
    rest, _ = _run(fresh, 2 if stop[1] < len(DATA) // 4 - 1 else 3 - stop[0] - 1, stop=None)
    assert straight[:n] + rest == straight
    assert isinstance(fresh, type(make()))


LOADERS: dict[str, Callable[[], DataLoader[Any]]] = {
    "shuffle": lambda: DataLoader(DATA, batch_size=4, shuffle=True),
    "own generator": lambda: DataLoader(
        DATA, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(5)
    ),
    "batch_size=None": lambda: DataLoader(DATA, batch_size=None, shuffle=True),
    "distributed_loader": lambda: distributed_loader(DATA, 4, seed=3),
    "TunedDataLoader": lambda: TunedDataLoader(DATA, batch_size=4, shuffle=True),
}
SLOW_LOADERS: dict[str, Callable[[], DataLoader[Any]]] = {
    "2 workers": lambda: DataLoader(DATA, batch_size=4, shuffle=True, num_workers=2),
    "persistent workers": lambda: DataLoader(
        DATA, batch_size=4, shuffle=True, num_workers=2, persistent_workers=True
    ),
    "distributed_loader, 2 workers": lambda: distributed_loader(DATA, 4, seed=3, num_workers=2),
}


@pytest.mark.parametrize("kind", sorted(LOADERS))
def test_a_resumed_pass_continues_exactly(kind: str) -> None:
    _resume_matches(LOADERS[kind])


@pytest.mark.slow  # DataLoader workers start every epoch
@pytest.mark.parametrize("kind", sorted(SLOW_LOADERS))
def test_a_resumed_pass_with_workers_continues_exactly(kind: str) -> None:
    _resume_matches(SLOW_LOADERS[kind])


def _tuned(asked: bool, workers: int) -> Callable[[], DataLoader[Any]]:
    """A TunedDataLoader as autotune_loader builds it: the caller asked for a persistent
    pool (``asked``) or not, and the tuner chose ``workers`` (persistent when any)."""

    def make() -> DataLoader[Any]:
        loader = TunedDataLoader(
            DATA,
            batch_size=4,
            shuffle=True,
            num_workers=workers,
            persistent_workers=workers > 0,
        )
        loader._persistent_asked = asked
        return loader

    return make


def test_a_tuned_loader_restored_at_an_epoch_s_end_draws_as_its_callers_loader() -> None:
    # Before: restore decided from the tuner's persistent_workers whether the next pass
    # draws, not from what the caller asked: a pool asked for but not chosen drew again.
    _resume_matches(_tuned(asked=True, workers=0), stop=(1, len(DATA) // 4 - 1))


@pytest.mark.slow  # DataLoader workers start
def test_a_tuned_loader_made_persistent_restored_at_an_epoch_s_end_draws_as_its_callers() -> None:
    _resume_matches(_tuned(asked=False, workers=1), stop=(1, len(DATA) // 4 - 1))


@pytest.mark.parametrize("kind", ["own generator", "shuffle", "distributed_loader"])
def test_a_pass_saved_at_its_last_batch_resumes_the_next_pass_exactly(kind: str) -> None:
    # Before: RandomSampler(generator=g) draws one more permutation on its way to
    # StopIteration, after the save at the last batch; the resumed run did not, so the
    # next epoch shuffled otherwise than the uninterrupted run's.
    _resume_matches(LOADERS[kind], stop=(1, len(DATA) // 4 - 1))


class _Endless(torch.utils.data.Sampler[int]):
    """A sampler with a length that never ends (mmengine's InfiniteSampler)."""

    def __len__(self) -> int:
        return 8

    def __iter__(self) -> Any:
        while True:
            yield from torch.randperm(8).tolist()


def test_a_sampler_that_never_ends_restores_from_a_save_at_its_length() -> None:
    # The tail drawn on restore is the one pull past the last batch, never the rest of a
    # pass: replaying an endless sampler to its end hung.
    loader = DataLoader(range(8), batch_size=4, sampler=_Endless())
    track(loader)
    it = iter(loader)
    next(it), next(it)
    state = copy.deepcopy(loader_state(loader))
    fresh = DataLoader(range(8), batch_size=4, sampler=_Endless())
    restore_loader(fresh, state, "loader")  # returns
    assert sorted(x for b in itertools.islice(iter(fresh), 2) for x in b.tolist()) == list(range(8))


def test_the_consumed_batches_are_skipped_at_the_sampler_never_loaded() -> None:
    torch.manual_seed(0)
    data = Recording()
    loader = DataLoader(data, batch_size=4, shuffle=True)
    track(loader)
    it = iter(loader)
    consumed = [_values(next(it)) for _ in range(3)]
    state = loader_state(loader)
    rest_straight = [_values(b) for b in it]
    fresh_data = Recording()
    fresh = DataLoader(fresh_data, batch_size=4, shuffle=True)
    restore_loader(fresh, state, "loader")
    assert [_values(b) for b in fresh] == rest_straight
    loaded = sorted(fresh_data.asked)
    assert loaded == sorted(i for batch in rest_straight for i in batch)  # 28 of 40
    assert not set(loaded) & {i for batch in consumed for i in batch}


def test_the_state_says_pass_position_and_whether_the_pass_ended() -> None:
    loader = DataLoader(DATA, batch_size=8)
    track(loader)
    assert loader_state(loader)["passes"] == 0  # type: ignore[index]
    it = iter(loader)
    next(it)
    state = loader_state(loader)
    assert state is not None
    assert (state["passes"], state["position"], state["done"]) == (1, 1, False)
    list(it)
    state = loader_state(loader)
    assert state is not None and (state["position"], state["length"], state["done"]) == (5, 5, True)


def test_a_pass_whose_last_batch_was_taken_is_over_before_its_stop_iteration() -> None:
    # Saved inside the loop at the last batch, it was an open pass: the resume replayed its
    # empty tail, and `for epoch in range(step // len(loader), E)` lost an epoch.
    torch.manual_seed(0)
    loader = DataLoader(DATA, batch_size=8, shuffle=True)
    track(loader)
    it = iter(loader)
    for _ in range(5):
        next(it)
    state = loader_state(loader)
    assert state is not None and (state["passes"], state["position"], state["done"]) == (1, 5, True)
    following = [_values(b) for b in loader]  # the uninterrupted run's next pass
    fresh = DataLoader(DATA, batch_size=8, shuffle=True)
    restore_loader(fresh, state, "loader")
    assert [_values(b) for b in fresh] == following


def test_an_older_file_with_a_finished_pass_marked_open_resumes_with_the_next_pass() -> None:
    torch.manual_seed(0)
    loader = DataLoader(DATA, batch_size=8, shuffle=True)
    track(loader)
    it = iter(loader)
    for _ in range(5):
        next(it)
    state = loader_state(loader)
    assert state is not None
    state["done"] = False  # what the versions before this fix wrote
    following = [_values(b) for b in loader]
    fresh = DataLoader(DATA, batch_size=8, shuffle=True)
    restore_loader(fresh, state, "loader")
    assert [_values(b) for b in fresh] == following


def test_saved_again_before_the_loop_it_still_resumes_mid_pass() -> None:
    torch.manual_seed(0)
    loader = DataLoader(DATA, batch_size=4, shuffle=True)
    track(loader)
    it = iter(loader)
    next(it)
    state = loader_state(loader)
    fresh = DataLoader(DATA, batch_size=4, shuffle=True)
    restore_loader(fresh, state, "loader")
    again = loader_state(fresh)
    assert again is not None and state is not None
    assert (again["passes"], again["position"], again["done"]) == (1, 1, False)


def test_a_loader_tracked_mid_pass_has_no_position_and_restore_says_so() -> None:
    loader = DataLoader(DATA, batch_size=4)
    track(loader, known=False)
    assert loader_state(loader) is None
    with pytest.warns(UserWarning, match=r"no position for loader 'train'.*before the loop"):
        restore_loader(DataLoader(DATA, batch_size=4), None, "train")
    list(loader)  # its next pass is tracked from the start
    assert loader_state(loader) is not None


class _Stream(IterableDataset[int]):
    def __iter__(self) -> Any:
        return iter(range(12))


def test_an_iterable_dataset_restarts_its_pass_with_a_warning() -> None:
    loader = DataLoader(_Stream(), batch_size=4)
    track(loader)
    it = iter(loader)
    next(it)
    state = loader_state(loader)
    fresh = DataLoader(_Stream(), batch_size=4)
    with pytest.warns(UserWarning, match=r"an IterableDataset has no sampler to skip"):
        restore_loader(fresh, state, "stream")
    assert next(_values(b) for b in fresh) == [0, 1, 2, 3]


def test_a_loader_of_another_length_restarts_its_pass_with_a_warning() -> None:
    loader = DataLoader(DATA, batch_size=4)
    track(loader)
    it = iter(loader)
    next(it)
    state = loader_state(loader)
    with pytest.warns(UserWarning, match=r"it has 5 batches per pass, but 10 when the checkpoint"):
        restore_loader(DataLoader(TensorDataset(torch.arange(20)), batch_size=4), state, "loader")


def test_another_batch_size_with_another_dataset_restarts_its_pass_with_a_warning() -> None:
    loader = DataLoader(DATA, batch_size=4)
    track(loader)
    it = iter(loader)
    next(it)
    state = loader_state(loader)
    with pytest.warns(UserWarning, match=r"it has 3 batches per pass, but 10 when the checkpoint"):
        restore_loader(DataLoader(TensorDataset(torch.arange(20)), batch_size=8), state, "loader")


@pytest.mark.parametrize(
    ("saved_from", "restored_into"),
    [
        (lambda: DataLoader(_Stream(), batch_size=4), lambda: DataLoader(_Stream(), batch_size=4)),
        (lambda: DataLoader(DATA, batch_size=4), lambda: DataLoader(DATA, batch_size=8)),
    ],
    ids=["iterable dataset", "another length"],
)
def test_a_pass_saved_before_its_first_batch_restores_without_a_restart_warning(
    saved_from: Callable[[], DataLoader[Any]], restored_into: Callable[[], DataLoader[Any]]
) -> None:
    # Before: a save after iter() but before the first batch warned that the pass restarts,
    # having "consumed 0 batches of it": nothing is lost by starting it here.
    loader = saved_from()
    track(loader)
    for _ in loader:
        pass
    it = iter(loader)  # the second pass begins: nothing taken from it yet
    state = loader_state(loader)
    del it
    fresh = restored_into()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        restore_loader(fresh, state, "loader")
    assert next(_values(b) for b in fresh)[:4] == [0, 1, 2, 3]


def test_an_entry_that_is_not_a_position_is_refused() -> None:
    with pytest.raises(ValueError, match=r"checkpoint entry 'loader' is not a DataLoader position"):
        restore_loader(DataLoader(DATA), {"weight": 1}, "loader")


def test_tracking_keeps_the_loaders_own_class_and_attributes() -> None:
    loader = distributed_loader(DATA, 4, seed=1)
    track(loader)
    track(loader)  # twice is harmless
    assert isinstance(loader, DistributedLoader) and type(loader).__name__ == "DistributedLoader"
    loader.set_epoch(2)
    assert loader.epoch == 2 and len(loader) == 10
    assert [len(_values(b)) for b in loader] == [4] * 10


@pytest.mark.parametrize("cls", [DataLoader, TunedDataLoader])
def test_a_tracked_loader_pickles_and_its_copy_is_tracked_on_its_own(cls: type) -> None:
    # Before: pickle refused the tracked class ("not the same object as DataLoader"), and a
    # deepcopy's sampler wrapper still pointed at the original, so iterating the copy took
    # the original's pending resume and overwrote its record of the pass.
    torch.manual_seed(0)
    loader = cls(DATA, batch_size=4, shuffle=True)
    track(loader)
    it = iter(loader)
    next(it), next(it)
    state = copy.deepcopy(loader_state(loader))
    del it
    restore_loader(loader, state, "loader")
    for twin in (pickle.loads(pickle.dumps(loader)), copy.deepcopy(loader)):
        assert type(twin) is type(loader)
        rest = [_values(b) for b in twin]
        assert len(rest) == 8  # the copy resumes the pass too
    assert [_values(b) for b in loader] == rest  # the original's resume is still its own


@pytest.mark.parametrize("cls", [DataLoader, TunedDataLoader])
@pytest.mark.parametrize("make_copy", [copy.copy, copy.deepcopy], ids=["copy", "deepcopy"])
def test_a_copy_of_a_tracked_loader_keeps_its_own_position(
    cls: type, make_copy: Callable[[Any], Any]
) -> None:
    # Before: copy.copy shared the tracker, so iterating the copy moved the position the
    # original would save (and the original's batches moved the copy's).
    torch.manual_seed(0)
    loader = cls(DATA, batch_size=4, shuffle=True)
    track(loader)
    it = iter(loader)
    next(it), next(it)
    twin = make_copy(loader)
    assert [len(_values(b)) for b in twin] == [4] * 10
    state = loader_state(loader)
    assert state is not None and (state["passes"], state["position"]) == (1, 2)
    next(it)
    twin_state = loader_state(twin)
    assert twin_state is not None and (twin_state["passes"], twin_state["position"]) == (2, 10)
    state = loader_state(loader)
    assert state is not None and (state["passes"], state["position"]) == (1, 3)


def _saved_mid_pass(batch_size: int, taken: int) -> tuple[dict[str, Any], list[int]]:
    """A shuffled loader's state after ``taken`` batches of ``batch_size``, and its pass's
    whole order (the samples, flat)."""
    torch.manual_seed(0)
    loader = DataLoader(DATA, batch_size=batch_size, shuffle=True)
    track(loader)
    it = iter(loader)
    order = [i for _ in range(taken) for i in _values(next(it))]
    state = copy.deepcopy(loader_state(loader))
    assert state is not None
    order += [i for b in it for i in _values(b)]
    return state, order


@pytest.mark.parametrize(("old", "taken", "new"), [(4, 3, 6), (8, 2, 4), (4, 4, 16)])
def test_another_batch_size_resumes_the_saved_order_at_the_consumed_samples(
    old: int, taken: int, new: int
) -> None:
    # Before: the pass restarted with a fresh permutation, the saved one's unseen samples lost.
    state, order = _saved_mid_pass(old, taken)
    fresh = DataLoader(DATA, batch_size=new, shuffle=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        restore_loader(fresh, state, "loader")
        batches = [_values(b) for b in fresh]
    assert [i for b in batches for i in b] == order[old * taken :]
    assert [len(b) for b in batches[:-1]] == [new] * (len(batches) - 1)
    again = loader_state(fresh)
    assert again is not None and (again["passes"], again["position"]) == (1, len(fresh))


def test_a_batch_size_that_does_not_divide_the_consumed_samples_repeats_a_few_with_a_warning() -> (
    None
):
    state, order = _saved_mid_pass(4, 3)  # 12 samples consumed: 2 batches of 5, and 2 more
    fresh = DataLoader(DATA, batch_size=5, shuffle=True)
    with pytest.warns(
        UserWarning,
        match=r"loader 'loader': its batch size changed from 4 to 5 since the checkpoint was "
        r"saved: the pass resumes in the saved order after 2 batches of 5 \(sample 10\), "
        r"so the last 2 samples of the 12 consumed \(3 batches of 4\) are seen again "
        r"\(a batch size that divides 12 resumes exactly\)",
    ):
        restore_loader(fresh, state, "loader")
    assert [i for b in fresh for i in _values(b)] == order[10:]
