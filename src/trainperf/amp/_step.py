"""What :meth:`trainperf.MixedPrecision.step` checks and runs: the refusals of a call that
cannot be right (:func:`check_step`, :func:`check_scalable_grads`), the plain step
(:func:`plain_step`) and the fp16 step through the loss scaler (:func:`scaled_step`), which
steps each optimizer and updates the scale once. Both record the optimizers that stepped (and
the fp16 one their inf/NaN flags), so that a step that raises can be retried without stepping
them twice, and without forgetting that one of them skipped.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

__all__ = [
    "check_loss",
    "check_max_grad_norm",
    "check_scalable_grads",
    "check_not_already_stepped",
    "check_not_zeroed",
    "check_optimizers",
    "check_step",
    "forget",
    "has_grads",
    "parameters",
    "plain_step",
    "scaled_step",
    "unscaled",
]


def check_step(
    optimizers: tuple[torch.optim.Optimizer, ...],
    max_grad_norm: object,
    *,
    pending: bool,
    stepped: bool,
    zeroed: set[int],
    already_stepped: set[int],
) -> None:
    """Refuse a :meth:`MixedPrecision.step` call that cannot be right: no optimizer or
    something else, one given twice, no ``mp.backward`` since the last step, a backward that
    ``mp.zero_grad(optimizer)`` dropped, an optimizer that a step which raised had already
    stepped on this backward, or a bad ``max_grad_norm``.

    Args:
        optimizers: what the call got.
        max_grad_norm: its clip value.
        pending: a backward waits for its step.
        stepped: a step used the last backward.
        zeroed: ids of the optimizers ``mp.zero_grad(optimizer)`` cleared since.
        already_stepped: ids of the optimizers a step that raised had stepped on it.

    Example:
        >>> try:
        ...     check_step(
        ...         (), None, pending=True, stepped=False, zeroed=set(), already_stepped=set()
        ...     )
        ... except TypeError as e:
        ...     print(str(e).split(";")[0])
        MixedPrecision.step() takes the optimizer(s) to step, got none
    """
    check_optimizers(optimizers)
    # An optimizer zeroed since the step has no gradients of that backward left: its
    # new ones (if any) came from a plain loss.backward(), the error below.
    if stepped and not pending and not zeroed.issuperset(map(id, optimizers)):
        raise RuntimeError(
            "MixedPrecision.step() was already called since the last mp.backward(loss): "
            "one backward, one step. To step several optimizers on one loss, pass them "
            "all to one call, mp.step(opt_a, opt_b), so that the fp16 loss scale is "
            "updated once, after all of them"
        )
    if not pending:
        raise RuntimeError(
            "MixedPrecision.step() found no gradients from mp.backward(loss) since the last "
            "step or zero_grad; call mp.backward(loss) instead of loss.backward(), so that "
            "fp16 loss scaling and skipped steps work"
        )
    check_not_zeroed(optimizers, zeroed)
    check_not_already_stepped(optimizers, already_stepped)
    check_max_grad_norm(max_grad_norm)


def check_loss(loss: object) -> None:
    """Refuse what ``mp.backward`` cannot take as a loss, before anything is recorded:
    torch's own errors ("grad can be implicitly created only for scalar outputs", "element 0
    of tensors does not require grad") name neither the shape nor the usual cause.

    Raises:
        TypeError: ``loss`` is not a tensor.
        ValueError: it has more than one element, or no graph to run backward through.

    Example:
        >>> try:
        ...     check_loss(torch.ones(2, 3, requires_grad=True))
        ... except ValueError as e:
        ...     print(str(e).split(";")[0])
        MixedPrecision.backward() takes a scalar loss, got a tensor of shape (2, 3)
    """
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"backward() takes the loss tensor, got {type(loss).__name__}")
    if loss.numel() != 1:
        raise ValueError(
            "MixedPrecision.backward() takes a scalar loss, got a tensor of shape "
            f"{tuple(loss.shape)}; reduce it first: loss.mean() or loss.sum()"
        )
    if not loss.requires_grad:
        raise ValueError(
            "MixedPrecision.backward() got a loss that does not require grad, so there is "
            "nothing to run backward through: it was computed under torch.no_grad() or "
            "torch.inference_mode(), detached (.detach(), .item()), or from parameters that "
            "all have requires_grad=False; compute it from the model's output with grad enabled"
        )


def check_optimizers(optimizers: tuple[torch.optim.Optimizer, ...]) -> None:
    """Refuse a call without optimizers, with something that is not one, or with one twice."""
    if not optimizers:
        raise TypeError(
            "MixedPrecision.step() takes the optimizer(s) to step, got none; call "
            "mp.step(optimizer), or mp.step(opt_a, opt_b) for several"
        )
    for o in optimizers:
        if not (callable(getattr(o, "step", None)) and hasattr(o, "param_groups")):
            raise TypeError(
                f"MixedPrecision.step() takes optimizers, got {o!r}; max_grad_norm is "
                "keyword-only: mp.step(optimizer, max_grad_norm=1.0)"
            )
    if len({id(o) for o in optimizers}) < len(optimizers):
        raise ValueError(
            "MixedPrecision.step() got the same optimizer twice; pass each optimizer once"
        )


def check_max_grad_norm(value: object) -> None:
    """Refuse a clip value that is not a finite number > 0 (None: no clipping).

    What ``torch.nn.utils.clip_grad_norm_`` takes is accepted: an int or float, a NumPy
    scalar (``np.float32(1.0)``), or a 0-dim real tensor. A bool is refused (``True`` is no
    clip value). A tensor on a GPU is read (one synchronisation, which ``clip_grad_norm_``
    makes anyway when it reads it); a ``meta`` tensor, which has no value, is checked for
    its shape and dtype only.

    Example:
        >>> check_max_grad_norm(torch.tensor(0.5))
        >>> try:
        ...     check_max_grad_norm(float("inf"))
        ... except ValueError as e:
        ...     print(str(e).split(" (")[0])
        max_grad_norm must be a number > 0
    """
    if value is None:
        return
    number = math.nan  # refused unless a number is found below
    if isinstance(value, torch.Tensor):
        real = value.dtype != torch.bool and not value.is_complex()
        if real and value.dim() == 0:
            if value.device.type == "meta":
                return  # no value to read
            # Read even on a GPU: clip_grad_norm_ reads it too (float(max_norm)).
            number = float(value.item())
    elif not isinstance(value, bool) and isinstance(value, numbers.Real):
        number = float(value)
    if not (math.isfinite(number) and number > 0):
        raise ValueError(
            "max_grad_norm must be a number > 0 (a finite int, float, NumPy scalar or 0-dim "
            f"tensor), or None not to clip, got {value!r}"
        )


def check_not_zeroed(optimizers: tuple[torch.optim.Optimizer, ...], zeroed: set[int]) -> None:
    """Refuse to step an optimizer ``mp.zero_grad(optimizer)`` cleared since the backward."""
    for i, o in enumerate(optimizers, 1):
        if id(o) in zeroed:
            raise RuntimeError(
                f"MixedPrecision.step() found no gradients for optimizer {i} of "
                f"{len(optimizers)} ({type(o).__name__}): mp.zero_grad(optimizer) cleared "
                "them since the last mp.backward(loss); step the other optimizers without "
                "it, or call mp.backward(loss) again first"
            )


def check_not_already_stepped(
    optimizers: tuple[torch.optim.Optimizer, ...], already_stepped: set[int]
) -> None:
    """Refuse to step again an optimizer that a step which raised had already stepped on
    this backward (a retry of the whole call would step it twice on the same gradients)."""
    for i, o in enumerate(optimizers, 1):
        if id(o) in already_stepped:
            raise RuntimeError(
                f"MixedPrecision.step() got optimizer {i} of {len(optimizers)} "
                f"({type(o).__name__}), which already stepped on this mp.backward(loss) "
                "before a later optimizer of the same step raised; retry only the "
                "optimizers that did not step, or skip them: mp.zero_grad(), then the next "
                "mp.backward(loss)"
            )


def plain_step(
    optimizers: tuple[torch.optim.Optimizer, ...],
    max_grad_norm: float | torch.Tensor | None,
    stepped: list[torch.optim.Optimizer],
    closure: Callable[[], Any] | None = None,
) -> bool:
    """Clip and step each optimizer (bf16, fp32), passing ``closure`` on; each optimizer
    that stepped is appended to ``stepped``. Never skips: returns True."""
    for optimizer in optimizers:
        if max_grad_norm is not None:
            nn.utils.clip_grad_norm_(parameters(optimizer), max_grad_norm)  # type: ignore[arg-type]
        if closure is None:
            optimizer.step()
        else:
            optimizer.step(closure)
        stepped.append(optimizer)
    return True


def scaled_step(
    scaler: torch.amp.GradScaler,
    optimizers: tuple[torch.optim.Optimizer, ...],
    max_grad_norm: float | torch.Tensor | None,
    stepped: list[torch.optim.Optimizer],
    flags: list[torch.Tensor],
) -> bool:
    """Unscale, clip and step each optimizer through ``scaler``, then update it once; each
    optimizer that stepped (or skipped on inf/NaN) is appended to ``stepped``, and its
    inf/NaN flags to ``flags``.

    ``flags`` holds on entry the flags of the optimizers that earlier calls, which raised,
    stepped on the same backward: the scale update and the result count them too, so an
    optimizer that skipped before the error still lowers the scale.

    If one raises, the scaler is left as it was before the call for the optimizers that did
    not step (see :func:`_undo`), so that the step can be retried or skipped."""
    earlier = list(flags)
    if not optimizers and not earlier:
        return True  # no gradients anywhere: nothing stepped, nothing skipped
    by_caller = {id(o) for o in optimizers if unscaled(scaler, o)}
    try:
        for optimizer in optimizers:
            if max_grad_norm is not None:
                if id(optimizer) not in by_caller:  # the caller's unscale_ is not repeated
                    scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
                nn.utils.clip_grad_norm_(parameters(optimizer), max_grad_norm)  # type: ignore[arg-type]
            scaler.step(optimizer)
            stepped.append(optimizer)
            if scaler.is_enabled():  # a disabled scaler keeps no flags (nor their state)
                # The inf/NaN flags GradScaler.step decided on (torch's own test, in
                # _maybe_opt_step); update() discards them, so keep them to read below.
                flags.extend(scaler._found_inf_per_device(optimizer).values())
    except BaseException:
        _undo(scaler, optimizers, stepped, by_caller)
        raise
    if not scaler.is_enabled():
        return True  # it stepped plainly; update() would be a no-op
    # One read per flag, instead of the loss scale before and after.
    found_inf = sum(v.item() for v in flags)
    _record_earlier(scaler, earlier)
    scaler.update()
    return not found_inf


def _record_earlier(scaler: torch.amp.GradScaler, earlier: list[torch.Tensor]) -> None:
    """Give ``scaler.update()`` the inf/NaN flags of the optimizers that a call which raised
    stepped (their own records were dropped then, see :func:`_undo`): ``update()`` lowers
    the scale if any of the flags it finds among its records is set."""
    if earlier:
        # update() reads every record's flags and then starts afresh; the key only has to
        # differ from the ids of the optimizers this call stepped.
        states = scaler._per_optimizer_states
        states[id(earlier)]["found_inf_per_device"] = dict(enumerate(earlier))


def _undo(
    scaler: torch.amp.GradScaler,
    optimizers: tuple[torch.optim.Optimizer, ...],
    stepped: list[torch.optim.Optimizer],
    by_caller: set[int],
) -> None:
    """After a scaled step raised: put back the scale of the gradients this step unscaled
    but did not step with, and drop the scaler's record of them and of the optimizers that
    stepped; the caller's own ``unscale_`` is kept.

    Without this a retry would unscale those gradients a second time (a step 65536 times
    too small), and every later step of an optimizer that stepped would fail with "step()
    has already been called since the last update()" (its loss scale is not updated).
    """
    done = {id(o) for o in stepped}
    for optimizer in optimizers:
        if id(optimizer) in by_caller and id(optimizer) not in done:
            continue  # unscaled by the caller before the step, as it still is
        if id(optimizer) not in done and unscaled(scaler, optimizer):
            scale = scaler.get_scale()  # a power of 2 unless set by hand: exact
            for p in parameters(optimizer):
                if p.grad is not None:
                    p.grad.mul_(scale)
        forget(scaler, optimizer)


def unscaled(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``scaler.unscale_(optimizer)`` ran since the last update: the caller's own,
    to read the true gradients (GradScaler refuses a second one before ``update()``)."""
    from torch.amp.grad_scaler import OptState

    states = getattr(scaler, "_per_optimizer_states", None)
    state = states.get(id(optimizer)) if states is not None else None
    return state is not None and state.get("stage") is OptState.UNSCALED


def forget(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Drop ``scaler``'s record of ``optimizer`` (None: of every optimizer) for this step (an
    ``unscale_`` the caller made, a step that raised), so the next step starts clean. A
    disabled scaler keeps none."""
    states = getattr(scaler, "_per_optimizer_states", None)
    if states is None:
        return
    if optimizer is None:
        states.clear()
    else:
        states.pop(id(optimizer), None)


def check_scalable_grads(
    optimizers: tuple[torch.optim.Optimizer, ...], *, caller: str = "step"
) -> None:
    """Refuse fp16 and complex gradients before anything steps or is unscaled (``caller``:
    the ``MixedPrecision`` method that asks), in one pass over the gradients on every fp16
    step: ``GradScaler`` cannot unscale either (its bare "Attempting to unscale FP16
    gradients." and ``NotImplementedError`` for 'ComplexFloat' name neither the cause nor
    the fix). fp16 gradients are named first, in any optimizer."""
    counts = []
    for o in optimizers:
        grads = [p.grad for p in parameters(o) if p.grad is not None]
        half = sum(g.dtype == torch.float16 for g in grads)
        counts.append((half, len(grads), any(g.is_complex() for g in grads)))
    for i, (o, (half, total, _)) in enumerate(zip(optimizers, counts, strict=True), 1):
        if half:
            raise ValueError(
                f"MixedPrecision.{caller}() found fp16 gradients in optimizer {i} of "
                f"{len(optimizers)} ({type(o).__name__}): {half} of its {total} "
                "parameters with a gradient are fp16 (the model was cast with model.half() or "
                ".to(torch.float16)), which the fp16 loss scaler cannot unscale; keep the "
                "model in fp32 (mp.autocast() already runs its operations in fp16): "
                "model.float(), then build the optimizer again"
            )
    for i, (o, (_, _, has_complex)) in enumerate(zip(optimizers, counts, strict=True), 1):
        if has_complex:
            _refuse_complex(o, i, len(optimizers), caller)


def _refuse_complex(optimizer: torch.optim.Optimizer, i: int, of: int, caller: str) -> None:
    """The complex-gradient refusal for optimizer ``i`` of ``of``, its parameters named."""
    complex_ = _complex_parameters(optimizer)
    raise ValueError(
        f"MixedPrecision.{caller}() found complex gradients in optimizer {i} of "
        f"{of} ({type(optimizer).__name__}): "
        f"parameter{'s' if len(complex_) > 1 else ''} {', '.join(complex_)}, which "
        "the fp16 loss scaler cannot unscale (torch has no complex unscale kernel); "
        "use MixedPrecision(precision='bf16' or 'fp32'), which need no loss scaler, "
        "or keep complex parameters out of the optimizer: freeze them "
        "(requires_grad_(False)), or store them real, shape (..., 2), and take "
        "torch.view_as_complex(p) in forward"
    )


def _complex_parameters(optimizer: torch.optim.Optimizer) -> list[str]:
    """Each of ``optimizer``'s parameters with a complex gradient: its name where the
    optimizer was given names (``model.named_parameters()``), else its position among the
    optimizer's parameters, with its shape and dtype."""
    found = []
    position = 0
    for group in optimizer.param_groups:
        names = group.get("param_names")
        for j, p in enumerate(group["params"]):
            position += 1
            if p.grad is not None and p.grad.is_complex():
                name = repr(names[j]) if names else f"#{position}"
                found.append(f"{name} (shape {tuple(p.shape)}, {p.dtype})")
    return found


def has_grads(optimizer: torch.optim.Optimizer) -> bool:
    """Whether any of ``optimizer``'s parameters has a gradient."""
    return any(p.grad is not None for p in parameters(optimizer))


def parameters(optimizer: torch.optim.Optimizer) -> Iterable[torch.Tensor]:
    """Every parameter ``optimizer`` steps, group by group."""
    return [p for group in optimizer.param_groups for p in group["params"]]
