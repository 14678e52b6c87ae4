"""trainperf.batchsize._holders: what holds the state a probe changes, found unpassed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trainperf.batchsize._holders import (
    holding_optimizers,
    module_generators,
    owning_modules,
    schedulers_held,
    stateful_objects,
)


def test_an_object_without_state_dict_is_refused_by_name() -> None:
    with pytest.raises(TypeError, match=r"str has no state_dict\(\)/load_state_dict\(\)"):
        stateful_objects(nn.Linear(1, 1), ("not a state",))


def test_schedulers_driving_a_given_optimizer_are_found_and_held_still() -> None:
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    other = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
    step_lr = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    torch.optim.lr_scheduler.StepLR(other, step_size=1)  # another optimizer's: not ours
    found = stateful_objects(model, opt)
    assert found[:2] == [model, opt] and {id(o) for o in found[2:]} == {id(plateau), id(step_lr)}
    assert stateful_objects(model, (opt, step_lr)).count(step_lr) == 1
    step_lr.step = step_lr.step  # an instance attribute of its own comes back as it was
    own = vars(step_lr)["step"]
    with schedulers_held(found):
        step_lr.step()
        plateau.step(1.0)
    assert step_lr.last_epoch == 0 and vars(step_lr)["step"] is own
    assert "step" not in vars(plateau)


def test_a_gan_s_second_optimizer_is_found_and_each_optimizer_only_once() -> None:
    gen, disc = nn.Linear(2, 2), nn.Linear(2, 1)
    opt_g = torch.optim.Adam(gen.parameters())
    opt_d = torch.optim.Adam(disc.parameters())
    assert holding_optimizers([gen, disc, opt_g]) == [opt_d]
    assert stateful_objects((gen, disc), (opt_g, opt_d)) == [gen, disc, opt_g, opt_d]
    assert holding_optimizers([nn.Linear(2, 2)]) == []


def test_the_outermost_module_owning_an_optimizer_s_parameters_is_found() -> None:
    model = nn.Sequential(nn.Sequential(nn.Linear(2, 2)), nn.BatchNorm1d(2, affine=False))
    opt = torch.optim.SGD(model[0].parameters(), lr=0.1)
    loose = nn.Parameter(torch.zeros(2))  # no module holds it: saved by value instead
    other = torch.optim.SGD([loose], lr=0.1)
    assert owning_modules([opt]) == [model]
    assert owning_modules([model, opt]) == [] and owning_modules([other]) == []


class _Seeded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gen = torch.Generator()


def test_the_generators_of_a_model_passed_or_found_by_its_optimizer_are_found() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(_Seeded()))
    gen = model[1][0].gen
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert [g is gen for g in module_generators([model])] == [True]
    assert [g is gen for g in module_generators([model, opt])] == [True]  # once
    assert [g is gen for g in module_generators([opt])] == [True]  # its owner, found
    # The owners given are taken as found: none given, none looked for.
    assert module_generators([opt], owners=[]) == []
    assert [g is gen for g in module_generators([opt], owners=[model])] == [True]
