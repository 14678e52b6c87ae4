"""Moving a model for :meth:`trainperf.MixedPrecision.prepare`, and saying when that left an
optimizer built before it with parameters the model no longer has.

torch moves and converts a module's parameters in place (``param.data = new``), so an
optimizer built before ``prepare`` still holds the model's parameters. It builds new
``Parameter`` objects instead under
``torch.__future__.set_overwrite_module_params_on_conversion(True)``, and for a parameter
whose new tensor cannot share its type (a tensor subclass, some backends): an optimizer
built before then steps the old ones, which get no gradient, and nothing trains, without an
error (``mp.step`` returns True).
"""

from __future__ import annotations

import warnings
import weakref

import torch
from torch import nn

from trainperf.amp._channels_last import model_to_channels_last

__all__ = ["move_model"]


def move_model(model: nn.Module, device: torch.device, *, channels_last: bool) -> None:
    """Move ``model`` to ``device`` (and its 4-D tensors to channels_last), in place.

    Warns (``UserWarning``) when that replaced parameters that something else still holds:
    an optimizer built before ``prepare``. Only weak references to the old parameters are
    kept while moving, so that one nothing else holds is freed as it is replaced (a device's
    memory is not held twice), and a replaced parameter still alive after is held elsewhere.
    """
    before = [(id(p), weakref.ref(p)) for p in model.parameters()]
    model.to(device)
    if channels_last:
        model_to_channels_last(model)  # 5-D weights (Conv3d) keep their layout
    now = {id(p) for p in model.parameters()}
    held = sum(1 for key, ref in before if ref() is not None and key not in now)
    if held:
        # stacklevel: the caller of mp.prepare.
        warnings.warn(_replaced_message(held, len(before)), UserWarning, stacklevel=3)


def _replaced_message(held: int, total: int) -> str:
    return (
        f"prepare() replaced {held} of the model's parameters (of {total}) with new Parameter "
        "objects (torch.__future__.set_overwrite_module_params_on_conversion(True) is in effect, "
        "or a parameter type cannot be converted in place), and the old ones are still held "
        "elsewhere: an optimizer built before prepare() steps those, which get no gradient, "
        "and trains nothing; build the optimizer from model.parameters() after "
        "mp.prepare(model)"
    )
