"""trainperf.loader._args: tune_loader's argument checks, each error with its message."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import pytest
import torch

from tests._utils._streams import Fresh, Resets, assert_refused_unread
from tests.loader._fakes import Waits, quick
from trainperf.errors import DeviceError
from trainperf.loader import _autotune as autotune_mod
from trainperf.loader import _tune as tune_mod
from trainperf.loader import autotune_loader, tune_loader
from trainperf.loader._args import CheckedArgs, check_args, check_sizes

# DataLoader's own timeout: 0 (its default) means "wait for ever", so 0 is allowed.
_LOADER_TIMEOUT = r"timeout must be a finite number of seconds >= 0 \(0: no timeout\)"


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        ((0,), {}, "batch_size must be an int >= 1, got 0"),
        ((None,), {}, r"batch_size=None \(no automatic batching\) is not supported .* pass the"),
        ((4,), {"max_workers": -1}, "max_workers must be None or an int >= 0"),
        ((4,), {"budget_s": 0}, "budget_s must be a positive number"),
        ((4,), {"epochs_hint": 0}, "epochs_hint must be None or an int >= 1"),
        ((4,), {"step_fn": 3}, "step_fn must be callable"),
        ((4,), {"num_workers": -1}, "num_workers must be an int >= 0, got -1"),
        ((4,), {"num_workers": 2, "prefetch_factor": 0}, "prefetch_factor must be None or an"),
        ((4,), {"prefetch_factor": 2}, r"prefetch_factor=2 needs num_workers > 0 \(DataLoader"),
        ((4,), {"num_workers": 0, "prefetch_factor": 4}, "prefetch_factor=4 needs num_workers"),
        ((4,), {"batch_sampler": [[0]]}, "batch_sampler is not supported"),
        ((4,), {"timeout": -1}, _LOADER_TIMEOUT + ", got -1"),
        ((4,), {"timeout": math.nan}, _LOADER_TIMEOUT + ", got nan"),
        ((4,), {"timeout": math.inf}, _LOADER_TIMEOUT + ", got inf"),
        ((4,), {"timeout": None}, _LOADER_TIMEOUT + ", got None"),
        ((4,), {"timeout": "5"}, _LOADER_TIMEOUT + ", got '5'"),
        ((4,), {"num_worker": 2}, "unknown DataLoader argument 'num_worker'; choices:"),
        ((4,), {"device": "gpu"}, "invalid device 'gpu': expected 'auto', 'cpu', 'cuda'"),
    ],
)
def test_bad_arguments_raise(args: tuple[Any, ...], kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        tune_loader(Waits(), *args, **{**quick(), **kwargs})


def test_device_of_the_wrong_type_raises() -> None:
    with pytest.raises(TypeError, match=r"device must be a str, int, torch\.device or None"):
        tune_loader(Waits(), 4, **quick(device=3.5))


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_cuda_without_cuda_raises() -> None:
    with pytest.raises(DeviceError, match=r"CUDA is not available.*device='cpu'"):
        tune_loader(Waits(), 4, **quick(device="cuda"))


@pytest.mark.parametrize(
    ("batch_size", "kwargs", "match"),
    [
        (True, {}, "batch_size must be an int >= 1, got True"),
        (2.0, {}, "batch_size must be an int >= 1, got 2.0"),
        (4, {"max_workers": True}, "max_workers must be None or an int >= 0, got True"),
        (4, {"max_workers": 1.5}, "max_workers must be None or an int >= 0, got 1.5"),
        (4, {"budget_s": math.inf}, "budget_s must be a positive number of seconds, got inf"),
        (4, {"budget_s": math.nan}, "budget_s must be a positive number of seconds, got nan"),
        (4, {"budget_s": True}, "budget_s must be a positive number of seconds, got True"),
        (4, {"budget_s": "10"}, "budget_s must be a positive number of seconds, got '10'"),
        (4, {"epochs_hint": False}, "epochs_hint must be None or an int >= 1, got False"),
    ],
)
def test_check_args_rejects_bools_non_numbers_and_infinities(
    batch_size: Any, kwargs: dict[str, Any], match: str
) -> None:
    args: dict[str, Any] = {
        "max_workers": None,
        "budget_s": 30.0,
        "epochs_hint": None,
        "step_fn": None,
        "loader_kwargs": {},
        **kwargs,
    }
    with pytest.raises(ValueError, match=match):
        check_args(batch_size, **args)


def test_check_args_accepts_the_defaults_and_bounds() -> None:
    check_args(1, None, 30.0, None, None, {})
    check_args(1, 0, 0.5, 1, len, {"shuffle": True, "timeout": 5})
    check_args(1, 0, 0.5, 1, len, {"timeout": 0})  # DataLoader's default: no timeout
    check_args(1, 0, 0.5, 1, len, {"timeout": 2.5})
    check_args(1, 64, 10, 3, lambda batch: None, {"multiprocessing_context": "spawn"})


def test_check_args_accepts_the_callers_own_worker_settings() -> None:
    # The caller's current DataLoader settings: measured as one candidate (see test_user).
    check_args(1, None, 30.0, None, None, {"num_workers": 1, "pin_memory": True})
    check_args(1, None, 30.0, None, None, {"num_workers": 4, "prefetch_factor": 8})
    check_args(1, None, 30.0, None, None, {"num_workers": 0, "prefetch_factor": None})
    check_args(1, None, 30.0, None, None, {"persistent_workers": True})


class _CountsReads(Waits):
    def __init__(self) -> None:
        self.reads = 0

    def __getitem__(self, i: int) -> dict[str, Any]:
        self.reads += 1
        return super().__getitem__(i)


@pytest.mark.parametrize("timeout", [-1, math.nan, math.inf])
def test_a_bad_dataloader_timeout_is_refused_before_anything_is_measured(timeout: float) -> None:
    ds = _CountsReads()
    with pytest.raises(ValueError, match=_LOADER_TIMEOUT):
        tune_loader(ds, 4, **quick(timeout=timeout))
    assert ds.reads == 0  # refused on entry, not by DataLoader after the tuning ran


def test_a_dataset_that_is_its_own_iterator_is_refused_before_any_sample_is_used() -> None:
    assert_refused_unread(
        lambda ds: tune_loader(
            ds, 8, device="cpu", max_workers=0, budget_s=5, cache=False, progress=False
        ),
        "tuning",
    )


@pytest.mark.parametrize("dataset", [Fresh(), Resets(64)], ids=["generator", "rewinds"])
def test_a_stream_that_starts_afresh_on_each_iter_is_tuned(dataset: Any) -> None:
    report = tune_loader(
        dataset, 8, device="cpu", max_workers=0, budget_s=5, cache=False, progress=False
    )
    measured = [c for c in report.candidates if c.batches]
    assert measured and all((c.samples_per_s or 0) > 0 for c in measured)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"multiprocessing_context": "sapwn"}, r"multiprocessing_context='sapwn' is neither"),
        ({"worker_init_fn": 5}, r"worker_init_fn must be None or callable, got 5"),
        ({"collate_fn": 5}, r"collate_fn must be None or callable, got 5"),
        ({"generator": "x"}, r"generator must be None or a torch.Generator, got 'x'"),
        ({"sampler": 5}, r"sampler must be None or an iterable of indices"),
        ({"pin_memory": "no"}, r"pin_memory must be one of \(True, False\), got 'no'"),
        ({"persistent_workers": "yes"}, r"persistent_workers must be one of \(True, False\)"),
        ({"shuffle": "yes"}, r"shuffle must be one of \(None, True, False\), got 'yes'"),
    ],
)
def test_arguments_of_the_wrong_kind_are_refused_by_name_before_measuring(
    kwargs: dict[str, Any], match: str
) -> None:
    # Before: each failed inside the measurement and was blamed on the dataset ("the
    # dataset raised in a worker", "the dataset fails in the main process"), or the tuner
    # fell back to num_workers=0 with the bad setting dropped or kept.
    ds = _CountsReads()
    with pytest.raises(ValueError, match=match):
        tune_loader(ds, 4, **quick(**kwargs))
    assert ds.reads == 0


@pytest.mark.parametrize(
    "make", [lambda: iter(range(16)), lambda: (i for i in range(16))], ids=["iter", "generator"]
)
def test_a_one_shot_sampler_is_refused_before_its_indices_are_used_up(make: Any) -> None:
    # Before: the measurements used up its indices, then tuning failed with "the DataLoader
    # yields no batch ... give a sampler with at least one batch of samples".
    sampler = make()
    with pytest.raises(ValueError, match=r"sampler=.* is a one-shot iterator: tuning reads"):
        tune_loader(_CountsReads(), 4, **quick(sampler=sampler))
    assert next(sampler) == 0  # nothing read


def test_right_kinds_pass() -> None:
    import multiprocessing

    kinds = {
        "multiprocessing_context": multiprocessing.get_context("fork"),
        "worker_init_fn": print, "collate_fn": list, "generator": torch.Generator(),
        "sampler": [0, 1], "pin_memory": False, "shuffle": None, "drop_last": True,
    }  # fmt: skip
    check_args(1, None, 30.0, None, None, kinds)


def _same_numbers(got: Any, want: Any) -> bool:
    """``got == want`` with each number of the same Python type (``np.int64(8) == 8``)."""
    if isinstance(want, dict):
        return got.keys() == want.keys() and all(_same_numbers(got[k], want[k]) for k in want)
    return type(got) is type(want) and got == want


def test_check_args_returns_numpy_numbers_as_python_ones() -> None:
    # Before: check_args took np.int64(8) and returned nothing, so tune_loader went on with
    # the NumPy scalar, which DataLoader refuses ("batch_size should be a positive integer
    # value") and json.dumps too (report.to_dict(), the cache key).
    kwargs = {"num_workers": 2, "prefetch_factor": 4, "timeout": 5, "shuffle": True}
    given = {"num_workers": np.int64(2), "prefetch_factor": np.int32(4), "timeout": np.int64(5)}
    numpy_args = check_args(
        np.int64(8), np.uint8(3), np.float32(2.5), np.int16(2), None, {**kwargs, **given}
    )
    python_args = check_args(8, 3, 2.5, 2, None, kwargs)
    assert numpy_args == python_args == CheckedArgs(8, 3, 2.5, 2, kwargs)
    assert _same_numbers(dataclasses.asdict(numpy_args), dataclasses.asdict(python_args))


@pytest.mark.parametrize(
    ("given", "want"),
    [
        ({}, {}),  # nothing added: an absent prefetch_factor is not None
        ({"batch_size": np.int64(8), "timeout": np.float64(2.5)},
         {"batch_size": 8, "timeout": 2.5}),
        ({"batch_size": None, "timeout": np.int64(5)}, {"batch_size": None, "timeout": 5}),
        ({"timeout": 5, "num_workers": np.int8(1)}, {"timeout": 5, "num_workers": 1}),
        ({"num_workers": 0, "prefetch_factor": None}, {"num_workers": 0, "prefetch_factor": None}),
    ],
)  # fmt: skip
def test_check_sizes_converts_numpy_numbers_and_keeps_the_rest(
    given: dict[str, Any], want: dict[str, Any]
) -> None:
    extra = {"shuffle": True, "generator": torch.Generator()}
    got = check_sizes({**given, **extra})
    assert _same_numbers({k: got[k] for k in want}, want)
    assert got.keys() == {**given, **extra}.keys()
    assert all(got[k] is v for k, v in extra.items())


def test_a_sampler_with_shuffle_is_refused_before_tuning_with_the_fix() -> None:
    # Before: DataLoader's bare "sampler option is mutually exclusive with shuffle", raised
    # from inside the first measurement, with no word of what to do.
    with pytest.raises(ValueError, match=r"sampler=\[0, 1\] with shuffle=True.*RandomSampler"):
        tune_loader(range(8), 2, **quick(sampler=[0, 1], shuffle=True))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"cache": "no"}, "cache must be True or False, got 'no'"),
        ({"progress": "false"}, "progress must be True or False, got 'false'"),
        ({"cache": 0}, "cache must be True or False, got 0"),
    ],
)
def test_a_flag_that_is_not_a_bool_is_refused_before_tuning(
    kwargs: dict[str, Any], match: str
) -> None:
    # Before: cache="no" read as true, and the call read and wrote the cache.
    with pytest.raises(TypeError, match=match):
        tune_loader(Waits(), 4, **{**quick(), **kwargs})
    with pytest.raises(TypeError, match=match):
        autotune_loader(Waits(), 4, **{**quick(), **kwargs})


def test_adapt_that_is_not_a_bool_is_refused_before_tuning(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_tuning(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("tuned before the arguments were checked")

    monkeypatch.setattr(autotune_mod, "tune_loader", no_tuning)
    with pytest.raises(TypeError, match="adapt must be True or False, got 'yes'"):
        autotune_loader(Waits(), 4, adapt="yes", **quick())


class _Stream(torch.utils.data.IterableDataset[torch.Tensor]):
    def __iter__(self) -> Any:
        return iter(torch.zeros(32, 2))


@pytest.mark.parametrize("tune", [tune_loader, autotune_loader])
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"shuffle": True},
            r"shuffle=True with an IterableDataset \(_Stream\): .*drop shuffle=True and shuffle "
            r"inside the dataset's __iter__.*buffer",
        ),
        (
            {"sampler": [0, 1, 2]},
            r"sampler=\[0, 1, 2\] with an IterableDataset \(_Stream\): .*drop sampler= and "
            r"shuffle inside the dataset's __iter__.*buffer",
        ),
    ],
)
def test_an_iterable_dataset_with_shuffle_or_sampler_is_refused_up_front(
    monkeypatch: pytest.MonkeyPatch, tune: Any, kwargs: dict[str, Any], match: str
) -> None:
    # Before: torch's own "expected unspecified shuffle option", with no fix, after setup.
    def no_tuning(*args: Any, **kw: Any) -> Any:
        raise AssertionError("tuning started")

    monkeypatch.setattr(tune_mod, "_set_up", no_tuning)
    with pytest.raises(ValueError, match=match):
        tune(_Stream(), 4, **quick(), **kwargs)


def test_an_iterable_dataset_with_shuffle_false_is_taken() -> None:
    report = tune_loader(_Stream(), 4, max_workers=0, **quick(budget_s=5.0), shuffle=False)
    assert report.best_kwargs["shuffle"] is False
