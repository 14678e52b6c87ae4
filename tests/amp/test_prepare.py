"""Tests of trainperf.amp._prepare: MixedPrecision.prepare moves the model, and says when an
optimizer built before it holds parameters the model no longer has."""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest
import torch

from tests.amp._helpers import small_cnn
from trainperf.amp import MixedPrecision


@pytest.fixture
def overwrite_params() -> Iterator[None]:
    """torch's opt-in to new Parameter objects on conversion (process-wide): on for the test."""
    before = torch.__future__.get_overwrite_module_params_on_conversion()
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    yield
    torch.__future__.set_overwrite_module_params_on_conversion(before)


@pytest.mark.parametrize("channels_last", [True, False])
def test_an_optimizer_built_before_prepare_keeps_the_model_s_parameters(
    channels_last: bool,
) -> None:
    model = small_cnn()
    params = list(model.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        MixedPrecision("cpu", precision="fp32", channels_last=channels_last).prepare(model)
    held = optimizer.param_groups[0]["params"]
    assert all(a is b for a, b in zip(held, model.parameters(), strict=True))
    assert all(a is b for a, b in zip(params, model.parameters(), strict=True))


@pytest.mark.usefixtures("overwrite_params")
@pytest.mark.parametrize("channels_last", [True, False])
def test_prepare_warns_when_an_optimizer_holds_parameters_it_replaced(
    channels_last: bool,
) -> None:
    # Before: no word; the optimizer stepped the old parameters, which got no gradient, so
    # nothing trained while mp.step returned True.
    model = small_cnn()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mp = MixedPrecision("cpu", precision="fp32", channels_last=channels_last)
    with pytest.warns(
        UserWarning,
        match=r"replaced 8 of the model's parameters.*"
        r"set_overwrite_module_params_on_conversion\(True\).*"
        r"build the optimizer .* after mp\.prepare\(model\)",
    ):
        mp.prepare(model)
    held = {id(p) for p in optimizer.param_groups[0]["params"]}
    assert not held & {id(p) for p in model.parameters()}  # what the warning is about


@pytest.mark.usefixtures("overwrite_params")
def test_prepare_does_not_warn_when_nothing_else_holds_the_replaced_parameters() -> None:
    model = small_cnn()
    mp = MixedPrecision("cpu", precision="fp32", channels_last=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mp.prepare(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # the order the docs show
    x, y = mp.prepare_batch((torch.randn(2, 3, 8, 8), torch.randn(2, 4)))
    before = [p.detach().clone() for p in model.parameters()]
    mp.backward(torch.nn.functional.mse_loss(model(x), y))
    assert mp.step(optimizer)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
