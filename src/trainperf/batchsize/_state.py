"""Training state saved before probing and put back after each probe and at the end.

Probing runs real training steps: the parameters move, the optimizer's moments fill in,
BatchNorm statistics drift, dropout draws random numbers. :class:`SavedState` copies what
the caller handed in (``model``, ``optimizer``, and anything else with ``state_dict`` and
``load_state_dict``) to host memory once, with every parameter's gradient, every module's
train/eval mode and the buffers ``state_dict()`` leaves out (``persistent=False``, and those
that are None), and a MixedPrecision's record of its backward and steps, and
:meth:`SavedState.restore` loads it back bit for bit. What ``step`` trains but the caller
did not pass is found too (:mod:`trainperf.batchsize._holders`): here, the model whose
parameters only an optimizer was passed for, and the EMA or SWA copies of the model. A
buffer, parameter or submodule a module registers while probing (on its first forward pass)
is removed again: the module is left as it was.

Restoring *between* probes matters too: each batch size starts from the caller's state, so
an optimizer that had no state yet allocates it inside the probe (its memory is part of that
size's peak, as in training) and drops it afterwards, and a probe's diverging steps never
leak into the next. A probe also starts with no loss scaler record of the caller's step (an
``unscale_`` made before tuning, which :meth:`SavedState.set_aside` sets aside): each probe
trains as a fresh step would. Random number generators are restored by
:func:`trainperf._utils.rng.preserved_rng` around the whole call.

Copies go to host memory: a copy on the GPU would take the memory being measured. A state
whose ``state_dict()`` is empty (a disabled ``GradScaler``) has nothing to restore and is
left alone; ``load_state_dict`` of an empty dict would refuse it.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from trainperf.amp import MixedPrecision
from trainperf.amp._bookkeeping import fresh
from trainperf.amp._state import restoring
from trainperf.batchsize._holders import (
    model_copies,
    owning_modules,
    parameters_of,
    state_holder,
)

__all__ = ["SavedState"]


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


# A module, the names of its own parameters, buffers and submodules when saved, and its
# plain attributes then (one that a lazily built layer replaces: ``self.head = None``).
Entries = tuple[nn.Module, frozenset[str], frozenset[str], frozenset[str], dict[str, Any]]


def _entries(objects: Iterable[Any]) -> list[Entries]:
    return [
        (
            m,
            frozenset(m._parameters),
            frozenset(m._buffers),
            frozenset(m._modules),
            # Not tensors (a plain-attribute cache would be held for the whole tuning, and
            # a tensor attribute cannot be registered over anyway).
            {k: v for k, v in vars(m).items() if not isinstance(v, torch.Tensor)},
        )
        for m in _modules(objects)
    ]


def _drop_new_entries(entries: list[Entries]) -> None:
    """Remove what a module registered since it was saved (a buffer made on the first
    forward pass: ``load_state_dict`` would miss its key in the saved state), putting back
    the plain attribute a registration replaced (``self.head = None`` before the first
    forward built the layer), so the module builds it again as it did the first time."""
    for m, params, buffers, children, plain in entries:
        for name in [n for n in m._parameters if n not in params]:
            del m._parameters[name]
            _put_back(m, name, plain)
        for name in [n for n in m._buffers if n not in buffers]:
            del m._buffers[name]
            m._non_persistent_buffers_set.discard(name)
            _put_back(m, name, plain)
        for name in [n for n in m._modules if n not in children]:
            del m._modules[name]
            _put_back(m, name, plain)


def _put_back(m: nn.Module, name: str, plain: dict[str, Any]) -> None:
    if name in plain:
        object.__setattr__(m, name, plain[name])


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


Book = tuple[MixedPrecision, dict[str, Any]]
"""A MixedPrecision and a copy of its record of its backward and steps, by attribute."""


def _books(objects: Iterable[Any]) -> list[Book]:
    """Each MixedPrecision's record of its backward and steps
    (:mod:`trainperf.amp._bookkeeping`): gradients accumulated before tuning must still be
    stepped after it, and the retry of a step that raised must still leave out the
    optimizers it stepped. Its fields are those of a fresh instance's record, so one that
    amp adds is saved too."""
    return [(o, _book_copy(vars(o))) for o in objects if isinstance(o, MixedPrecision)]


def _book_copy(attributes: dict[str, Any]) -> dict[str, Any]:
    """A copy of the record's fields in ``attributes``: new sets and lists, which the
    probes' steps clear and fill in place, of the same items (the inf/NaN flags are tensors
    on the device that no step writes to again: copies would take the memory measured)."""
    return {name: copy.copy(attributes[name]) for name in fresh()}


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


def _looseparameters_of(objects: Iterable[Any]) -> list[Loose]:
    """Host copies of the parameters an optimizer steps that no module among ``objects``
    owns: ``optimizer=`` passed without the model (an optimizer's ``state_dict()`` holds
    no parameter values)."""
    owned = {id(p) for m in objects if isinstance(m, nn.Module) for p in m.parameters()}
    owned |= {id(b) for m in objects if isinstance(m, nn.Module) for b in m.buffers()}
    return [
        (p, p.detach().to("cpu", copy=True)) for p in parameters_of(objects) if id(p) not in owned
    ]


Groups = tuple[Optimizer, list[tuple[dict[str, Any], list[Any]]]]
"""An optimizer, and each of its param groups with the parameters it held when saved."""


def _groups_of(holders: Iterable[Any]) -> list[Groups]:
    """The param groups of each optimizer among ``holders``, with their parameters."""
    return [
        (o, [(group, list(group["params"])) for group in o.param_groups])
        for o in holders
        if isinstance(o, Optimizer)
    ]


def _put_back_groups(groups: list[Groups]) -> None:
    """Give each optimizer back the param groups and parameters it had when saved: a step
    that added a group (progressive unfreezing) or a parameter would otherwise have
    ``load_state_dict`` refuse the saved state, leaving the probe's group and moments.

    A ``ZeroRedundancyOptimizer`` is among them beside its local optimizer: its
    ``add_param_group`` adds the group to both, and the next step refuses groups that
    differ in number. Its partition of the parameters over the ranks, cached, is then
    worked out again (:func:`_repartition`)."""
    for opt, saved in groups:
        changed = len(opt.param_groups) != len(saved) or any(
            a is not group or list(map(id, a["params"])) != list(map(id, params))
            for a, (group, params) in zip(opt.param_groups, saved, strict=False)
        )
        opt.param_groups[:] = [group for group, _ in saved]
        for group, params in saved:
            group["params"][:] = params
        if changed:
            _repartition(opt)


def _repartition(opt: Optimizer) -> None:
    """Drop a ``ZeroRedundancyOptimizer``'s cached partition (which rank steps which
    parameter, its buckets) after its groups changed, as its own ``add_param_group``
    does; nothing for another optimizer."""
    if state_holder(opt) is opt or not callable(getattr(opt, "_clear_cache", None)):
        return
    opt._clear_cache()  # type: ignore[attr-defined]
    opt._build_param_buckets()  # type: ignore[attr-defined]  # without bucket views: a no-op


def _wrappers(objects: Iterable[Any]) -> list[Any]:
    """The objects whose state another holds (a ``ZeroRedundancyOptimizer``), once each."""
    found: list[Any] = []
    for obj in objects:
        if state_holder(obj) is not obj and all(obj is not f for f in found):
            found.append(obj)
    return found


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
        loose: ``(parameter, copy)`` of every parameter only an optimizer holds, no module.
        modes: ``(module, its .training flag)`` for every submodule.
        buffers: ``(module, name, copy, device)`` of every buffer ``state_dict()`` leaves
            out (copy None: the buffer was None).
        books: ``(MixedPrecision, copy of its record of its backward and steps)``: whether a
            backward waits for its step, whether it was stepped since, the optimizers zeroed
            since, and those a step that raised had stepped, with their inf/NaN flags.
        stages: ``(GradScaler, copy of its per-optimizer stages)``, of those passed in and
            of each MixedPrecision's.
        groups: ``(optimizer, copy of its param_groups' settings)`` of each optimizer whose
            state another object holds (a ``ZeroRedundancyOptimizer``: a step that sets its
            ``lr`` by hand changes its own groups, which it copies into its local
            optimizer's at each step).
        entries: ``(module, names of its parameters, buffers, submodules)`` for every
            submodule (what a forward pass registers while probing is removed).
        param_groups: ``(optimizer, [(param group, its parameters)])`` of each optimizer
            whose state is loaded back, and of each ``ZeroRedundancyOptimizer`` over one
            (a group or parameter added while probing is removed from both).
    """

    states: list[tuple[Any, Any, Layout | None]] = field(default_factory=list)
    grads: list[tuple[nn.Parameter, torch.Tensor | None]] = field(default_factory=list)
    flags: list[tuple[nn.Parameter, bool]] = field(default_factory=list)
    loose: list[Loose] = field(default_factory=list)
    modes: list[tuple[nn.Module, bool]] = field(default_factory=list)
    buffers: list[Buffer] = field(default_factory=list)
    books: list[Book] = field(default_factory=list)
    stages: list[Stages] = field(default_factory=list)
    groups: list[tuple[Any, list[dict[str, Any]]]] = field(default_factory=list)
    entries: list[Entries] = field(default_factory=list)
    param_groups: list[Groups] = field(default_factory=list)

    @classmethod
    def save(cls, objects: Iterable[Any], *, owners: list[nn.Module] | None = None) -> SavedState:
        """Copy the state of ``objects`` (see :func:`stateful_objects`) to host memory,
        of the modules that own the parameters of an optimizer among them (``owners``:
        :func:`~trainperf.batchsize._holders.owning_modules` of ``objects``, found here
        when None) and of the EMA or SWA copies of their models
        (:func:`~trainperf.batchsize._holders.model_copies`).

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
        objects += owning_modules(objects) if owners is None else owners
        objects += model_copies(objects)
        states = []
        for obj in objects:
            holder = state_holder(obj)
            if holder is not obj and any(holder is o for o in objects):
                continue  # saved as itself
            state = holder.state_dict()
            if len(state):
                states.append((holder, _to_host(state), _state_layout(holder, state)))
        params = parameters_of(objects)
        grads = [
            (p, None if p.grad is None else p.grad.detach().to("cpu", copy=True)) for p in params
        ]
        return cls(
            states=states,
            grads=grads,
            flags=[(p, p.requires_grad) for p in params],
            loose=_looseparameters_of(objects),
            modes=[(m, m.training) for m in _modules(objects)],
            buffers=_unsaved_buffers(objects),
            books=_books(objects),
            stages=_stages(objects),
            groups=[(obj, _group_settings(obj)) for obj in objects if state_holder(obj) is not obj],
            entries=_entries(objects),
            param_groups=_groups_of([*(holder for holder, _, _ in states), *_wrappers(objects)]),
        )

    def restore(self) -> None:
        """Load every saved state back, exactly: values, gradients and train/eval modes;
        what a module registered since, and a param group or parameter an optimizer was
        given since, is removed first.

        ``load_state_dict`` gets a fresh copy each time: an optimizer keeps the tensors it
        is handed when they already have the right device and dtype, and its next step
        would then change the saved copy.
        """
        errors: list[BaseException] = []
        _drop_new_entries(self.entries)
        _put_back_groups(self.param_groups)
        for m, name, buffer, _ in self.buffers:
            if buffer is None:  # before load_state_dict, which would expect its key
                m._buffers[name] = None
        self._forget_probe_backwards()
        with restoring():  # the caller's own loss scale comes back, 0 included
            for obj, state, layout in self.states:
                try:
                    _load_state(obj, state, layout)
                except Exception as e:  # the rest is still put back, then the first raised
                    errors.append(e)
        self._restore_tensors()
        if errors:
            raise errors[0]

    def _forget_probe_backwards(self) -> None:
        """Give each saved MixedPrecision a fresh record, before any state is loaded: a
        probe stopped by an out-of-memory error between ``mp.backward`` and ``mp.step``
        (Adam allocating its moments in its first step) leaves a backward waiting, and
        ``load_state_dict`` refuses another loss scale then, whether the MixedPrecision's
        own or that of an object holding it (``model=(model, train_state)``). The saved
        records are put back after the states (:meth:`_restore_tensors`)."""
        for mp, _ in self.books:
            mp.__dict__.update(fresh())

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
        for mp, book in self.books:
            mp.__dict__.update(_book_copy(book))
        for scaler, stages in self.stages:
            scaler._per_optimizer_states = copy.deepcopy(stages)
        for opt, settings in self.groups:
            for group, setting in zip(opt.param_groups, settings, strict=False):
                group.update(copy.deepcopy(setting))

    def set_aside(self) -> None:
        """Clear each saved loss scaler's per-optimizer records (an ``unscale_`` the caller
        made before tuning) before a probe: its first ``mp.backward`` would drop them with
        a warning meant for the caller, its own ``scaler.unscale_`` would raise "already
        called", and a plain ``scaler.step`` would apply its gradients still scaled. Each
        MixedPrecision's count of fp16 steps skipped in a row starts again at 0: a probe's
        skipped step is not one more of the caller's run (whose 20th warns that the loss
        is inf/NaN). :meth:`restore` puts both back."""
        for scaler, _ in self.stages:
            scaler._per_optimizer_states.clear()  # keeps its defaultdict's factory
        for mp, _ in self.books:
            mp._skipped_in_a_row = 0

    def drop_gradients(self) -> None:
        """Set every parameter's ``.grad`` to None (after an out-of-memory error, before the
        memory is handed back)."""
        for p, _ in self.grads:
            p.grad = None
