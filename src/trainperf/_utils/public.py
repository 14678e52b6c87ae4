"""Public ``__module__`` paths for re-exported objects (the loop in httpx's ``__init__``).

A class defined in ``trainperf.loader._report`` and imported as ``trainperf.TuningReport``
should say so in reprs, tracebacks and the API reference. Each package ``__init__`` calls
:func:`set_public_module` on what it exports; the top-level package runs last, so a name it
exports ends up as ``trainperf.<name>``.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping

__all__ = ["set_public_module"]


def set_public_module(namespace: Mapping[str, object], names: Iterable[str], module: str) -> None:
    """Set ``__module__`` to ``module`` on every trainperf class and function in ``names``.

    Objects from other packages (torch, typing aliases) are left alone.

    Args:
        namespace: the package's ``globals()``.
        names: its ``__all__``.
        module: its public name, e.g. ``"trainperf.bench"``.

    Example:
        >>> def f() -> None: ...
        >>> f.__module__ = "trainperf.x._private"
        >>> set_public_module({"f": f}, ["f"], "trainperf.x")
        >>> f.__module__
        'trainperf.x'
    """
    for name in names:
        obj = namespace[name]
        if not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue
        if str(getattr(obj, "__module__", "")).startswith("trainperf."):
            obj.__module__ = module
