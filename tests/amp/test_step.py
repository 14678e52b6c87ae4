"""trainperf.amp._step: what MixedPrecision.step checks, and what a pickled copy keeps."""

from __future__ import annotations

import copy
import math
import pickle
from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch import nn

from tests.amp._helpers import needs_cpu_fp16
from trainperf.amp import MixedPrecision


def clipped(max_grad_norm: object) -> list[float]:
    """The weights after one SGD step with the gradients clipped to ``max_grad_norm``."""
    mp = MixedPrecision("cpu", precision="fp32")
    w = nn.Parameter(torch.ones(2))
    mp.backward((w * 10).sum())
    assert mp.step(torch.optim.SGD([w], lr=1.0), max_grad_norm=max_grad_norm)  # type: ignore[arg-type]
    return w.tolist()


@pytest.mark.parametrize(
    "value",
    [np.float32(1.0), np.int64(1), torch.tensor(1.0), torch.tensor(1), 1],
    ids=["np.float32", "np.int64", "tensor", "int-tensor", "int"],
)
def test_max_grad_norm_takes_what_clip_grad_norm_takes(value: object) -> None:
    # Before: "max_grad_norm must be a number > 0" for NumPy scalars and 0-dim tensors.
    assert clipped(value) == pytest.approx(clipped(1.0))


@pytest.mark.parametrize(
    "bad",
    [
        math.inf,
        np.float32("nan"),
        np.bool_(True),
        torch.tensor(True),
        torch.tensor([1.0]),
        torch.tensor(-1.0),
        torch.tensor(1j),
        True,
    ],
    ids=["inf", "np-nan", "np-bool", "bool-tensor", "1-d", "negative-tensor", "complex", "True"],
)
def test_max_grad_norm_refuses_what_is_not_a_finite_number_above_0(bad: object) -> None:
    with pytest.raises(
        ValueError,
        match=r"max_grad_norm must be a number > 0 \(a finite int, float, NumPy scalar or "
        r"0-dim tensor\), or None not to clip, got ",
    ):
        clipped(bad)


def test_max_grad_norm_on_meta_is_checked_for_shape_only() -> None:
    from trainperf.amp._step import check_max_grad_norm

    check_max_grad_norm(torch.tensor(-1.0, device="meta"))  # no value to read
    with pytest.raises(ValueError, match="max_grad_norm must be a number > 0"):
        check_max_grad_norm(torch.ones(2, device="meta"))


def pickle_copy(mp: MixedPrecision) -> MixedPrecision:
    copied: MixedPrecision = pickle.loads(pickle.dumps(mp))
    return copied


@pytest.mark.parametrize("make_copy", [copy.deepcopy, pickle_copy], ids=["deepcopy", "pickle"])
def test_a_copy_made_between_backward_and_step_has_no_backward_pending(
    make_copy: Callable[[MixedPrecision], MixedPrecision],
) -> None:
    # Before: the copy's step failed inside torch: "Attempted step but _scale is None".
    mp = MixedPrecision("cpu", precision="fp16")
    model = mp.prepare(nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with mp.autocast():
        loss = model(torch.randn(3, 4) * 0.01).float().mean()
    mp.backward(loss)
    copied = make_copy(mp)
    with pytest.raises(RuntimeError, match=r"found no gradients from mp\.backward\(loss\)"):
        copied.step(optimizer)
    assert copied.state_dict() == mp.state_dict()
    assert mp.step(optimizer)  # the original's backward is still there to step
    with mp.autocast():  # and the copy trains on its own backward
        loss = model(torch.randn(3, 4) * 0.01).float().mean()
    copied.backward(loss)
    assert copied.step(optimizer)


@needs_cpu_fp16
def test_gradients_unscaled_by_hand_are_clipped_without_a_second_unscale() -> None:
    # GradScaler's own pattern reads the true gradients (to log their norm) with
    # scaler.unscale_(optimizer); mp.step(max_grad_norm=...) unscaled them a second time,
    # and torch raised "unscale_() has already been called on this optimizer".
    mp = MixedPrecision("cpu", precision="fp16")
    w = nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([w], lr=1.0)
    mp.backward((w * 10).sum())
    assert mp.scaler is not None
    mp.scaler.unscale_(optimizer)
    assert w.grad is not None and w.grad.tolist() == [10.0, 10.0]
    assert mp.step(optimizer, max_grad_norm=1.0)
    assert [round(v, 4) for v in w.tolist()] == [0.2929, 0.2929]  # clipped once, to norm 1
