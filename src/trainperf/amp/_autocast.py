"""What :meth:`trainperf.MixedPrecision.autocast` returns: ``torch.autocast``, or for fp32
a context that does nothing; either is usable as ``with`` and as ``@``."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

__all__ = ["AutocastContext", "NoAutocast"]

F = TypeVar("F", bound=Callable[..., Any])


class AutocastContext(Protocol):
    """A context manager that also decorates, as ``torch.autocast`` is."""

    def __enter__(self) -> Any: ...

    def __exit__(self, exc_type: Any, exc_value: Any, traceback: Any) -> Any: ...

    def __call__(self, func: F) -> F: ...


class NoAutocast(contextlib.ContextDecorator):
    """fp32's autocast: nothing to cast, usable as ``with`` and as ``@``, as torch.autocast is
    (``contextlib.nullcontext`` is no decorator)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: Any, exc_value: Any, traceback: Any) -> None:
        return None
