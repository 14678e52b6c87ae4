"""``module.qualname`` names for cache keys: :func:`qualname`.

A cache entry is keyed by what decides the answer, and callables (a dataset class, the
caller's step function, a ``collate_fn``) count by name, since their identity changes every
run. Used by the ``loader`` cache (:mod:`trainperf.loader._cache`) and the ``batchsize``
cache (:mod:`trainperf.batchsize._cache`).
"""

from __future__ import annotations

import functools
import hashlib
import types
from typing import Any

__all__ = ["code_digest", "qualname"]


def qualname(obj: Any) -> str:
    """``module.qualname`` of a class or function (of the object's type otherwise); lambdas and
    nested functions, whose names are not unique, add where they are defined, functions,
    methods and callable objects (their class's ``__call__``) add a hash of their body
    (:func:`code_digest`: a cached answer for an edited step is not reused), bodies a
    decorator wraps (``__wrapped__``) included, a ``functools.partial`` names its function
    and a module ``torch.compile`` wrapped names the module it compiled.

    Example:
        >>> qualname(len), qualname(3)
        ('builtins.len', 'builtins.int')
        >>> f, g = (lambda b: None), (lambda b: b)
        >>> qualname(f) == qualname(g), qualname(f).split("@")[0].endswith(".<lambda>")
        (False, True)
    """
    if isinstance(obj, functools.partial):
        return f"functools.partial({qualname(obj.func)})"
    if type(obj).__name__ == "OptimizedModule" and hasattr(obj, "_orig_mod"):
        return f"torch.compile({qualname(obj._orig_mod)})"
    target = (
        obj
        if isinstance(obj, type) or (callable(obj) and hasattr(obj, "__qualname__"))
        else type(obj)
    )
    name = f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', repr(target))}"
    code, body = getattr(target, "__code__", None), target
    if code is None and target is type(obj) and callable(obj):  # a step object's __call__
        body = _body(target)
        code = getattr(body, "__code__", None)
    if code is not None and ("<lambda>" in name or "<locals>" in name):
        name += f"@{code.co_filename}:{code.co_firstlineno}"
    if isinstance(code, types.CodeType):
        name += f"#{code_digest(code, *_wrapped_codes(body))}"
    return name


def _wrapped_codes(fn: Any) -> list[types.CodeType]:
    """The bodies of the functions ``fn`` wraps (``functools.wraps`` sets ``__wrapped__``;
    so does ``torch.compile`` of a function): the wrapper's own body is the decorator's, the
    same whatever it wraps."""
    codes: list[types.CodeType] = []
    seen = {id(fn)}
    while (fn := getattr(fn, "__wrapped__", None)) is not None and id(fn) not in seen:
        seen.add(id(fn))
        code = getattr(fn, "__code__", None)
        if code is None and callable(fn) and not isinstance(fn, type):
            code = getattr(_body(type(fn)), "__code__", None)
        if isinstance(code, types.CodeType):
            codes.append(code)
    return codes


def _body(cls: type) -> Any:
    """The method a call of an instance of ``cls`` runs the caller's code in: its
    ``__call__``, or an ``nn.Module``'s ``forward`` (``Module.__call__`` is torch's own,
    the same for every module)."""
    call = cls.__call__
    if getattr(call, "__module__", "").startswith("torch.") and callable(
        getattr(cls, "forward", None)
    ):
        return cls.forward  # type: ignore[attr-defined]
    return call


def code_digest(*codes: types.CodeType) -> str:
    """A hash of functions' bodies (bytecode, constants and names, nested functions'
    too): editing a function changes it, running it again does not.

    Example:
        >>> def f(x): return x + 1
        >>> def g(x): return x + 2
        >>> code_digest(f.__code__) == code_digest(g.__code__), len(code_digest(f.__code__))
        (False, 16)
    """
    h = hashlib.sha256()
    for code in codes:
        _feed(h, code)
    return h.hexdigest()[:16]


def _feed(h: Any, code: types.CodeType) -> None:
    h.update(code.co_code)
    h.update(repr(code.co_names).encode())
    for const in code.co_consts:
        h.update(_canonical(const).encode())
        if isinstance(const, types.CodeType):
            _feed(h, const)  # a nested function: its body, not its repr (which has an address)


def _canonical(const: object) -> str:
    """A constant's text, the same in every process: a frozenset's order follows the
    per-process string hash (``PYTHONHASHSEED``), so its items are sorted; a code object's
    repr has an address, so it counts by its body (hashed by the caller).

    Example:
        >>> print(_canonical(frozenset({"b", "a"})), _canonical((1, frozenset({2, 1}))))
        frozenset({'a', 'b'}) (1, frozenset({1, 2}))
    """
    if isinstance(const, types.CodeType):
        return "<code>"
    if isinstance(const, frozenset):
        return "frozenset({" + ", ".join(sorted(_canonical(c) for c in const)) + "})"
    if isinstance(const, tuple):
        return "(" + ", ".join(_canonical(c) for c in const) + ")"
    return repr(const)
