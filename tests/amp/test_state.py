"""Tests of trainperf.amp._state: what MixedPrecision.load_state_dict accepts."""

from __future__ import annotations

import copy
import math
import pickle
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from tests.amp._helpers import needs_cpu_fp16
from trainperf.amp import MixedPrecision
from trainperf.amp._state import check_scaler_settings, restoring


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
@pytest.mark.parametrize("bad", ["65536", None, True, [1.0], np.timedelta64(5)])
def test_loading_a_loss_scale_that_is_not_a_number_is_refused(bad: object) -> None:
    # Before: "65536", [1.0] and np.timedelta64(5) (NumPy counts it an integer) were taken,
    # and the first mp.backward raised a bare TypeError.
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
def test_restoring_puts_back_a_scale_that_collapsed_before_tuning() -> None:
    # tune_batch_size saves the caller's state before its probes and puts it back after:
    # a scale that reached 0 in the caller's own run is theirs, and comes back as it was.
    mp = MixedPrecision("cpu", precision="fp16")
    _collapsed(mp)
    saved = mp.state_dict()
    mp.load_state_dict({**saved, "scaler": None})  # what a probe may leave: another scale
    with restoring():
        mp.load_state_dict(saved)
    assert mp.state_dict() == saved
    with pytest.raises(ValueError, match=r"is 0\.0"):  # outside tuning's restore: refused
        mp.load_state_dict(saved)


# ------------------------------------------------- a loss scale between backward and step


@needs_cpu_fp16
def test_the_loss_scale_in_use_loads_between_backward_and_step() -> None:
    # Before: refused with "scaled by 65536.0 ... unscale them by the loaded scale (65536.0)
    # instead": nothing the waiting gradients depend on changes.
    mp = MixedPrecision("cpu", precision="fp16")
    w = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=1.0)
    saved = mp.state_dict()
    mp.backward(w.sum())
    mp.load_state_dict(saved)
    assert mp.step(opt) and w.tolist() == [0.0, 0.0]  # lr 1.0 times the unscaled gradient 1.0


@needs_cpu_fp16
def test_the_fix_the_mid_step_refusal_names_works_without_prepared_models() -> None:
    # Before: the refusal said "mp.zero_grad()", which raises for a MixedPrecision that
    # prepared no model, and mp.zero_grad(optimizer) still left the load refused.
    mp = MixedPrecision("cpu", precision="fp16")
    w = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=1.0)
    saved = {"precision": "fp16", "scaler": {**mp.state_dict()["scaler"], "scale": 2.0}}
    mp.backward(w.sum())
    scales = r"another loss scale: .* 65536\.0, .* loaded 2\.0 .* "
    fix = r"or drop the waiting gradients first with mp.zero_grad\(optimizer\)"
    with pytest.raises(RuntimeError, match=scales + fix):
        mp.load_state_dict(saved)
    mp.zero_grad(opt)
    mp.load_state_dict(saved)
    assert mp.state_dict() == saved and w.grad is None
    mp.backward(w.sum())
    assert mp.step(opt) and w.tolist() == [0.0, 0.0]  # scaled and unscaled by 2.0


@needs_cpu_fp16
def test_another_scale_loaded_after_zero_grad_of_one_optimizer_ends_the_backward_for_all() -> None:
    # The other optimizer's gradients were scaled by 65536: stepping them after the load
    # would unscale them by 2.0 (a step 32768 times too large). It is refused instead.
    mp = MixedPrecision("cpu", precision="fp16")
    a, b = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))
    opt_a, opt_b = torch.optim.SGD([a], lr=1.0), torch.optim.SGD([b], lr=1.0)
    saved = {"precision": "fp16", "scaler": {**mp.state_dict()["scaler"], "scale": 2.0}}
    mp.backward((a + b).sum())
    mp.scaler.unscale_(opt_b)  # type: ignore[union-attr]  # its record goes with the backward
    mp.zero_grad(opt_a)
    mp.load_state_dict(saved)
    with pytest.raises(RuntimeError, match=r"found no gradients from mp.backward"):
        mp.step(opt_b)
    assert b.tolist() == [1.0, 1.0]
    mp.zero_grad(opt_b)
    mp.backward((a + b).sum())
    assert mp.step(opt_a, opt_b) and a.tolist() == b.tolist() == [0.0, 0.0]


# ------------------------------------------------------------------- a pickled loss scale


def _pickled_with_scale(scale: object, *, plain: bool) -> bytes:
    """An fp16 MixedPrecision pickled with its loss scale at ``scale``: by this trainperf, or
    (``plain``) as trainperf 0.1.0 wrote it, its ``_scaler`` a plain ``torch.amp.GradScaler``
    and no record of a failed step."""
    mp = MixedPrecision("cpu", precision="fp16")
    if plain:
        state = mp.__getstate__()
        state["_scaler"] = torch.amp.GradScaler("cpu", init_scale=scale)  # type: ignore[arg-type]
        del state["_already_stepped"], state["_skip_flags"]
        return pickle.dumps(state)
    assert mp.scaler is not None
    # GradScaler pickles its scale as a number (its _init_scale), never a tensor.
    mp.scaler._init_scale = scale  # type: ignore[assignment]
    return pickle.dumps(mp)


def _unpickled(data: bytes, *, plain: bool) -> MixedPrecision:
    if plain:
        mp = MixedPrecision.__new__(MixedPrecision)
        mp.__setstate__(pickle.loads(data))
        return mp
    loaded: MixedPrecision = pickle.loads(data)
    return loaded


def _refused_at_use(mp: MixedPrecision, match: str) -> None:
    """``mp``'s backward and step (what needs its loss scale) raise a ValueError matching
    ``match``, and touch no gradient."""
    w = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1)
    with pytest.raises(ValueError, match=match):
        mp.backward(w.sum())
    assert w.grad is None
    with pytest.raises(ValueError, match=match):
        mp.step(opt)
    assert w.tolist() == [1.0, 1.0]


@needs_cpu_fp16
@pytest.mark.parametrize("plain", [False, True], ids=["pickle", "pickle-of-0.1.0"])
@pytest.mark.parametrize("bad", [0.0, -1024.0, math.inf, -math.inf, math.nan, "65536", None])
def test_a_pickled_loss_scale_not_finite_and_positive_unpickles_and_is_refused_at_use(
    bad: object, plain: bool
) -> None:
    # Before: unpickled without a word, though load_state_dict refuses the same scale: at
    # inf or NaN every later fp16 step was skipped, at 0 the first step on CPU wrote NaN into
    # the weights, and "65536" or None failed at the first backward with a bare TypeError.
    # Unpickling does not raise either (nothing else saved in the same file could be loaded
    # then): it unpickles, and what needs the scale refuses it.
    mp = _unpickled(_pickled_with_scale(bad, plain=plain), plain=plain)
    _refused_at_use(
        mp,
        rf"the pickled MixedPrecision's loss scale is {re.escape(repr(bad))}: it must be "
        r"a finite number > 0.*MixedPrecision\('cpu', precision='fp16'\)",
    )
    assert repr(mp.state_dict()["scaler"]["scale"]) == repr(bad)  # readable as it was


@needs_cpu_fp16
def test_a_checkpoint_holding_a_mixed_precision_whose_scale_collapsed_loads(
    tmp_path: Path,
) -> None:
    # Before: it loaded, and the MixedPrecision's first step on CPU wrote NaN into the
    # weights. Refusing while unpickling would leave the model weights saved beside it
    # unreadable: the checkpoint loads, and the MixedPrecision refuses backward and step.
    model = nn.Linear(2, 1)
    mp = MixedPrecision("cpu", precision="fp16")
    _collapsed(mp)
    torch.save({"model": model.state_dict(), "step": 7, "mp": mp}, tmp_path / "ckpt.pt")
    loaded = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    assert loaded["step"] == 7
    assert torch.equal(loaded["model"]["weight"], model.weight.detach())
    _refused_at_use(loaded["mp"], r"pickled MixedPrecision's loss scale is 0\.0")


@needs_cpu_fp16
def test_a_mixed_precision_copied_after_its_scale_collapsed_is_refused_at_use() -> None:
    mp = MixedPrecision("cpu", precision="fp16")
    _collapsed(mp)
    copied = copy.deepcopy(mp)  # Before: copied, and its first step wrote NaN
    _refused_at_use(copied, r"pickled MixedPrecision's loss scale is 0\.0")
    _refused_at_use(copy.deepcopy(copied), r"loss scale is 0\.0")  # a copy of the copy too
    # The fixes the refusal names: a new MixedPrecision, or a good scale loaded into this one.
    fresh = MixedPrecision("cpu", precision="fp16")
    assert fresh.scaler is not None and fresh.scaler.get_scale() == 2.0**16
    copied.load_state_dict(fresh.state_dict())
    w = nn.Parameter(torch.ones(2))
    copied.backward(w.sum())
    assert copied.step(torch.optim.SGD([w], lr=0.1))


@needs_cpu_fp16
def test_a_collapsed_scale_loaded_as_it_was_keeps_a_pickled_copy_refused() -> None:
    # Loading the state without its scale, or tuning's restore of the same bad scale, leaves
    # the copy's own scale bad: it stays refused.
    mp = MixedPrecision("cpu", precision="fp16")
    _collapsed(mp)
    copied = copy.deepcopy(mp)
    saved = copied.state_dict()
    copied.load_state_dict({**saved, "scaler": None})
    with restoring():
        copied.load_state_dict(saved)
    _refused_at_use(copied, r"loss scale is 0\.0")


@needs_cpu_fp16
@pytest.mark.parametrize("plain", [False, True], ids=["pickle", "pickle-of-0.1.0"])
@pytest.mark.parametrize("good", [1.0, 2.0**-149, 3e38, 1024])
def test_unpickling_any_finite_positive_loss_scale_keeps_it(good: float, plain: bool) -> None:
    mp = _unpickled(_pickled_with_scale(good, plain=plain), plain=plain)
    assert mp.scaler is not None and mp.scaler.get_scale() == good


# ------------------------------------------------- the loss scaler's other settings


@needs_cpu_fp16
@pytest.mark.parametrize(
    ("key", "bad", "rule"),
    [
        ("backoff_factor", 2.0, r"a number in \(0, 1\]"),
        ("backoff_factor", math.nan, r"a number in \(0, 1\]"),
        ("backoff_factor", 0.0, r"a number in \(0, 1\]"),
        ("backoff_factor", 1.5, r"a number in \(0, 1\]"),
        ("growth_factor", 0.5, r"a finite number >= 1"),
        ("growth_factor", math.inf, r"a finite number >= 1"),
        ("growth_factor", math.nan, r"a finite number >= 1"),
        ("growth_interval", 0, r"an int from 1 to 2\*\*63 - 1"),
        ("growth_interval", 1.5, r"an int from 1 to 2\*\*63 - 1"),
        ("growth_interval", 2**63, r"an int from 1 to 2\*\*63 - 1"),
        ("_growth_tracker", "x", r"an int from 0 to 2\*\*31 - 1"),
        ("_growth_tracker", -1, r"an int from 0 to 2\*\*31 - 1"),
        ("_growth_tracker", 2**31, r"an int from 0 to 2\*\*31 - 1"),
        # NumPy counts a timedelta64 as an integer; GradScaler takes none.
        ("growth_interval", np.timedelta64(5), r"an int from 1 to 2\*\*63 - 1"),
        ("_growth_tracker", np.timedelta64(5), r"an int from 0 to 2\*\*31 - 1"),
        ("growth_factor", np.timedelta64(5), r"a finite number >= 1"),
    ],
)
def test_a_loss_scaler_setting_no_grad_scaler_takes_is_refused_and_loads_nothing(
    key: str, bad: object, rule: str
) -> None:
    # Before: loaded without a word: a backoff_factor of 2.0 raised the scale on every
    # skipped step (NaN: every step skipped from then on), a growth_factor of 0.5 lowered it
    # after good ones (GradScaler's own constructor refuses both), a growth_interval of 0
    # never grew it; 1.5 and "x" failed at the first backward or step with a bare TypeError,
    # as did a np.timedelta64(5) growth_interval or _growth_tracker.
    mp = MixedPrecision("cpu", precision="fp16")
    before = mp.state_dict()
    state = {"precision": "fp16", "scaler": {**before["scaler"], key: bad}}
    with pytest.raises(
        ValueError,
        match=rf"state\['scaler'\]\['{key}'\] is {re.escape(repr(bad))}, a setting GradScaler "
        rf"cannot use: it must be {rule}.*"
        r"mp.load_state_dict\(\{\*\*state, 'scaler': None\}\)",
    ) as caught:
        mp.load_state_dict(state)
    assert mp.state_dict() == before
    # A setting made through GradScaler's own setters is neither corrupt nor hand-edited:
    # the message does not say it is.
    assert "corrupt" not in str(caught.value)
    assert "a setting GradScaler cannot use" in str(caught.value)


@needs_cpu_fp16
def test_loss_scaler_settings_a_grad_scaler_takes_load() -> None:
    mp = MixedPrecision("cpu", precision="fp16")
    settings = {"growth_factor": 1.5, "backoff_factor": 0.25, "growth_interval": 10}
    saved = {**mp.state_dict()["scaler"], **settings, "_growth_tracker": np.int64(3)}
    mp.load_state_dict({"precision": "fp16", "scaler": saved})
    assert mp.scaler is not None and mp.scaler.get_growth_interval() == 10
    assert mp.state_dict()["scaler"]["_growth_tracker"] == 3


@needs_cpu_fp16
@pytest.mark.parametrize(
    ("setter", "value"),
    [
        ("set_growth_factor", 1.0),  # growth off
        ("set_growth_factor", 1),
        ("set_backoff_factor", 1.0),  # no backoff: a fixed scale with growth off
        ("set_growth_interval", 2**63 - 1),  # growth off another way
    ],
)
def test_a_scaler_set_through_grad_scalers_setters_round_trips(setter: str, value: float) -> None:
    # GradScaler's setters and update kernel take these (growth or backoff off, as its
    # constructor does not): the check of the settings must not refuse mp's own state_dict().
    mp = MixedPrecision("cpu", precision="fp16")
    assert mp.scaler is not None
    getattr(mp.scaler, setter)(value)
    w = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1)
    mp.backward(w.sum())
    assert mp.step(opt)  # the update kernel runs with it
    saved = mp.state_dict()
    resumed = MixedPrecision("cpu", precision="fp16")
    resumed.load_state_dict(saved)
    assert resumed.state_dict() == saved
    mp.load_state_dict(saved)  # into itself too
    resumed.zero_grad(opt)
    resumed.backward(w.sum())
    assert resumed.step(opt)


def test_a_timedelta64_setting_is_refused_with_a_value_error() -> None:
    # NumPy counts a timedelta64 as an integer, and GradScaler takes none (the first backward
    # or step fails with a bare TypeError): the check reads it as no number, rather than
    # comparing it with the bounds (a bare OverflowError against 2**63) or taking it.
    for key in ("growth_interval", "_growth_tracker"):
        with pytest.raises(ValueError, match=rf"\['{key}'\] is np.timedelta64\(5\), a setting"):
            check_scaler_settings({key: np.timedelta64(5)})


@pytest.mark.parametrize("bad", ["no", 0, None])
def test_strict_must_be_true_or_false(bad: object) -> None:
    # Before: strict="no" read as True, and refused what strict=False would have loaded.
    mp = MixedPrecision("cpu", precision="fp32")
    with pytest.raises(TypeError, match=rf"strict must be True or False, got {bad!r}"):
        mp.load_state_dict({"precision": "fp32", "scaler": None}, strict=bad)  # type: ignore[arg-type]


@needs_cpu_fp16
@pytest.mark.parametrize(
    "bad", [1e39, 1e300, 2**128, 10**400], ids=["1e39", "1e300", "2**128", "10**400"]
)
def test_a_loss_scale_past_float32s_range_is_refused_and_loads_nothing(bad: float) -> None:
    # Before: 1e300 loaded and the first mp.backward raised a bare RuntimeError ("value
    # cannot be converted to type float without overflow": GradScaler keeps the scale in a
    # float32 tensor); 10**400 raised a bare OverflowError from the check itself.
    mp = MixedPrecision("cpu", precision="fp16")
    before = mp.state_dict()
    state = {"precision": "fp16", "scaler": {**before["scaler"], "scale": bad}}
    with pytest.raises(
        ValueError,
        match=r"state\['scaler'\]\['scale'\]\) is .*finite number > 0.*at most 3\.4e\+38.*"
        r"mp.load_state_dict\(\{\*\*state, 'scaler': None\}\)",
    ):
        mp.load_state_dict(state)
    assert mp.state_dict() == before


# ------------------------------------------------- a growth factor past float32's range


@needs_cpu_fp16
@pytest.mark.parametrize(
    "bad", [1e300, 1e38, 10**400, 2.0**113], ids=["1e300", "1e38", "10**400", "2**113"]
)
def test_a_growth_factor_past_float32_from_the_starting_scale_is_refused(bad: float) -> None:
    # Before: loaded without a word; GradScaler's update kernel then never grew the scale
    # (it drops a growth past float32's range), or a factor just in range sent it far past
    # what fp16 gradients hold.
    mp = MixedPrecision("cpu", precision="fp16")
    before = mp.state_dict()
    state = {"precision": "fp16", "scaler": {**before["scaler"], "growth_factor": bad}}
    with pytest.raises(
        ValueError,
        match=rf"state\['scaler'\]\['growth_factor'\] is {re.escape(repr(bad))}, a setting "
        r"GradScaler cannot use: it must be a finite number >= 1 .* at most 5\.19e\+33 .*"
        r"never grows the scale\); load the state without it.*"
        r"mp.load_state_dict\(\{\*\*state, 'scaler': None\}\)",
    ):
        mp.load_state_dict(state)
    assert mp.state_dict() == before


@needs_cpu_fp16
@pytest.mark.parametrize(
    ("scale", "factor"),
    [(2.0**127, 2.0), (1.0, torch.finfo(torch.float32).max / 2**16)],
    ids=["top", "cap"],
)
def test_a_growth_factor_up_to_the_cap_loads_whatever_the_scale(
    scale: float, factor: float
) -> None:
    # A scale that grew to the top by the default factor is a state GradScaler writes: the
    # cap does not depend on the scale.
    mp = MixedPrecision("cpu", precision="fp16")
    saved = {**mp.state_dict()["scaler"], "scale": scale, "growth_factor": factor}
    mp.load_state_dict({"precision": "fp16", "scaler": saved})
    assert mp.scaler is not None and mp.scaler.get_growth_factor() == factor


@needs_cpu_fp16
@pytest.mark.parametrize(
    "bad", [1e300, 10**400, 0.5, math.inf], ids=["1e300", "10**400", "0.5", "inf"]
)
def test_set_growth_factor_refuses_what_load_state_dict_would(bad: float) -> None:
    # Before: mp.scaler.set_growth_factor(1e300) was taken (GradScaler's setter checks
    # nothing), and mp.state_dict() then held a state that load_state_dict refuses.
    mp = MixedPrecision("cpu", precision="fp16")
    assert mp.scaler is not None
    with pytest.raises(
        ValueError,
        match=rf"set_growth_factor\(\) got {re.escape(repr(bad))}: .* at most 5\.19e\+33 .*"
        r"such as 2\.0",
    ):
        mp.scaler.set_growth_factor(bad)
    assert mp.scaler.get_growth_factor() == 2.0
    mp.scaler.set_growth_factor(4.0)
    assert mp.scaler.get_growth_factor() == 4.0


@needs_cpu_fp16
@pytest.mark.parametrize(
    ("setter", "getter", "bad", "good"),
    [
        ("set_backoff_factor", "get_backoff_factor", 2.0, 0.25),
        ("set_backoff_factor", "get_backoff_factor", math.nan, 1.0),
        ("set_growth_interval", "get_growth_interval", 0, 10),
        ("set_growth_interval", "get_growth_interval", 1.5, 10),
    ],
)
def test_the_other_scaler_setters_refuse_what_load_state_dict_would(
    setter: str, getter: str, bad: float, good: float
) -> None:
    # GradScaler's setters take anything: mp.scaler.set_backoff_factor(2.0) raised the scale
    # at every skipped step, and mp.state_dict() then held a state load_state_dict refuses.
    mp = MixedPrecision("cpu", precision="fp16")
    assert mp.scaler is not None
    before = getattr(mp.scaler, getter)()
    with pytest.raises(ValueError, match=rf"{setter}\(\) got .*: it must be .*such as"):
        getattr(mp.scaler, setter)(bad)
    assert getattr(mp.scaler, getter)() == before
    getattr(mp.scaler, setter)(good)
    assert getattr(mp.scaler, getter)() == good
    mp.load_state_dict(mp.state_dict())  # what the setter leaves loads


# ------------------------------------------------- restoring a scale no float32 holds


@needs_cpu_fp16
@pytest.mark.parametrize("pending", [False, True], ids=["idle", "zeroed-mid-step"])
@pytest.mark.parametrize("bad", [10**400, 1e39, -(10**309)], ids=["10**400", "1e39", "-10**309"])
def test_restoring_a_scale_no_float32_holds_is_refused_and_loads_nothing(
    bad: float, pending: bool
) -> None:
    # Before: mid-step, _changes_scale's float(10**400) raised a bare OverflowError; else
    # GradScaler set half the state, then failed with a bare OverflowError or RuntimeError.
    mp = MixedPrecision("cpu", precision="fp16")
    w = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=1.0)
    mp.backward(w.sum())
    if pending:
        mp.zero_grad(opt)
    else:
        assert mp.step(opt)
    before = mp.state_dict()
    state = {"precision": "fp16", "scaler": {**before["scaler"], "scale": bad}}
    with pytest.raises(ValueError, match=rf"is {re.escape(repr(bad))}: .*float32"), restoring():
        mp.load_state_dict(state)
    assert mp.state_dict() == before
    assert mp._backward_pending is pending


@needs_cpu_fp16
def test_scaler_settings_given_as_numpy_numbers_are_kept_as_python_ones() -> None:
    # Stored as given, an np.int64 interval made mp.state_dict() unreadable to a plain
    # torch.load (weights_only refuses NumPy scalars).
    mp = MixedPrecision("cpu", precision="fp16")
    assert mp.scaler is not None
    mp.scaler.set_growth_interval(np.int64(100))
    mp.scaler.set_backoff_factor(np.float32(0.25))
    mp.scaler.set_growth_factor(np.float64(4.0))
    assert type(mp.scaler.get_growth_interval()) is int
    assert type(mp.scaler.get_backoff_factor()) is float
    assert type(mp.scaler.get_growth_factor()) is float
