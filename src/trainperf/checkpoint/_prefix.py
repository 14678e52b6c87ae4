"""Wrapper layers and key prefixes: unwrapping models, stripping and fitting state dicts.

DataParallel and DDP add ``module.`` to every key, ``torch.compile`` adds ``_orig_mod.``; these
functions peel the wrappers off models and the prefixes off state dicts, in any nesting.
"""

from __future__ import annotations

import contextlib
import sys
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
    shown = ", ".join(names[:limit])
    return shown + (f", ...and {len(names) - limit} more" if len(names) > limit else "")


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
        shapes = [f"{k} checkpoint {tuple(a)} vs model {tuple(b)}" for k, a, b in result.mismatched]
        lines.append(f"  {len(shapes)} shape mismatch(es): {_names(shapes)}")
    nested = [k for k, v in sd.items() if isinstance(v, Mapping)]
    if nested:
        lines.append(
            f"  The state dict holds nested dicts under {_names(nested)}: it looks like a whole "
            f"checkpoint; pass checkpoint[{nested[0]!r}] instead."
        )
    lines.append(
        "  Check that the checkpoint was saved from this architecture with the same sizes, "
        "or pass strict=False to load only the keys that fit."
    )
    return "\n".join(lines)


def load_state_dict(
    model: nn.Module, state_dict: Mapping[str, Any], *, strict: bool = True
) -> LoadResult:
    """Load ``state_dict`` into ``model``, whichever of them carries wrapper prefixes.

    The state dict's ``module.`` / ``_orig_mod.`` prefixes are removed as far as that makes
    its keys match, and it is loaded into ``unwrap_model(model)``, which shares parameters
    with every wrapper around it. Shapes are checked before anything is copied, so one error
    lists missing, unexpected and shape-mismatched keys together.

    Args:
        model: A plain, DataParallel, DDP or ``torch.compile``-d module (any nesting).
        state_dict: Parameters and buffers, e.g. ``load_checkpoint(path)["model"]``.
        strict: If True, any difference raises and nothing is loaded. If False, the keys
            that fit are loaded and the rest are reported in the result.

    Returns:
        A ``LoadResult``; with ``strict=True`` it is always complete.

    Raises:
        TypeError: ``state_dict`` is not a mapping.
        StateDictMismatchError: ``strict=True`` and keys or shapes differ; the model is
            unchanged.

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
    unexpected = [k for k in best if k not in target]
    missing = [k for k in target if k not in best]
    mismatched: list[Mismatch] = []
    for key, value in best.items():
        want = target.get(key)
        if (
            isinstance(value, torch.Tensor)
            and isinstance(want, torch.Tensor)
            and not nn.parameter.is_lazy(want)
            and value.shape != want.shape
        ):
            mismatched.append((key, tuple(value.shape), tuple(want.shape)))
    result = LoadResult(tuple(missing), tuple(unexpected), tuple(mismatched))
    if strict:
        if not result.complete:
            raise StateDictMismatchError(
                _mismatch_message(inner, best, result),
                missing=missing,
                unexpected=unexpected,
                mismatched=mismatched,
            )
        inner.load_state_dict(best, strict=True)
        return result
    skip = set(unexpected) | {k for k, _, _ in mismatched}
    keep = _same_type(best, ((k, v) for k, v in best.items() if k not in skip))
    if hasattr(best, "_metadata"):
        keep._metadata = best._metadata
    torch_result = inner.load_state_dict(keep, strict=False)
    bad = {k for k, _, _ in mismatched}
    # torch's own list accounts for load hooks (e.g. BatchNorm filling in old checkpoints).
    missing = [k for k in torch_result.missing_keys if k not in bad]
    unexpected += [k for k in torch_result.unexpected_keys if k not in unexpected]
    return LoadResult(tuple(missing), tuple(unexpected), tuple(mismatched))
