"""trainperf.ddp._data_parallel: data_parallel's device_ids, with and without GPUs."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import trainperf.ddp as ddp


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


@pytest.fixture
def two_fake_gpus(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """Two visible GPUs (no CUDA here), and ``nn.DataParallel`` stubbed out: the returned
    list records the ``device_ids`` each wrap was given. The warning is taken as given."""
    import trainperf.ddp._data_parallel as dp_module

    wrapped: list[list[int]] = []
    monkeypatch.setattr(dp_module, "_dp_warned", True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(nn, "DataParallel", lambda model, device_ids: wrapped.append(device_ids))
    return wrapped


@pytest.mark.usefixtures("two_fake_gpus")
def test_data_parallel_names_the_renumbering_of_cuda_visible_devices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # It said only "device_ids [3] are not visible GPUs (0..1)": a user who set
    # CUDA_VISIBLE_DEVICES=2,3 and passed the physical number 3 got no fix.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    with pytest.raises(
        ValueError,
        match=r"device_ids \[3\] are not visible GPUs: 2 visible, numbered 0\.\.1 "
        r"\(CUDA_VISIBLE_DEVICES='2,3' renumbers the cards it shows from cuda:0\); pass "
        r"numbers in 0\.\.1",
    ):
        ddp.data_parallel(nn.Linear(2, 2), device_ids=[0, 3])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with pytest.raises(ValueError, match=r"\(CUDA_VISIBLE_DEVICES is unset: all of the mach"):
        ddp.data_parallel(nn.Linear(2, 2), device_ids=[2])


class _Placed(nn.Linear):
    """A module that records where it was moved, instead of moving (no GPU here)."""

    placed: torch.device | None = None

    def to(self, device: Any) -> _Placed:  # type: ignore[override]
        self.placed = device
        return self


def test_data_parallel_takes_devices_as_nn_data_parallel_does(
    two_fake_gpus: list[list[int]],
) -> None:
    # torch.device("cuda:1") and "cuda:1" failed with a bare TypeError from int().
    wrapped = two_fake_gpus
    model = _Placed(2, 2)
    ddp.data_parallel(model, device_ids=[torch.device("cuda:1"), "cuda:0", 0, "cuda"])
    assert wrapped == [[1, 0, 0, 0]] and model.placed == torch.device("cuda", 1)
    with pytest.raises(ValueError, match=r"device_ids \[3\] are not visible GPUs: 2 visible"):
        ddp.data_parallel(model, device_ids=["cuda:3"])


def test_data_parallel_takes_gpu_numbers_written_as_digits(two_fake_gpus: list[list[int]]) -> None:
    # os.environ["GPUS"].split(",") gives "0", "1": int() took them before device_ids were
    # checked, then they were refused as "not a device name".
    wrapped = two_fake_gpus
    model = _Placed(2, 2)
    ddp.data_parallel(model, device_ids=["1", " 0"])  # "1, 0".split(",")
    assert wrapped == [[1, 0]] and model.placed == torch.device("cuda", 1)


@pytest.mark.parametrize(
    ("device_ids", "match"),
    [
        ("0,1", r"device_ids must be a sequence of GPUs, got '0,1' \(str\): pass \[0, 1\]"),
        ("01", r"got '01' \(str\)"),  # was taken as GPUs 0 and 1, one per character
        (1, r"got 1 \(int\): pass \[1\]"),  # was "object of type 'int' has no len()"
        (True, r"got True \(bool\): pass a list of GPU numbers such as \[0, 1\]"),  # not [True]
        (torch.device("cuda", 1), r"got device\(type='cuda', index=1\) \(device\)"),
    ],
)
def test_data_parallel_refuses_one_value_for_device_ids_with_the_list_to_pass(
    device_ids: object, match: str
) -> None:
    with pytest.raises(TypeError, match=match):
        ddp.data_parallel(nn.Linear(2, 2), device_ids=device_ids)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("entry", "error", "match"),
    [
        ("cpu", ValueError, r"device_ids must name CUDA GPUs, got 'cpu' \(a cpu device\)"),
        (torch.device("meta"), ValueError, r"got device\(type='meta'\) \(a meta device\)"),
        ("gpu1", ValueError, r"device_ids entry 'gpu1' is not a device name: .* 'cuda:1'"),
        ("1.5", ValueError, r"device_ids entry '1\.5' is not a device name"),
        ("-1", ValueError, r"device_ids entry '-1' is not a device name"),
        (1.5, TypeError, r"device_ids entries must be GPU numbers.*: got 1\.5 \(float\)"),
        (True, TypeError, r"got True \(bool\)"),
    ],
)
def test_data_parallel_refuses_a_device_that_is_not_a_gpu(
    entry: object, error: type[Exception], match: str
) -> None:
    # Refused with or without CUDA: 1.5 was truncated to GPU 1 by int().
    with pytest.raises(error, match=match):
        ddp.data_parallel(nn.Linear(2, 2), device_ids=[0, entry])  # type: ignore[list-item]


@pytest.mark.requires_cuda
def test_data_parallel_moves_the_model_to_the_first_device_and_warns_once() -> None:
    import trainperf.ddp._data_parallel as dp_module

    dp_module._dp_warned = False
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
