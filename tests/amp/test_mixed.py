"""trainperf.amp._mixed: MixedPrecision's device, training step, loss scaling, checkpoints."""

from __future__ import annotations

import copy
import json
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import trainperf.device
from tests.amp._helpers import TinyViT, fake_gpu, needs_cpu_fp16, small_cnn, small_mlp
from trainperf.amp import MixedPrecision, _tf32, choose_precision
from trainperf.checkpoint import load_checkpoint, save_checkpoint
from trainperf.errors import DeviceError


def train(
    mp: MixedPrecision, model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int
) -> list[float]:
    model = mp.prepare(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    xb, yb = mp.prepare_batch((x, y))
    losses = []
    for _ in range(steps):
        with mp.autocast():
            out = model(xb)
        loss = nn.functional.cross_entropy(out.float(), yb)
        mp.backward(loss)
        assert mp.step(opt, max_grad_norm=5.0)
        mp.zero_grad(opt)
        losses.append(loss.item())
    return losses


# ----------------------------------------------------------------- the device, construction


def test_device_none_uses_best_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trainperf.device, "best_device", lambda: torch.device("cpu"))
    assert MixedPrecision(precision="fp32").device == torch.device("cpu")
    monkeypatch.setattr(trainperf.device, "best_device", lambda: torch.device("cuda", 0))
    fake_gpu(monkeypatch, (7, 0))  # fp16: an answer the CPU never gives
    assert choose_precision() == torch.float16
    assert MixedPrecision().device == torch.device("cuda", 0)


@pytest.mark.slow
def test_construction_on_cpu_does_not_initialise_cuda() -> None:
    code = (
        "import torch\n"
        "from trainperf.amp import MixedPrecision\n"
        "mp = MixedPrecision('cpu')\n"
        "m = mp.prepare(torch.nn.Conv2d(3, 4, 3))\n"
        "x = mp.prepare_batch(torch.randn(2, 3, 8, 8))\n"
        "with mp.autocast():\n"
        "    loss = m(x).float().sum()\n"
        "mp.backward(loss)\n"
        "mp.step(torch.optim.SGD(m.parameters(), lr=0.1))\n"
        "print(torch.cuda.is_initialized())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip().splitlines()[-1] == "False"


# --------------------------------------------------------------------------- misuse


def test_cuda_without_cuda_is_a_device_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DeviceError, match="CUDA is not available"):
        MixedPrecision("cuda")
    with pytest.raises(DeviceError, match="CUDA is not available"):
        choose_precision("cuda:1")


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"precision": "fp8"}, ValueError, "precision must be one of"),
        ({"precision": "bfloat16"}, ValueError, "precision must be one of"),
        ({"channels_last": "yes"}, ValueError, "channels_last must be 'auto', True or False"),
        ({"channels_last": 1}, ValueError, "channels_last must be 'auto', True or False"),
        ({"tf32": "yes"}, TypeError, "tf32 must be True or False"),
        ({"device": 3.5}, TypeError, "device must be a str, int, torch.device or None"),
        ({"device": "gpu7"}, ValueError, "invalid device 'gpu7'"),
    ],
)
def test_bad_arguments(kwargs: dict[str, object], exc: type[Exception], match: str) -> None:
    kwargs.setdefault("device", "cpu")
    with pytest.raises(exc, match=match):
        MixedPrecision(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("given", "name"),
    [
        (torch.bfloat16, "bf16"),
        (torch.float16, "fp16"),
        (torch.float32, "fp32"),
        ("bfloat16", "bf16"),
        ("float16", "fp16"),
        ("half", "fp16"),
        ("float32", "fp32"),
        ("BF16", "bf16"),
    ],
)
def test_a_dtype_or_another_name_for_a_precision_is_told_the_name_to_pass(
    given: object, name: str
) -> None:
    # The error listed the choices but left the user to map torch.bfloat16 onto one.
    with pytest.raises(ValueError, match=rf"got {re.escape(repr(given))}; pass precision='{name}'"):
        MixedPrecision("cpu", precision=given)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"got 'fp8'$"):  # no name to suggest
        MixedPrecision("cpu", precision="fp8")  # type: ignore[arg-type]


def test_step_without_backward_through_mp_is_an_error() -> None:
    mp = MixedPrecision("cpu", precision="bf16")
    model = mp.prepare(small_mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with mp.autocast():
        loss = model(torch.randn(4, 16)).float().sum()
    loss.backward()  # the mistake: not through mp
    with pytest.raises(RuntimeError, match=r"call mp\.backward\(loss\) instead of loss\.backward"):
        mp.step(opt)


def test_a_step_consumes_the_backward_and_zero_grad_discards_it() -> None:
    mp = MixedPrecision("cpu", precision="fp32")
    model = mp.prepare(small_mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mp.backward(model(torch.randn(4, 16)).sum())
    mp.backward(model(torch.randn(4, 16)).sum())  # accumulation: two backwards, one step
    assert mp.step(opt)
    with pytest.raises(RuntimeError, match=r"already called since the last mp\.backward"):
        mp.step(opt)
    mp.backward(model(torch.randn(4, 16)).sum())
    mp.zero_grad(opt)
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(RuntimeError, match="found no gradients"):
        mp.step(opt)


def two_optimizers(mp: MixedPrecision) -> tuple[nn.Module, list[torch.optim.Optimizer]]:
    """A backbone and a head with one optimizer each, after one mp.backward(loss)."""
    torch.manual_seed(0)
    model = mp.prepare(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in model]
    with mp.autocast():
        # Small: the fp16 backward of the scaled loss (x 65536) stays finite.
        loss = model(torch.randn(8, 4) * 1e-3).float().mean() * 1e-2
    mp.backward(loss)
    assert all(p.grad is not None and p.grad.isfinite().all() for p in model.parameters())
    return model, opts


def test_one_step_call_steps_several_optimizers_and_a_second_call_says_so() -> None:
    mp = MixedPrecision("cpu", precision="fp32")
    model, opts = two_optimizers(mp)
    before = [p.detach().clone() for p in model.parameters()]
    assert mp.step(*opts, max_grad_norm=0.5)
    assert all(not torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    with pytest.raises(RuntimeError, match=r"pass them all to one call, mp\.step\(opt_a, opt_b\)"):
        mp.step(opts[1])


def test_a_second_step_after_zero_grad_of_the_first_optimizer_says_to_pass_both() -> None:
    # for opt in opts: mp.step(opt); mp.zero_grad(opt) -- the zero_grad used to erase the
    # step, and the second step blamed a plain loss.backward() the caller never made.
    mp = MixedPrecision("cpu", precision="fp32")
    _, opts = two_optimizers(mp)
    assert mp.step(opts[0])
    mp.zero_grad(opts[0])
    with pytest.raises(RuntimeError, match=r"pass them all to one call, mp\.step\(opt_a, opt_b\)"):
        mp.step(opts[1])
    # Both together: the second still has that backward's gradients (before: blamed
    # loss.backward(), because the first was zeroed).
    with pytest.raises(RuntimeError, match=r"pass them all to one call, mp\.step\(opt_a, opt_b\)"):
        mp.step(*opts)
    mp.zero_grad()  # every prepared model: the backward and its step are forgotten
    with pytest.raises(RuntimeError, match=r"call mp\.backward\(loss\) instead of loss\.backward"):
        mp.step(opts[1])


def test_a_plain_backward_after_a_step_and_zero_grad_still_says_to_use_mp_backward() -> None:
    mp = MixedPrecision("cpu", precision="fp32")
    model, opts = two_optimizers(mp)
    assert mp.step(*opts)
    for opt in opts:
        mp.zero_grad(opt)
    model(torch.randn(8, 4)).sum().backward()  # the mistake: not through mp
    with pytest.raises(RuntimeError, match=r"call mp\.backward\(loss\) instead of loss\.backward"):
        mp.step(opts[0])
    mp.backward(model(torch.randn(8, 4)).sum())  # through mp: both step again
    assert mp.step(*opts)


def test_clipping_several_optimizers_clips_each_one_s_gradients() -> None:
    mp = MixedPrecision("cpu", precision="fp32")
    model, opts = two_optimizers(mp)
    for p in model.parameters():
        assert p.grad is not None
        p.grad.mul_(100.0)  # well above the clip
    for opt in opts:
        opt.param_groups[0]["lr"] = 0.0  # keep the clipped gradients readable
    mp.step(*opts, max_grad_norm=0.5)
    for layer in model:
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in layer.parameters()]))
        assert norm.item() == pytest.approx(0.5, rel=1e-4)


def test_step_needs_an_optimizer_and_each_one_once() -> None:
    mp = MixedPrecision("cpu", precision="fp32")
    _, opts = two_optimizers(mp)
    with pytest.raises(TypeError, match=r"got none; call mp\.step\(optimizer\)"):
        mp.step()
    with pytest.raises(ValueError, match="the same optimizer twice"):
        mp.step(opts[0], opts[0])


@needs_cpu_fp16
def test_fp16_several_optimizers_match_gradscaler_and_update_the_scale_once() -> None:
    mp = MixedPrecision("cpu", precision="fp16")
    model, opts = two_optimizers(mp)
    ref = copy.deepcopy(model)
    ref_opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in ref]
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(torch.ones(()))  # its loss scale, the same as mp's (the gradients are mp's)
    for p, q in zip(ref.parameters(), model.parameters(), strict=True):
        p.grad = q.grad.clone()  # type: ignore[union-attr]
    assert mp.step(*opts)
    for opt in ref_opts:  # GradScaler's documented pattern for several optimizers
        scaler.step(opt)
    scaler.update()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q)
    assert mp.state_dict()["scaler"]["_growth_tracker"] == 1  # one update, not two


@needs_cpu_fp16
def test_fp16_an_optimizer_with_inf_gradients_skips_alone_and_step_says_false() -> None:
    mp = MixedPrecision("cpu", precision="fp16")
    model, opts = two_optimizers(mp)
    backbone, head = (
        [p.detach().clone() for p in model[0].parameters()],
        [p.detach().clone() for p in model[1].parameters()],
    )
    model[1].weight.grad[0, 0] = math.inf  # type: ignore[index]
    assert mp.step(*opts) is False
    assert all(not torch.equal(p, q) for p, q in zip(model[0].parameters(), backbone, strict=True))
    assert all(torch.equal(p, q) for p, q in zip(model[1].parameters(), head, strict=True))
    assert mp.state_dict()["scaler"]["scale"] == 32768.0  # halved once


def test_a_clip_value_passed_positionally_is_refused_before_anything_steps() -> None:
    mp = MixedPrecision("cpu", precision="fp32")
    model, opts = two_optimizers(mp)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(TypeError, match=r"got 1\.0; max_grad_norm is keyword-only"):
        mp.step(opts[0], 1.0)  # type: ignore[arg-type]
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    assert mp.step(optimizer=opts[0])  # the keyword of the one-optimizer signature


@pytest.mark.parametrize("precision", ["fp32", pytest.param("fp16", marks=needs_cpu_fp16)])
def test_an_optimizer_whose_parameters_got_no_gradient_is_stepped_plainly(precision: str) -> None:
    # A frozen backbone: GradScaler asserted "No inf checks were recorded" after the head
    # had stepped, and every later step failed ("step() has already been called").
    mp = MixedPrecision("cpu", precision=precision)
    model, opts = two_optimizers(mp)
    for p in model[0].parameters():
        p.grad = None
    head = [p.detach().clone() for p in model[1].parameters()]
    stepped: list[object] = []
    opts[0].register_step_post_hook(lambda opt, args, kwargs: stepped.append(opt))
    if precision == "fp16":  # unscaled for a look at the gradients: forgotten with the step
        mp.scaler.unscale_(opts[0])  # type: ignore[union-attr]
    assert mp.step(*opts)
    assert all(not torch.equal(p, q) for p, q in zip(model[1].parameters(), head, strict=True))
    assert stepped == [opts[0]]  # stepped plainly: its hooks and schedulers see the step
    mp.zero_grad()
    with mp.autocast():
        loss = model(torch.randn(8, 4) * 1e-3).float().mean() * 1e-2
    mp.backward(loss)
    if precision == "fp16":
        mp.scaler.unscale_(opts[0])  # type: ignore[union-attr]
    assert mp.step(*opts)  # the next step works


@needs_cpu_fp16
def test_a_mixed_precision_pickles_whole_with_its_loss_scale(tmp_path: Path) -> None:
    # Before: torch.save(mp) failed with "cannot pickle 'weakref.ReferenceType' object"
    # (the prepared models are held weakly), though the docs say torch.save pickles it whole.
    from trainperf.amp._mixed import LIVE

    mp = MixedPrecision("cpu", precision="fp16")
    model, opts = two_optimizers(mp)
    with mp.autocast():
        loss = model(torch.randn(8, 4)).float().mean()
    mp.backward(loss)
    mp.step(*opts)
    mp.scaler.update(new_scale=1024.0)  # type: ignore[union-attr]
    torch.save(mp, tmp_path / "mp.pt")
    loaded = torch.load(tmp_path / "mp.pt", weights_only=False)
    assert loaded.state_dict() == mp.state_dict() and loaded.state_dict()["scaler"]["scale"] == 1024
    assert loaded in LIVE and copy.deepcopy(mp) in LIVE  # watch() and the tuner see copies
    with pytest.raises(RuntimeError, match=r"call mp\.zero_grad\(optimizer\)"):
        loaded.zero_grad()  # it knows no prepared model
    mp.zero_grad()  # the original still does
    assert all(p.grad is None for p in model.parameters())


@needs_cpu_fp16
def test_a_mixed_precision_pickles_between_unscale_and_step() -> None:
    # Before: a bare AssertionError from GradScaler ("may only be pickled at the beginning
    # of an iteration"), though a copy made between backward and step is documented to work.
    mp = MixedPrecision("cpu", precision="fp16")
    w = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=1.0)
    mp.backward(w.sum())
    mp.unscale_(opt)
    copied = copy.deepcopy(mp)
    assert copied.state_dict() == mp.state_dict()
    with pytest.raises(RuntimeError, match=r"found no gradients from mp\.backward"):
        copied.step(opt)  # the copy has no backward of its own
    assert mp.step(opt) and w.tolist() == [0.0, 0.0]  # the original's unscale_ is kept
    copied.zero_grad(opt)
    copied.backward(w.sum())
    assert copied.step(opt) and w.tolist() == [-1.0, -1.0]  # and the copy's own is fresh


@needs_cpu_fp16
def test_a_failing_fp16_step_does_not_break_every_later_one() -> None:
    mp = MixedPrecision("cpu", precision="fp16")
    model, opts = two_optimizers(mp)

    class Broken(torch.optim.SGD):
        def step(self, closure: Any = None) -> Any:
            raise OSError("the optimizer failed")

    broken = Broken(model[1].parameters(), lr=0.1)
    with pytest.raises(OSError, match="the optimizer failed"):
        mp.step(opts[0], broken)
    mp.zero_grad()
    with mp.autocast():
        loss = model(torch.randn(8, 4) * 1e-3).float().mean() * 1e-2
    mp.backward(loss)
    assert mp.step(*opts)  # "step() has already been called since the last update()" before


@needs_cpu_fp16
@pytest.mark.parametrize("max_grad_norm", [None, 1.0])
def test_fp16_step_on_a_half_model_names_the_cause_before_anything_steps(
    max_grad_norm: float | None,
) -> None:
    mp = MixedPrecision("cpu", precision="fp16")
    frozen = nn.Linear(4, 4).requires_grad_(False)  # no gradients: stepped plainly
    model = mp.prepare(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))).half()
    opts = [torch.optim.SGD(frozen.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), 0.1)]
    before = [p.detach().clone() for p in model.parameters()]
    with mp.autocast():
        loss = model(torch.randn(8, 4).half()).float().mean()
    mp.backward(loss)
    # GradScaler's own error was a bare "Attempting to unscale FP16 gradients."
    match = r"optimizer 2 of 2 \(SGD\): 4 of its 4 .* fp16 .*model\.half\(\).*model\.float\(\)"
    for _ in range(2):  # refused before anything stepped: the same answer again
        with pytest.raises(ValueError, match=match):
            mp.step(*opts, max_grad_norm=max_grad_norm)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, "1.0", True])  # True read as 1 before
def test_max_grad_norm_must_be_positive(bad: object) -> None:
    mp = MixedPrecision("cpu", precision="fp32")
    w = nn.Parameter(torch.ones(2))
    mp.backward(w.sum())
    with pytest.raises(ValueError, match="max_grad_norm must be a number > 0"):
        mp.step(torch.optim.SGD([w], lr=0.1), max_grad_norm=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [True, []], ids=["set_to_none", "a-list"])
def test_zero_grad_names_an_argument_that_is_not_an_optimizer(bad: object) -> None:
    # Before: AttributeError: 'bool' object has no attribute 'zero_grad'.
    mp = MixedPrecision("cpu", precision="fp32")
    with pytest.raises(TypeError, match=r"takes one optimizer or none, got .*keyword-only"):
        mp.zero_grad(bad)  # type: ignore[arg-type]


def test_backward_and_prepare_check_their_argument() -> None:
    mp = MixedPrecision("cpu", precision="fp32")
    with pytest.raises(TypeError, match=r"backward\(\) takes the loss tensor, got float"):
        mp.backward(1.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"prepare\(\) takes an nn\.Module, got dict"):
        mp.prepare({})  # type: ignore[arg-type]


def test_zero_grad_without_optimizer_clears_prepared_models() -> None:
    mp = MixedPrecision("cpu", precision="fp32")
    with pytest.raises(RuntimeError, match=r"call mp\.zero_grad\(optimizer\)"):
        mp.zero_grad()
    a, b = mp.prepare(small_mlp()), mp.prepare(small_mlp())
    mp.backward((a(torch.randn(2, 16)) + b(torch.randn(2, 16))).sum())
    mp.zero_grad(set_to_none=False)
    for p in [*a.parameters(), *b.parameters()]:
        assert p.grad is not None and not p.grad.any()


def test_bf16_and_fp32_never_create_a_scaler() -> None:
    for precision in ("bf16", "fp32"):
        mp = MixedPrecision("cpu", precision=precision)  # type: ignore[arg-type]
        model = mp.prepare(small_mlp())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with mp.autocast():
            loss = model(torch.randn(4, 16)).float().sum()
        mp.backward(loss)
        mp.step(opt)
        assert mp.scaler is None and not mp.uses_scaler and mp._scaler is None
        assert mp.state_dict() == {"precision": precision, "scaler": None}


# --------------------------------------------------------------------------- training on the CPU


@pytest.mark.slow
def test_bf16_trains_a_small_cnn_in_channels_last() -> None:
    torch.manual_seed(0)
    # Classes differ in their per-channel means, which the pooled CNN can learn quickly.
    y = torch.arange(16) % 4
    x = 1.5 * torch.randn(4, 3, 1, 1)[y] + torch.randn(16, 3, 16, 16)
    mp = MixedPrecision("cpu", precision="bf16", channels_last=True)
    model = small_cnn()
    losses = train(mp, model, x, y, steps=30)
    assert losses[-1] < 0.5 * losses[0]
    assert mp.uses_channels_last
    assert model[0].weight.is_contiguous(memory_format=torch.channels_last)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # fp32 master weights
    with mp.autocast():
        assert model(mp.prepare_batch(x)).dtype == torch.bfloat16


def test_bf16_trains_a_small_mlp() -> None:
    torch.manual_seed(0)
    x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))
    losses = train(MixedPrecision("cpu", precision="bf16"), small_mlp(), x, y, steps=40)
    assert losses[-1] < 0.5 * losses[0]


def test_fp32_autocast_is_a_no_op() -> None:
    mp = MixedPrecision("cpu", precision="fp32")
    with mp.autocast():
        assert not torch.is_autocast_enabled("cpu")
        assert nn.Linear(4, 2)(torch.randn(3, 4)).dtype == torch.float32


@needs_cpu_fp16
@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_fp16_skips_the_step_on_non_finite_gradients_and_lowers_the_scale(bad: float) -> None:
    torch.manual_seed(0)
    mp = MixedPrecision("cpu", precision="fp16")
    assert mp.uses_scaler and mp.dtype == torch.float16
    model = mp.prepare(small_mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    assert mp.scaler is not None
    scale = mp.scaler.get_scale()

    with mp.autocast():
        loss = nn.functional.cross_entropy(model(x).float(), y)
    mp.backward(loss)
    model[0].weight.grad[0, 0] = bad  # type: ignore[index]
    before = [p.detach().clone() for p in model.parameters()]
    stepped = mp.step(opt, max_grad_norm=1.0)
    if stepped:
        sched.step()
    assert stepped is False
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert mp.scaler.get_scale() == scale * 0.5
    assert opt.param_groups[0]["lr"] == 0.1  # the scheduler did not advance
    mp.zero_grad(opt)

    with mp.autocast():
        loss = nn.functional.cross_entropy(model(x).float(), y)
    mp.backward(loss)
    assert mp.step(opt, max_grad_norm=1.0) is True
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert mp.scaler.get_scale() == scale * 0.5


@needs_cpu_fp16
def test_fp16_step_that_grows_the_scale_counts_as_stepped() -> None:
    mp = MixedPrecision("cpu", precision="fp16")
    assert mp.scaler is not None
    mp.scaler.load_state_dict(
        {"scale": 8.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 1,
         "_growth_tracker": 0}
    )  # fmt: skip
    w = nn.Parameter(torch.ones(3))
    mp.backward((w * 2).sum())
    assert mp.step(torch.optim.SGD([w], lr=0.1)) is True
    assert mp.scaler.get_scale() == 16.0
    assert torch.allclose(w.detach(), torch.full((3,), 0.8))


@needs_cpu_fp16
@pytest.mark.parametrize("finite", [True, False])
def test_fp16_step_reads_the_device_at_most_once_more_than_grad_scaler(
    monkeypatch: pytest.MonkeyPatch, finite: bool
) -> None:
    # Each device-to-host read in a step (a CUDA synchronisation on a GPU) is a Tensor.item().
    item = torch.Tensor.item
    reads = 0

    def counted(self: torch.Tensor) -> object:
        nonlocal reads
        reads += 1
        return item(self)

    def after_backward() -> tuple[MixedPrecision, torch.optim.Optimizer]:
        w = nn.Parameter(torch.ones(3))
        mp = MixedPrecision("cpu", precision="fp16")
        mp.backward((w * 2).sum())
        if not finite:
            w.grad[0] = math.inf  # type: ignore[index]
        return mp, torch.optim.SGD([w], lr=0.1)

    mp, opt = after_backward()
    assert mp.scaler is not None
    monkeypatch.setattr(torch.Tensor, "item", counted)
    mp.scaler.step(opt)  # what a hand-written loop does
    mp.scaler.update()
    bare, reads = reads, 0
    mp, opt = after_backward()
    assert mp.step(opt) is finite
    assert bare >= 1 and reads <= bare + 1


@needs_cpu_fp16
@pytest.mark.parametrize("max_grad_norm", [None, 1.0])
def test_fp16_step_with_a_disabled_scaler_is_a_plain_step(max_grad_norm: float | None) -> None:
    # MixedPrecision never builds one, but a disabled GradScaler (GradScaler("cuda") disables
    # itself without CUDA) keeps none of the per-optimizer state the skip check reads.
    mp = MixedPrecision("cpu", precision="fp16")
    mp._scaler = torch.amp.GradScaler("cpu", enabled=False)
    w = nn.Parameter(torch.ones(3))
    mp.backward((w * 2).sum())
    assert w.grad is not None and w.grad.tolist() == [2.0, 2.0, 2.0]  # not scaled
    assert mp.step(torch.optim.SGD([w], lr=0.1), max_grad_norm=max_grad_norm) is True
    grad = 2.0 if max_grad_norm is None else 2.0 / math.sqrt(12.0)  # the norm clipped to 1
    assert w.detach().tolist() == pytest.approx([1.0 - 0.1 * grad] * 3, abs=1e-6)


def reference_fp32(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int, clip: float
) -> nn.Module:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        loss = 100 * nn.functional.cross_entropy(model(x), y)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return model


@pytest.mark.parametrize(
    ("precision", "tol"),
    [
        ("fp32", 1e-6),
        ("bf16", 2e-2),
        pytest.param("fp16", 5e-3, marks=needs_cpu_fp16),
    ],
)
def test_clipping_through_step_matches_the_fp32_reference(precision: str, tol: float) -> None:
    torch.manual_seed(0)
    x, y = torch.randn(16, 16), torch.randint(0, 4, (16,))
    start = small_mlp()
    ref = reference_fp32(copy.deepcopy(start), x, y, steps=3, clip=0.5)

    mp = MixedPrecision("cpu", precision=precision)  # type: ignore[arg-type]
    model = mp.prepare(copy.deepcopy(start))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = tries = 0
    while steps < 3 and tries < 30:
        tries += 1
        with mp.autocast():
            out = model(x)
        # x100 makes the raw gradient norm far above 0.5, so clipping decides the update; with
        # fp16, clipping the still-scaled gradients would make the step ~65536x too small.
        # fp16 skips the first steps (the scaled gradients overflow) until the scale is low
        # enough; a skipped step leaves plain SGD's parameters as they were.
        mp.backward(100 * nn.functional.cross_entropy(out.float(), y))
        steps += mp.step(opt, max_grad_norm=0.5)
        mp.zero_grad(opt)
    assert steps == 3
    moved = [
        (p - q).abs().max().item()
        for p, q in zip(model.parameters(), start.parameters(), strict=True)
    ]
    assert min(moved) > 1e-3  # the comparison below is not trivially true
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=tol, rtol=tol)


# --------------------------------------------------------------------------- checkpoints


@needs_cpu_fp16
def test_scaler_state_round_trips_through_a_checkpoint(tmp_path: Path) -> None:
    mp = MixedPrecision("cpu", precision="fp16")
    w = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1)
    mp.backward(w.sum())
    w.grad[0] = math.inf  # type: ignore[index]
    assert not mp.step(opt)
    mp.zero_grad(opt)
    mp.backward(w.sum())
    assert mp.step(opt)
    state = mp.state_dict()
    assert state["precision"] == "fp16"
    assert state["scaler"]["scale"] == 32768.0 and state["scaler"]["_growth_tracker"] == 1

    path = save_checkpoint({"amp": state, "w": w.detach()}, tmp_path / "ckpt.pt")
    loaded = load_checkpoint(path)  # weights_only=True: plain values only
    resumed = MixedPrecision("cpu", precision="fp16")
    resumed.load_state_dict(loaded["amp"])
    assert resumed.scaler is not None
    assert resumed.scaler.get_scale() == 32768.0
    assert resumed.state_dict() == state
    json.dumps(state)  # plain Python values


@needs_cpu_fp16
def test_loading_a_loss_scale_into_bf16() -> None:
    state = MixedPrecision("cpu", precision="fp16").state_dict()
    bf16 = MixedPrecision("cpu", precision="bf16")
    with pytest.raises(ValueError, match=r"loss scale from a fp16 run.*strict=False"):
        bf16.load_state_dict(state)
    bf16.load_state_dict(state, strict=False)
    assert bf16.scaler is None


def test_loading_a_state_without_scale_keeps_a_fresh_scaler() -> None:
    mp = MixedPrecision("cpu", precision="fp32")
    mp.load_state_dict({"precision": "bf16", "scaler": None})
    assert mp.scaler is None


@needs_cpu_fp16
def test_loading_a_state_without_scale_into_fp16_keeps_its_fresh_scaler() -> None:
    fresh = MixedPrecision("cpu", precision="fp16").state_dict()
    mp = MixedPrecision("cpu", precision="fp16")
    mp.load_state_dict({"precision": "bf16", "scaler": None})  # a bf16 run resumed as fp16
    assert mp.scaler is not None
    assert mp.scaler.get_scale() == 2.0**16  # GradScaler's initial scale
    assert mp.state_dict() == fresh
    w = nn.Parameter(torch.ones(2))
    mp.backward(w.sum())
    assert mp.step(torch.optim.SGD([w], lr=0.1))  # and it works


@pytest.mark.parametrize("bad", [{"scale": 1.0}, {"precision": "fp16"}, [1, 2], None])
def test_load_state_dict_rejects_other_dicts(bad: object) -> None:
    with pytest.raises(ValueError, match="not a MixedPrecision state dict"):
        MixedPrecision("cpu", precision="fp32").load_state_dict(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "bad", ["garbage", "auto", "float16", "FP16", torch.float16, None, ["fp16"]]
)
def test_load_state_dict_refuses_a_precision_state_dict_never_writes(bad: object) -> None:
    # Before: any value was taken ("garbage" loaded without a word).
    mp = MixedPrecision("cpu", precision="fp32")
    with pytest.raises(ValueError, match=r"state\['precision'\] must be one of \['bf16', 'fp16'"):
        mp.load_state_dict({"precision": bad, "scaler": None})


@needs_cpu_fp16
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_load_state_dict_refuses_a_loss_scale_saved_with_a_precision_without_one(
    precision: str,
) -> None:
    # Before: a "bf16" state with a loss scale was loaded into an fp16 MixedPrecision.
    mp = MixedPrecision("cpu", precision="fp16")
    before = mp.state_dict()
    scale = {**before["scaler"], "scale": 1024.0}
    with pytest.raises(ValueError, match=rf"loss scale .* its precision is '{precision}'"):
        mp.load_state_dict({"precision": precision, "scaler": scale})
    assert mp.state_dict() == before


@needs_cpu_fp16
def test_loading_a_loss_scale_between_backward_and_step_is_refused_and_loads_nothing() -> None:
    # Before: the scale was loaded, and the step unscaled the gradients scaled by 65536 by
    # the loaded 2.0: a step 32768 times too large, without a word.
    w = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=1.0)
    mp = MixedPrecision("cpu", precision="fp16")
    saved = {"precision": "fp16", "scaler": {**mp.state_dict()["scaler"], "scale": 2.0}}
    before = mp.state_dict()
    mp.backward(w.sum())
    with pytest.raises(RuntimeError, match=r"between mp.backward\(loss\) and mp.step.*65536.*"
                       r"load the state before mp.backward\(loss\) or after mp.step"):  # fmt: skip
        mp.load_state_dict(saved)
    assert mp.state_dict() == before
    assert mp.step(opt) and w.tolist() == [0.0, 0.0]  # lr 1.0 times the unscaled gradient 1.0
    mp.load_state_dict(saved)  # after the step
    mp.zero_grad(opt)
    mp.backward(w.sum())
    assert mp.step(opt) and w.tolist() == [-1.0, -1.0]  # scaled and unscaled by 2.0


@needs_cpu_fp16
def test_a_state_without_a_loss_scale_loads_between_backward_and_step() -> None:
    # Nothing is loaded that the waiting gradients depend on: no refusal.
    mp = MixedPrecision("cpu", precision="fp16")
    w = nn.Parameter(torch.ones(2))
    mp.backward(w.sum())
    mp.load_state_dict({"precision": "bf16", "scaler": None})
    assert mp.step(torch.optim.SGD([w], lr=1.0)) and w.tolist() == [0.0, 0.0]


# ----------------------------------------------------------------- prepare: channels_last, TF32


def test_prepare_on_cpu_leaves_auto_channels_last_off_and_tf32_alone() -> None:
    mp = MixedPrecision("cpu", precision="bf16")
    model = mp.prepare(small_cnn())
    assert not mp.uses_channels_last and not mp.tf32_enabled
    assert model[0].weight.is_contiguous()
    x = mp.prepare_batch(torch.randn(2, 3, 8, 8))
    assert x.is_contiguous() and not x.is_contiguous(memory_format=torch.channels_last)
    assert "channels_last: not on cpu" in repr(mp) and "TF32: not applicable" in repr(mp)


class StaysOnCpu(nn.Sequential):
    """A model that ignores ``.to(device)`` (keeping ``memory_format``), so that prepare() can
    run against a faked GPU without CUDA."""

    def to(self, *args: Any, **kwargs: Any) -> StaysOnCpu:
        kwargs.pop("device", None)
        args = tuple(a for a in args if not isinstance(a, torch.device))
        return super().to(*args, **kwargs)


@pytest.mark.parametrize(
    ("capability", "precision", "tf32", "channels_last", "tf32_on"),
    [
        ((6, 1), "auto", True, False, False),  # Pascal: fp32, no tensor cores
        ((7, 0), "auto", True, True, False),  # V100: fp16 tensor cores; TF32 needs 8.0
        ((7, 5), "fp32", True, False, False),  # T4 in fp32: no tensor cores in use
        ((8, 0), "auto", True, True, True),  # A100: bf16
        ((9, 0), "fp32", True, True, True),  # H200 in fp32: TF32 tensor cores
        ((9, 0), "fp32", False, False, False),  # ... without TF32: none
        ((9, 0), "bf16", False, True, False),
    ],
)
def test_prepare_turns_the_compute_capability_into_channels_last_and_tf32(
    monkeypatch: pytest.MonkeyPatch,
    restore_tf32: None,
    capability: tuple[int, int],
    precision: str,
    tf32: bool,
    channels_last: bool,
    tf32_on: bool,
) -> None:
    fake_gpu(monkeypatch, capability)
    with _tf32.tf32(False):
        mp = MixedPrecision("cuda", precision=precision, tf32=tf32)  # type: ignore[arg-type]
        model = mp.prepare(StaysOnCpu(*small_cnn()))
        assert _tf32.tf32_state() == _tf32.TF32State(matmul=tf32_on, cudnn=tf32_on)
    assert (mp.uses_channels_last, mp.tf32_enabled) == (channels_last, tf32_on)
    assert model[0].weight.is_contiguous(memory_format=torch.channels_last) is channels_last
    if channels_last:
        assert "channels_last: yes, 2 2-D convolutions over feature maps" in mp.reason
    else:
        assert "channels_last: no, no tensor cores in use" in mp.reason
    if tf32_on:
        assert "TF32: enabled process-wide" in mp.reason
    elif not tf32:
        assert "TF32: off (tf32=False)" in mp.reason
    else:
        assert "TF32: not applicable (needs CUDA compute capability >= 8.0)" in mp.reason


def test_prepare_leaves_a_vit_alone_on_a_faked_h200(
    monkeypatch: pytest.MonkeyPatch, restore_tf32: None
) -> None:
    fake_gpu(monkeypatch, (9, 0))
    vit = TinyViT()
    vit.to = lambda *args, **kwargs: vit  # type: ignore[method-assign]  # no CUDA to move to
    with _tf32.tf32(False):
        mp = MixedPrecision("cuda")
        mp.prepare(vit)
    assert not mp.uses_channels_last and mp.tf32_enabled
    assert "not a convolutional model" in mp.reason


def test_prepare_batch_moves_to_the_device() -> None:
    mp = MixedPrecision("meta", precision="fp32")
    x, y = mp.prepare_batch([torch.randn(2, 3), torch.tensor([1])])
    assert x.device.type == "meta" and y.device.type == "meta"


# --------------------------------------------------------------------------- on a GPU


@pytest.mark.requires_cuda
def test_prepare_on_cuda_picks_channels_last_and_tf32(restore_tf32: None) -> None:
    torchvision = pytest.importorskip("torchvision")
    mp = MixedPrecision("cuda")
    model = mp.prepare(torchvision.models.resnet18(weights=None))
    major, _ = torch.cuda.get_device_capability()
    assert next(model.parameters()).device.type == "cuda"
    assert mp.uses_channels_last == (major >= 7)
    assert mp.tf32_enabled == (major >= 8)
    x, y = mp.prepare_batch((torch.randn(4, 3, 64, 64), torch.randint(0, 1000, (4,))))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with mp.autocast():
        loss = nn.functional.cross_entropy(model(x).float(), y)
    mp.backward(loss)
    assert mp.step(opt, max_grad_norm=1.0)
    assert torch.isfinite(loss)


@pytest.mark.requires_cuda
@pytest.mark.parametrize("max_grad_norm", [None, 1.0])
@pytest.mark.parametrize("optimizer", ["sgd-foreach", "adam-fused"])
def test_fp16_on_cuda_skips_non_finite_steps_with_foreach_and_fused_optimizers(
    restore_tf32: None, optimizer: str, max_grad_norm: float | None
) -> None:
    # A fused optimizer takes GradScaler's other path: it gets the inf flag and skips on the
    # device (torch's _step_supports_amp_scaling) instead of GradScaler deciding on the host.
    torch.manual_seed(0)
    mp = MixedPrecision("cuda", precision="fp16")
    model = mp.prepare(small_mlp())
    opt: torch.optim.Optimizer
    if optimizer == "sgd-foreach":
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=True)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    x, y = mp.prepare_batch((torch.randn(8, 16), torch.randint(0, 4, (8,))))
    scaler = mp.scaler
    assert scaler is not None and scaler.is_enabled()

    def backward(bad: float | None) -> list[torch.Tensor]:
        with mp.autocast():
            loss = nn.functional.cross_entropy(model(x).float(), y)
        mp.backward(loss)
        if bad is not None:
            model[0].weight.grad[0, 0] = bad  # type: ignore[index]
        return [p.detach().clone() for p in model.parameters()]

    before = backward(None)
    scale = scaler.get_scale()
    assert mp.step(opt, max_grad_norm=max_grad_norm) is True
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert scaler.get_scale() == scale  # growth comes only after 2000 good steps
    mp.zero_grad(opt)

    before = backward(math.inf)
    assert mp.step(opt, max_grad_norm=max_grad_norm) is False
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert scaler.get_scale() == scale * 0.5
    mp.zero_grad(opt)

    backward(None)
    assert mp.step(opt, max_grad_norm=max_grad_norm) is True


# ----------------------------------------------------------------- prepare: 5-D weights


def test_prepare_in_channels_last_leaves_conv3d_weights_alone_on_the_cpu() -> None:
    mp = MixedPrecision("cpu", precision="fp32", channels_last=True)
    model = mp.prepare(nn.Sequential(nn.Conv2d(3, 8, 3), nn.Conv3d(8, 8, (1, 3, 3))))
    assert mp.uses_channels_last
    assert model[0].weight.is_contiguous(memory_format=torch.channels_last)
    assert model[1].weight.is_contiguous()


def test_auto_channels_last_on_a_faked_h200_does_not_fail_on_conv3d(
    monkeypatch: pytest.MonkeyPatch, restore_tf32: None
) -> None:
    fake_gpu(monkeypatch, (9, 0))
    with _tf32.tf32(False):
        mp = MixedPrecision("cuda")  # channels_last="auto"
        model = mp.prepare(StaysOnCpu(nn.Conv2d(3, 8, 3), nn.Conv3d(8, 8, (1, 3, 3))))
    assert mp.uses_channels_last
    assert "channels_last: yes, 1 2-D convolution over feature maps" in mp.reason
    assert model[0].weight.is_contiguous(memory_format=torch.channels_last)
    assert model[1].weight.is_contiguous()


# ----------------------------------------------------------------- autocast as a decorator


@pytest.mark.parametrize(
    ("precision", "dtype"),
    [
        ("bf16", torch.bfloat16),
        pytest.param("fp16", torch.float16, marks=needs_cpu_fp16),
        ("fp32", torch.float32),
    ],
)
def test_autocast_is_a_context_manager_and_a_decorator(precision: str, dtype: torch.dtype) -> None:
    mp = MixedPrecision("cpu", precision=precision)  # type: ignore[arg-type]
    linear = nn.Linear(4, 2)

    @mp.autocast()
    def forward(x: torch.Tensor) -> torch.Tensor:
        """Runs under autocast."""
        return linear(x)

    assert forward(torch.randn(3, 4)).dtype == dtype
    assert forward(torch.randn(3, 4)).dtype == dtype  # the same decorator, entered again
    assert forward.__doc__ == "Runs under autocast."
    with mp.autocast():
        assert linear(torch.randn(3, 4)).dtype == dtype
    assert not torch.is_autocast_enabled("cpu")


# ----------------------------------------------------------------- zero_grad per optimizer


def gan(
    mp: MixedPrecision,
) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer, torch.optim.Optimizer]:
    """A generator and a discriminator, each with its optimizer, after the generator's
    backward (which also fills the discriminator's gradients)."""
    torch.manual_seed(0)
    g, d = mp.prepare(nn.Linear(2, 2)), mp.prepare(nn.Linear(2, 1))
    opt_g, opt_d = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (g, d))
    mp.backward(d(g(torch.randn(4, 2))).mean())
    return g, d, opt_g, opt_d


def test_zero_grad_of_one_optimizer_keeps_the_backward_for_the_others() -> None:
    mp = MixedPrecision("cpu", precision="fp32")
    g, d, opt_g, opt_d = gan(mp)
    mp.zero_grad(opt_d)  # the discriminator's gradients from the generator's loss: dropped
    before = g.weight.detach().clone()
    assert mp.step(opt_g)
    assert not torch.equal(g.weight, before)
    assert d.weight.grad is None


def test_stepping_an_optimizer_zeroed_since_the_backward_is_an_error() -> None:
    mp = MixedPrecision("cpu", precision="fp32")
    g, d, opt_g, opt_d = gan(mp)
    mp.zero_grad(opt_d)
    with pytest.raises(RuntimeError, match=r"optimizer 2 of 2 .* mp\.zero_grad\(optimizer\)"):
        mp.step(opt_g, opt_d)
    with pytest.raises(RuntimeError, match=r"optimizer 1 of 1 .* since the last mp\.backward"):
        mp.step(opt_d)
    mp.backward(d(g(torch.randn(4, 2))).mean())  # a new backward: both may step again
    assert mp.step(opt_g, opt_d)
    mp.backward(d(g(torch.randn(4, 2))).mean())
    mp.zero_grad()  # every prepared model: the backward is gone for every optimizer
    with pytest.raises(RuntimeError, match="found no gradients"):
        mp.step(opt_g)


def test_zero_grad_after_the_step_does_not_mark_the_next_backward() -> None:
    mp = MixedPrecision("cpu", precision="fp32")
    _, _, opt_g, opt_d = gan(mp)
    assert mp.step(opt_g, opt_d)
    mp.zero_grad(opt_g)
    mp.zero_grad(opt_d)
    with pytest.raises(RuntimeError, match="found no gradients"):
        mp.step(opt_g)


# ----------------------------------------------------------------- backward's arguments


def _backward_precisions() -> list[Any]:
    return ["fp32", "bf16", pytest.param("fp16", marks=needs_cpu_fp16)]


@pytest.mark.parametrize("precision", _backward_precisions())
def test_backward_retain_graph_allows_a_second_backward_through_the_graph(precision: str) -> None:
    mp = MixedPrecision("cpu", precision=precision)  # type: ignore[arg-type]
    w = nn.Parameter(torch.tensor([1.0, 2.0]))
    h = w * 3
    mp.backward(h.sum(), retain_graph=True)
    mp.backward((h * h).sum())  # through h's graph again
    scale = mp.scaler.get_scale() if mp.scaler is not None else 1.0
    assert w.grad is not None
    torch.testing.assert_close(w.grad / scale, torch.tensor([3.0 + 18.0, 3.0 + 36.0]))


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
@pytest.mark.parametrize("precision", _backward_precisions())
def test_backward_create_graph_and_inputs_reach_loss_backward(precision: str) -> None:
    mp = MixedPrecision("cpu", precision=precision)  # type: ignore[arg-type]
    a, b = nn.Parameter(torch.tensor([2.0])), nn.Parameter(torch.tensor([5.0]))
    mp.backward((a**3 * b).sum(), create_graph=True, inputs=[a])
    scale = mp.scaler.get_scale() if mp.scaler is not None else 1.0
    assert b.grad is None  # only the inputs asked for
    assert a.grad is not None and a.grad.requires_grad  # a graph to differentiate again
    torch.testing.assert_close(a.grad.detach() / scale, torch.tensor([3 * 4.0 * 5.0]))
    opt = torch.optim.SGD([a], lr=0.0)
    assert mp.step(opt)
    a.grad = None  # create_graph ties the gradient to its parameter: break the cycle


@needs_cpu_fp16
@pytest.mark.parametrize(
    ("scaler", "lacks"),
    [({"scale": 3.0}, "_growth_tracker"), ({}, "_growth_tracker"), (3.0, "_growth_tracker")],
    ids=["partial", "empty", "not-a-dict"],
)
def test_loading_an_incomplete_loss_scale_changes_nothing(scaler: object, lacks: str) -> None:
    # Before: a bare KeyError 'growth_factor', after GradScaler had already set the scale
    # to 3.0 (a RuntimeError, or a TypeError, for the other two).
    mp = MixedPrecision("cpu", precision="fp16")
    before = mp.state_dict()
    with pytest.raises(ValueError, match=rf"state\['scaler'\]\) lacks \[.*'{lacks}'.*\]"):
        mp.load_state_dict({"precision": "fp16", "scaler": scaler})
    assert mp.state_dict() == before


@pytest.mark.parametrize("bad", ["no", 0, None])
def test_zero_grad_set_to_none_must_be_true_or_false(bad: object) -> None:
    # Before: set_to_none="no" read as True: the gradients were set to None, not zeroed.
    mp = MixedPrecision("cpu", precision="fp32")
    w = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1)
    mp.backward(w.sum())
    with pytest.raises(TypeError, match=rf"set_to_none must be True or False, got {bad!r}"):
        mp.zero_grad(opt, set_to_none=bad)  # type: ignore[arg-type]
    assert w.grad is not None and w.grad.tolist() == [1.0, 1.0]  # nothing cleared
