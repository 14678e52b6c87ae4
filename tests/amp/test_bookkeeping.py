"""trainperf.amp._bookkeeping: a run of skipped fp16 steps is reported, and
``mp.unscale_(optimizer)`` works for every precision."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

from tests.amp._helpers import needs_cpu_fp16
from trainperf.amp import MixedPrecision, Precision
from trainperf.amp._bookkeeping import SKIPS_BEFORE_WARNING


def nan_step(mp: MixedPrecision, w: nn.Parameter, opt: torch.optim.Optimizer) -> bool:
    """One fp16 step on a NaN loss (skipped at any loss scale), then ``mp.zero_grad``."""
    mp.backward(w.sum() * math.nan)
    stepped = mp.step(opt)
    mp.zero_grad(opt)
    return stepped


@needs_cpu_fp16
def test_fp16_a_run_of_skipped_steps_warns_once_naming_the_likely_cause() -> None:
    # Before: a NaN loss skipped every step silently, and the loss scale fell to 0.0, after
    # which no step can ever succeed again.
    mp = MixedPrecision("cpu", precision="fp16")
    w = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(SKIPS_BEFORE_WARNING - 1):
            assert not nan_step(mp, w, opt)
        assert not caught
        assert not nan_step(mp, w, opt)
        assert len(caught) == 1
        for _ in range(5):
            nan_step(mp, w, opt)
    assert len(caught) == 1  # once per run of skipped steps
    message = str(caught[0].message)
    assert f"the last {SKIPS_BEFORE_WARNING} fp16 steps were all skipped" in message
    assert "torch.isfinite(loss)" in message
    assert caught[0].filename == __file__  # it points at the caller's mp.step


@needs_cpu_fp16
def test_fp16_a_good_step_ends_the_run_of_skipped_steps() -> None:
    mp = MixedPrecision("cpu", precision="fp16")
    w = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            for _ in range(SKIPS_BEFORE_WARNING - 1):
                nan_step(mp, w, opt)
            mp.backward(w.mean())
            assert mp.step(opt)
            mp.zero_grad(opt)
    assert not caught


@needs_cpu_fp16
def test_fp16_unscale_then_clip_then_step_steps_with_the_true_clipped_gradients() -> None:
    mp = MixedPrecision("cpu", precision="fp16")
    w = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=1.0)
    mp.backward((w * 3).sum())
    mp.unscale_(opt)
    assert w.grad is not None and w.grad.tolist() == [3.0, 3.0]  # the true gradients
    norm = nn.utils.clip_grad_norm_([w], 1.0)
    assert float(norm) == pytest.approx(math.sqrt(18))
    assert mp.step(opt)  # not unscaled a second time
    assert w.tolist() == pytest.approx([1 - 1 / math.sqrt(2)] * 2)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_unscale_is_a_no_op_without_a_loss_scaler(precision: Precision) -> None:
    # Before: mp.scaler.unscale_(opt) is an AttributeError on None for bf16 and fp32, so a
    # loop written for fp16 failed under "auto" on an Ampere GPU.
    mp = MixedPrecision("cpu", precision=precision)
    w = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=1.0)
    mp.backward((w * 3).sum())
    mp.unscale_(opt)
    assert w.grad is not None and w.grad.tolist() == [3.0, 3.0]
    assert mp.step(opt)


@pytest.mark.parametrize("precision", ["bf16", pytest.param("fp16", marks=needs_cpu_fp16)])
def test_unscale_without_a_backward_is_refused(precision: Precision) -> None:
    mp = MixedPrecision("cpu", precision=precision)
    w = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=1.0)
    with pytest.raises(RuntimeError, match=r"unscale_\(\) found no gradients from mp.backward"):
        mp.unscale_(opt)
    mp.backward(w.sum())
    assert mp.step(opt)
    with pytest.raises(RuntimeError, match=r"between mp.backward\(loss\) and mp.step"):
        mp.unscale_(opt)


def test_unscale_takes_an_optimizer() -> None:
    mp = MixedPrecision("cpu", precision="fp32")
    w = nn.Parameter(torch.ones(2))
    mp.backward(w.sum())
    with pytest.raises(TypeError, match=r"MixedPrecision.unscale_\(\) takes one optimizer"):
        mp.unscale_([w])  # type: ignore[arg-type]


@needs_cpu_fp16
def test_fp16_unscale_of_a_half_model_names_the_cause() -> None:
    mp = MixedPrecision("cpu", precision="fp16")
    w = nn.Parameter(torch.ones(2, dtype=torch.float16))
    opt = torch.optim.SGD([w], lr=1.0)
    mp.backward(w.float().sum())
    with pytest.raises(ValueError, match=r"fp16 gradients .* model.float\(\)"):
        mp.unscale_(opt)
