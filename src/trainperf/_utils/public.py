"""Public ``__module__`` paths for re-exported objects (the loop in httpx's ``__init__``).

A class defined in ``trainperf.loader._report`` and imported as ``trainperf.TuningReport``
should say so in reprs, tracebacks and the API reference. Each package ``__init__`` calls
:func:`set_public_module` on what it exports (``trainperf.loader.TuningReport``); the
top-level package, which imports nothing itself, calls it again on the names it re-exports as
soon as each subpackage is imported, by whatever path (``_Package.__setattr__`` in
``trainperf/__init__.py``), so such a name ends up as ``trainperf.<name>``.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Iterable, Mapping

__all__ = ["set_public_module"]


def set_public_module(namespace: Mapping[str, object], names: Iterable[str], module: str) -> None:
    """Set ``__module__`` to ``module`` on every trainperf class and function in ``names``,
    and on every callable object standing for a function (one with ``__wrapped__``, as
    ``functools.update_wrapper`` leaves it, such as ``trainperf.worker_init_fn``).

    Objects from other packages (torch, typing aliases) are left alone, and so is the
    function such an object wraps (it pickles by its defining module).

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
        if not (inspect.isclass(obj) or inspect.isfunction(obj) or _wraps_a_function(obj)):
            continue
        if str(getattr(obj, "__module__", "")).startswith("trainperf."):
            if inspect.isclass(obj):
                _resolve_annotations(obj)
            obj.__module__ = module


def _wraps_a_function(obj: object) -> bool:
    return callable(obj) and hasattr(obj, "__wrapped__")


def _resolve_annotations(cls: type) -> None:
    # ``from __future__ import annotations`` leaves annotations as strings, which
    # ``typing.get_type_hints`` evaluates in ``sys.modules[cls.__module__]``: resolve them in
    # the defining module while ``__module__`` still names it (dataclass tools, pydantic and
    # OmegaConf read them).
    own = vars(cls).get("__annotations__")
    if not own:
        return
    try:
        hints = typing.get_type_hints(cls, include_extras=True)
    except (NameError, TypeError, AttributeError):  # a name only imported for type checking
        return
    cls.__annotations__ = {name: hints.get(name, value) for name, value in own.items()}
