"""Finding the model's state dict inside a whole checkpoint, by matching keys and shapes.

Tools save the weights under their own names: timm under ``state_dict`` (and an EMA copy
under ``state_dict_ema``), Lightning's ``Trainer`` under ``state_dict`` with the
LightningModule's attribute name in front of every key (``model.0.weight``), Fabric and most
scripts under ``model``. Rather than a list of names, every dict inside the checkpoint (two
levels deep) is tried, and the one where most of the model's keys fit by name and shape wins.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from trainperf.checkpoint._keys import _fit_prefixes, _names, _same_shape, _same_type, _strip
from trainperf.errors import StateDictMismatchError

# A path component that names an exponential moving average copy: state_dict_ema (timm),
# model_ema, ema_state_dict, ema (many scripts).
_EMA = re.compile(r"(?:^|_)ema(?:_|$)", re.IGNORECASE)
_DEPTH = 2


@dataclass(frozen=True)
class Found:
    """A candidate: where it is, the state dict ready to compare, how many model keys fit."""

    where: tuple[str, ...]
    prefix: str
    state_dict: Mapping[str, Any]
    fits: int

    @property
    def ema(self) -> bool:
        """Named like an EMA copy: a dict (``state_dict_ema``) or an attribute prefix
        (``model_ema.module.``, a LightningModule's EMA attribute)."""
        parts = (*self.where, *self.prefix.split("."))
        return any(_EMA.search(str(part)) for part in parts)

    def path(self) -> str:
        """``checkpoint['state_dict']``; ``state_dict`` for the mapping itself."""
        if not self.where:
            return "state_dict"
        return "checkpoint" + "".join(f"[{part!r}]" for part in self.where)

    def describe(self) -> str:
        """``checkpoint['state_dict'] (prefix 'model.' removed)``; '' for the mapping itself."""
        if not self.where:
            return ""
        return self.path() + (f" (prefix {self.prefix!r} removed)" if self.prefix else "")


def _count_fits(sd: Mapping[str, Any], target: Mapping[str, Any]) -> int:
    return sum(1 for k, v in sd.items() if k in target and _same_shape(v, target[k]))


def _nested(mapping: Mapping[str, Any], where: tuple[str, ...] = ()) -> Iterator[Found]:
    """Every mapping inside ``mapping`` that holds a tensor, up to ``_DEPTH`` levels down
    (``fits`` still 0)."""
    for key, value in mapping.items():
        if not isinstance(value, Mapping) or key == "_metadata":
            continue
        path = (*where, str(key))
        if any(isinstance(v, torch.Tensor) for v in value.values()):
            yield Found(path, "", value, 0)
        if len(path) < _DEPTH:
            yield from _nested(value, path)


def under_prefix_code(expr: str, prefix: str) -> str:
    """Python code for the keys of the state dict ``expr`` under ``prefix``, without it.

    What a message suggests for one attribute's weights (a LightningModule's ``self.model``):
    ``strip_prefix(expr, prefix)`` would not do, as it keeps the other attributes' keys and
    strips the prefix again from keys that repeat it (``model.model.0.weight``).

    Example:
        >>> code = under_prefix_code("sd", "model.")
        >>> code
        "{k[6:]: v for k, v in sd.items() if k.startswith('model.')}"
        >>> eval(code, {"sd": {"model.model.w": 1, "loss.w": 2}})
        {'model.w': 1}
    """
    return f"{{k[{len(prefix)}:]: v for k, v in {expr}.items() if k.startswith({prefix!r})}}"


def _under_prefix(sd: Mapping[str, Any], prefix: str) -> Mapping[str, Any]:
    """The keys of ``sd`` that start with ``prefix``, without it: one attribute's weights
    (a LightningModule's ``self.model``); the other attributes' keys are left out."""
    inside = _same_type(sd, ((k, v) for k, v in sd.items() if k.startswith(prefix)))
    meta = getattr(sd, "_metadata", None)
    if meta is not None:
        inside._metadata = meta
    result: Mapping[str, Any] = _strip(inside, (prefix,), 1)
    return result


def _extra_prefixes(sd: Mapping[str, Any], target: Mapping[str, Any]) -> dict[str, int]:
    """``P.`` -> how many model keys fit as ``P.`` + key (name and shape)."""
    counts: dict[str, int] = {}
    for key, value in sd.items():
        parts = key.split(".") if isinstance(key, str) else []
        for i in range(1, len(parts)):
            rest = ".".join(parts[i:])
            if rest in target and _same_shape(value, target[rest]):
                prefix = ".".join(parts[:i]) + "."
                counts[prefix] = counts.get(prefix, 0) + 1
    return counts


def _variants(cand: Found, target: Mapping[str, Any]) -> list[Found]:
    """The candidate with wrapper prefixes removed, or, where more keys fit that way, with
    each best-fitting extra prefix (``model.``) removed: two equal ones stay ambiguous."""
    plain = _fit_prefixes(cand.state_dict, target)
    fits = _count_fits(plain, target)
    counts = _extra_prefixes(plain, target)
    top = max(counts.values(), default=0)
    if top <= fits:
        return [Found(cand.where, "", plain, fits)]
    return [Found(cand.where, p, _under_prefix(plain, p), n) for p, n in counts.items() if n == top]


def _candidates(mapping: Mapping[str, Any], target: Mapping[str, Any]) -> list[Found]:
    found = [Found((), "", _fit_prefixes(mapping, target), 0)]
    found[0] = Found((), "", found[0].state_dict, _count_fits(found[0].state_dict, target))
    for cand in _nested(mapping):
        found += _variants(cand, target)
    return [f for f in found if f.fits > 0]


def _choices(found: list[Found]) -> str:
    return "; ".join(f"{f.describe() or 'the mapping itself'} ({f.fits} keys fit)" for f in found)


def _same_tensor(a: Any, b: Any) -> bool:
    """One object, or two views of the same memory (``v.detach()``); equal values in other
    memory are two copies, which may well differ elsewhere (two models of one init)."""
    if a is b:
        return True
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.is_meta:
        return False
    view = (a.dtype, a.device, a.shape, a.stride(), a.storage_offset())
    same_view = view == (b.dtype, b.device, b.shape, b.stride(), b.storage_offset())
    return same_view and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _same_weights(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Loading either gives the model the same weights: the same dict saved under two names
    (``{"model": sd, "state_dict": sd}``), or equal keys holding the very same tensors."""
    return a is b or (list(a) == list(b) and all(_same_tensor(a[k], b[k]) for k in a))


def _distinct(found: list[Found]) -> list[Found]:
    """``found`` without candidates that hold the same weights as an earlier one."""
    kept: list[Found] = []
    for f in found:
        if not any(_same_weights(f.state_dict, k.state_dict) for k in kept):
            kept.append(f)
    return kept


def _ambiguous(best: list[Found], n_target: int, ema_hint: bool) -> StateDictMismatchError:
    names = ", ".join(f"{f.describe() or 'the mapping itself'}" for f in best)
    first = best[0]
    pick = (
        f"load_state_dict(model, {under_prefix_code(first.path(), first.prefix)})"
        if first.prefix
        else f"load_state_dict(model, {first.path()})"
    )
    return StateDictMismatchError(
        f"{len(best)} parts of the checkpoint fit the model equally well ({best[0].fits} of its "
        f"{n_target} keys each): {names}; pass the one you mean, e.g. {pick}"
        + (", or ema=True for the EMA copy" if ema_hint else ""),
        missing=[],
        unexpected=[],
        mismatched=[],
    )


def find_state_dict(mapping: Mapping[str, Any], target: Mapping[str, Any], ema: bool) -> Found:
    """The part of ``mapping`` that fits ``target`` (a model's state dict) best.

    A mapping without nested dicts is a state dict: it is used as given (wrapper prefixes
    removed). Otherwise the mapping and every dict inside it compete; dicts named like an
    EMA copy take part only with ``ema=True`` (and then only they do). When nothing fits,
    the mapping itself is returned, for the caller's error to explain.

    Raises:
        StateDictMismatchError: Two candidates with different weights fit equally well (the
            same weights under two names are one candidate, the first), or ``ema=True`` and
            no EMA copy fits.
    """
    nested = any(isinstance(v, Mapping) for k, v in mapping.items() if k != "_metadata")
    if not nested and not ema:
        return Found((), "", _fit_prefixes(mapping, target), 0)
    found = _candidates(mapping, target)
    pool = [f for f in found if f.ema == ema]
    if ema and not pool:
        fit = f" (these fit: {_choices(found)})" if found else ""
        raise StateDictMismatchError(
            "ema=True, but the checkpoint holds no EMA copy that fits the model (a dict "
            f"named like state_dict_ema, model_ema or ema){fit}; pass ema=False to load the "
            "regular weights",
            missing=[],
            unexpected=[],
            mismatched=[],
        )
    top = max((f.fits for f in pool), default=0)
    best = _distinct([f for f in pool if f.fits == top])
    if len(best) > 1:
        raise _ambiguous(best, len(target), not ema and any(f.ema for f in found))
    return best[0] if best else Found((), "", _fit_prefixes(mapping, target), 0)


def nested_hint(mapping: Mapping[str, Any], target: Mapping[str, Any]) -> str | None:
    """What the search found when nothing was chosen: only EMA copies fit, or the mapping is
    a whole checkpoint none of whose dicts fits. None for a mapping without nested dicts."""
    nested = [str(k) for k, v in mapping.items() if isinstance(v, Mapping) and k != "_metadata"]
    if not nested:
        return None
    ema = [f for f in _candidates(mapping, target) if f.ema]
    if ema:
        return (
            f"only an EMA copy fits the model ({_choices(ema)}): pass ema=True to load it, "
            "if the moving-average weights are the ones you want"
        )
    return (
        f"it looks like a whole checkpoint (dicts under {_names(nested)}), but no dict in it "
        "fits the model by key and shape: check that the checkpoint was saved from this "
        "architecture, and which entry holds its weights"
    )
