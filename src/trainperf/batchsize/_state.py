"""Training state saved before probing and put back after each probe and at the end.

Probing runs real training steps: the parameters move, the optimizer's moments fill in,
BatchNorm statistics drift, dropout draws random numbers. :class:`SavedState` copies what
the caller handed in (``model``, ``optimizer``, and anything else with ``state_dict`` and
``load_state_dict``) to host memory once, with every parameter's gradient, every module's
train/eval mode and the buffers ``state_dict()`` leaves out (``persistent=False``, and those
that are None), and a MixedPrecision's pending backward, and :meth:`SavedState.restore`
loads it back bit for bit. What ``step`` trains but the caller did not pass is found too:
the optimizers stepping the passed parameters (:func:`holding_optimizers`), the LR
schedulers driving those (:func:`attached_schedulers`) and every live MixedPrecision
(:func:`with_live_mixed_precision`).

Restoring *between* probes matters too: each batch size starts from the caller's state, so
an optimizer that had no state yet allocates it inside the probe (its memory is part of that
size's peak, as in training) and drops it afterwards, and a probe's diverging steps never
leak into the next. Random number generators are restored by
:func:`trainperf._utils.rng.preserved_rng` around the whole call.

Copies go to host memory: a copy on the GPU would take the memory being measured. A state
whose ``state_dict()`` is empty (a disabled ``GradScaler``) has nothing to restore and is
left alone; ``load_state_dict`` of an empty dict would refuse it.
"""

from __future__ import annotations

import contextlib
import copy
import gc
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

from trainperf.amp import MixedPrecision
from trainperf.amp._mixed import LIVE

__all__ = [
    "SavedState",
    "attached_schedulers",
    "holding_optimizers",
    "is_scheduler",
    "schedulers_held",
    "state_holder",
    "stateful_objects",
    "with_live_mixed_precision",
]


def stateful_objects(*groups: object) -> list[Any]:
    """The objects whose state is saved: each argument, or each item of a tuple or list;
    then the optimizers that step their parameters and the LR schedulers of every optimizer
    among them, found without being passed.

    Raises:
        TypeError: one of them has no ``state_dict``/``load_state_dict``.

    Example:
        >>> m = nn.Linear(2, 2)
        >>> opt = torch.optim.SGD(m.parameters(), lr=0.1)
        >>> [type(o).__name__ for o in stateful_objects(m, (opt,), None)]
        ['Linear', 'SGD']
    """
    found: list[Any] = []
    for group in groups:
        items = group if isinstance(group, (tuple, list)) else (group,)
        for obj in items:
            if obj is None:
                continue
            if not (callable(getattr(obj, "state_dict", None))) or not callable(
                getattr(obj, "load_state_dict", None)
            ):
                raise TypeError(
                    f"{type(obj).__name__} has no state_dict()/load_state_dict(), so "
                    f"tune_batch_size cannot put it back after probing; pass modules, "
                    f"optimizers, schedulers, GradScalers (anything with both methods)"
                )
            if all(obj is not seen for seen in found):
                found.append(obj)
    found += holding_optimizers(found)
    for scheduler in attached_schedulers([o for o in found if isinstance(o, Optimizer)]):
        if all(scheduler is not seen for seen in found):
            found.append(scheduler)
    return found


def holding_optimizers(objects: list[Any]) -> list[Optimizer]:
    """The optimizers alive in this process, not among ``objects``, that step a parameter of
    the modules or optimizers among them.

    ``model=`` passed without its optimizer (or a GAN's second optimizer left out): each
    probe step fills the optimizer's moments and step count, which would stay so. Found by
    a scan of the objects the garbage collector tracks (one pass, however many parameters;
    ``gc.get_referrers`` of every parameter would scan once per parameter).

    Example:
        >>> m = nn.Linear(2, 2)
        >>> opt = torch.optim.Adam(m.parameters())
        >>> holding_optimizers([m]) == [opt], holding_optimizers([m, opt])
        (True, [])
    """
    ours = {id(p) for p in _parameters(objects)}
    if not ours:
        return []
    # type(), not isinstance(): isinstance reads __class__, which some module proxies
    # answer with a deprecation warning or an import.
    return [
        o
        for o in gc.get_objects()
        if issubclass(type(o), Optimizer)
        and all(o is not seen for seen in objects)
        and any(id(p) in ours for p in _stepped(o))
    ]


def _stepped(optimizer: Any) -> Iterator[Any]:
    """The parameters an optimizer steps; none for a subclass that never set its groups."""
    for group in getattr(optimizer, "param_groups", None) or ():
        yield from group.get("params", ()) if isinstance(group, dict) else ()


def with_live_mixed_precision(objects: Iterable[Any]) -> list[Any]:
    """``objects``, then every live :class:`~trainperf.MixedPrecision` not among them.

    A ``step`` that uses one moves its loss scale and growth tracker (an fp16 probe that
    overflows halves the scale) and its pending-backward flags, passed or not. They are
    kept out of :func:`stateful_objects` (the cache key): one alive for another model says
    nothing about this step.

    Example:
        >>> mp = MixedPrecision("cpu", precision="fp32")
        >>> any(o is mp for o in with_live_mixed_precision([]))
        True
    """
    out = list(objects)
    out += [mp for mp in list(LIVE) if all(mp is not o for o in out)]
    return out


def is_scheduler(obj: object) -> bool:
    """``obj`` is an LR scheduler (``ReduceLROnPlateau`` included)."""
    return isinstance(obj, (LRScheduler, ReduceLROnPlateau))


_NOT_SET = object()


@contextlib.contextmanager
def schedulers_held(objects: Iterable[Any]) -> Iterator[None]:
    """Every LR scheduler among ``objects`` stands still meanwhile: its ``step()`` does
    nothing. Probing runs thousands of steps; a scheduler stepped by each would run out
    (OneCycleLR raises past its ``total_steps``) and its learning rates are no part of what
    a step costs.

    Example:
        >>> opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
        >>> sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        >>> with schedulers_held([sched]):
        ...     sched.step()
        >>> sched.last_epoch, sched.step.__name__
        (0, 'step')
    """
    held = [o for o in objects if is_scheduler(o)]
    own = [o.__dict__.get("step", _NOT_SET) for o in held]
    for scheduler in held:
        scheduler.step = _standing_still
    try:
        yield
    finally:
        for scheduler, step in zip(held, own, strict=True):
            if step is _NOT_SET:
                del scheduler.step
            else:
                scheduler.step = step


def _standing_still(*args: Any, **kwargs: Any) -> None:
    """A held scheduler's ``step``: nothing."""


def attached_schedulers(optimizers: list[Optimizer]) -> list[Any]:
    """The LR schedulers alive in this process that drive one of ``optimizers``.

    A ``step`` that also steps its scheduler advances it on every probe step: unless its
    state is put back too, training resumes further along its schedule than it was (a
    OneCycleLR's warm-up spent on probes, or run past its ``total_steps``). The schedulers
    are found by who refers to each optimizer (``gc.get_referrers``), so the caller need
    not pass them.

    Example:
        >>> opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
        >>> sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3)
        >>> attached_schedulers([opt]) == [sched]
        True
    """
    if not optimizers:
        return []
    # An instance's attributes refer to it from the instance itself (inline values) or
    # from its __dict__, whose referrer is the instance: one more scan for all the dicts.
    refs = gc.get_referrers(*optimizers)
    dicts = [r for r in refs if isinstance(r, dict)]
    owners = [r for r in refs if not isinstance(r, dict)]
    owners += gc.get_referrers(*dicts) if dicts else []
    found: list[Any] = []
    for owner in owners:
        opt = getattr(owner, "optimizer", None) if is_scheduler(owner) else None
        if any(opt is o for o in optimizers) and all(owner is not f for f in found):
            found.append(owner)
    return found


def state_holder(obj: Any) -> Any:
    """The object whose ``state_dict()`` holds ``obj``'s state in this process: a
    ``ZeroRedundancyOptimizer``'s local optimizer (the moments of this rank's shard), since
    its own ``state_dict()`` refuses until ``consolidate_state_dict()``, a collective, ran
    on every rank; ``obj`` itself for anything else.

    Example:
        >>> opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
        >>> state_holder(opt) is opt
        True
    """
    inner = getattr(obj, "optim", None)
    if callable(getattr(obj, "consolidate_state_dict", None)) and isinstance(inner, Optimizer):
        return inner
    return obj


def _group_settings(optimizer: Any) -> list[dict[str, Any]]:
    """A copy of each of ``optimizer``'s param groups, its parameters left out."""
    return [
        {k: copy.deepcopy(v) for k, v in group.items() if k != "params"}
        for group in optimizer.param_groups
    ]


def _to_host(value: Any) -> Any:
    """A deep copy of a state dict with every tensor copied to host memory."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return type(value)((k, _to_host(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_to_host(v) for v in value)
    return copy.deepcopy(value)


def _parameters(objects: Iterable[Any]) -> list[nn.Parameter]:
    """Every parameter of the modules and optimizers among ``objects``, once."""
    params: list[nn.Parameter] = []
    seen: set[int] = set()

    def add(ps: Iterable[Any]) -> None:
        for p in ps:
            if isinstance(p, torch.Tensor) and id(p) not in seen:
                seen.add(id(p))
                params.append(p)  # type: ignore[arg-type]

    for obj in objects:
        if isinstance(obj, nn.Module):
            add(obj.parameters())
        elif isinstance(obj, torch.optim.Optimizer):
            for group in obj.param_groups:
                add(group["params"])
    return params


def _modules(objects: Iterable[Any]) -> Iterator[nn.Module]:
    for obj in objects:
        if isinstance(obj, nn.Module):
            yield from obj.modules()


Buffer = tuple[nn.Module, str, torch.Tensor | None, torch.device | None]
"""A module, a buffer's name, a host copy of it (None: it was None) and its device."""


def _unsaved_buffers(objects: Iterable[Any]) -> list[Buffer]:
    """Host copies of the buffers ``state_dict()`` leaves out, with their modules: those
    registered with ``persistent=False`` (a metric's running sums, a step counter, a grown
    rotary cache) and those that are None (``register_buffer("mean", None)``, filled in by
    the first forward pass: ``load_state_dict`` would then miss its key)."""
    out: list[Buffer] = []
    for m in _modules(objects):
        unsaved: set[str] = getattr(m, "_non_persistent_buffers_set", set())
        for name, b in m._buffers.items():
            if b is None:
                out.append((m, name, None, None))
            elif name in unsaved:
                out.append((m, name, b.detach().to("cpu", copy=True), b.device))
    return out


def _load_state(obj: Any, state: Any, layout: Layout | None) -> None:
    if isinstance(obj, nn.Module):
        _match_buffer_shapes(obj, state)
    obj.load_state_dict(copy.deepcopy(state))
    if layout:
        _restore_layout(obj, state, layout)


def _match_buffer_shapes(module: nn.Module, state: Any) -> None:
    """Put back the saved tensor itself for each persistent buffer whose shape changed since
    it was saved (a cache a step grows with the batch), which ``load_state_dict`` would
    refuse as a size mismatch."""
    for name, now in list(module.named_buffers()):
        saved = state.get(name)
        if isinstance(saved, torch.Tensor) and now.shape != saved.shape:
            owner_name, _, leaf = name.rpartition(".")
            owner = module.get_submodule(owner_name) if owner_name else module
            owner._buffers[leaf] = saved.to(device=now.device, copy=True)


def _restore_buffer(m: nn.Module, name: str, saved: torch.Tensor | None, device: Any) -> None:
    now = m._buffers.get(name)
    if saved is None or now is None or now.shape != saved.shape or now.dtype != saved.dtype:
        m._buffers[name] = None if saved is None else saved.to(device=device, copy=True)
    else:
        with torch.no_grad():
            now.copy_(saved)


Pending = tuple[MixedPrecision, tuple[bool, bool, frozenset[int]]]
"""A MixedPrecision, whether a backward waits for its step, whether it was stepped since,
and the optimizers ``zero_grad`` cleared since that backward."""


def _pending(objects: Iterable[Any]) -> list[Pending]:
    """Each MixedPrecision's "a backward is waiting for its step" and "stepped since"
    flags (gradients accumulated before tuning must still be stepped after it)."""
    return [
        (o, (o._backward_pending, o._stepped, frozenset(o._zeroed)))
        for o in objects
        if isinstance(o, MixedPrecision)
    ]


Stages = tuple[torch.amp.GradScaler, Any]
"""A loss scaler and a copy of its per-optimizer stages (unscaled, stepped, inf found)."""


def _stages(objects: Iterable[Any]) -> list[Stages]:
    """Each loss scaler's per-optimizer stages, which its ``state_dict()`` leaves out: a
    probe that ran out of memory between ``unscale_`` and ``update`` leaves them half-way,
    and the next ``unscale_`` raises, or the next ``step`` applies gradients still scaled
    by the loss scale (65536 times too large)."""
    scalers: list[torch.amp.GradScaler] = []
    for o in objects:
        scaler = o.scaler if isinstance(o, MixedPrecision) else o
        if isinstance(scaler, torch.amp.GradScaler) and all(scaler is not s for s in scalers):
            scalers.append(scaler)
    return [
        (s, copy.deepcopy(s._per_optimizer_states))
        for s in scalers
        if getattr(s, "_per_optimizer_states", None) is not None
    ]


Loose = tuple[torch.Tensor, torch.Tensor]
"""A parameter no module passed in owns (only an optimizer holds it), and a host copy."""


def _loose_parameters(objects: Iterable[Any]) -> list[Loose]:
    """Host copies of the parameters an optimizer steps that no module among ``objects``
    owns: ``optimizer=`` passed without the model (an optimizer's ``state_dict()`` holds
    no parameter values)."""
    owned = {id(p) for m in objects if isinstance(m, nn.Module) for p in m.parameters()}
    owned |= {id(b) for m in objects if isinstance(m, nn.Module) for b in m.buffers()}
    return [
        (p, p.detach().to("cpu", copy=True)) for p in _parameters(objects) if id(p) not in owned
    ]


Layout = dict[tuple[int, str], tuple[torch.dtype, torch.device]]
"""An optimizer's state tensors by (parameter index, key): their dtype and device."""


def _state_layout(obj: Any, state: Any) -> Layout | None:
    """The dtype and device of each tensor in an optimizer's ``state_dict()["state"]``, which
    ``load_state_dict`` casts to its parameter's (fp32 moments of bf16 parameters, a state
    kept on the host beside parameters on the GPU); None for anything else."""
    if not isinstance(obj, Optimizer):
        return None
    return {
        (index, key): (value.dtype, value.device)
        for index, per_param in state.get("state", {}).items()
        if isinstance(per_param, dict)  # not a custom optimizer's own counter
        for key, value in per_param.items()
        if isinstance(value, torch.Tensor)
    }


def _restore_layout(obj: Optimizer, saved: Any, layout: Layout) -> None:
    """Put back the dtype and device of each optimizer state tensor ``load_state_dict``
    cast, from the host copy ``saved`` (which keeps the dtype)."""
    params = [p for group in obj.param_groups for p in group["params"]]
    for (index, key), (dtype, device) in layout.items():
        if not isinstance(index, int) or index >= len(params):
            continue
        now = obj.state.get(params[index], {}).get(key)
        if isinstance(now, torch.Tensor) and (now.dtype != dtype or now.device != device):
            obj.state[params[index]][key] = saved["state"][index][key].to(
                device=device, dtype=dtype, copy=True
            )


@dataclass
class SavedState:
    """Host copies of the caller's state, and :meth:`restore` to load them back.

    Attributes:
        states: ``(object, copy of its state_dict(), an optimizer's state layout)`` for
            each object with a state.
        grads: ``(parameter, copy of its .grad or None)`` for every parameter.
        flags: ``(parameter, its requires_grad)`` for every parameter (a step that freezes
            part of the model, a GAN's discriminator, may stop half-way at an OOM).
        loose: ``(parameter, copy)`` of every parameter only an optimizer holds.
        modes: ``(module, its .training flag)`` for every submodule.
        buffers: ``(module, name, copy, device)`` of every buffer ``state_dict()`` leaves
            out (copy None: the buffer was None).
        pending: ``(MixedPrecision, (whether a backward waits for its step, whether it
            was stepped since, the optimizers zeroed since))``.
        stages: ``(GradScaler, copy of its per-optimizer stages)``, of those passed in and
            of each MixedPrecision's.
        groups: ``(optimizer, copy of its param_groups' settings)`` of each optimizer whose
            state another object holds (a ``ZeroRedundancyOptimizer``: a step that sets its
            ``lr`` by hand changes its own groups, which it copies into its local
            optimizer's at each step).
    """

    states: list[tuple[Any, Any, Layout | None]] = field(default_factory=list)
    grads: list[tuple[nn.Parameter, torch.Tensor | None]] = field(default_factory=list)
    flags: list[tuple[nn.Parameter, bool]] = field(default_factory=list)
    loose: list[Loose] = field(default_factory=list)
    modes: list[tuple[nn.Module, bool]] = field(default_factory=list)
    buffers: list[Buffer] = field(default_factory=list)
    pending: list[Pending] = field(default_factory=list)
    stages: list[Stages] = field(default_factory=list)
    groups: list[tuple[Any, list[dict[str, Any]]]] = field(default_factory=list)

    @classmethod
    def save(cls, objects: Iterable[Any]) -> SavedState:
        """Copy the state of ``objects`` (see :func:`stateful_objects`) to host memory.

        Example:
            >>> m = nn.Linear(2, 1)
            >>> saved = SavedState.save([m])
            >>> with torch.no_grad():
            ...     _ = m.weight.add_(1.0)
            >>> before = saved.states[0][1]["weight"].clone()
            >>> saved.restore()
            >>> torch.equal(m.weight.detach(), before)
            True
        """
        objects = list(objects)
        states = []
        for obj in objects:
            holder = state_holder(obj)
            if holder is not obj and any(holder is o for o in objects):
                continue  # saved as itself
            state = holder.state_dict()
            if len(state):
                states.append((holder, _to_host(state), _state_layout(holder, state)))
        params = _parameters(objects)
        grads = [
            (p, None if p.grad is None else p.grad.detach().to("cpu", copy=True)) for p in params
        ]
        return cls(
            states=states,
            grads=grads,
            flags=[(p, p.requires_grad) for p in params],
            loose=_loose_parameters(objects),
            modes=[(m, m.training) for m in _modules(objects)],
            buffers=_unsaved_buffers(objects),
            pending=_pending(objects),
            stages=_stages(objects),
            groups=[(obj, _group_settings(obj)) for obj in objects if state_holder(obj) is not obj],
        )

    def restore(self) -> None:
        """Load every saved state back, exactly: values, gradients and train/eval modes.

        ``load_state_dict`` gets a fresh copy each time: an optimizer keeps the tensors it
        is handed when they already have the right device and dtype, and its next step
        would then change the saved copy.
        """
        errors: list[BaseException] = []
        for m, name, buffer, _ in self.buffers:
            if buffer is None:  # before load_state_dict, which would expect its key
                m._buffers[name] = None
        for obj, state, layout in self.states:
            try:
                _load_state(obj, state, layout)
            except Exception as e:  # the rest is still put back, then the first error raised
                errors.append(e)
        self._restore_tensors()
        if errors:
            raise errors[0]

    def _restore_tensors(self) -> None:
        """Gradients, flags, modes, unsaved buffers and MixedPrecision/GradScaler flags."""
        with torch.no_grad():
            for t, saved in self.loose:
                t.copy_(saved)
            for p, g in self.grads:
                if g is None:
                    p.grad = None
                elif p.grad is not None and p.grad.shape == g.shape:
                    p.grad.copy_(g)
                else:
                    p.grad = g.to(device=p.device, copy=True)
        for p, flag in self.flags:
            p.requires_grad_(flag)
        for m, training in self.modes:
            m.train(training)
        for m, name, buffer, device in self.buffers:
            _restore_buffer(m, name, buffer, device)
        for mp, (pending, stepped, zeroed) in self.pending:
            mp._backward_pending, mp._stepped, mp._zeroed = pending, stepped, set(zeroed)
        for scaler, stages in self.stages:
            scaler._per_optimizer_states = copy.deepcopy(stages)
        for opt, settings in self.groups:
            for group, saved in zip(opt.param_groups, settings, strict=False):
                group.update(copy.deepcopy(saved))

    def drop_gradients(self) -> None:
        """Set every parameter's ``.grad`` to None (after an out-of-memory error, before the
        memory is handed back)."""
        for p, _ in self.grads:
            p.grad = None
