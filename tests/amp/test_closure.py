"""trainperf.amp._closure: optimizers that step with a closure (LBFGS) in MixedPrecision.step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.amp._helpers import Flaky, needs_cpu_fp16
from trainperf.amp import MixedPrecision, Precision


def quadratic(precision: Precision) -> tuple[MixedPrecision, nn.Parameter, torch.optim.LBFGS]:
    mp = MixedPrecision("cpu", precision=precision)
    w = nn.Parameter(torch.zeros(3))
    return mp, w, torch.optim.LBFGS([w], lr=1.0, max_iter=20)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_lbfgs_steps_with_a_closure_passed_through(precision: Precision) -> None:
    # Before: TypeError "step() got an unexpected keyword argument 'closure'".
    mp, w, lbfgs = quadratic(precision)
    calls = []

    def closure() -> torch.Tensor:
        lbfgs.zero_grad()
        with mp.autocast():
            loss = ((w - torch.tensor([1.0, 2.0, 3.0])) ** 2).sum().float()
        mp.backward(loss)
        calls.append(loss.item())
        return loss

    assert mp.step(lbfgs, closure=closure) is True  # no mp.backward needed before it
    assert len(calls) > 1  # LBFGS re-evaluated the loss
    assert w.tolist() == pytest.approx([1.0, 2.0, 3.0], abs=1e-3)
    with pytest.raises(RuntimeError, match=r"already called since the last mp\.backward"):
        mp.step(torch.optim.SGD([w], lr=0.1))  # the closure's backward was used
    assert mp.step(lbfgs, closure=closure) is True  # a closure makes its own gradients


@pytest.mark.parametrize("scheduler", [False, True], ids=["bare", "with-lr-scheduler"])
def test_lbfgs_without_a_closure_says_how_to_pass_one(scheduler: bool) -> None:
    # Before: torch's bare "missing 1 required positional argument: 'closure'".
    mp, w, lbfgs = quadratic("fp32")
    if scheduler:  # it replaces lbfgs.step with a wrapper of another signature
        torch.optim.lr_scheduler.StepLR(lbfgs, step_size=1)
    mp.backward((w**2).sum())
    with pytest.raises(
        TypeError,
        match=r"optimizer 1 of 1 \(LBFGS\), whose step\(\) needs a closure; pass it: "
        r"mp\.step\(optimizer, closure=closure\)",
    ):
        mp.step(lbfgs)
    assert w.tolist() == [0.0, 0.0, 0.0]


@needs_cpu_fp16
def test_fp16_refuses_a_closure_and_an_optimizer_that_needs_one() -> None:
    # Before: GradScaler's "Closure use is not currently supported if GradScaler is
    # enabled." (or the bare missing-argument error), with no way out named.
    mp, w, lbfgs = quadratic("fp16")
    mp.backward((w**2).sum())
    with pytest.raises(ValueError, match=r"GradScaler does not support closures.*'bf16'"):
        mp.step(lbfgs, closure=lambda: (w**2).sum())
    with pytest.raises(ValueError, match=r"\(LBFGS\), whose step\(\) needs a closure, but fp16"):
        mp.step(lbfgs)


def test_a_closure_with_max_grad_norm_or_not_callable_is_refused() -> None:
    mp, w, lbfgs = quadratic("fp32")
    with pytest.raises(ValueError, match=r"max_grad_norm=1\.0 with a closure.*inside the closure"):
        mp.step(lbfgs, closure=lambda: (w**2).sum(), max_grad_norm=1.0)
    with pytest.raises(TypeError, match=r"closure=\.\.\.\) takes a function .*, got 1\.0"):
        mp.step(lbfgs, closure=1.0)  # type: ignore[arg-type]


def test_a_closure_that_raises_leaves_mp_as_it_was() -> None:
    mp = MixedPrecision("cpu", precision="fp32")
    w = nn.Parameter(torch.ones(2))
    sgd = torch.optim.SGD([w], lr=0.1)

    def closure() -> torch.Tensor:
        mp.backward((w * 10).sum())
        raise OSError("the data went away")

    with pytest.raises(OSError, match="the data went away"):
        mp.step(sgd, closure=closure)
    with pytest.raises(RuntimeError, match=r"found no gradients from mp\.backward\(loss\)"):
        mp.step(sgd)  # the closure's backward was not a backward of the loop's


class StepAttribute:
    """An optimizer wrapper whose ``step`` is an instance attribute, not a method."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.param_groups = optimizer.param_groups
        self.step = optimizer.step
        self.zero_grad = optimizer.zero_grad


def test_an_optimizer_whose_step_is_an_instance_attribute_steps() -> None:
    # Before: AttributeError "type object 'StepAttribute' has no attribute 'step'".
    mp, w, lbfgs = quadratic("fp32")
    sgd = StepAttribute(torch.optim.SGD([w], lr=0.1))
    mp.backward((w * 10).sum())
    assert mp.step(sgd)  # type: ignore[arg-type]
    assert w.tolist() == pytest.approx([-1.0, -1.0, -1.0])
    mp.backward((w * 10).sum())
    with pytest.raises(TypeError, match=r"\(StepAttribute\), whose step\(\) needs a closure"):
        mp.step(StepAttribute(lbfgs))  # type: ignore[arg-type]


def test_a_failed_closure_step_keeps_the_record_of_an_earlier_failed_step() -> None:
    # Before: the closure's mp.backward cleared the record that opt_a had stepped in the
    # failed step before it, and the failure did not put it back: opt_a stepped twice.
    mp = MixedPrecision("cpu", precision="fp32")
    a, b = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))
    opt_a, opt_b = torch.optim.SGD([a], lr=0.01), Flaky([b], lr=0.01)
    mp.backward((a * 10).sum() + (b * 10).sum())
    with pytest.raises(OSError, match="the optimizer failed"):
        mp.step(opt_a, opt_b)

    def closure() -> torch.Tensor:
        loss = (b * 10).sum()
        mp.backward(loss)
        raise OSError("the data went away")

    with pytest.raises(OSError, match="the data went away"):
        mp.step(torch.optim.SGD([b], lr=0.01), closure=closure)
    with pytest.raises(RuntimeError, match=r"optimizer 1 of 2 \(SGD\), which already stepped"):
        mp.step(opt_a, opt_b)
    assert a.tolist() == pytest.approx([0.9, 0.9])
