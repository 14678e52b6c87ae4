"""trainperf.batchsize._trained: a step that does not train is refused, or warned about."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

from tests.batchsize._fakes import Trainer, same_state, sample, small_model, state_of
from tests.batchsize._workers import untrained_on_rank_1
from tests.ddp._distributed import fast_start_method
from trainperf.batchsize import BatchSizeReport, tune_batch_size
from trainperf.batchsize._trained import TrainingCheck, unstepped_note
from trainperf.ddp import launch_all

pytestmark = pytest.mark.usefixtures("quick")

UNTRAINED = r"ran \d+ times at batch size 2 but trained nothing it was given"
UNSTEPPED = r"tune_batch_size: step made gradients but changed no parameter"


def tune(step: Any, **kw: Any) -> BatchSizeReport:
    kw.setdefault("max_size", 4)
    return tune_batch_size(step, sample, device="cpu", min_size=2, budget_s=10.0,
                           progress=False, cache=False, **kw)  # fmt: skip


def no_warnings_tune(step: Any, **kw: Any) -> BatchSizeReport:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return tune(step, **kw)


# --------------------------------------------------------------------------- refused


def test_a_step_that_never_calls_backward_is_refused_and_the_state_comes_back() -> None:
    # Before: a forward-only step was timed as if it trained, and the size chosen from its
    # far smaller memory and time was too large, without a word.
    t = Trainer()

    def forward_only(batch: Any) -> torch.Tensor:
        t.opt.zero_grad()  # as a real step starts: the caller's gradients are set to None
        x, y = batch
        return nn.functional.mse_loss(t.model(x), y)

    t.model(torch.randn(4, 8)).sum().backward()  # the caller holds gradients
    before = state_of(t.model, t.opt)
    with pytest.raises(ValueError, match=UNTRAINED) as e:
        tune(forward_only, model=t.model, optimizer=t.opt)
    assert "loss.backward()" in str(e.value) and "model=()" in str(e.value)
    assert same_state(state_of(t.model, t.opt), before)


def test_a_step_that_trains_another_model_than_the_one_passed_is_refused() -> None:
    passed, trained = Trainer(), Trainer()
    with pytest.raises(ValueError, match=UNTRAINED):
        tune(trained, model=passed.model)


def test_an_inference_step_tuned_on_purpose_passes_with_model_empty() -> None:
    model = small_model().eval()

    def infer(batch: Any) -> None:
        with torch.no_grad():
            model(batch[0])

    assert no_warnings_tune(infer, model=()).chosen().status == "ok"


# ------------------------------------------------------------------- not refused


def test_a_step_that_zeroes_the_gradients_at_its_end_is_not_refused() -> None:
    t = Trainer()

    def step(batch: Any) -> None:
        x, y = batch
        nn.functional.mse_loss(t.model(x), y).backward()
        t.opt.step()
        t.opt.zero_grad(set_to_none=True)

    assert no_warnings_tune(step, model=t.model, optimizer=t.opt).chosen().status == "ok"


def test_a_step_that_accumulates_gradients_is_not_refused_nor_warned_about() -> None:
    t = Trainer()
    calls = [0]

    def step(batch: Any) -> None:
        x, y = batch
        nn.functional.mse_loss(t.model(x), y).backward()
        calls[0] += 1
        if calls[0] % 4 == 0:  # the optimizer steps once per 4 calls
            t.opt.step()
            t.opt.zero_grad()

    assert no_warnings_tune(step, model=t.model, optimizer=t.opt).chosen().status == "ok"


def test_a_loss_scaler_that_skips_every_step_is_not_refused_but_warned_about() -> None:
    # fp16's first steps at a large scale overflow, and the scaler skips the optimizer's
    # step; here every step overflows (inf gradients), and the gradients are set to None
    # after each: backward() ran all the same.
    t = Trainer()
    scaler = torch.amp.GradScaler("cpu")

    def step(batch: Any) -> None:
        x, y = batch
        loss = nn.functional.mse_loss(t.model(x), y) * float("inf")
        scaler.scale(loss).backward()
        scaler.step(t.opt)  # skipped: inf gradients
        scaler.update()
        t.opt.zero_grad(set_to_none=True)

    with pytest.warns(UserWarning, match=UNSTEPPED):
        report = tune(step, model=t.model, optimizer=(t.opt, scaler))
    assert report.chosen().status == "ok"
    assert any("can ignore this" in n for n in report.notes)


def test_a_frozen_backbone_with_a_trained_head_is_not_refused() -> None:
    backbone, head = nn.Linear(8, 16), nn.Linear(16, 1)
    backbone.requires_grad_(False)
    model = nn.Sequential(backbone, nn.ReLU(), head)
    opt = torch.optim.SGD(head.parameters(), lr=0.01)

    def step(batch: Any) -> None:
        x, y = batch
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    assert no_warnings_tune(step, model=model, optimizer=opt).chosen().status == "ok"


def test_a_step_without_an_optimizer_step_is_warned_about_in_the_report() -> None:
    t = Trainer()

    def step(batch: Any) -> None:
        x, y = batch
        t.opt.zero_grad()
        nn.functional.mse_loss(t.model(x), y).backward()  # no t.opt.step()

    with pytest.warns(UserWarning, match=UNSTEPPED):
        report = tune(step, model=t.model, optimizer=t.opt)
    assert any(n.startswith("step made gradients but changed no") for n in report.notes)


@pytest.mark.parametrize("impl", ["fused", "foreach", "for-loop"])
def test_a_step_whose_learning_rate_warms_up_from_0_is_not_warned_about(impl: str) -> None:
    # Before (fused): "step made gradients but changed no parameter": at lr 0 (a linear
    # warm-up's first value, held still while tuning) a fused step changes no value and
    # bumps no version counter, though the optimizer stepped.
    torch.manual_seed(0)
    model = small_model()
    flags = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **flags[impl])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / 100))

    def step(batch: Any) -> None:
        x, y = batch
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        sched.step()

    report = no_warnings_tune(step, model=model, optimizer=opt)
    assert opt.param_groups[0]["lr"] == 0.0 and not any("changed no" in n for n in report.notes)


def test_an_optimizer_s_step_hook_is_removed_after_the_warm_up() -> None:
    w = nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([w], lr=0.0)
    check = TrainingCheck([w], [opt])
    marks = check.mark()
    with check.hooked(marks):
        (w * 2).sum().backward()
        opt.step()
    assert marks is not None and marks.stepped and not opt._optimizer_step_post_hooks
    assert check.record(marks, steps=1) and check.stepped_seen and check.settled
    assert unstepped_note(check) is None


# ------------------------------------------------------------------------ the marks


class _Lookahead(torch.optim.Optimizer):
    """timm's Lookahead shape: an Optimizer that skips Optimizer.__init__ on purpose."""

    def __init__(self, base: torch.optim.Optimizer) -> None:
        self.base = base
        self.param_groups = base.param_groups
        self.defaults = base.defaults
        self.state = base.state

    def step(self, closure: Any = None) -> Any:
        return self.base.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.base.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:  # timm's has its own, too
        return self.base.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.base.load_state_dict(state_dict)


def test_an_optimizer_that_skipped_optimizer_init_is_not_hooked_and_tunes() -> None:
    # Before: AttributeError '_Lookahead' object has no attribute
    # '_optimizer_step_post_hooks' from the warm-up's step hook, which stopped tuning.
    torch.manual_seed(0)
    model = small_model()
    opt = _Lookahead(torch.optim.SGD(model.parameters(), lr=0.1))

    def step(batch: Any) -> None:
        x, y = batch
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    assert no_warnings_tune(step, model=model, optimizer=opt).batch_size in (2, 3, 4)


def test_a_fused_optimizer_s_update_counts_as_a_move_though_it_bumps_no_version() -> None:
    model = nn.Linear(8, 4)
    opt = torch.optim.Adam(model.parameters(), fused=True)
    check = TrainingCheck(list(model.parameters()))
    marks = check.mark()
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    assert check.record(marks, steps=1) and check.moved_seen and check.settled
    assert check.mark() is None  # settled: nothing marked any more


def test_hooks_see_a_backward_whose_gradients_are_gone_and_are_removed_after() -> None:
    w = nn.Parameter(torch.ones(3))
    frozen = nn.Parameter(torch.ones(3), requires_grad=False)  # cannot be hooked
    check = TrainingCheck([w, frozen])
    marks = check.mark()
    with check.hooked(marks):
        (w * 2).sum().backward()
        w.grad = None
    assert marks is not None and marks.hooked and not w._backward_hooks
    assert check.record(marks, steps=1) and not check.moved_seen


def test_no_parameters_means_nothing_to_check() -> None:
    check = TrainingCheck([])
    assert check.settled and check.mark() is None and check.record(None, steps=3)
    assert unstepped_note(check) is None


@pytest.mark.slow  # two ranks started and tuned
def test_a_step_that_trains_nothing_on_one_rank_stops_both_ranks() -> None:
    results = launch_all(
        untrained_on_rank_1, nprocs=2, backend="gloo", start_method=fast_start_method(),
        timeout=60.0, hang_timeout=10.0,
    )  # fmt: skip
    assert len(results) == 2
    for r in results:
        assert "trained nothing it was given" in r, r
