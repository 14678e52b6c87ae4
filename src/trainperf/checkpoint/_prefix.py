"""Wrapper layers and key prefixes: unwrapping models, stripping and fitting state dicts.

DataParallel and DDP add ``module.`` to every key, ``torch.compile`` adds ``_orig_mod.``; these
functions peel the wrappers off models and the prefixes off state dicts, in any nesting.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from trainperf._utils.serialize import result_dict
from trainperf.errors import StateDictMismatchError

DEFAULT_PREFIXES: tuple[str, ...] = ("module.", "_orig_mod.")
M = TypeVar("M", bound=Mapping[str, Any])
Mismatch = tuple[str, tuple[int, ...], tuple[int, ...]]


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


def _strip_key(
    key: str, prefixes: tuple[str, ...], rounds: int | None, meta: bool = False
) -> tuple[str, int]:
    done = 0
    while rounds is None or done < rounds:
        for p in prefixes:
            if key.startswith(p) and len(key) > len(p):
                key = key[len(p) :]
                done += 1
                break
            # `_metadata` keys are module paths without the trailing dot: "module" is the root.
            if meta and p.endswith(".") and key == p[:-1]:
                key = ""
                done += 1
                break
        else:
            break
    return key, done


def _same_type(template: Mapping[str, Any], items: Iterable[tuple[str, Any]]) -> Any:
    pairs = list(items)
    try:
        out: Any = type(template)()
        for k, v in pairs:
            out[k] = v
    except Exception:  # a read-only or oddly constructed Mapping: a plain dict will do
        out = dict(pairs)
    return out


def _strip(state_dict: M, prefixes: tuple[str, ...], rounds: int | None) -> M:
    origin: dict[str, str] = {}
    pairs = []
    for key, value in state_dict.items():
        new = _strip_key(key, prefixes, rounds)[0] if isinstance(key, str) else key
        if new in origin:
            raise ValueError(
                f"strip_prefix: keys {origin[new]!r} and {key!r} both become {new!r} after "
                f"removing {prefixes}; the state dict mixes wrapped and unwrapped copies of "
                "one parameter: keep one of them before loading"
            )
        origin[new] = key
        pairs.append((new, value))
    out: M = _same_type(state_dict, pairs)
    meta = getattr(state_dict, "_metadata", None)
    if meta is not None:
        # Wrappers add their own metadata entries; the innermost module's (most stripped) wins.
        depth: dict[str, int] = {}
        new_meta: dict[str, Any] = {}
        for key, value in dict(meta).items():
            new, done = _strip_key(key, prefixes, rounds, meta=True)
            if done >= depth.get(new, -1):
                depth[new], new_meta[new] = done, value
        with contextlib.suppress(AttributeError, TypeError):
            out._metadata = _same_type(meta, new_meta.items())  # type: ignore[attr-defined]
    return out


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
    """

    missing: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()
    mismatched: tuple[Mismatch, ...] = ()

    @property
    def complete(self) -> bool:
        """True when every key was loaded and nothing was left over."""
        return not (self.missing or self.unexpected or self.mismatched)

    def __str__(self) -> str:
        if self.complete:
            return "every key loaded"
        lines = []
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


def _names(names: list[str], limit: int = 10) -> str:
    shown = ", ".join(map(str, names[:limit]))
    return shown + (f", ...and {len(names) - limit} more" if len(names) > limit else "")


def _nested_hint(sd: Mapping[str, Any]) -> str | None:
    nested = [k for k, v in sd.items() if isinstance(v, Mapping)]
    if not nested:
        return None
    return (
        f"The state dict holds nested dicts under {_names(nested)}: it looks like a whole "
        f"checkpoint; pass checkpoint[{nested[0]!r}] instead."
    )


def _mismatch_message(model: nn.Module, sd: Mapping[str, Any], result: LoadResult) -> str:
    lines = [f"state dict does not fit {type(model).__name__}:"]
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
    hint = _nested_hint(sd)
    if hint:
        lines.append(f"  {hint}")
    lines.append(
        "  Check that the checkpoint was saved from this architecture with the same sizes, "
        "or pass strict=False to load only the keys that fit."
    )
    return "\n".join(lines)


def _shapes(result: LoadResult) -> str:
    return _names(
        [f"{k} checkpoint {tuple(a)} vs model {tuple(b)}" for k, a, b in result.mismatched]
    )


def _same_shape(a: Any, b: Any) -> bool:
    tensors = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
    if tensors and not (nn.parameter.is_lazy(a) or nn.parameter.is_lazy(b)):
        return bool(a.shape == b.shape)
    return True


def _common_prefix(longer: Mapping[str, Any], shorter: Mapping[str, Any]) -> tuple[str, int] | None:
    """The most common ``P.`` such that ``P.`` + a key of ``shorter`` is a key of ``longer``
    holding a value of the same shape, with how many keys it fits."""
    counts: dict[str, int] = {}
    for key, value in longer.items():
        parts = key.split(".") if isinstance(key, str) else []
        for i in range(1, len(parts)):
            rest = ".".join(parts[i:])
            if rest in shorter and _same_shape(value, shorter[rest]):
                prefix = ".".join(parts[:i]) + "."
                counts[prefix] = counts.get(prefix, 0) + 1
    return max(counts.items(), key=lambda item: item[1]) if counts else None


def _likely_fix(target: Mapping[str, Any], sd: Mapping[str, Any], result: LoadResult) -> str:
    if not sd:
        return "the state dict is empty: check what was saved under the key you loaded"
    if result.mismatched:
        return (
            f"{len(result.mismatched)} keys match by name, but every one has another shape: "
            f"{_shapes(result)}; build the model with the sizes the checkpoint was saved with"
        )
    hint = _nested_hint(sd)
    if hint:
        return hint
    extra = _common_prefix(sd, target)
    if extra:
        return (
            f"{extra[1]} of its keys fit once the prefix {extra[0]!r} is removed (the model "
            "was an attribute of a wrapper when it was saved, e.g. a LightningModule): "
            f"load_state_dict(model, strip_prefix(state_dict, {extra[0]!r}))"
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
) -> str:
    even = " (an error even with strict=False)" if not strict else ""
    return (
        f"state dict does not fit {type(model).__name__}: none of the state dict's {len(sd)} "
        f"keys fits any of the model's {len(target)}, so nothing would be loaded{even}.\n"
        f"  model keys: {_names(list(target), 3)}\n"
        f"  state-dict keys: {_names(list(sd), 3)}\n"
        f"  Likely fix: {_likely_fix(target, sd, result)}"
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
        stacklevel=3,
    )


def _fit_prefixes(state_dict: Mapping[str, Any], target: Mapping[str, Any]) -> Mapping[str, Any]:
    """``state_dict`` with as many prefix layers removed as makes most of its keys match."""
    # Candidates strip one more layer of prefixes each; the one matching most model keys wins,
    # so a model with a submodule that really is called "module" is not over-stripped.
    best, best_score = state_dict, sum(k in target for k in state_dict)
    candidate: Mapping[str, Any] = state_dict
    while True:
        try:
            nxt = _strip(candidate, DEFAULT_PREFIXES, 1)
        except ValueError:
            break
        if list(nxt) == list(candidate):
            break
        candidate = nxt
        score = sum(k in target for k in candidate)
        if score >= best_score:
            best, best_score = candidate, score
    return best


def _compare(best: Mapping[str, Any], target: Mapping[str, Any]) -> LoadResult:
    mismatched: list[Mismatch] = []
    for key, value in best.items():
        if key in target and not _same_shape(value, target[key]):
            mismatched.append((key, tuple(value.shape), tuple(target[key].shape)))
    return LoadResult(
        missing=tuple(k for k in target if k not in best),
        unexpected=tuple(k for k in best if k not in target),
        mismatched=tuple(mismatched),
    )


def load_state_dict(
    model: nn.Module, state_dict: Mapping[str, Any], *, strict: bool = True
) -> LoadResult:
    """Load ``state_dict`` into ``model``, whichever of them carries wrapper prefixes.

    The state dict's ``module.`` / ``_orig_mod.`` prefixes are removed as far as that makes
    its keys match, and it is loaded into ``unwrap_model(model)``, which shares parameters
    with every wrapper around it. Shapes are checked before anything is copied, so one error
    lists missing, unexpected and shape-mismatched keys together.

    A state dict of which no key fits the model (by name and shape, after removing the
    prefixes) is always an error, ``strict=False`` or not: loading nothing is never what was
    meant. The message shows a few keys of each and the likely fix (a whole checkpoint
    instead of its model entry, an extra prefix such as a LightningModule's ``model.``, a
    submodule's weights, other sizes).

    Args:
        model: A plain, DataParallel, DDP or ``torch.compile``-d module (any nesting).
        state_dict: Parameters and buffers, e.g. ``load_checkpoint(path)["model"]``.
        strict: If True, any difference raises and nothing is loaded. If False, the keys
            that fit are loaded, the rest are reported in the result, and a ``UserWarning``
            says how many keys were missing, unexpected or of another shape.

    Returns:
        A ``LoadResult``; with ``strict=True`` it is always complete.

    Raises:
        TypeError: ``state_dict`` is not a mapping.
        StateDictMismatchError: No key fits (whatever ``strict`` says), or ``strict=True``
            and keys or shapes differ; the model is unchanged.

    Example:
        >>> net = nn.Linear(2, 2)
        >>> load_state_dict(net, nn.DataParallel(nn.Linear(2, 2)).state_dict()).complete
        True
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            f"state_dict must be a mapping of names to tensors, got {type(state_dict).__name__}"
        )
    inner = unwrap_model(model)
    target = inner.state_dict()
    best = _fit_prefixes(state_dict, target)
    result = _compare(best, target)
    fits = len(target) - len(result.missing) - len(result.mismatched)
    if fits == 0 and (target or best):
        raise StateDictMismatchError(
            _nothing_fits_message(inner, target, best, result, strict),
            missing=list(result.missing),
            unexpected=list(result.unexpected),
            mismatched=list(result.mismatched),
        )
    if strict:
        if not result.complete:
            raise StateDictMismatchError(
                _mismatch_message(inner, best, result),
                missing=list(result.missing),
                unexpected=list(result.unexpected),
                mismatched=list(result.mismatched),
            )
        inner.load_state_dict(best, strict=True)
        return result
    result = _load_what_fits(inner, best, result)
    if not result.complete:
        _warn_partial(target, result)
    return result


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
    return LoadResult(tuple(missing), tuple(unexpected), found.mismatched)
