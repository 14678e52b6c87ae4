"""Training state saved and restored bit for bit: parameters, moments, gradients, modes."""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.amp._helpers import needs_cpu_fp16
from tests.batchsize._fakes import MeanOnFirstForward, Trainer, same_state, sample, state_of
from trainperf import tune_batch_size
from trainperf.amp import MixedPrecision
from trainperf.batchsize._holders import stateful_objects, with_live_amp_state
from trainperf.batchsize._state import SavedState


def test_restore_undoes_training_steps_exactly() -> None:
    t = Trainer()
    for _ in range(3):  # the caller's run so far: Adam moments exist
        t(sample(4))
    t.model.eval()
    before = state_of(t.model, t.opt)
    saved = SavedState.save(stateful_objects(t.model, t.opt))
    for _ in range(5):
        t(sample(16))  # probing: parameters, moments, BatchNorm statistics and modes change
    assert not same_state(before, state_of(t.model, t.opt))
    saved.restore()
    assert same_state(before, state_of(t.model, t.opt))


def test_restore_can_be_repeated_without_the_optimizer_changing_the_saved_copy() -> None:
    # Optimizer.load_state_dict keeps CPU tensors it is handed as they are; without a fresh
    # copy per restore, the next probe's steps would update the saved moments in place.
    t = Trainer()
    t(sample(4))
    before = state_of(t.model, t.opt)
    saved = SavedState.save([t.model, t.opt])
    for _ in range(3):
        t(sample(8))
        saved.restore()
    assert same_state(before, state_of(t.model, t.opt))


def test_an_optimizer_without_state_gets_none_back() -> None:
    t = Trainer()
    saved = SavedState.save([t.model, t.opt])
    t(sample(8))
    assert len(t.opt.state) > 0
    saved.restore()
    assert len(t.opt.state) == 0  # the probe's moments are dropped, memory with them
    assert all(p.grad is None for p in t.model.parameters())


def test_gradients_in_the_middle_of_an_accumulation_come_back() -> None:
    t = Trainer()
    x, y = sample(4)
    nn.functional.mse_loss(t.model(x), y).backward()  # half of an accumulated update
    grads = [p.grad.clone() for p in t.model.parameters()]  # type: ignore[union-attr]
    saved = SavedState.save([t.model, t.opt])
    t(sample(8))
    saved.drop_gradients()
    assert all(p.grad is None for p in t.model.parameters())
    saved.restore()
    assert all(torch.equal(p.grad, g) for p, g in zip(t.model.parameters(), grads, strict=True))  # type: ignore[arg-type]


def test_schedulers_and_scalers_in_a_tuple_are_restored_and_empty_states_skipped() -> None:
    t = Trainer()
    sched = torch.optim.lr_scheduler.StepLR(t.opt, step_size=1, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", enabled=False)  # state_dict() is {}: nothing to do
    objects = stateful_objects(t.model, (t.opt, sched, scaler))
    assert objects == [t.model, t.opt, sched, scaler]
    saved = SavedState.save(objects)
    for _ in range(3):
        t(sample(4))
        sched.step()
    saved.restore()
    assert sched.last_epoch == 0 and t.opt.param_groups[0]["lr"] == 0.01


class Counting(nn.Module):
    """A layer with a buffer ``state_dict()`` leaves out: a count of samples seen, and a
    cache that grows with the longest input (as rotary caches do)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("seen", torch.zeros((), dtype=torch.long), persistent=False)
        self.register_buffer("cache", torch.zeros(2), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += x.shape[0]
        if self.cache.numel() < x.shape[0]:
            self.cache = torch.arange(float(x.shape[0]))
        return self.lin(x)


def test_buffers_left_out_of_the_state_dict_come_back() -> None:
    m = Counting()
    m(torch.zeros(3, 4))
    saved = SavedState.save(stateful_objects(m))
    for n in (8, 16):
        m(torch.zeros(n, 4))  # probing: the count grows, the cache is replaced by a larger one
    saved.restore()
    assert int(m.seen) == 3
    assert torch.equal(m.cache, torch.arange(3.0))


def test_a_backward_waiting_for_its_step_still_waits_after_tuning() -> None:
    # Tuned in the middle of a gradient accumulation: mp.step(opt) must still step the
    # gradients accumulated before (it refused: "found no gradients from mp.backward").
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mp = MixedPrecision("cpu", precision="fp32")
    mp.backward(model(torch.ones(2, 4)).sum())
    saved = SavedState.save(stateful_objects(model, opt, mp))
    mp.backward(model(torch.ones(2, 4)).sum())
    mp.step(opt)  # a probe's step
    saved.restore()
    before = model.weight.detach().clone()
    mp.step(opt)
    assert not torch.equal(model.weight.detach(), before)


class _FailingStep(torch.optim.SGD):
    """An optimizer whose step runs out of memory while ``fail`` says so (inside
    ``scaler.step``, after its ``unscale_``)."""

    fail = False

    def step(self, closure=None):  # type: ignore[no-untyped-def, override]
        if self.fail:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
        return super().step(closure)


@pytest.mark.parametrize("through", ["scaler", "mixed-precision"])
def test_a_loss_scaler_left_half_way_by_an_oom_is_put_back_ready(through: str) -> None:
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    opt = _FailingStep(model.parameters(), lr=0.1)
    mp = MixedPrecision("cpu", precision="fp16")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16) if through == "scaler" else mp.scaler
    assert scaler is not None
    x, y = torch.randn(4, 8), torch.randn(4, 1)

    def train_step() -> None:
        opt.zero_grad()
        scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
        scaler.unscale_(opt)  # as for gradient clipping
        scaler.step(opt)
        scaler.update()

    saved = SavedState.save([model, opt, scaler if through == "scaler" else mp])
    opt.fail = True
    with pytest.raises(torch.OutOfMemoryError):
        train_step()  # the probe: unscaled, then out of memory before update()
    opt.fail = False
    saved.restore()
    w0 = model.weight.detach().clone()
    train_step()  # the first training step after tuning: no "unscale_() already called"
    moved = (model.weight.detach() - w0).abs().max().item()
    # The gradients were unscaled: a step of lr * grad, not 65536 times that.
    assert 0.0 < moved < 1.0, moved


def test_parameters_frozen_by_a_step_that_stopped_half_way_are_unfrozen() -> None:
    # A GAN step freezes the discriminator, and an OOM may stop it before it unfreezes.
    t = Trainer()
    saved = SavedState.save([t.model, t.opt])
    for p in t.model.parameters():
        p.requires_grad_(False)
    saved.restore()
    assert all(p.requires_grad for p in t.model.parameters())


def test_parameters_only_an_optimizer_holds_are_put_back() -> None:
    # optimizer= without model=: an optimizer's state_dict() holds no parameter values.
    t = Trainer()
    before = [p.detach().clone() for p in t.model.parameters()]
    saved = SavedState.save(stateful_objects(None, t.opt))
    t(sample(8))
    assert not all(torch.equal(a, p) for a, p in zip(before, t.model.parameters(), strict=True))
    saved.restore()
    assert all(torch.equal(a, p) for a, p in zip(before, t.model.parameters(), strict=True))


def test_optimizer_state_keeps_its_own_dtype() -> None:
    # fp32 moments for bf16 parameters: load_state_dict would cast them to bf16.
    w = nn.Parameter(torch.randn(4, dtype=torch.bfloat16))
    opt = torch.optim.SGD([w], lr=0.1, momentum=0.9)
    opt.state[w]["momentum_buffer"] = torch.randn(4, dtype=torch.float32)
    before = opt.state[w]["momentum_buffer"].clone()
    saved = SavedState.save([opt])
    opt.state[w]["momentum_buffer"].mul_(3)
    saved.restore()
    after = opt.state[w]["momentum_buffer"]
    assert after.dtype == torch.float32 and torch.equal(after, before)


def test_an_optimizer_s_own_counter_in_its_state_is_kept() -> None:
    # Some custom optimizers keep a value of their own in self.state, not per parameter.
    w = nn.Parameter(torch.randn(4))
    opt = torch.optim.SGD([w], lr=0.1)
    opt.state["global_step"] = 7  # type: ignore[index]
    saved = SavedState.save([opt])
    opt.state["global_step"] = 9  # type: ignore[index]
    saved.restore()
    assert opt.state["global_step"] == 7  # type: ignore[index]


class _GrowingCache(nn.Module):
    """A persistent buffer the forward pass regrows to the batch (some positional caches)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 1)
        self.register_buffer("cache", torch.zeros(1, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cache.shape[0] < len(x):
            self.cache = torch.zeros(len(x), 8)
        return self.lin(x + self.cache[: len(x)])


def test_a_persistent_buffer_that_changed_shape_is_put_back_with_everything_else() -> None:
    # Before: load_state_dict refused the size mismatch, and the optimizer's moments and the
    # gradients were left as the probe left them.
    model = nn.Sequential(_GrowingCache())
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    before = state_of(model, opt)
    saved = SavedState.save(stateful_objects(model, opt))
    model(torch.randn(16, 8)).sum().backward()
    opt.step()
    assert model[0].cache.shape == (16, 8) and len(opt.state) == 2
    saved.restore()
    assert model[0].cache.shape == (1, 8)
    assert same_state(before, state_of(model, opt)) and len(opt.state) == 0
    assert model[0].lin.weight.grad is None


def test_an_error_restoring_one_object_still_restores_the_rest_then_raises() -> None:
    t = Trainer()
    saved = SavedState.save(stateful_objects(t.model, t.opt))
    t(sample(8))

    def refuse(state: object) -> None:
        raise RuntimeError("refused")

    t.model.load_state_dict = refuse  # type: ignore[method-assign,assignment]
    with pytest.raises(RuntimeError, match="refused"):
        saved.restore()
    assert len(t.opt.state) == 0  # the optimizer, after the model, was still put back
    assert all(p.grad is None for p in t.model.parameters())


def test_an_optimizer_and_its_scheduler_not_passed_are_found_by_the_model_s_parameters() -> None:
    # Before: model= alone saved the model only; the probes' Adam moments and step count
    # stayed in the optimizer (step=3427 after one call).
    t = Trainer()
    sched = torch.optim.lr_scheduler.StepLR(t.opt, step_size=1)
    other = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)  # another model's
    found = stateful_objects(t.model)
    assert found[0] is t.model and {id(o) for o in found[1:]} == {id(t.opt), id(sched)}
    assert all(o is not other for o in found)
    saved = SavedState.save(found)
    t(sample(8))
    sched.step()
    saved.restore()
    assert len(t.opt.state) == 0 and sched.last_epoch == 0


def test_a_mixed_precision_the_step_uses_but_not_passed_gets_its_loss_scale_back() -> None:
    # Before: its loss scale came back at 8192 instead of 32768, its growth tracker moved.
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mp = MixedPrecision("cpu", precision="fp16")
    assert mp.scaler is not None
    objects = with_live_amp_state(stateful_objects(model, opt))
    assert objects[:2] == [model, opt] and sum(o is mp for o in objects) == 1
    assert sum(o is mp for o in with_live_amp_state([model, mp])) == 1
    saved = SavedState.save(objects)
    before = mp.state_dict()
    mp.backward(model(torch.ones(2, 4)).sum())  # a probe's backward, not yet stepped
    mp.scaler.update(new_scale=8192.0)  # as an overflow would have backed it off
    assert mp.state_dict() != before
    saved.restore()
    assert mp.state_dict() == before and not mp._backward_pending


def test_a_buffer_that_was_none_is_none_again() -> None:
    # Before: load_state_dict refused the restore ("Missing key(s) in state_dict: mean"),
    # and the probe's tensor stayed in the buffer.
    m = MeanOnFirstForward()
    saved = SavedState.save(stateful_objects(m))
    m(torch.randn(8, 4))
    assert m.mean is not None
    saved.restore()
    assert m.mean is None and "mean" in m._buffers
    m(torch.ones(2, 4))  # and the next forward fills it in again, from its own batch
    assert torch.equal(m.mean, torch.ones(4))


def test_optimizer_alone_puts_back_the_model_s_batchnorm_statistics_and_modes() -> None:
    # Before: only the parameter values came back; running_mean and num_batches_tracked
    # stayed drifted and the model stayed in train mode.
    t = Trainer()
    t.model.eval()
    before = state_of(t.model, t.opt)
    saved = SavedState.save(stateful_objects(None, t.opt))
    t.model.train()
    t(sample(8))
    saved.restore()
    assert same_state(before, state_of(t.model, t.opt)) and not t.model.training


def test_a_gan_s_discriminator_passed_only_by_its_optimizer_is_put_back() -> None:
    # model=G, optimizer=(optG, optD): D's BatchNorm statistics stayed drifted.
    g = nn.Linear(4, 4)
    d = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4, affine=False), nn.Linear(4, 1))
    opt_g = torch.optim.SGD(g.parameters(), lr=0.1)
    opt_d = torch.optim.SGD(d.parameters(), lr=0.1)
    before = {k: v.clone() for k, v in d.state_dict().items()}
    saved = SavedState.save(stateful_objects(g, (opt_g, opt_d)))
    opt_d.zero_grad()
    d(g(torch.randn(8, 4))).sum().backward()
    opt_d.step()
    saved.restore()
    after = d.state_dict()
    assert all(torch.equal(v, after[k]) for k, v in before.items())


def test_a_grad_scaler_the_step_uses_but_not_passed_gets_its_scale_back() -> None:
    # Before: a plain torch.amp.GradScaler was not found; its scale grew 1024x in tuning.
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", growth_interval=1)
    saved = SavedState.save(with_live_amp_state(stateful_objects(model, opt)))
    before = scaler.state_dict()
    for _ in range(3):
        scaler.scale(model(torch.ones(2, 4)).sum()).backward()
        scaler.step(opt)
        scaler.update()
    assert scaler.get_scale() > before["scale"]
    saved.restore()
    assert scaler.state_dict() == before


class _StatsOnFirstForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "stats"):
            self.register_buffer("stats", x.mean(0).detach())
        return self.lin(x)


def test_a_buffer_registered_while_probing_is_removed_again() -> None:
    # Before: load_state_dict raised "Missing key(s) in state_dict" and the buffer stayed.
    m = _StatsOnFirstForward()
    saved = SavedState.save(stateful_objects(m))
    m(torch.randn(8, 4))
    saved.restore()
    assert not hasattr(m, "stats") and "stats" not in m.state_dict()


class _LazyHead(nn.Module):
    """Builds its head on the first forward, in place of the ``None`` set in __init__."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.head: nn.Module | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.head is None:
            self.head = nn.Linear(4, 1)
        return self.head(self.body(x))


def test_a_layer_built_on_the_first_forward_is_undone_to_the_attribute_it_replaced() -> None:
    m = _LazyHead()
    saved = SavedState.save(stateful_objects(m))
    m(torch.randn(8, 4))
    saved.restore()
    assert m.head is None and "head.weight" not in m.state_dict()
    assert m(torch.randn(2, 4)).shape == (2, 1)  # it builds the head again


def test_tuning_a_model_that_builds_a_layer_on_its_first_forward_leaves_it_usable() -> None:
    m = _LazyHead()
    opt = torch.optim.SGD(m.body.parameters(), lr=0.1)

    def step(batch: torch.Tensor) -> None:
        opt.zero_grad()
        m(batch).sum().backward()
        opt.step()

    report = tune_batch_size(
        step, lambda n: torch.ones(n, 4), model=m, optimizer=opt, device="cpu",
        max_size=4, budget_s=2.0, progress=False, cache=False,
    )  # fmt: skip
    assert report.batch_size >= 1 and m.head is None


def test_param_groups_a_step_added_are_removed_and_the_rest_put_back() -> None:
    # Progressive unfreezing: the step adds the backbone's group on the way. Before:
    # load_state_dict refused ("a different number of parameter groups") and the optimizer
    # kept the probe's group, moments and all.
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
    backbone, head = model
    opt = torch.optim.Adam(head.parameters(), lr=0.01)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    before = state_of(model, opt)
    saved = SavedState.save(stateful_objects(model, opt))
    opt.add_param_group({"params": backbone.parameters(), "lr": 1e-3})
    opt.param_groups[0]["params"].append(nn.Parameter(torch.zeros(3)))  # one more, by hand
    model(torch.randn(4, 4)).sum().backward()
    opt.step()
    saved.restore()
    assert len(opt.param_groups) == 1 and len(opt.param_groups[0]["params"]) == 2
    assert all(backbone.weight is not p for p in opt.state)
    assert same_state(before, state_of(model, opt))


@pytest.fixture
def one_rank_group(tmp_path: Path) -> Iterator[None]:
    """A gloo process group of this process alone (a ZeroRedundancyOptimizer needs one)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=(tmp_path / "store").as_uri(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.usefixtures("one_rank_group")
@pytest.mark.parametrize("buckets", [False, True], ids=["tensors", "bucket-views"])
def test_a_group_a_step_added_to_a_zero_redundancy_optimizer_leaves_both_its_levels(
    buckets: bool,
) -> None:
    # Before: only the local optimizer's groups were put back; ZeRO kept the added group
    # (and its partition), and its next step failed: "Mismatch between number of source
    # and destination parameter groups".
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
    backbone, head = model
    opt = ZeroRedundancyOptimizer(head.parameters(), optimizer_class=torch.optim.Adam,
                                  lr=0.01, parameters_as_bucket_view=buckets)  # fmt: skip
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    before = state_of(model, opt.optim)
    saved = SavedState.save(stateful_objects(model, opt))
    opt.add_param_group({"params": backbone.parameters(), "lr": 1e-3})
    model(torch.randn(4, 4)).sum().backward()
    opt.step()
    saved.restore()
    assert len(opt.param_groups) == len(opt.optim.param_groups) == 1
    assert [len(g["params"]) for g in opt.param_groups] == [2]
    assert same_state(before, state_of(model, opt.optim))
    frozen = backbone.weight.detach().clone()
    model(torch.randn(2, 4)).sum().backward()
    opt.step()  # ZeRO's own step: its groups and its partition agree with the local ones
    assert torch.equal(frozen, backbone.weight) and len(opt.optim.state) == 2
    opt.consolidate_state_dict()  # its partition, cached, holds the head alone again
    assert [len(g["params"]) for g in opt.state_dict()["param_groups"]] == [2]


def _same_value(a: object, b: object) -> bool:
    """Equal, tensors (and lists of them) compared by value."""
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return torch.equal(a, b)
    return a is b or a == b


def _a_step_that_raised_half_way() -> tuple[MixedPrecision, nn.Sequential, list[torch.optim.SGD]]:
    """An fp16 MixedPrecision whose ``mp.step(first, second)`` stepped ``first`` and ran out
    of memory in ``second``: its retry record holds ``first`` and ``first``'s inf/NaN flags."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    first = torch.optim.SGD(model[0].parameters(), lr=0.1)
    second = _FailingStep(model[1].parameters(), lr=0.1)
    mp = MixedPrecision("cpu", precision="fp16")
    mp.backward(model(torch.ones(2, 4)).sum())
    second.fail = True
    with pytest.raises(torch.OutOfMemoryError):
        mp.step(first, second)
    second.fail = False
    assert mp._already_stepped == {id(first)} and len(mp._skip_flags) == 1
    return mp, model, [first, second]


@pytest.mark.usefixtures("quick")
def test_a_step_s_retry_record_survives_tuning_and_the_retry_steps_each_optimizer_once() -> None:
    # Before: a probe's mp.backward cleared _already_stepped and _skip_flags, which tuning
    # did not put back, so the retry stepped the first optimizer a second time.
    mp, model, (first, second) = _a_step_that_raised_half_way()
    # Copies of the containers: the probes' steps clear and fill the same set objects.
    before = {k: v.copy() if isinstance(v, (set, list)) else v for k, v in vars(mp).items()}

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        mp.backward(nn.functional.mse_loss(model(batch[0]).float(), batch[1]))
        mp.step(first, second)
        mp.zero_grad(first)
        mp.zero_grad(second)

    tune_batch_size(
        step, lambda n: (torch.ones(n, 4), torch.ones(n, 1)), model=model, optimizer=first,
        device="cpu", max_size=4, budget_s=2.0, progress=False, cache=False,
    )  # fmt: skip
    # Every attribute, not a list of them: one MixedPrecision gains is checked too.
    changed = sorted(k for k in before.keys() | vars(mp).keys()
                     if not _same_value(before.get(k), vars(mp).get(k)))  # fmt: skip
    assert changed == []
    w_first, w_second = model[0].weight.detach().clone(), model[1].weight.detach().clone()
    with pytest.raises(RuntimeError, match=r"optimizer 1 of 2 \(SGD\), which already stepped"):
        mp.step(first, second)  # the first optimizer would step twice on one backward
    mp.step(second)  # the retry
    assert torch.equal(model[0].weight.detach(), w_first)
    assert not torch.equal(model[1].weight.detach(), w_second)


@pytest.mark.usefixtures("quick")
def test_tuning_between_unscale_and_step_warns_nothing_and_leaves_the_unscale(
    recwarn: pytest.WarningsRecorder,
) -> None:
    # Before: each probe's mp.backward found the caller's unscale_ record and warned that
    # a backward came after unscale_, though tuning puts that record back afterwards.
    from trainperf.amp._bookkeeping import UNSCALED_BACKWARD

    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mp = MixedPrecision("cpu", precision="fp16")
    assert mp.scaler is not None

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        mp.backward(nn.functional.mse_loss(model(batch[0]).float(), batch[1]))
        mp.step(opt)
        mp.zero_grad(opt)

    mp.backward(nn.functional.mse_loss(model(torch.ones(2, 4)), torch.zeros(2, 1)))
    mp.scaler.unscale_(opt)  # to clip the gradients; then tuning, then mp.step(opt)
    unscaled = model.weight.grad.clone()  # type: ignore[union-attr]
    tune_batch_size(
        step, lambda n: (torch.ones(n, 4), torch.zeros(n, 1)), model=model, optimizer=opt,
        device="cpu", max_size=4, budget_s=2.0, progress=False, cache=False,
    )  # fmt: skip
    assert [str(w.message) for w in recwarn if UNSCALED_BACKWARD in str(w.message)] == []
    before = model.weight.detach().clone()
    mp.step(opt)  # applies the gradients unscaled before tuning, not unscaled again
    assert torch.allclose(model.weight.detach(), before - 0.1 * unscaled)


@pytest.mark.usefixtures("quick")
def test_a_plain_scaler_s_unscale_before_tuning_neither_breaks_the_probes_nor_is_lost() -> None:
    # Before: each probe's own scaler.unscale_ raised "unscale_() has already been called
    # on this optimizer since the last update()", and tune_batch_size with it.
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        scaler.scale(nn.functional.mse_loss(model(batch[0]), batch[1])).backward()
        scaler.unscale_(opt)
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()

    scaler.scale(nn.functional.mse_loss(model(torch.ones(2, 4)), torch.zeros(2, 1))).backward()
    scaler.unscale_(opt)
    unscaled = model.weight.grad.clone()  # type: ignore[union-attr]
    tune_batch_size(
        step, lambda n: (torch.ones(n, 4), torch.zeros(n, 1)), model=model, optimizer=opt,
        device="cpu", max_size=4, budget_s=2.0, progress=False, cache=False,
    )  # fmt: skip
    before = model.weight.detach().clone()
    scaler.step(opt)  # the caller's step: its gradients unscaled once, before tuning
    assert torch.allclose(model.weight.detach(), before - 0.1 * unscaled)


def _fp16_caller_mid_accumulation() -> tuple[MixedPrecision, nn.Linear, torch.optim.SGD]:
    """An fp16 MixedPrecision whose caller tunes between ``mp.backward`` and ``mp.step``,
    with a loss scale of 1024 (not the initial one)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mp = MixedPrecision("cpu", precision="fp16")
    assert mp.scaler is not None
    scale = {**mp.state_dict()["scaler"], "scale": 1024.0}
    mp.load_state_dict({"precision": "fp16", "scaler": scale})
    mp.backward(nn.functional.mse_loss(model(torch.ones(2, 4)), torch.zeros(2, 1)))
    return mp, model, opt


@needs_cpu_fp16
@pytest.mark.usefixtures("quick")
def test_tuning_whose_probe_runs_out_of_memory_mid_step_restores_the_loss_scale() -> None:
    # With mp.load_state_dict refused between mp.backward and mp.step, the restore after a
    # probe whose step ran out of memory there failed; the loss scale, the gradients and the
    # backward waiting for its step must all come back as they were, bit for bit.
    mp, model, opt = _fp16_caller_mid_accumulation()
    state, grad = mp.state_dict(), model.weight.grad.clone()  # type: ignore[union-attr]

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        mp.backward(nn.functional.mse_loss(model(batch[0]), batch[1]))
        if len(batch[0]) > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
        mp.step(opt)
        mp.zero_grad(opt)

    report = tune_batch_size(
        step, lambda n: (torch.ones(n, 4), torch.zeros(n, 1)), model=model, optimizer=opt,
        device="cpu", min_size=2, max_size=4, budget_s=2.0, progress=False, cache=False,
    )  # fmt: skip
    assert report.batch_size == 2
    assert mp.state_dict() == state and torch.equal(model.weight.grad, grad)
    before = model.weight.detach().clone()
    mp.step(opt)  # the caller's step: its gradients unscaled by 1024, as they were scaled
    assert torch.allclose(model.weight.detach(), before - 0.1 * grad / 1024.0)


@needs_cpu_fp16
@pytest.mark.usefixtures("quick")
def test_a_probe_s_skipped_step_neither_warns_nor_counts_toward_the_caller_s_run() -> None:
    # Before: the caller had 19 fp16 steps in a row skipped; a probe's first step, skipped
    # too, was the 20th and warned that the loss is probably inf/NaN, during tuning.
    from trainperf.amp._bookkeeping import SKIPPED_STEPS, SKIPS_BEFORE_WARNING

    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mp = MixedPrecision("cpu", precision="fp16")
    for _ in range(SKIPS_BEFORE_WARNING - 1):
        mp.backward(model(torch.ones(2, 4)).sum() * math.nan)
        assert not mp.step(opt)
        mp.zero_grad(opt)
    first_of_probe = [True]

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        nan = math.nan if first_of_probe[0] else 1.0  # the probe's first step skips
        first_of_probe[0] = False
        mp.backward(nn.functional.mse_loss(model(batch[0]), batch[1]) * nan)
        mp.step(opt)
        mp.zero_grad(opt)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tune_batch_size(
            step, lambda n: (torch.ones(n, 4), torch.zeros(n, 1)), model=model, optimizer=opt,
            device="cpu", min_size=2, max_size=2, budget_s=2.0, progress=False, cache=False,
        )  # fmt: skip
    assert not first_of_probe[0]  # a probe's step was skipped
    skipped = SKIPPED_STEPS.split("{")[0]
    assert [str(w.message) for w in caught if skipped in str(w.message)] == []
    assert mp._skipped_in_a_row == SKIPS_BEFORE_WARNING - 1  # the caller's run, restored


class _TrainState:
    """A caller's bundle passed as one of ``model=(...)``: its ``load_state_dict`` loads
    the MixedPrecision it holds."""

    def __init__(self, mp: MixedPrecision) -> None:
        self.mp = mp
        self.epoch = 3

    def state_dict(self) -> dict[str, object]:
        return {"epoch": self.epoch, "amp": self.mp.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = state["epoch"]
        self.mp.load_state_dict(state["amp"])


@needs_cpu_fp16
def test_a_mixed_precision_a_passed_object_loads_comes_back_after_a_probe_s_backward() -> None:
    # Before: the bundle's load_state_dict reached mp.load_state_dict while the probe's
    # backward still waited for its step: RuntimeError, instead of the state put back.
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mp = MixedPrecision("cpu", precision="fp16")
    assert mp.scaler is not None
    bundle = _TrainState(mp)
    saved = SavedState.save(with_live_amp_state(stateful_objects((model, bundle), opt)))
    before = mp.state_dict()
    mp.backward(model(torch.ones(2, 4)).sum())  # a probe's backward, stopped by an OOM
    mp.scaler.update(new_scale=8192.0)  # another scale than the caller's
    bundle.epoch = 4
    saved.restore()
    assert mp.state_dict() == before and not mp._backward_pending and bundle.epoch == 3


@needs_cpu_fp16
@pytest.mark.usefixtures("quick")
@pytest.mark.parametrize("scale", [1024.0, 0.0])
def test_a_probe_out_of_memory_mid_step_is_oom_with_the_mixed_precision_in_a_bundle(
    scale: float,
) -> None:
    # Before: tune_batch_size raised RuntimeError ("load_state_dict() was called between
    # mp.backward(loss) and mp.step") instead of marking the size oom, or, with the caller's
    # loss scale already down to 0, ValueError ("the state's loss scale ... is 0.0").
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mp = MixedPrecision("cpu", precision="fp16")
    assert mp.scaler is not None
    mp.scaler.load_state_dict({**mp.scaler.state_dict(), "scale": scale})
    state = mp.state_dict()

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        mp.backward(nn.functional.mse_loss(model(batch[0]), batch[1]))
        if len(batch[0]) > 2:  # Adam's first step allocating its moments, say
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
        mp.step(opt)
        mp.zero_grad(opt)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # at scale 0 every step skips: the tuner says so
        report = tune_batch_size(
            step, lambda n: (torch.ones(n, 4), torch.zeros(n, 1)), model=(model, _TrainState(mp)),
            optimizer=opt, device="cpu", min_size=2, max_size=4, budget_s=2.0, progress=False,
            cache=False,
        )  # fmt: skip
    assert report.batch_size == 2
    assert [c.status for c in report.candidates if c.batch_size == 4] == ["oom"]
    assert mp.state_dict() == state and not mp._backward_pending
