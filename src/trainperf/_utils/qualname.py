"""``module.qualname`` names for cache keys: :func:`qualname`.

A cache entry is keyed by what decides the answer, and callables (a dataset class, the
caller's step function, a ``collate_fn``) count by name, since their identity changes every
run. Used by the ``loader`` cache (:mod:`trainperf.loader._cache`) and the ``batchsize``
cache (:mod:`trainperf.batchsize._cache`).
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["qualname"]


def qualname(obj: Any) -> str:
    """``module.qualname`` of a class or function (of the object's type otherwise); lambdas and
    nested functions, whose names are not unique, add where they are defined, and a
    ``functools.partial`` names its function.

    Example:
        >>> qualname(len), qualname(3)
        ('builtins.len', 'builtins.int')
        >>> f, g = (lambda b: None), (lambda b: b)
        >>> qualname(f) == qualname(g), qualname(f).split("@")[0].endswith(".<lambda>")
        (False, True)
    """
    if isinstance(obj, functools.partial):
        return f"functools.partial({qualname(obj.func)})"
    target = (
        obj
        if isinstance(obj, type) or (callable(obj) and hasattr(obj, "__qualname__"))
        else type(obj)
    )
    name = f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', repr(target))}"
    code = getattr(target, "__code__", None)
    if code is not None and ("<lambda>" in name or "<locals>" in name):
        name += f"@{code.co_filename}:{code.co_firstlineno}:{code.co_code.hex()[:32]}"
    return name
