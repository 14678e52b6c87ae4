"""Wrapper layers and key prefixes: unwrapping models, stripping and fitting state dicts.

DataParallel and DDP add ``module.`` to every key, ``torch.compile`` adds ``_orig_mod.``; these
functions peel the wrappers off models and the prefixes off state dicts, in any nesting.
"""

from __future__ import annotations

import functools
import sys
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from trainperf._utils.serialize import result_dict
from trainperf._utils.stack import user_stacklevel
from trainperf._utils.validate import choice
from trainperf.checkpoint._keys import (
    DEFAULT_PREFIXES,
    M,
    Mismatch,
    _common_prefix,
    _names,
    _same_shape,
    _same_type,
    _strip,
    fit_compile_layers,
    is_extra_state,
)
from trainperf.checkpoint._search import find_state_dict, nested_hint, under_prefix_code
from trainperf.errors import StateDictMismatchError


def unwrap_model(model: nn.Module) -> nn.Module:
    """Peel DataParallel, DistributedDataParallel and ``torch.compile`` layers off ``model``.

    Wrappers share their parameters with the module inside, so loading into the result
    loads into the wrapped model too.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.

    Example:
        >>> net = nn.Linear(2, 2)
        >>> unwrap_model(nn.DataParallel(net)) is net
        True
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"unwrap_model expects an nn.Module, got {type(model).__name__}")
    # OptimizedModule can only exist once torch._dynamo is imported; importing it here would
    # cost a second on every call.
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    optimized = getattr(eval_frame, "OptimizedModule", None)
    parallel = (nn.DataParallel, nn.parallel.DistributedDataParallel)
    while True:
        if isinstance(model, parallel):
            model = model.module
        elif optimized is not None and isinstance(model, optimized):
            model = model._orig_mod
        else:
            return model


def _check_prefixes(prefixes: str | Iterable[str]) -> tuple[str, ...]:
    result = (prefixes,) if isinstance(prefixes, str) else tuple(prefixes)
    if not result or any(not isinstance(p, str) or not p for p in result):
        raise ValueError(f"prefixes must be non-empty strings such as 'module.', got {prefixes!r}")
    return result


def strip_prefix(state_dict: M, prefixes: str | Iterable[str] = DEFAULT_PREFIXES) -> M:
    """Return a copy of ``state_dict`` with wrapper prefixes removed from the front of each key.

    Prefixes are removed repeatedly in any order, so ``module._orig_mod.fc.weight`` (DDP around
    a compiled model) and ``_orig_mod.module.fc.weight`` both become ``fc.weight``. The result
    has the input's mapping type (an ``OrderedDict`` stays one) and keeps torch's ``_metadata``
    attribute, with its keys stripped too.

    It is meant for wrapper layers, which put their prefix before every key: a given prefix
    is removed again from keys that repeat it, and keys without it are kept. To take one
    attribute's weights out of a wrapper's state dict (a LightningModule's ``self.model``,
    whose network may have a submodule called ``model`` too), select them instead:
    ``{k[6:]: v for k, v in sd.items() if k.startswith("model.")}``, or give
    ``load_state_dict`` the whole checkpoint, which does that itself.

    Args:
        state_dict: A mapping from parameter names to values.
        prefixes: Prefixes to remove; each must be non-empty.

    Returns:
        A new mapping; the input is not changed.

    Raises:
        ValueError: A prefix is empty, or two keys become the same key.

    Example:
        >>> strip_prefix({"module._orig_mod.fc.weight": 1, "step": 2})
        {'fc.weight': 1, 'step': 2}
    """
    return _strip(state_dict, _check_prefixes(prefixes), None)


@dataclass(frozen=True)
class LoadResult:
    """What ``load_state_dict`` left out.

    Attributes:
        missing: Model keys the state dict lacks (left at their current values).
        unexpected: State-dict keys the model has no place for (ignored).
        mismatched: ``(key, checkpoint_shape, model_shape)`` for keys whose shapes differ
            (not loaded).
        source: Where the loaded state dict was found when a whole checkpoint was given,
            e.g. ``"checkpoint['state_dict'] (prefix 'model.' removed)"``; ``""`` when the
            mapping given was the state dict itself.
    """

    missing: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()
    mismatched: tuple[Mismatch, ...] = ()
    source: str = ""

    @property
    def complete(self) -> bool:
        """True when every key was loaded and nothing was left over."""
        return not (self.missing or self.unexpected or self.mismatched)

    def __str__(self) -> str:
        lines = [f"loaded from {self.source}"] if self.source else []
        if self.complete:
            return "\n".join([*lines, "every key loaded"])
        if self.missing:
            lines.append(f"{len(self.missing)} missing: {_names(list(self.missing))}")
        if self.unexpected:
            lines.append(f"{len(self.unexpected)} unexpected: {_names(list(self.unexpected))}")
        for key, saved, wanted in self.mismatched:
            lines.append(f"shape mismatch: {key}: checkpoint {list(saved)}, model {list(wanted)}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-safe dict (shapes as lists), plus ``complete``."""
        return {**result_dict(self), "complete": self.complete}


_STRICT_FALSE = "pass strict=False"  # load_state_dict's way to load only the keys that fit


def _subject(result: LoadResult) -> str:
    return f"state dict {result.source}" if result.source else "state dict"


def _mismatch_message(
    model: nn.Module, result: LoadResult, hint: str | None, partial: str = _STRICT_FALSE
) -> str:
    """Why ``result`` is refused, and the fixes; ``partial`` says how to load only the keys
    that fit (the caller's own way: ``restore`` has no ``strict``)."""
    lines = [f"{_subject(result)} does not fit {type(model).__name__}:"]
    if result.missing:
        n = len(result.missing)
        lines.append(f"  {n} missing key(s) (in the model, not the state dict): ")
        lines[-1] += _names(list(result.missing))
    if result.unexpected:
        n = len(result.unexpected)
        lines.append(f"  {n} unexpected key(s) (in the state dict, not the model): ")
        lines[-1] += _names(list(result.unexpected))
    if result.mismatched:
        lines.append(f"  {len(result.mismatched)} shape mismatch(es): {_shapes(result)}")
    if hint:
        lines.append(f"  {hint[0].upper()}{hint[1:]}.")
    if "n_averaged" in result.unexpected:
        lines.append(
            "  n_averaged is the update counter of torch.optim.swa_utils.AveragedModel: load "
            f"into AveragedModel(model) as it was saved, or {partial} to load the averaged "
            "network alone."
        )
    lines.append(
        "  Check that the checkpoint was saved from this architecture with the same sizes, "
        f"or {partial} to load only the keys that fit."
    )
    return "\n".join(lines)


def _shapes(result: LoadResult) -> str:
    return _names(
        [f"{k} checkpoint {tuple(a)} vs model {tuple(b)}" for k, a, b in result.mismatched]
    )


def _likely_fix(
    target: Mapping[str, Any], sd: Mapping[str, Any], result: LoadResult, hint: str | None
) -> str:
    if not sd:
        return "the state dict is empty: check what was saved under the key you loaded"
    if result.mismatched:
        return (
            f"{len(result.mismatched)} keys match by name, but every one has another shape: "
            f"{_shapes(result)}; build the model with the sizes the checkpoint was saved with"
        )
    if hint:
        return hint
    extra = _common_prefix(sd, target)
    if extra:
        return (
            f"{extra[1]} of its keys fit once the prefix {extra[0]!r} is removed (the model "
            "was an attribute of a wrapper when it was saved, e.g. a LightningModule): "
            f"load_state_dict(model, {under_prefix_code('state_dict', extra[0])})"
        )
    inner = _common_prefix(target, sd)
    if inner:
        name = inner[0][:-1]
        return (
            f"it holds the weights of the submodule {name!r} only ({inner[1]} of its keys fit "
            f"there): load_state_dict(model.get_submodule({name!r}), state_dict)"
        )
    return (
        "it was saved from another architecture: build the model class (and sizes) the "
        "checkpoint was saved from"
    )


def _nothing_fits_message(
    model: nn.Module,
    target: Mapping[str, Any],
    sd: Mapping[str, Any],
    result: LoadResult,
    strict: bool,
    hint: str | None,
) -> str:
    even = " (an error even with strict=False)" if not strict else ""
    return (
        f"{_subject(result)} does not fit {type(model).__name__}: none of the state dict's "
        f"{len(sd)} "
        f"keys fits any of the model's {len(target)}, so nothing would be loaded{even}.\n"
        f"  model keys: {_names(list(target), 3)}\n"
        f"  state-dict keys: {_names(list(sd), 3)}\n"
        f"  Likely fix: {_likely_fix(target, sd, result, hint)}"
    )


def _warn_partial(target: Mapping[str, Any], result: LoadResult) -> None:
    loaded = len(target) - len(result.missing) - len(result.mismatched)
    parts = [
        f"{len(names)} {kind} ({_names(list(names), 3)})"
        for kind, names in (
            ("missing", result.missing),
            ("unexpected", result.unexpected),
            ("with another shape", [k for k, _, _ in result.mismatched]),
        )
        if names
    ]
    warnings.warn(
        f"load_state_dict(strict=False) loaded {loaded} of {len(target)} model keys: "
        f"{', '.join(parts)}; the returned LoadResult lists them all (missing keys keep their "
        "current values)",
        UserWarning,
        stacklevel=user_stacklevel(),
    )


def _filled_in(key: str, best: Mapping[str, Any]) -> bool:
    """A key torch's own loading fills in when the state dict lacks it: BatchNorm's
    ``num_batches_tracked`` in a state dict without version metadata (saved before torch
    0.4.1, or built by hand)."""
    module, _, name = key.rpartition(".")
    stats = f"{module}.running_mean" if module else "running_mean"
    return name == "num_batches_tracked" and stats in best and not hasattr(best, "_metadata")


def _compare(best: Mapping[str, Any], target: Mapping[str, Any], source: str = "") -> LoadResult:
    mismatched: list[Mismatch] = []
    for key, value in best.items():
        if key in target and not _same_shape(value, target[key]):
            mismatched.append((key, tuple(value.shape), tuple(target[key].shape)))
    return LoadResult(
        missing=tuple(k for k in target if k not in best and not _filled_in(k, best)),
        unexpected=tuple(k for k in best if k not in target),
        mismatched=tuple(mismatched),
        source=source,
    )


def load_state_dict(
    model: nn.Module, state_dict: Mapping[str, Any], *, strict: bool = True, ema: bool = False
) -> LoadResult:
    """Load ``state_dict`` into ``model``, whichever of them carries wrapper prefixes.

    The state dict's ``module.`` / ``_orig_mod.`` prefixes are removed as far as that makes
    its keys match, and it is loaded into ``unwrap_model(model)``, which shares parameters
    with every wrapper around it. Shapes are checked before anything is copied, so one error
    lists missing, unexpected and shape-mismatched keys together.

    A whole checkpoint (a mapping holding dicts) is searched for the model's weights: the
    mapping and every dict in it, two levels deep, are matched against the model by key and
    shape, also with an extra prefix removed (a LightningModule's ``model.``, whose other
    attributes' keys are then left out), and the one where most model keys fit is loaded:
    timm's ``state_dict``, Lightning's ``state_dict``, Fabric's or a script's ``model``.
    Dicts named like an EMA copy (``state_dict_ema``, ``model_ema``, ``ema``) are used only,
    and then exclusively, with ``ema=True``. ``LoadResult.source`` says which part was
    loaded. Two parts that fit equally well are an error naming both, unless they hold the
    very same tensors (``{"model": sd, "state_dict": sd}``): then the first is loaded.

    A state dict of which no key fits the model (by name and shape, after removing the
    prefixes) is always an error, ``strict=False`` or not: loading nothing is never what was
    meant. The message shows a few keys of each and the likely fix (an extra prefix such as
    a LightningModule's ``model.``, a submodule's weights, other sizes).

    Args:
        model: A plain, DataParallel, DDP or ``torch.compile``-d module (any nesting).
        state_dict: Parameters and buffers, e.g. ``load_checkpoint(path)["model"]``, or the
            whole checkpoint.
        strict: If True, any difference raises and nothing is loaded. If False, the keys
            that fit are loaded, the rest are reported in the result, and a ``UserWarning``
            says how many keys were missing, unexpected or of another shape.
        ema: Load the EMA copy of a whole checkpoint (timm's ``state_dict_ema``) instead of
            the regular weights.

    Returns:
        A ``LoadResult``; with ``strict=True`` it is always complete.

    Raises:
        TypeError: ``state_dict`` is not a mapping.
        ValueError: ``strict`` or ``ema`` is not True or False (``None`` or ``"false"``
            would otherwise read as the other setting); nothing is loaded.
        StateDictMismatchError: No key fits (whatever ``strict`` says), ``strict=True`` and
            keys or shapes differ, two parts of a checkpoint fit equally well, or ``ema=True``
            and no EMA copy fits; the model is unchanged.

    Example:
        >>> net = nn.Linear(2, 2)
        >>> load_state_dict(net, nn.DataParallel(nn.Linear(2, 2)).state_dict()).complete
        True
        >>> ckpt = {"model": nn.Linear(2, 2).state_dict(), "optimizer": {}, "epoch": 3}
        >>> load_state_dict(net, ckpt).source
        "checkpoint['model']"
    """
    # Checked, not read as truthy: strict=None would load part of the state dict quietly,
    # and strict="false" would be strict.
    choice("strict", strict, (True, False))
    choice("ema", ema, (False, True))
    inner, target, best, result = _plan(model, state_dict, strict, ema)
    if strict:
        inner.load_state_dict(best, strict=True)
        return result
    result = _load_what_fits(inner, best, result)
    if not result.complete:
        _warn_partial(target, result)
    return result


def check_state_dict(model: nn.Module, state_dict: Any, partial: str = _STRICT_FALSE) -> None:
    """Raise what ``load_state_dict(model, state_dict)`` (strict) would raise before it
    loads anything, and change nothing: so a caller loading several objects can check them
    all first. ``partial`` is the caller's way to load only the keys that fit, which the
    message suggests (``"pass strict=False"``: ``load_state_dict``'s).

    Raises:
        TypeError: ``state_dict`` is not a mapping.
        StateDictMismatchError: it does not fit ``model``.
    """
    _plan(model, state_dict, True, False, partial)


def _plan(
    model: nn.Module, state_dict: Any, strict: bool, ema: bool, partial: str = _STRICT_FALSE
) -> tuple[nn.Module, Mapping[str, Any], Mapping[str, Any], LoadResult]:
    """The module to load into, its own state dict, what to load and how it fits; raises
    when it must not be loaded (nothing is changed)."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            f"state_dict must be a mapping of names to tensors, got {type(state_dict).__name__}"
        )
    inner = unwrap_model(model)
    target = inner.state_dict()
    found = find_state_dict(state_dict, target, ema)
    best = fit_compile_layers(found.state_dict, target)
    result = _compare(best, target, found.describe())
    hint = None if found.where else nested_hint(state_dict, target)
    fits = sum(k in best for k in target) - len(result.mismatched)
    if (fits == 0 and (target or best)) or (strict and not result.complete):
        raise StateDictMismatchError(
            _nothing_fits_message(inner, target, best, result, strict, hint)
            if fits == 0
            else _mismatch_message(inner, result, hint, partial),
            missing=list(result.missing),
            unexpected=list(result.unexpected),
            mismatched=list(result.mismatched),
        )
    _refuse_no_data(best, target, partial)
    return inner, target, best, result


def _no_data(value: Any, model_value: Any) -> str | None:
    """Why ``value`` cannot be copied into the model's tensor ``model_value``, or None.

    Checks what torch's ``copy_`` refuses: another layout (sparse into dense), a quantized
    value into a float tensor, a dtype it has no copy for; quantized models (whose modules
    load their own way) are left to torch.
    """
    if not isinstance(model_value, torch.Tensor):
        return None  # a module's extra state (get_extra_state) is any object
    if not isinstance(value, torch.Tensor):
        return f"a {type(value).__name__}, not a tensor"
    if value.is_meta and not model_value.is_meta:
        return "a meta tensor, which holds no data (saved before the weights were materialised)"
    if model_value.is_quantized:
        return None
    if value.is_nested and not model_value.is_nested:
        return "a nested tensor (a list of tensors of different shapes), not one tensor"
    if value.layout != model_value.layout:
        kind = "sparse" if "sparse" in str(value.layout) else "non-dense"
        return (
            f"a {kind} tensor (layout {value.layout}) but the model's is {model_value.layout}:"
            " convert it with .to_dense() first"
            if value.layout != torch.strided
            else f"a dense tensor but the model's has layout {model_value.layout}"
        )
    if value.is_quantized:
        return (
            f"a quantized tensor ({value.dtype}) but the model's is {model_value.dtype}: "
            "convert it with .dequantize() first, or load it into the quantized model"
        )
    if not _copies(value.dtype, model_value.dtype):
        return f"of dtype {value.dtype}, which torch cannot copy into {model_value.dtype}"
    return None


@functools.cache
def _copies(source: torch.dtype, target: torch.dtype) -> bool:
    """Whether torch can copy a tensor of dtype ``source`` into one of ``target``: tried on
    one element, once per pair (bit dtypes, for one, have no copy at all)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # complex into real warns: torch's load will too
            torch.empty(1, dtype=target).copy_(torch.empty(1, dtype=source))
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return True


def _refuse_no_data(
    best: Mapping[str, Any], target: Mapping[str, Any], partial: str = _STRICT_FALSE
) -> None:
    """Before anything is copied: values that cannot be (torch would raise half-way, leaving
    the model partly loaded); ``partial`` is the caller's way to load only some keys."""
    bad = [
        (k, why)
        for k, v in best.items()
        if k in target
        and not is_extra_state(k)  # set_extra_state takes any object
        and (why := _no_data(v, target[k]))
    ]
    if bad:
        listed = "; ".join(f"{k!r}: {why}" for k, why in bad[:5])
        more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
        raise StateDictMismatchError(
            f"the state dict holds {len(bad)} value(s) that cannot be loaded into the model: "
            f"{listed}{more}; nothing was loaded. Save the checkpoint again from a model with "
            f"real weights, or drop those keys and {partial}",
            missing=[],
            unexpected=[],
            mismatched=[],
        )


def _load_what_fits(inner: nn.Module, best: Mapping[str, Any], found: LoadResult) -> LoadResult:
    bad = {k for k, _, _ in found.mismatched}
    skip = set(found.unexpected) | bad
    keep = _same_type(best, ((k, v) for k, v in best.items() if k not in skip))
    if hasattr(best, "_metadata"):
        keep._metadata = best._metadata
    torch_result = inner.load_state_dict(keep, strict=False)
    # torch's own list accounts for load hooks (e.g. BatchNorm filling in old checkpoints).
    missing = [k for k in torch_result.missing_keys if k not in bad]
    unexpected = list(found.unexpected)
    unexpected += [k for k in torch_result.unexpected_keys if k not in unexpected]
    return LoadResult(tuple(missing), tuple(unexpected), found.mismatched, found.source)
