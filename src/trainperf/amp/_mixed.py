""":class:`MixedPrecision` and :func:`choose_precision`, the "auto" policy's public face.

The policy table is in :mod:`trainperf.amp`'s docstring and the per-device rules in
:mod:`trainperf.amp._precision`; what each choice is worth, measured, is in the project's
``docs/benchmarks.md``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, TypeVar, get_args

import torch
from torch import nn

from trainperf._utils.validate import flag
from trainperf.amp import _bookkeeping, _precision, _state
from trainperf.amp._autocast import AutocastContext, NoAutocast
from trainperf.amp._channels_last import channels_last_decision
from trainperf.amp._precision import choose_precision
from trainperf.amp._prepare import move_model
from trainperf.amp._scaler import LossScaler, unscaled_grads
from trainperf.amp._step import check_loss
from trainperf.amp._tf32 import enable_tf32, tf32_decision
from trainperf.device import resolve_device, to_device
from trainperf.device._move import to_device_channels_last

__all__ = ["MixedPrecision", "Precision", "choose_precision"]

# Live MixedPrecision objects: trainperf.watch() reads them so that it does not advise mixed
# precision to a loop that already uses it (a WeakSet: it never keeps one alive).
LIVE: weakref.WeakSet[MixedPrecision] = weakref.WeakSet()

Precision = Literal["auto", "bf16", "fp16", "fp32"]
_PRECISIONS: tuple[str, ...] = get_args(Precision)
_NAMES = _precision.NAMES

T = TypeVar("T")


# --------------------------------------------------------------------------- the class


class MixedPrecision:
    """Autocast, loss scaling, channels_last and TF32, chosen for the device.

    ``precision="auto"`` follows :func:`choose_precision`; "bf16", "fp16" and "fp32" force
    one. A loss scaler (``torch.amp.GradScaler``) exists only for fp16; bf16 has fp32's range
    and needs none. Nothing here initialises CUDA unless ``device`` is a CUDA device.

    A training step::

        mp = MixedPrecision()                      # device=None: best_device()
        model = mp.prepare(model)                  # device, channels_last, TF32
        for batch in loader:
            x, y = mp.prepare_batch(batch)         # to_device + channels_last
            with mp.autocast():
                loss = loss_fn(model(x), y)
            mp.backward(loss)
            if mp.step(optimizer, max_grad_norm=1.0):
                scheduler.step()                   # not on a skipped fp16 step
            mp.zero_grad(optimizer)

    Args:
        device: where to train; None or ``"auto"`` means :func:`trainperf.best_device`
            (parsed by :func:`trainperf.device.resolve_device`).
        precision: "auto", "bf16", "fp16" or "fp32".
        channels_last: "auto" converts models with at least one 2-D convolution over
            feature maps (a patch embedding, as in a ViT, does not count), on CUDA, when
            tensor cores are in use; True/False force it on/off. Only 4-D weights are
            converted: 5-D ones (``Conv3d``) keep their layout.
        tf32: allow TF32 for fp32 matmuls and convolutions on compute capability >= 8.0 when
            :meth:`prepare` runs. This is process-wide torch state. False leaves it as is.

    Raises:
        ValueError: an invalid ``device``; an unknown ``precision`` or ``channels_last``;
            bf16 or fp16 asked for on a device whose autocast (in this torch) does not
            support it.
        TypeError: ``tf32`` is not a bool, or ``device`` has the wrong type.
        DeviceError: CUDA or MPS asked for but not available, a CUDA index beyond the
            visible GPUs, or bf16 asked for on a GPU without native bf16 (compute
            capability < 8.0).

    Example:
        >>> mp = MixedPrecision("cpu", precision="bf16")
        >>> model = mp.prepare(torch.nn.Linear(4, 2))
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> x, y = mp.prepare_batch((torch.randn(8, 4), torch.randn(8, 2)))
        >>> with mp.autocast():
        ...     loss = torch.nn.functional.mse_loss(model(x).float(), y)
        >>> mp.backward(loss)
        >>> mp.step(optimizer, max_grad_norm=1.0)
        True
        >>> mp.dtype, mp.uses_scaler
        (torch.bfloat16, False)
    """

    def __init__(
        self,
        device: str | torch.device | None = None,
        precision: Precision = "auto",
        *,
        channels_last: bool | Literal["auto"] = "auto",
        tf32: bool = True,
    ) -> None:
        _precision.check_precision(precision, _PRECISIONS)
        if channels_last not in (True, False, "auto") or not isinstance(channels_last, (bool, str)):
            raise ValueError(f"channels_last must be 'auto', True or False, got {channels_last!r}")
        flag("tf32", tf32)
        self.device: torch.device = resolve_device(device, allowed=None)
        self.precision: Precision = precision
        self.channels_last: bool | Literal["auto"] = channels_last
        self.tf32 = tf32
        self.dtype: torch.dtype
        self.dtype, self._precision_reason = _precision.resolve(self.device, precision)
        self._capability = (
            _precision.cuda_capability(self.device) if self.device.type == "cuda" else None
        )
        self._scaler: torch.amp.GradScaler | None = None
        # What backward, step and zero_grad remember: see trainperf.amp._bookkeeping.
        self._backward_pending: bool
        self._stepped: bool
        self._zeroed: set[int]
        self._already_stepped: set[int]
        self._skip_flags: list[torch.Tensor]
        self._skipped_in_a_row: int
        self.__dict__.update(_bookkeeping.fresh())
        # Why an unpickled loss scale cannot be used (see trainperf.amp._state.unpickled).
        self._unusable_scale: str | None = None
        self._models: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self.uses_channels_last = False
        self.tf32_enabled = False
        self._prepare_reasons: list[str] = []
        LIVE.add(self)

    # ----------------------------------------------------------------- what was chosen

    @property
    def uses_scaler(self) -> bool:
        """True for fp16, the only precision whose small range needs loss scaling."""
        return self.dtype == torch.float16

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """The fp16 loss scaler (created on first use), or None: bf16 and fp32 never have one.

        A ``torch.amp.GradScaler`` that also remembers which optimizers ``unscale_`` saw, so
        that :meth:`backward` keeps the ``unscale_`` of gradients it does not touch."""
        if self.uses_scaler and self._scaler is None:
            self._scaler = LossScaler(self.device.type)
        return self._scaler

    @property
    def _enabled_scaler(self) -> torch.amp.GradScaler | None:
        """:attr:`scaler` when it is enabled; None for bf16 and fp32 and for a disabled
        scaler, for :meth:`step` and :meth:`unscale_`."""
        scaler = self.scaler
        return scaler if scaler is not None and scaler.is_enabled() else None

    @property
    def reason(self) -> str:
        """Why the precision (and, after :meth:`prepare`, channels_last and TF32) were chosen."""
        return "; ".join([self._precision_reason, *self._prepare_reasons])

    def __repr__(self) -> str:
        return (
            f"MixedPrecision(device='{self.device}', dtype={_NAMES[self.dtype]}, "
            f"uses_scaler={self.uses_scaler}, channels_last={self.channels_last!r}, "
            f"tf32={self.tf32}; why: {self.reason})"
        )

    # ----------------------------------------------------------------- model and batches

    def prepare(self, model: nn.Module) -> nn.Module:
        """Move ``model`` to the device, to channels_last where it helps, and enable TF32.

        channels_last converts the 4-D parameters and buffers; 5-D ones (``Conv3d``) keep
        their layout, where ``model.to(memory_format=torch.channels_last)`` would fail.
        Weights stay fp32 (autocast casts per op). TF32 is switched on process-wide (torch
        keeps it as global state) when ``tf32=True`` and the GPU has compute capability >= 8.0.
        The parameters are moved in place, so an optimizer built before still holds them
        (build it after, though: its state, if any, is not moved).

        Args:
            model: the module to train.

        Returns:
            The same module, moved in place.

        Raises:
            TypeError: ``model`` is not an ``nn.Module``.

        Warns:
            UserWarning: moving replaced parameters with new objects (torch's
                ``set_overwrite_module_params_on_conversion(True)``) that something else
                still holds: an optimizer built before ``prepare``, which would train nothing.

        Example:
            >>> mp = MixedPrecision("cpu", precision="fp32", channels_last=True)
            >>> model = mp.prepare(torch.nn.Conv2d(3, 8, 3))
            >>> model.weight.is_contiguous(memory_format=torch.channels_last)
            True
        """
        if not isinstance(model, nn.Module):
            raise TypeError(f"prepare() takes an nn.Module, got {type(model).__name__}")
        tf32_on, why_tf32 = tf32_decision(self.tf32, self._capability)
        tensor_cores = (self._capability or (0, 0)) >= (7, 0)
        use_cl, why_cl = channels_last_decision(
            model,
            self.channels_last,
            device=self.device,
            tensor_cores=tensor_cores and (self.dtype != torch.float32 or tf32_on),
        )
        move_model(model, self.device, channels_last=use_cl)
        if use_cl:
            self.uses_channels_last = True
        if tf32_on:
            enable_tf32()
            self.tf32_enabled = True
        self._prepare_reasons = [why_cl, why_tf32]
        self._models.add(model)
        return model

    def prepare_batch(self, batch: T) -> T:
        """Move ``batch`` to the device; 4-D float tensors go channels_last if a model did.

        One walk, as :func:`trainperf.to_device`'s (containers and Parameters keep their
        types); each 4-D image changes device and layout in one copy.

        Args:
            batch: a tensor or a nesting of containers holding tensors.

        Returns:
            The batch on the device.

        Example:
            >>> mp = MixedPrecision("cpu", precision="fp32", channels_last=True)
            >>> _ = mp.prepare(torch.nn.Conv2d(3, 8, 3))
            >>> x, y = mp.prepare_batch((torch.randn(2, 3, 8, 8), torch.tensor([0, 1])))
            >>> x.is_contiguous(memory_format=torch.channels_last), y.tolist()
            (True, [0, 1])
        """
        if self.uses_channels_last:
            return to_device_channels_last(batch, self.device)
        return to_device(batch, self.device, non_blocking=True)

    # ----------------------------------------------------------------- the training step

    def autocast(self) -> AutocastContext:
        """The context for the forward pass: autocast to bf16/fp16, or nothing for fp32.

        A context manager, and for every precision also a decorator (``@mp.autocast()``), as
        ``torch.autocast`` is.

        Example:
            >>> mp = MixedPrecision("cpu", precision="bf16")
            >>> with mp.autocast():
            ...     torch.nn.Linear(4, 2)(torch.randn(3, 4)).dtype
            torch.bfloat16
            >>> @MixedPrecision("cpu", precision="fp32").autocast()
            ... def forward(x):
            ...     return torch.nn.Linear(4, 2)(x)
            >>> forward(torch.randn(3, 4)).dtype
            torch.float32
        """
        if self.dtype == torch.float32:
            return NoAutocast()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def backward(
        self,
        loss: torch.Tensor,
        *,
        retain_graph: bool | None = None,
        create_graph: bool = False,
        inputs: torch.Tensor | Sequence[torch.Tensor] | None = None,
    ) -> None:
        """``loss.backward()``, through the loss scaler for fp16.

        With fp16, a backward that gives new gradients to an optimizer after
        ``mp.scaler.unscale_(optimizer)``, with no :meth:`step` or :meth:`zero_grad` in
        between (the gradients cleared with a plain ``optimizer.zero_grad()``, or
        accumulated onto), drops the scaler's record of that ``unscale_``, so that the next
        step unscales the new gradients instead of applying them 65536 times too large, and
        warns. The ``unscale_`` of an optimizer whose gradients it leaves as they are (one
        loss per optimizer) is kept.

        Args:
            loss: the scalar loss of the forward pass.
            retain_graph: keep the graph for another backward through it (two losses that
                share a forward); None means ``create_graph``. Keyword only, as the two below,
                and passed to ``loss.backward`` as they are.
            create_graph: build a graph of the backward, for higher-order gradients (a
                gradient penalty). With fp16 the gradients are those of the scaled loss, as
                with ``GradScaler``: divide them by ``mp.scaler.get_scale()`` before using them.
            inputs: accumulate gradients into these tensors only; None means every leaf.

        Raises:
            TypeError: ``loss`` is not a tensor.
            ValueError: ``loss`` has more than one element (reduce it: ``loss.mean()``), or
                does not require grad (computed under ``torch.no_grad()``, or detached);
                (fp16) this is an unpickled copy whose pickled loss scale is not a finite
                number > 0 (see :meth:`__setstate__`).

        Warns:
            UserWarning: (fp16) it came after an ``unscale_`` as above; the fix is
                ``mp.zero_grad(optimizer)`` to skip such a step, or ``unscale_`` after the
                last backward of an accumulation.

        Example:
            >>> mp = MixedPrecision("cpu", precision="fp32")
            >>> w = torch.ones(2, requires_grad=True)
            >>> h = w * 3
            >>> mp.backward(h.sum(), retain_graph=True)
            >>> mp.backward(h.sum())  # through h's graph again
            >>> w.grad.tolist()
            [6.0, 6.0]
        """
        _state.check_usable(self, "mp.backward(loss)")
        check_loss(loss)
        scaler = self.scaler
        scaled = scaler.scale(loss) if scaler is not None else loss
        unscaled = unscaled_grads(scaler) if scaler is not None else {}
        scaled.backward(  # type: ignore[no-untyped-call]
            retain_graph=retain_graph, create_graph=create_graph, inputs=inputs
        )
        _bookkeeping.after_backward(self, scaler, unscaled)

    def step(
        self,
        *optimizers: torch.optim.Optimizer,
        max_grad_norm: float | torch.Tensor | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        closure: Callable[[], Any] | None = None,
    ) -> bool:
        """Clip (after unscaling), then step; for fp16, skip the step on inf/NaN gradients.

        One :meth:`backward`, one ``step``: when one loss trains several optimizers (a
        backbone's and a head's), pass them all to one call, ``mp.step(opt_a, opt_b)``. The
        fp16 loss scale is then updated once, after every optimizer stepped (stepping them
        in separate calls would unscale the later ones with a changed scale). As in
        ``GradScaler``, each optimizer skips on inf/NaN in its own gradients.

        The fp16 loss scale is lowered after a skipped step and raised after a run of good
        ones. Only advance an LR scheduler when this returns True. For fp16, besides the
        synchronisation inside ``GradScaler.step`` (which reads the inf/NaN flag to decide; a
        fused optimizer skips on the device without it), this reads those flags back once
        more after the steps to say whether they stepped: at most two synchronisations per
        optimizer. bf16 and fp32 never skip and never synchronise here.

        A step that raises (an optimizer's own error) leaves ``mp`` as it was before it, fp16
        gradients scaled again included: catch the error, then call ``step`` again (a retry)
        or ``mp.zero_grad()`` and go on to the next ``backward`` (a skip). Optimizers of the
        same call that stepped before the error are refused by the retry; with fp16, one
        of them that skipped on inf/NaN still counts: the retry returns False and the loss
        scale is lowered.

        Args:
            *optimizers: the optimizers whose parameters got gradients from :meth:`backward`
                (one or more).
            max_grad_norm: clip each optimizer's total gradient norm (over its parameters)
                to this finite value > 0 (a NumPy scalar, a 0-dim tensor too); None does not
                clip. Keyword only. fp16 gradients are unscaled first, unless
                :meth:`unscale_` (or ``mp.scaler.unscale_``) already did (to read their norm).
            optimizer: one optimizer by keyword, as ``mp.step(optimizer=opt)`` (the
                signature before several could be passed).
            closure: for an optimizer that re-evaluates the loss in its step
                (``torch.optim.LBFGS``): a function that runs the forward under
                :meth:`autocast`, calls :meth:`backward` and returns the loss, passed on to
                ``optimizer.step(closure)``. No :meth:`backward` is needed before such a
                step. bf16 and fp32 only: ``GradScaler`` cannot step with a closure.

        Returns:
            True if every optimizer stepped, False if an fp16 step was skipped (an
            optimizer none of whose parameters got a gradient is stepped plainly and
            counts as stepped).

        Raises:
            RuntimeError: no :meth:`backward` since the last step or :meth:`zero_grad`
                (a second ``step`` after one backward says to pass all optimizers to one),
                ``mp.zero_grad(optimizer)`` cleared one of ``optimizers`` since it, or one
                already stepped on it before a step raised.
            TypeError: no optimizer given, or something that is not one (a clip value
                passed positionally: ``max_grad_norm`` is keyword-only); an optimizer that
                needs a closure (LBFGS) got none; ``closure`` is not callable.
            ValueError: ``max_grad_norm`` is not a positive number, an optimizer is given
                twice, (fp16) a gradient is fp16 itself: the model was cast to fp16
                (``model.half()``), where loss scaling needs fp32 parameters; (fp16) a
                gradient is complex, which the loss scaler cannot unscale (the error names
                the parameters: use bf16 or fp32, or keep them out of the optimizer); a
                closure (or an optimizer that needs one) with fp16, or with
                ``max_grad_norm``; (fp16)
                this is an unpickled copy whose pickled loss scale is not a finite number > 0
                (see :meth:`__setstate__`).

        Warns:
            UserWarning: (fp16) once, when this is the 20th step in a row skipped on
                inf/NaN gradients: lowering the loss scale did not help, so the loss itself
                is probably inf/NaN.

        Example:
            >>> mp = MixedPrecision("cpu", precision="fp32")
            >>> w = torch.nn.Parameter(torch.ones(2))
            >>> opt = torch.optim.SGD([w], lr=1.0)
            >>> mp.backward((w * 10).sum())
            >>> mp.step(opt, max_grad_norm=1.0), [round(v, 4) for v in w.tolist()]
            (True, [0.2929, 0.2929])
            >>> lbfgs = torch.optim.LBFGS([w])
            >>> def closure():
            ...     lbfgs.zero_grad()
            ...     loss = ((w - 3) ** 2).sum()
            ...     mp.backward(loss)
            ...     return loss
            >>> mp.step(lbfgs, closure=closure), [round(v, 4) for v in w.tolist()]
            (True, [3.0, 3.0])
        """
        _state.check_usable(self, "mp.step(optimizer)")
        if optimizer is not None:
            optimizers = (*optimizers, optimizer)
        scaler = self._enabled_scaler
        _bookkeeping.check_step_call(
            self, optimizers, max_grad_norm, closure, scaling=scaler is not None
        )
        return _bookkeeping.run_step(self, scaler, optimizers, max_grad_norm, closure)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ``optimizer``'s fp16 gradients by the loss scale now, to clip or log them
        before :meth:`step`; bf16 and fp32 gradients have no scale and stay as they are.

        For fp16 this is ``mp.scaler.unscale_(optimizer)``, which :meth:`step` does not
        repeat; unlike ``mp.scaler`` (None for bf16 and fp32) it works for every precision,
        so one loop runs under any. After the last :meth:`backward` of an accumulation.

        Args:
            optimizer: whose gradients to unscale.

        Raises:
            TypeError: ``optimizer`` is not an optimizer.
            RuntimeError: no :meth:`backward` since the last step or :meth:`zero_grad` (of
                this optimizer); (fp16) already unscaled since the last step.
            ValueError: (fp16) a gradient is fp16 itself (the model was cast with
                ``model.half()``) or complex, which the loss scaler cannot unscale.

        Example:
            >>> mp = MixedPrecision("cpu", precision="bf16")
            >>> w = torch.nn.Parameter(torch.ones(2))
            >>> opt = torch.optim.SGD([w], lr=0.1)
            >>> mp.backward((w * 3).sum())
            >>> mp.unscale_(opt)
            >>> round(float(torch.nn.utils.clip_grad_norm_([w], max_norm=1.0)), 2)
            4.24
            >>> mp.step(opt)
            True
        """
        _bookkeeping.unscale(self, self._enabled_scaler, optimizer)

    def zero_grad(
        self, optimizer: torch.optim.Optimizer | None = None, *, set_to_none: bool = True
    ) -> None:
        """Clear gradients: the optimizer's, or every model :meth:`prepare` has seen.

        ``mp.zero_grad(optimizer)`` between :meth:`backward` and :meth:`step` drops that
        backward for this optimizer only: the others can still be stepped (a GAN step that
        discards the discriminator's gradients from the generator's loss).
        ``mp.zero_grad()`` drops it for all. With fp16 it also drops the loss scaler's record
        of an ``mp.scaler.unscale_(optimizer)`` made since that backward, so that the next
        backward's gradients are unscaled in their turn.

        Args:
            optimizer: whose parameters to clear; None clears the prepared models'.
            set_to_none: set ``.grad`` to None (cheaper) instead of zero-filling it.

        Raises:
            RuntimeError: no optimizer was given and no model was prepared.
            TypeError: ``optimizer`` is not an optimizer (``set_to_none`` passed positionally,
                a list of optimizers), or ``set_to_none`` is not True or False.

        Example:
            >>> mp = MixedPrecision("cpu", precision="fp32")
            >>> model = mp.prepare(torch.nn.Linear(2, 1))
            >>> mp.backward(model(torch.ones(1, 2)).sum())
            >>> mp.zero_grad()
            >>> model.weight.grad is None
            True
        """
        flag("set_to_none", set_to_none)
        _bookkeeping.zero_grad(self, self._scaler, optimizer, self._models, set_to_none=set_to_none)

    # ----------------------------------------------------------------- checkpoints

    def __getstate__(self) -> dict[str, Any]:
        """What pickling keeps: all but the models :meth:`prepare` saw (held weakly) and a
        backward waiting for its step (see :func:`~trainperf.amp._state.pickled`)."""
        return _state.pickled(self.__dict__)

    def __setstate__(self, state: dict[str, Any]) -> None:
        """The copy knows no prepared model (its ``zero_grad()`` needs an optimizer) and is
        live, as a new instance is, for ``trainperf.watch()`` and ``tune_batch_size``.

        An fp16 loss scale that :meth:`load_state_dict` would refuse (0, from a run whose
        losses stayed inf/NaN; negative, inf, NaN, not a number) does not stop unpickling,
        so that a checkpoint holding the object still loads: the copy's :meth:`backward` and
        :meth:`step` raise a ``ValueError`` naming it and the fix (a new MixedPrecision, or a
        good scale loaded with :meth:`load_state_dict`), until such a scale is loaded.

        Example:
            >>> import pickle
            >>> mp = MixedPrecision("cpu", precision="fp16")
            >>> copy = pickle.loads(pickle.dumps(mp))
            >>> copy.state_dict() == mp.state_dict(), copy in LIVE
            (True, True)
        """
        _state.unpickled(self.__dict__, state)  # older pickles too: see there
        LIVE.add(self)

    def state_dict(self) -> dict[str, Any]:
        """The precision and the loss-scaler state (None without a scaler), for checkpoints.

        Plain Python values only, so ``load_checkpoint(..., weights_only=True)`` reads it.

        Example:
            >>> MixedPrecision("cpu", precision="fp32").state_dict()
            {'precision': 'fp32', 'scaler': None}
        """
        return _state.state_of(self)

    def load_state_dict(self, state: Mapping[str, Any], *, strict: bool = True) -> None:
        """Restore the loss scale of a resumed fp16 run.

        The precision is not restored: this instance keeps its own, so a run may resume on
        another GPU ("auto": bf16 on an A100, fp16 on a V100). A state without a loss scale
        (bf16, fp32) leaves an fp16 instance a fresh scale; an fp16 state's loss scale
        loaded into bf16 or fp32, which have no scaler, is refused unless ``strict=False``.

        Args:
            state: what :meth:`state_dict` returned.
            strict: raise when ``state`` holds a loss scale this instance has no scaler for
                (an fp16 run resumed as bf16 or fp32); False drops it.

        Raises:
            ValueError: ``state`` is not a MixedPrecision state dict (other keys, a
                precision other than "bf16", "fp16" or "fp32", a loss scale saved with a
                precision other than fp16), its loss scale lacks a key of
                ``GradScaler.state_dict()`` or (fp16) is not a finite number > 0 within
                float32's range, 3.4e38 (0, from a run whose losses stayed inf/NaN, would
                skip every step: load ``{**state, "scaler": None}`` to keep this one's
                scale), nothing loaded then, or (``strict``) it carries a loss scale that
                this precision cannot use; a loss-scaler setting no ``GradScaler`` can use
                (a ``backoff_factor`` outside (0, 1], a ``growth_factor`` < 1, not finite
                or past 5.19e33, a ``growth_interval`` < 1); while ``tune_batch_size``
                restores its state, a loss scale no float32 holds.
            TypeError: ``strict`` is not True or False.
            RuntimeError: (fp16) another loss scale than the one in use loaded between
                :meth:`backward` and :meth:`step`: the step would unscale the waiting
                gradients by it, not by the scale they were scaled with. Load before the
                backward or after the step, or drop the waiting gradients first with
                ``mp.zero_grad(optimizer)``: the load then ends that backward for every
                optimizer (step none on it; clear the others' gradients too).

        Example:
            >>> mp = MixedPrecision("cpu", precision="fp32")
            >>> mp.load_state_dict({"precision": "fp32", "scaler": None})
        """
        flag("strict", strict)
        _state.load_into(self, state, strict=strict)
