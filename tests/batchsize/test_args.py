"""Every argument ``tune_batch_size`` refuses, refused on entry with its name and the fix."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainperf.batchsize._args import check_args, check_state, size_space

GOOD: dict[str, Any] = {
    "min_size": 1,
    "max_size": None,
    "global_batch": None,
    "budget_s": 60.0,
    "headroom": 0.1,
    "num_workers": 0,
    "prefetch_factor": None,
}


def check(step: Any = print, sample: Any = print, **changes: Any) -> None:
    check_args(step, sample, **{**GOOD, **changes})


def test_good_arguments_pass() -> None:
    check()
    check(min_size=8, max_size=8, global_batch=64, headroom=0.0, num_workers=4, prefetch_factor=4)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"step": None}, r"step must be callable \(it gets one batch\), got None"),
        ({"sample": 3}, r"sample must be callable \(it gets a batch size n\), got 3"),
        (
            {"sample": TensorDataset(torch.zeros(4, 2))},
            r"TensorDataset.*>; for a dataset, pass sample=trainperf\.batches_from\(dataset\)",
        ),
        (
            {"sample": DataLoader(TensorDataset(torch.zeros(4, 2)))},
            r"for a DataLoader, pass sample=trainperf\.batches_from\(loader\.dataset, "
            r"collate_fn=loader\.collate_fn\)",
        ),
        ({"min_size": 0}, r"min_size must be an int >= 1, got 0"),
        ({"max_size": 2.5}, r"max_size must be None or an int >= 1, got 2.5"),
        ({"min_size": 8, "max_size": 4}, r"max_size=4 is below min_size=8"),
        ({"global_batch": True}, r"global_batch must be None or an int >= 1, got True"),
        ({"budget_s": float("nan")}, r"budget_s must be a positive number of seconds, got nan"),
        ({"headroom": 1}, r"headroom must be a fraction of the memory in \[0, 1\)"),
        ({"headroom": -0.1}, r"headroom must be a fraction .* got -0.1"),
        ({"headroom": float("nan")}, r"headroom must be a fraction .* got nan"),
        ({"headroom": "10%"}, r"headroom must be a fraction .* got '10%'"),
        ({"num_workers": -1}, r"num_workers must be an int >= 0, got -1"),
        ({"prefetch_factor": 0, "num_workers": 2}, r"prefetch_factor must be None or an int"),
        ({"prefetch_factor": 2}, r"prefetch_factor=2 needs num_workers > 0"),
        ({"progress": "no"}, r"progress must be one of \(True, False\), got 'no'"),
        ({"cache": None}, r"cache must be one of \(True, False\), got None"),
    ],
)
def test_bad_arguments_are_refused_by_name(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check(**changes)


def test_numpy_numbers_are_taken_and_handed_on_as_python_numbers() -> None:
    # Before: headroom=np.float32(0.1) was refused as "must be a fraction ... got
    # np.float32(0.1)", budget_s=np.float32(5) and np.int64 sizes likewise, blaming the value.
    checked = check_args(
        print, print, min_size=np.int64(2), max_size=np.int32(64), global_batch=np.int64(128),
        budget_s=np.float32(5), headroom=np.float32(0.25), num_workers=np.int64(2),
        prefetch_factor=np.int8(4),
    )  # fmt: skip
    assert (checked.min_size, checked.max_size, checked.global_batch) == (2, 64, 128)
    assert (checked.budget_s, checked.headroom) == (5.0, 0.25)
    assert (checked.num_workers, checked.prefetch_factor) == (2, 4)
    assert all(type(v) in (int, float) for v in vars(checked).values())
    with pytest.raises(ValueError, match=r"headroom must be a fraction .* got (np\.False_|False)$"):
        check(headroom=np.bool_(False))


def test_a_list_dataset_passed_as_sample_is_named_in_a_short_message() -> None:
    # Before: the message held the repr of all 10,000 samples (about 200,000 characters).
    dataset = [(torch.zeros(3), i) for i in range(10_000)]
    with pytest.raises(ValueError, match=r"got \[\(tensor.*\.\.\.\]; for a dataset") as e:
        check(sample=dataset)
    assert len(str(e.value)) < 400


def test_the_global_batch_is_split_over_the_ranks() -> None:
    assert size_space(1, None, 256, 1).per_rank == 256
    assert size_space(1, None, 256, 2).per_rank == 128
    assert size_space(4, 64, None, 2).per_rank is None


def test_a_global_batch_the_ranks_cannot_share_names_both() -> None:
    message = r"global_batch=100 is not divisible by world_size=3.*e\.g\. 102"
    with pytest.raises(ValueError, match=message):
        size_space(1, None, 100, 3)


def test_a_range_without_a_divisor_is_refused() -> None:
    with pytest.raises(ValueError, match=r"no batch size in \[min_size=5, max_size=6\] divides"):
        size_space(5, 6, 64, 2)


@pytest.mark.parametrize(
    ("low", "high", "global_batch", "fix"),
    [
        (2, 12, 13, r"pass min_size=1 or max_size=13"),  # a prime global batch
        (5, 7, 16, r"pass min_size=4 or max_size=8"),
        (4, None, 2, r"pass min_size=2"),  # a global batch below min_size
        (3, 3, 16, r"pass min_size=2 or max_size=4"),
    ],
)
def test_a_range_without_a_divisor_names_the_nearest_divisors_to_pass(
    low: int, high: int | None, global_batch: int, fix: str
) -> None:
    # Before: the fix was always "lower min_size", even where only raising max_size
    # helps, and named no value to pass.
    with pytest.raises(ValueError, match=r"no batch size in .* divides .*: " + fix + r"[ ,]"):
        size_space(low, high, global_batch, 1)


def test_neither_model_nor_optimizer_is_refused_with_the_fix() -> None:
    # Before: the probes trained the caller's model and stepped its optimizer, silently.
    fix = r"pass model=model, optimizer=optimizer .* or model=\(\) if step changes no state"
    with pytest.raises(ValueError, match=r"got neither model= nor optimizer=: .*" + fix):
        check_state(None, None)
    check_state((), None)  # nothing to restore, said explicitly
    check_state(None, torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1))


def test_a_lazy_module_not_yet_run_is_refused_by_name_with_the_fix() -> None:
    # Before: torch's "Attempted to use an uninitialized parameter" from deep in the save.
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.LazyLinear(2)))
    fix = r"run one forward pass before tuning"
    with pytest.raises(ValueError, match=r"model's submodule '1.0' \(LazyLinear\) .*" + fix):
        check_state(model, None)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"optimizer's SGD \(built over a lazy module\)"):
        check_state(None, (opt,))
    model(torch.zeros(1, 4))  # the forward pass gives the parameters their shape
    check_state(model, opt)


def test_a_model_on_the_meta_device_is_refused_by_name_with_the_fix() -> None:
    # Before: torch's bare NotImplementedError "Cannot copy out of meta tensor; no data!"
    # from deep in the save of the state.
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2, device="meta"))
    fix = r"materialize it first: model.to_empty\(device='cpu'\), then initialize"
    with pytest.raises(
        ValueError, match=r"model's submodule '1' \(Linear\) is on the meta .*" + fix
    ):
        check_state(model, None)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"optimizer's SGD \(built over a module on the meta"):
        check_state(None, (opt,))
    check_state(nn.Linear(4, 2), None)


def test_a_lazy_module_is_named_before_a_module_on_the_meta_device() -> None:
    # One walk finds both; the lazy module's message comes first, wherever it is.
    model = nn.Sequential(nn.Linear(4, 4, device="meta"), nn.LazyLinear(2))
    with pytest.raises(ValueError, match=r"model's submodule '1' \(LazyLinear\) has uninit"):
        check_state(model, None)
    with torch.device("meta"):
        on_meta = nn.LazyLinear(2)  # both lazy and on the meta device: named as lazy
    with pytest.raises(ValueError, match=r"model's LazyLinear has uninitialized parameters"):
        check_state(on_meta, None)
    opt = torch.optim.SGD([*model[0].parameters(), *model[1].parameters()], lr=0.1)
    with pytest.raises(ValueError, match=r"optimizer's SGD \(built over a lazy module\)"):
        check_state(None, opt)
