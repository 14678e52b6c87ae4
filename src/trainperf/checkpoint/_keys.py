"""State-dict keys: removing prefix layers and matching keys and shapes against a model's.

The helpers behind :mod:`._prefix` (``strip_prefix``, ``load_state_dict``), :mod:`._search`
(finding the model's state dict inside a whole checkpoint) and :mod:`._files`
(``strip_wrapper_layers``: what ``save_checkpoint`` removes from a state dict).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

import torch
from torch import nn

DEFAULT_PREFIXES: tuple[str, ...] = ("module.", "_orig_mod.")
M = TypeVar("M", bound=Mapping[str, Any])
Mismatch = tuple[str, tuple[int, ...], tuple[int, ...]]


def is_extra_state(key: object) -> bool:
    """A module's extra state (``get_extra_state``): ``_extra_state`` or ``<module>._extra_state``,
    which may hold any object; ``pos_extra_state`` is an ordinary parameter or buffer.

    Example:
        >>> [is_extra_state(k) for k in ("_extra_state", "fc._extra_state", "pos_extra_state")]
        [True, True, False]
    """
    return isinstance(key, str) and (key == "_extra_state" or key.endswith("._extra_state"))


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


def strip_wrapper_layers(state_dict: M) -> M:
    """``state_dict`` without the prefix layers that a wrapper puts before *every* key.

    DataParallel, DDP and ``torch.compile`` own no parameters or buffers of their own, so
    their state dicts carry ``module.`` / ``_orig_mod.`` before every key; such a layer is
    removed (repeatedly: DDP around a compiled model). A state dict where some key lacks
    the prefix came from a module with a real submodule of that name
    (``torch.optim.swa_utils.AveragedModel``: ``module.*`` and its own ``n_averaged``) and
    keeps its keys.

    Example:
        >>> strip_wrapper_layers({"module._orig_mod.w": 1, "module._orig_mod.b": 2})
        {'w': 1, 'b': 2}
        >>> strip_wrapper_layers({"n_averaged": 0, "module.w": 1})
        {'n_averaged': 0, 'module.w': 1}
    """
    out = state_dict
    while out:
        keys = list(out)
        layer = next(
            (
                p
                for p in DEFAULT_PREFIXES
                if all(isinstance(k, str) and k.startswith(p) and len(k) > len(p) for k in keys)
            ),
            None,
        )
        if layer is None:
            break
        out = _strip(out, (layer,), 1)
    return drop_compile_layers(out)


_COMPILED = "_orig_mod"  # torch.compile's OptimizedModule keeps the module it wraps here


def _uncompiled(key: str) -> str:
    """``key`` without ``_orig_mod`` path components (a compiled submodule's layer)."""
    parts = key.split(".")
    return ".".join(p for p in parts if p != _COMPILED) if _COMPILED in parts else key


def drop_compile_layers(state_dict: M) -> M:
    """``state_dict`` without the ``_orig_mod.`` layers of compiled *submodules* (``model.
    encoder = torch.compile(model.encoder)`` saves ``encoder._orig_mod.weight``), so the file
    loads into the model compiled or not. No module has a submodule of that name but
    ``torch.compile``'s wrapper.

    Example:
        >>> drop_compile_layers({"encoder._orig_mod.w": 1, "head.w": 2})
        {'encoder.w': 1, 'head.w': 2}
    """
    if not any(isinstance(k, str) and _COMPILED in k.split(".") for k in state_dict):
        return state_dict
    return _renamed(state_dict, {k: _uncompiled(k) for k in state_dict if isinstance(k, str)})


def fit_compile_layers(state_dict: M, target: Mapping[str, Any]) -> M:
    """``state_dict``'s keys renamed to ``target``'s where the two differ only by compiled
    submodules' ``_orig_mod.`` layers (either side), each to exactly one target key."""
    by_plain: dict[str, list[str]] = {}
    for k in target:
        by_plain.setdefault(_uncompiled(k), []).append(k)
    renames: dict[str, str] = {}
    for k in state_dict:
        if isinstance(k, str) and k not in target:
            hits = by_plain.get(_uncompiled(k), [])
            if len(hits) == 1 and hits[0] not in state_dict:
                renames[k] = hits[0]
    if not renames or len(set(renames.values())) != len(renames):
        return state_dict
    return _renamed(state_dict, renames, getattr(target, "_metadata", None))


def _renamed(state_dict: M, renames: Mapping[str, str], target_meta: Any = None) -> M:
    """``state_dict`` with keys renamed (its ``_metadata`` module paths too: to the target's
    where given, else without compile layers).

    Raises:
        ValueError: two keys become one.
    """
    origin: dict[Any, Any] = {}
    for key in state_dict:
        new = renames.get(key, key)
        if new in origin:
            raise ValueError(
                f"keys {origin[new]!r} and {key!r} both become {new!r} without the compiled "
                "submodule's _orig_mod. layer: the state dict mixes compiled and plain copies "
                "of one module; keep one of them"
            )
        origin[new] = key
    out: M = _same_type(state_dict, ((renames.get(k, k), v) for k, v in state_dict.items()))
    meta = getattr(state_dict, "_metadata", None)
    if meta is not None:
        paths = {_uncompiled(m): m for m in (target_meta or {})}
        moved = {paths.get(_uncompiled(m), _uncompiled(m)): v for m, v in dict(meta).items()}
        with contextlib.suppress(AttributeError, TypeError):
            out._metadata = _same_type(meta, moved.items())  # type: ignore[attr-defined]
    return out


def _names(names: list[str], limit: int = 10) -> str:
    shown = ", ".join(map(str, names[:limit]))
    return shown + (f", ...and {len(names) - limit} more" if len(names) > limit else "")


def _same_shape(a: Any, b: Any) -> bool:
    tensors = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
    if tensors and (a.is_nested or b.is_nested):
        return True  # no one shape to compare (.shape raises): loading refuses it by name
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
        if score > best_score:  # a tie keeps the fewer strips: those keys already fit
            best, best_score = candidate, score
    return best
