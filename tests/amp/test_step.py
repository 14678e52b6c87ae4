"""trainperf.amp._step: what MixedPrecision.step checks, and what a pickled copy keeps."""

from __future__ import annotations

import copy
import math
import pickle
import warnings
from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch import nn

from tests.amp._helpers import Flaky, needs_cpu_fp16
from trainperf.amp import MixedPrecision, Precision
from trainperf.amp._scaler import LossScaler


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


# ----------------------------------------------------------------- a step that raises


PRECISIONS = ["fp32", "bf16", pytest.param("fp16", marks=needs_cpu_fp16)]


@pytest.mark.parametrize("max_grad_norm", [None, 100.0])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_step_that_raised_can_be_retried_on_the_same_backward(
    precision: Precision, max_grad_norm: float | None
) -> None:
    # Before: the retry was refused ("already called since the last mp.backward(loss)"), as
    # if the step had happened; and for fp16 the gradients the failed step had unscaled
    # would have been unscaled again.
    mp = MixedPrecision("cpu", precision=precision)
    w = nn.Parameter(torch.ones(2))
    optimizer = Flaky([w], lr=0.01)
    mp.backward((w * 10).sum())
    with pytest.raises(OSError, match="the optimizer failed"):
        mp.step(optimizer, max_grad_norm=max_grad_norm)
    assert w.tolist() == [1.0, 1.0]
    assert mp.step(optimizer, max_grad_norm=max_grad_norm)
    assert w.tolist() == pytest.approx([0.9, 0.9])  # one step on the true gradients
    if precision == "fp16":
        assert mp.state_dict()["scaler"]["_growth_tracker"] == 1  # one update, not zero
    with pytest.raises(RuntimeError, match=r"already called since the last mp\.backward"):
        mp.step(optimizer)  # the retry used the backward


@needs_cpu_fp16
def test_fp16_gradients_the_caller_unscaled_stay_unscaled_through_a_failed_step() -> None:
    mp = MixedPrecision("cpu", precision="fp16")
    w = nn.Parameter(torch.ones(2))
    optimizer = Flaky([w], lr=0.01)
    mp.backward((w * 10).sum())
    assert mp.scaler is not None
    mp.scaler.unscale_(optimizer)  # to read their norm, as GradScaler's docs do
    with pytest.raises(OSError, match="the optimizer failed"):
        mp.step(optimizer, max_grad_norm=100.0)
    assert w.grad is not None and w.grad.tolist() == [10.0, 10.0]
    assert mp.step(optimizer, max_grad_norm=100.0)
    assert w.tolist() == pytest.approx([0.9, 0.9])


@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_step_that_raised_can_be_skipped_with_a_plain_zero_grad(precision: Precision) -> None:
    # optimizer.zero_grad() instead of mp.zero_grad(): for fp16 the failed step leaves the
    # scaler no record of gradients it unscaled, which would keep the next ones scaled.
    mp = MixedPrecision("cpu", precision=precision)
    w = nn.Parameter(torch.ones(2))
    optimizer = Flaky([w], lr=0.01)
    mp.backward((w * 10).sum())
    with pytest.raises(OSError, match="the optimizer failed"):
        mp.step(optimizer)
    optimizer.zero_grad()
    mp.backward((w * 10).sum())
    assert mp.step(optimizer)
    assert w.tolist() == pytest.approx([0.9, 0.9])


@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_retry_refuses_the_optimizers_that_stepped_before_the_error(
    precision: Precision,
) -> None:
    mp = MixedPrecision("cpu", precision=precision)
    a, b = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))
    opt_a, opt_b = torch.optim.SGD([a], lr=0.01), Flaky([b], lr=0.01)
    mp.backward((a * 10).sum() + (b * 10).sum())
    with pytest.raises(OSError, match="the optimizer failed"):
        mp.step(opt_a, opt_b)
    assert a.tolist() == pytest.approx([0.9, 0.9]) and b.tolist() == [1.0, 1.0]
    with pytest.raises(RuntimeError, match=r"optimizer 1 of 2 \(SGD\), which already stepped"):
        mp.step(opt_a, opt_b)  # a would step twice on one backward
    assert mp.step(opt_b)
    assert a.tolist() == pytest.approx([0.9, 0.9]) and b.tolist() == pytest.approx([0.9, 0.9])
    mp.zero_grad(opt_a)
    mp.zero_grad(opt_b)
    mp.backward((a * 10).sum() + (b * 10).sum())
    assert mp.step(opt_a, opt_b)  # the next backward steps both again
    assert a.tolist() == pytest.approx([0.8, 0.8]) and b.tolist() == pytest.approx([0.8, 0.8])


def test_a_step_that_raised_keeps_what_zero_grad_dropped() -> None:
    # Before: the failed step forgot mp.zero_grad(d_optimizer), so nothing stopped a later
    # step of d_optimizer on the gradients that zero_grad cleared.
    mp = MixedPrecision("cpu", precision="fp32")
    g, d = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))
    g_optimizer, d_optimizer = Flaky([g], lr=0.01), torch.optim.SGD([d], lr=0.01)
    mp.backward((g * d * 10).sum())
    mp.zero_grad(d_optimizer)
    with pytest.raises(OSError, match="the optimizer failed"):
        mp.step(g_optimizer)
    with pytest.raises(RuntimeError, match=r"mp\.zero_grad\(optimizer\) cleared them"):
        mp.step(d_optimizer)
    assert mp.step(g_optimizer)


@needs_cpu_fp16
@pytest.mark.parametrize("one", [True, False], ids=["zero_grad(optimizer)", "zero_grad()"])
def test_fp16_a_step_skipped_after_unscale_unscales_the_next_gradients(one: bool) -> None:
    # GradScaler's pattern: unscale_ to read the norm, then skip the step when it is too
    # large. The scaler kept its record of that unscale_, and the next step applied the next
    # backward's gradients still scaled: 65536 times too large.
    mp = MixedPrecision("cpu", precision="fp16")
    model = nn.Linear(2, 1, bias=False)
    mp.prepare(model)
    nn.init.ones_(model.weight)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    mp.backward(model(torch.ones(1, 2)).sum() * 10)
    assert mp.scaler is not None
    mp.scaler.unscale_(optimizer)
    if one:  # skip this step
        mp.zero_grad(optimizer)
    else:
        mp.zero_grad()
    mp.backward(model(torch.ones(1, 2)).sum() * 10)
    assert mp.step(optimizer)
    assert model.weight.flatten().tolist() == pytest.approx([0.9, 0.9])


def test_a_mixed_precision_pickled_without_the_retry_record_still_steps() -> None:
    # A torch.save(mp) from trainperf 0.1.0 has no record of a failed step's optimizers.
    state = MixedPrecision("cpu", precision="fp32").__getstate__()
    del state["_already_stepped"]
    mp = MixedPrecision.__new__(MixedPrecision)
    mp.__setstate__(state)
    w = nn.Parameter(torch.ones(2))
    mp.backward((w * 10).sum())
    assert mp.step(torch.optim.SGD([w], lr=0.01))
    assert w.tolist() == pytest.approx([0.9, 0.9])


# ----------------------------------------------------------------- fp16 records across calls


@needs_cpu_fp16
@pytest.mark.parametrize("clear", [False, True], ids=["retry", "retry-after-zero_grad"])
def test_fp16_a_retry_counts_an_optimizer_that_skipped_before_the_error(clear: bool) -> None:
    # Before: the retry updated the loss scale with the retried optimizers' inf/NaN flags
    # only: opt_a, which skipped on inf in the failed call, did not lower the scale, and
    # the retry said True (a scheduler stepped on a skipped step).
    mp = MixedPrecision("cpu", precision="fp16")
    a, b = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))
    opt_a, opt_b = torch.optim.SGD([a], lr=0.01), Flaky([b], lr=0.01)
    mp.backward((a * 10).sum() + (b * 10).sum())
    assert a.grad is not None and mp.scaler is not None
    a.grad[0] = math.inf
    scale = mp.scaler.get_scale()
    with pytest.raises(OSError, match="the optimizer failed"):
        mp.step(opt_a, opt_b)
    if clear:  # opt_b is then stepped plainly, with no gradient to find inf in
        opt_b.zero_grad()
    assert not mp.step(opt_b)
    assert a.tolist() == [1.0, 1.0]
    assert b.tolist() == ([1.0, 1.0] if clear else pytest.approx([0.9, 0.9]))
    assert mp.scaler.get_scale() == scale / 2
    assert mp.state_dict()["scaler"]["_growth_tracker"] == 0


@needs_cpu_fp16
@pytest.mark.parametrize("accumulate", [False, True], ids=["optimizer.zero_grad", "no-zero_grad"])
def test_fp16_a_backward_after_unscale_drops_its_record_and_warns(accumulate: bool) -> None:
    # GradScaler's pattern, unscale_ to read the norm, then skipping the step with a plain
    # optimizer.zero_grad() (not mp.zero_grad): the scaler kept its record of the unscale_,
    # and the next step applied the new gradients still scaled, 65536 times too large.
    mp = MixedPrecision("cpu", precision="fp16")
    w = nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([w], lr=0.01)
    mp.backward((w * 10).sum())
    assert mp.scaler is not None
    mp.scaler.unscale_(optimizer)
    if not accumulate:
        optimizer.zero_grad()
    with pytest.warns(UserWarning, match=r"mp\.zero_grad\(optimizer\), not optimizer\.zero_grad"):
        mp.backward((w * 10).sum())
    assert mp.step(optimizer)
    # Accumulating onto unscaled gradients, those are unscaled twice (almost nothing): the
    # step is that of the new gradients, never one 65536 times too large.
    assert w.tolist() == pytest.approx([0.9, 0.9], abs=1e-4)


@needs_cpu_fp16
def test_fp16_unscale_then_step_or_mp_zero_grad_then_backward_warns_nothing() -> None:
    mp = MixedPrecision("cpu", precision="fp16")
    w = nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([w], lr=0.01)
    assert mp.scaler is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mp.backward((w * 10).sum())
        mp.scaler.unscale_(optimizer)
        assert mp.step(optimizer)
        mp.zero_grad(optimizer)
        mp.backward((w * 10).sum())
        mp.scaler.unscale_(optimizer)
        mp.zero_grad(optimizer)
        mp.backward((w * 10).sum())
        assert mp.step(optimizer)
    assert w.tolist() == pytest.approx([0.8, 0.8])


@needs_cpu_fp16
@pytest.mark.parametrize("inputs", [False, True], ids=["disjoint-losses", "backward-inputs"])
def test_fp16_a_backward_keeps_the_unscale_of_an_optimizer_it_did_not_touch(inputs: bool) -> None:
    # One loss per optimizer, a's unscaled (to read its norm) before b's backward. Before:
    # that backward dropped the scaler's record of a's unscale_ too, with a warning whose
    # advice did not fit, and the step unscaled a's gradients again: a ended at 0.99999845.
    _one_loss_per_optimizer_after_an_unscale("cpu", inputs)


@pytest.mark.requires_cuda
def test_fp16_on_cuda_a_backward_keeps_the_unscale_of_an_optimizer_it_did_not_touch() -> None:
    # The same on the GPU, where LossScaler's gradient versions come from CUDA tensors.
    _one_loss_per_optimizer_after_an_unscale("cuda", inputs=False)


def _one_loss_per_optimizer_after_an_unscale(device: str, inputs: bool) -> None:
    mp = MixedPrecision(device, precision="fp16")
    a = nn.Parameter(torch.ones(2, device=device))
    b = nn.Parameter(torch.ones(2, device=device))
    opt_a, opt_b = torch.optim.SGD([a], lr=0.01), torch.optim.SGD([b], lr=0.01)
    assert mp.scaler is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mp.backward((a * 10).sum())
        mp.scaler.unscale_(opt_a)
        if inputs:  # one loss over both, its gradients kept from a
            mp.backward((a * 10).sum() + (b * 10).sum(), inputs=[b])
        else:
            mp.backward((b * 10).sum())
        assert mp.step(opt_a, opt_b)
    assert a.tolist() == pytest.approx([0.9, 0.9]) and b.tolist() == pytest.approx([0.9, 0.9])
    assert mp.state_dict()["scaler"]["_growth_tracker"] == 1


@needs_cpu_fp16
def test_fp16_a_backward_drops_only_the_unscale_of_the_optimizer_it_touched() -> None:
    mp = MixedPrecision("cpu", precision="fp16")
    a, b = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))
    opt_a, opt_b = torch.optim.SGD([a], lr=0.01), torch.optim.SGD([b], lr=0.01)
    assert mp.scaler is not None
    mp.backward((a * 10).sum() + (b * 10).sum())
    mp.scaler.unscale_(opt_a)
    mp.scaler.unscale_(opt_b)
    opt_b.zero_grad()  # skipping b's step the plain way, then a new loss for b
    with pytest.warns(UserWarning, match=r"mp\.zero_grad\(optimizer\), not optimizer\.zero_grad"):
        mp.backward((b * 10).sum())
    assert mp.step(opt_a, opt_b)
    assert a.tolist() == pytest.approx([0.9, 0.9]) and b.tolist() == pytest.approx([0.9, 0.9])


@needs_cpu_fp16
@pytest.mark.parametrize("make_copy", [copy.deepcopy, pickle_copy], ids=["deepcopy", "pickle"])
def test_fp16_a_copy_after_an_unscale_keeps_the_unscale_of_an_untouched_optimizer(
    make_copy: Callable[[MixedPrecision], MixedPrecision],
) -> None:
    # The scaler remembers the optimizers unscale_ saw by weak reference, which cannot be
    # pickled: the copy starts with none, and learns its own.
    mp = MixedPrecision("cpu", precision="fp16")
    a, b = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))
    opt_a, opt_b = torch.optim.SGD([a], lr=0.01), torch.optim.SGD([b], lr=0.01)
    assert mp.scaler is not None
    mp.backward((a * 10).sum())
    mp.scaler.unscale_(opt_a)
    assert mp.step(opt_a)
    mp.zero_grad(opt_a)
    copied = make_copy(mp)
    assert copied.scaler is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        copied.backward((a * 10).sum())
        copied.scaler.unscale_(opt_a)
        copied.backward((b * 10).sum())
        assert copied.step(opt_a, opt_b)
    assert a.tolist() == pytest.approx([0.8, 0.8]) and b.tolist() == pytest.approx([0.9, 0.9])


@needs_cpu_fp16
def test_fp16_a_plain_grad_scaler_drops_every_unscale_at_a_backward() -> None:
    # A scaler that does not know the optimizers (an mp pickled by trainperf 0.1.0 holds a
    # plain GradScaler) cannot tell which gradients a backward touched: it drops them all.
    mp = MixedPrecision("cpu", precision="fp16")
    mp._scaler = torch.amp.GradScaler("cpu")
    a, b = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))
    opt_a, opt_b = torch.optim.SGD([a], lr=0.01), torch.optim.SGD([b], lr=0.01)
    mp.backward((a * 10).sum())
    mp._scaler.unscale_(opt_a)
    opt_a.zero_grad()
    with pytest.warns(UserWarning, match=r"gave new gradients to an optimizer after"):
        mp.backward((a * 10).sum() + (b * 10).sum())
    assert mp.step(opt_a, opt_b)
    assert a.tolist() == pytest.approx([0.9, 0.9]) and b.tolist() == pytest.approx([0.9, 0.9])


def _pickled_by_0_1_0(scale: float) -> bytes:
    """The pickled state of an fp16 MixedPrecision as trainperf 0.1.0 wrote it: its
    ``_scaler`` a plain ``torch.amp.GradScaler`` at ``scale``, no record of a failed step."""
    state = MixedPrecision("cpu", precision="fp16").__getstate__()
    state["_scaler"] = torch.amp.GradScaler("cpu", init_scale=scale)
    del state["_already_stepped"], state["_skip_flags"]
    return pickle.dumps(state)


@needs_cpu_fp16
def test_fp16_a_mixed_precision_pickled_by_0_1_0_tracks_the_unscale_of_each_optimizer() -> None:
    # Before: the unpickled mp kept 0.1.0's plain GradScaler, which knows no optimizer: b's
    # backward dropped a's unscale_ (with advice that did not fit) and a's gradients were
    # unscaled twice (a ended at 0.99999845 instead of 0.9).
    mp = MixedPrecision.__new__(MixedPrecision)
    mp.__setstate__(pickle.loads(_pickled_by_0_1_0(scale=1024.0)))
    assert isinstance(mp.scaler, LossScaler) and mp.scaler.get_scale() == 1024.0
    a, b = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))
    opt_a, opt_b = torch.optim.SGD([a], lr=0.01), torch.optim.SGD([b], lr=0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mp.backward((a * 10).sum())
        mp.scaler.unscale_(opt_a)
        mp.backward((b * 10).sum())
        assert mp.step(opt_a, opt_b)
    assert a.tolist() == pytest.approx([0.9, 0.9]) and b.tolist() == pytest.approx([0.9, 0.9])


@pytest.mark.parametrize("precision", ["fp32", "bf16", pytest.param("fp16", marks=needs_cpu_fp16)])
def test_backward_of_a_loss_that_is_not_a_scalar_says_to_reduce_it(precision: Precision) -> None:
    # Before: torch's bare "grad can be implicitly created only for scalar outputs".
    mp = MixedPrecision("cpu", precision=precision)
    model = nn.Linear(4, 2)
    with pytest.raises(ValueError, match=r"shape \(3, 2\); reduce it first: loss.mean\(\)"):
        mp.backward(model(torch.randn(3, 4)))
    with pytest.raises(RuntimeError, match="found no gradients"):  # nothing was recorded
        mp.step(torch.optim.SGD(model.parameters(), lr=0.1))
    mp.backward(model(torch.randn(3, 4)).sum().reshape(1, 1))  # one element is a scalar
    assert model.weight.grad is not None


def test_backward_of_a_loss_without_a_graph_names_the_likely_causes() -> None:
    # Before: torch's "element 0 of tensors does not require grad and does not have a grad_fn".
    mp = MixedPrecision("cpu", precision="fp32")
    model = nn.Linear(4, 2)
    with torch.no_grad():
        loss = model(torch.randn(3, 4)).sum()
    with pytest.raises(ValueError, match=r"does not require grad.*torch.no_grad\(\)"):
        mp.backward(loss)


# ------------------------------------------------- complex parameters under fp16


@needs_cpu_fp16
@pytest.mark.parametrize("call", ["step", "unscale_"])
def test_fp16_complex_parameters_are_refused_before_anything_steps(call: str) -> None:
    # Before: a bare NotImplementedError from torch's unscale kernel
    # ("_amp_foreach_non_finite_check_and_unscale_cpu" not implemented for 'ComplexFloat'),
    # which names neither the parameter nor the fix.
    mp = MixedPrecision("cpu", precision="fp16")
    real = nn.Parameter(torch.ones(2))
    z = nn.Parameter(torch.ones(3, dtype=torch.complex64))
    opt = torch.optim.SGD([real, z], lr=1.0)
    mp.backward(real.sum() + z.abs().sum())
    with pytest.raises(
        ValueError,
        match=r"complex gradients in optimizer 1 of 1 \(SGD\): parameter #2 \(shape \(3,\), "
        r"torch.complex64\).*precision='bf16' or 'fp32'.*requires_grad_\(False\)",
    ):
        getattr(mp, call)(opt)
    assert real.tolist() == [1.0, 1.0] and z.tolist() == [1, 1, 1]  # nothing stepped
    mp.zero_grad(opt)  # the way on: drop the backward


@needs_cpu_fp16
def test_fp16_complex_parameters_are_named_when_the_optimizer_knows_their_names() -> None:
    mp = MixedPrecision("cpu", precision="fp16")
    model = nn.Linear(2, 2, dtype=torch.complex64)
    opt = torch.optim.SGD(model.named_parameters(), lr=0.1)
    mp.backward(model(torch.ones(1, 2, dtype=torch.complex64)).abs().sum())
    with pytest.raises(ValueError, match=r"parameters 'weight' \(shape \(2, 2\), .*'bias'"):
        mp.step(opt)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_complex_parameters_step_without_a_loss_scaler(precision: Precision) -> None:
    # The fix the fp16 refusal names: no loss scaler, nothing to unscale.
    mp = MixedPrecision("cpu", precision=precision)
    z = nn.Parameter(torch.ones(2, dtype=torch.complex64))
    opt = torch.optim.SGD([z], lr=0.5)
    mp.backward((z.real * 2).sum())
    assert mp.step(opt) and z.tolist() == [0j, 0j]


class _CountedGroups(list):  # type: ignore[type-arg]
    """An optimizer's ``param_groups`` that counts the passes over it."""

    passes = 0

    def __iter__(self):  # type: ignore[no-untyped-def]
        type(self).passes += 1
        return super().__iter__()


def test_the_fp16_and_complex_gradient_checks_walk_the_parameters_once() -> None:
    # Before: check_no_fp16_grads, then check_no_complex_grads, each over every parameter
    # on every fp16 step (and again for unscale_).
    from trainperf.amp._step import check_scalable_grads

    w = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=1.0)
    w.grad = torch.ones(2)
    opt.param_groups = _CountedGroups(opt.param_groups)
    check_scalable_grads((opt,))
    assert _CountedGroups.passes == 1
    half = nn.Parameter(torch.ones(2, dtype=torch.float16))
    half.grad = torch.ones(2, dtype=torch.float16)
    z = nn.Parameter(torch.ones(2, dtype=torch.complex64))
    z.grad = torch.ones(2, dtype=torch.complex64)
    complex_opt = torch.optim.SGD([z], lr=1.0)
    # fp16 is named first, even in a later optimizer than a complex one.
    with pytest.raises(ValueError, match=r"unscale_\(\) found fp16 gradients in optimizer 2 of 2"):
        check_scalable_grads((complex_opt, torch.optim.SGD([half], lr=1.0)), caller="unscale_")
    with pytest.raises(ValueError, match=r"step\(\) found complex gradients .* parameter #1"):
        check_scalable_grads((opt, complex_opt))
