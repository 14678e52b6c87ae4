"""Tests of trainperf.amp._state: what MixedPrecision.load_state_dict accepts."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
from torch import nn

from tests.amp._helpers import needs_cpu_fp16
from trainperf.amp import MixedPrecision
from trainperf.amp._state import replace_state


def _collapsed(mp: MixedPrecision) -> None:
    """Skip fp16 steps on NaN losses until the loss scale is 0, as in a run whose loss went
    NaN for good (each skip halves the scale: 65536 reaches 0 after about 165)."""
    w = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1)
    assert mp.scaler is not None
    mp.scaler.load_state_dict({**mp.scaler.state_dict(), "scale": 2.0**-148})
    for _ in range(3):
        mp.backward((w * math.nan).sum())
        assert not mp.step(opt)
        mp.zero_grad(opt)
    assert mp.scaler.get_scale() == 0.0


@needs_cpu_fp16
@pytest.mark.parametrize("bad", [0.0, -1024.0, math.inf, -math.inf, math.nan, 0])
def test_a_loss_scale_not_finite_and_positive_is_refused_and_loads_nothing(bad: float) -> None:
    # Before: loaded without a word; every later fp16 step was then skipped (0, NaN, inf),
    # or a scale no GradScaler writes was taken (a negative one).
    mp = MixedPrecision("cpu", precision="fp16")
    before = mp.state_dict()
    state = {"precision": "fp16", "scaler": {**before["scaler"], "scale": bad}}
    with pytest.raises(
        ValueError,
        match=rf"state\['scaler'\]\['scale'\]\) is {re.escape(repr(bad))}.*finite number > 0.*"
        r"mp.load_state_dict\(\{\*\*state, 'scaler': None\}\)",
    ):
        mp.load_state_dict(state)
    assert mp.state_dict() == before


@needs_cpu_fp16
@pytest.mark.parametrize("bad", ["65536", None, True, [1.0]])
def test_loading_a_loss_scale_that_is_not_a_number_is_refused(bad: object) -> None:
    # Before: "65536" and [1.0] were taken, and the first mp.backward raised a bare TypeError.
    mp = MixedPrecision("cpu", precision="fp16")
    before = mp.state_dict()
    state = {"precision": "fp16", "scaler": {**before["scaler"], "scale": bad}}
    with pytest.raises(ValueError, match=r"state\['scaler'\]\['scale'\]\) is .*finite number"):
        mp.load_state_dict(state)
    assert mp.state_dict() == before


@needs_cpu_fp16
@pytest.mark.parametrize("good", [1.0, 2.0**-149, 3e38, 1024, np.float32(512.0)])
def test_any_finite_positive_loss_scale_loads(good: float) -> None:
    mp = MixedPrecision("cpu", precision="fp16")
    scaler = {**mp.state_dict()["scaler"], "scale": good}
    mp.load_state_dict({"precision": "fp16", "scaler": scaler})
    assert mp.scaler is not None and mp.scaler.get_scale() == float(good)


@needs_cpu_fp16
def test_the_fix_the_refusal_names_loads_a_fresh_scale() -> None:
    collapsed = MixedPrecision("cpu", precision="fp16")
    _collapsed(collapsed)
    state = collapsed.state_dict()
    mp = MixedPrecision("cpu", precision="fp16")
    with pytest.raises(ValueError, match=r"is 0\.0"):
        mp.load_state_dict(state)
    mp.load_state_dict({**state, "scaler": None})
    assert mp.scaler is not None and mp.scaler.get_scale() == 2.0**16
    w = nn.Parameter(torch.ones(2))
    mp.backward(w.sum())
    assert mp.step(torch.optim.SGD([w], lr=0.1))


@needs_cpu_fp16
def test_replace_state_puts_back_a_scale_that_collapsed_before_tuning() -> None:
    # tune_batch_size saves the caller's state before its probes and puts it back after:
    # a scale that reached 0 in the caller's own run is theirs, and comes back as it was.
    mp = MixedPrecision("cpu", precision="fp16")
    _collapsed(mp)
    saved = mp.state_dict()
    mp.load_state_dict({**saved, "scaler": None})  # what a probe may leave: another scale
    fresh = MixedPrecision("cpu", precision="fp16").state_dict()
    replace_state(mp, {**fresh, "scaler": {**fresh["scaler"], "scale": 1.0}})
    replace_state(mp, saved)
    assert mp.state_dict() == saved
