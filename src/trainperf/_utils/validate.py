"""Argument checks shared by every package: one rule, one message per kind of value.

Each check returns the value it accepted, so a call site reads
``batch_size = positive_int("batch_size", batch_size)``. Where a Python number is accepted,
so is a NumPy scalar of an integer or floating dtype (a value read from a NumPy config or
array), and the check returns it as a Python ``int`` or ``float``: a caller that keeps the
returned value never holds a NumPy scalar (which ``json.dumps`` and ``DataLoader`` refuse).
A bool (``np.bool_`` too) is never a number here.

:func:`worker_numbers` checks DataLoader's ``num_workers``, ``prefetch_factor`` and
``timeout`` together, with one message for ``prefetch_factor`` without workers; it is the
one check of those arguments for ``loader`` (``tune_loader`` and the loaders it builds) and
``ddp`` (``distributed_loader``).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "as_real_number",
    "choice",
    "flag",
    "fresh_stream",
    "int_like",
    "non_negative_int",
    "non_negative_number",
    "positive_int",
    "positive_number",
    "worker_numbers",
]


def as_real_number(value: object) -> int | float | None:
    """``value`` as a Python ``int`` or ``float`` if it is a real number: an int, a float, or
    a NumPy scalar of an integer or floating dtype; else None. A bool (``np.bool_`` too), a
    ``timedelta64`` (NumPy counts it an integer), a tensor or a string is not a number here.

    Example:
        >>> import numpy as np
        >>> as_real_number(np.float32(0.5)), as_real_number(np.int64(3)), as_real_number(True)
        (0.5, 3, None)
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    dtype = getattr(value, "dtype", None)
    if dtype is not None and getattr(dtype, "kind", "") not in ("i", "u", "f"):
        return None  # np.timedelta64 registers as an integer
    return int(value) if isinstance(value, numbers.Integral) else float(value)


def _int_at_least(name: str, value: object, minimum: int, none_ok: bool, fix: str) -> int:
    if none_ok and value is None:
        return value  # type: ignore[return-value]
    number = as_real_number(value)
    if not isinstance(number, int) or number < minimum:
        allowed = f"an int >= {minimum}"
        hint = f" (pass int({name}))" if int_like(value, minimum) else ""
        raise ValueError(
            f"{name} must be {'None or ' if none_ok else ''}{allowed}, got {value!r}{hint}"
            f"{'; ' + fix if fix else ''}"
        )
    return number


def int_like(value: object, minimum: int) -> bool:
    """Whether ``value`` is a whole number >= ``minimum`` of a type the check refuses: a
    one-element tensor, ``5.0`` (what ``int(value)`` would make right)."""
    dtype = str(getattr(value, "dtype", ""))
    if isinstance(value, (str, bool)) or dtype in ("bool", "torch.bool"):
        return False
    if dtype.startswith("timedelta64"):  # int() drops its unit
        return False
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, RuntimeError, OverflowError):  # Fraction(10**400)
        return False
    return math.isfinite(number) and number.is_integer() and number >= minimum


def positive_int(name: str, value: object, *, none_ok: bool = False, fix: str = "") -> int:
    """``value`` as an int if it is an int >= 1 (NumPy's integers too; ``True`` is not),
    else ``ValueError`` naming ``name``.

    Args:
        name: the argument's name, as the caller wrote it.
        value: what was passed.
        none_ok: accept None too (the caller documents what None means); the error says so.
        fix: what to pass instead, for the end of the message (the caller knows what its
            argument means and what leaving it out does).

    Raises:
        ValueError: ``value`` is not a whole number >= 1.

    Example:
        >>> positive_int("batch_size", 32)
        32
        >>> positive_int("batch_size", 0)
        Traceback (most recent call last):
        ...
        ValueError: batch_size must be an int >= 1, got 0
        >>> positive_int("nprocs", True, fix="pass an int, e.g. nprocs=2")
        Traceback (most recent call last):
        ...
        ValueError: nprocs must be an int >= 1, got True; pass an int, e.g. nprocs=2
    """
    return _int_at_least(name, value, 1, none_ok, fix)


def non_negative_int(name: str, value: object, *, none_ok: bool = False, fix: str = "") -> int:
    """``value`` as an int if it is an int >= 0 (NumPy's integers too; ``True`` is not),
    else ``ValueError`` naming ``name``.

    Args:
        name: the argument's name.
        value: what was passed.
        none_ok: accept None too; the error says so.
        fix: what to pass instead, for the end of the message.

    Raises:
        ValueError: ``value`` is not a whole number >= 0.

    Example:
        >>> non_negative_int("seed", 0)
        0
        >>> non_negative_int("max_workers", -1, none_ok=True)
        Traceback (most recent call last):
        ...
        ValueError: max_workers must be None or an int >= 0, got -1
    """
    return _int_at_least(name, value, 0, none_ok, fix)


def positive_number(name: str, value: object, *, unit: str = "") -> float:
    """``value`` as a float if it is a finite number > 0 (an int, a float or a NumPy
    scalar of either), else ``ValueError`` naming ``name``.

    Args:
        name: the argument's name.
        value: what was passed.
        unit: what the number counts, for the message (``"seconds"``).

    Raises:
        ValueError: ``value`` is not a finite number > 0.

    Example:
        >>> positive_number("budget_s", 10)
        10.0
        >>> positive_number("budget_s", -1, unit="seconds")
        Traceback (most recent call last):
        ...
        ValueError: budget_s must be a positive number of seconds, got -1
        >>> positive_number("budget_s", float("inf"), unit="seconds")
        Traceback (most recent call last):
        ...
        ValueError: budget_s must be a positive number of seconds, got inf; pass a finite number
    """
    number = as_real_number(value)
    if number is None or not math.isfinite(number) or number <= 0:
        what = f"a positive number of {unit}" if unit else "a positive number"
        hint = "; pass a finite number" if number == math.inf else ""
        raise ValueError(f"{name} must be {what}, got {value!r}{hint}")
    return float(number)


def non_negative_number(name: str, value: object, *, unit: str = "", zero: str = "") -> float:
    """``value`` as a float if it is a finite number >= 0 (an int, a float or a NumPy
    scalar of either), else ``ValueError`` naming ``name``.

    For options where 0 is meaningful (DataLoader's ``timeout=0``: no timeout), unlike
    :func:`positive_number`. NaN and infinity are refused, as there.

    Args:
        name: the argument's name.
        value: what was passed.
        unit: what the number counts, for the message (``"seconds"``).
        zero: what 0 means, for the message (``"no timeout"``).

    Raises:
        ValueError: ``value`` is not a finite number >= 0.

    Example:
        >>> non_negative_number("timeout", 0)
        0.0
        >>> non_negative_number("timeout", float("nan"), unit="seconds", zero="no timeout")
        Traceback (most recent call last):
        ...
        ValueError: timeout must be a finite number of seconds >= 0 (0: no timeout), got nan
    """
    number = as_real_number(value)
    if number is None or not math.isfinite(number) or number < 0:
        what = f"a finite number of {unit} >= 0" if unit else "a finite number >= 0"
        meaning = f" (0: {zero})" if zero else ""
        raise ValueError(f"{name} must be {what}{meaning}, got {value!r}")
    return float(number)


def choice(name: str, value: object, choices: Sequence[object]) -> None:
    """Raise ``ValueError`` unless ``value`` is one of ``choices`` (compared with ``==``).

    Raises:
        ValueError: ``value`` is not among ``choices``; the message lists them.

    Example:
        >>> choice("last_batch", "drop", ("drop", "keep"))
        >>> choice("last_batch", "all", ("drop", "keep"))
        Traceback (most recent call last):
        ...
        ValueError: last_batch must be one of ('drop', 'keep'), got 'all'
    """
    if value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")


def flag(name: str, value: object, *, none_ok: bool = False) -> None:
    """Raise ``TypeError`` unless ``value`` is True or False (or None, with ``none_ok``):
    a string such as ``"no"`` or ``"false"`` would otherwise read as true.

    Example:
        >>> flag("train", True)
        >>> flag("train", "no")
        Traceback (most recent call last):
        ...
        TypeError: train must be True or False, got 'no'
    """
    if not isinstance(value, bool) and not (none_ok and value is None):
        allowed = "True, False or None" if none_ok else "True or False"
        raise TypeError(f"{name} must be {allowed}, got {value!r}")


def worker_numbers(loader_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """DataLoader's ``num_workers``, ``prefetch_factor`` and ``timeout`` among
    ``loader_kwargs`` (those given), as Python numbers, checked as DataLoader checks them and
    more: DataLoader raises a bare ``TypeError`` for ``num_workers="2"``, takes
    ``num_workers=2.0`` or ``prefetch_factor=0`` only to fail in the training loop, keeps a
    NumPy number as given (``json.dumps`` refuses it) and lets a NaN or infinite ``timeout``
    through. A ``timeout`` keeps its kind (``np.int64(5)`` becomes ``5``, ``np.float64(5)``
    ``5.0``).

    Returns:
        A new dict holding those of the three that ``loader_kwargs`` has.

    Raises:
        ValueError: ``num_workers`` not an int >= 0, ``prefetch_factor`` not None or an
            int >= 1, or given without workers (DataLoader refuses it), ``timeout`` not a
            finite number of seconds >= 0.

    Example:
        >>> import numpy as np
        >>> given = {"num_workers": 2, "prefetch_factor": np.int64(4), "timeout": np.float64(2)}
        >>> worker_numbers(given)
        {'num_workers': 2, 'prefetch_factor': 4, 'timeout': 2.0}
        >>> worker_numbers({"prefetch_factor": 2, "shuffle": True})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: prefetch_factor=2 needs num_workers > 0 (DataLoader refuses it ...
    """
    timeout = loader_kwargs.get("timeout", 0)
    non_negative_number("timeout", timeout, unit="seconds", zero="no timeout")
    n = non_negative_int("num_workers", loader_kwargs.get("num_workers", 0))
    pf = positive_int("prefetch_factor", loader_kwargs.get("prefetch_factor"), none_ok=True)
    if pf is not None and n == 0:
        raise ValueError(
            f"prefetch_factor={pf} needs num_workers > 0 (DataLoader refuses it without "
            f"workers): pass num_workers= with it, or leave prefetch_factor out"
        )
    checked = {"num_workers": n, "prefetch_factor": pf, "timeout": as_real_number(timeout)}
    return {name: value for name, value in checked.items() if name in loader_kwargs}


def _returns_self(self: object) -> object:
    return self


def _one_shot(dataset: object) -> bool:
    """An iterator that cannot start again: a C-level one (a generator, ``iter(list)``),
    or a class whose ``__iter__`` does nothing but ``return self`` (one that resets itself
    first, ``self.i = 0; return self``, starts afresh and is not one)."""
    kind = type(dataset)
    if not callable(getattr(kind, "__next__", None)):
        return False
    code = getattr(getattr(kind, "__iter__", None), "__code__", None)
    if code is None:  # implemented in C: calling it has no side effect
        return iter(dataset) is dataset  # type: ignore[call-overload]
    mine = _returns_self.__code__
    return bool(code.co_code == mine.co_code and code.co_argcount == 1)


def fresh_stream(dataset: object, reader: str) -> None:
    """Raise ``ValueError`` for a dataset that is a one-shot iterator: a generator, or an
    ``IterableDataset`` whose ``__iter__`` just returns itself. ``reader`` (what reads it
    ahead of the training loop: "tuning", "batches_from()") would use up samples the loop
    then never sees, and each DataLoader worker would replay its own copy of the stream.

    Example:
        >>> from torch.utils.data import IterableDataset
        >>> class Once(IterableDataset):
        ...     def __init__(self): self.stream = iter(range(8))
        ...     def __iter__(self): return self
        ...     def __next__(self): return next(self.stream)
        >>> fresh_stream(Once(), "tuning")
        Traceback (most recent call last):
        ...
        ValueError: Once is a one-shot iterator (its __iter__ returns it as it is): ...
        >>> fresh_stream(list(range(8)), "tuning")  # a list starts again each time
    """
    if not _one_shot(dataset):
        return
    raise ValueError(
        f"{type(dataset).__name__} is a one-shot iterator (its __iter__ returns it as it "
        f"is): {reader} would use up samples your training loop then never sees (and each "
        f"DataLoader worker would replay its own copy of the stream). Give it an __iter__ "
        f"that starts the stream afresh on each call (a generator: `def __iter__(self): "
        f"yield from ...`)"
    )
