"""The argument checks of :func:`trainperf.loader.tune_loader` and of the loaders it builds,
done once on entry: what they return holds the numbers as Python ``int`` and ``float`` (a
NumPy scalar passed in converted), which is all the code behind them sees."""

from __future__ import annotations

import inspect
import multiprocessing
import multiprocessing.context
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from trainperf._utils.validate import (
    choice,
    flag,
    fresh_stream,
    non_negative_int,
    positive_int,
    positive_number,
    worker_numbers,
)

__all__ = [
    "CheckedArgs",
    "check_args",
    "check_flags",
    "check_loader_kwargs",
    "check_sizes",
    "check_stream_order",
    "checked_context",
    "loader_args",
]

_ALLOWED = frozenset(inspect.signature(DataLoader.__init__).parameters) - {
    "self",
    "dataset",
    "batch_size",
}


@dataclass(frozen=True)
class CheckedArgs:
    """``tune_loader``'s arguments as :func:`check_args` accepted them: the numbers as Python
    ints and floats, a NumPy scalar passed in converted (DataLoader refuses a NumPy
    ``batch_size``, ``json.dumps`` a NumPy number in the report, and the cache key must not
    depend on which of the two was given)."""

    batch_size: int
    max_workers: int | None
    budget_s: float
    epochs_hint: int | None
    loader_kwargs: dict[str, Any]  # a new dict: see check_sizes


def check_args(
    batch_size: object,
    max_workers: object,
    budget_s: object,
    epochs_hint: object,
    step_fn: Callable[[Any], Any] | None,
    loader_kwargs: Mapping[str, Any],
) -> CheckedArgs:
    """The arguments as ``tune_loader`` works with them, or ``ValueError`` for the first
    one it cannot take. NumPy integers and floats are taken where Python's are.

    Returns:
        :class:`CheckedArgs`: the numbers as ``int`` and ``float``, with ``loader_kwargs``'s
        own (see :func:`check_sizes`).

    Raises:
        ValueError: a bad ``batch_size``, ``max_workers``, ``budget_s``, ``epochs_hint`` or
            ``step_fn``, a DataLoader argument it rejects (see :func:`check_loader_kwargs`),
            a bad ``num_workers``, ``prefetch_factor`` or ``timeout`` (a finite number of
            seconds >= 0; DataLoader itself lets NaN and infinity through and refuses -1
            only when the final loader is built, after the tuning), or ``prefetch_factor``
            without workers (DataLoader refuses it too); a ``collate_fn`` or
            ``worker_init_fn`` that is not callable, a ``generator`` that is not a
            ``torch.Generator``, a ``sampler`` that cannot be iterated or is a one-shot
            iterator (the measurements would use up its indices), a
            ``multiprocessing_context`` that is no start method, a ``sampler`` with
            ``shuffle=True`` (DataLoader takes one or the other), or ``pin_memory``,
            ``persistent_workers``, ``drop_last`` or ``shuffle`` other than True/False
            (these would otherwise fail inside the measurement, blamed on the dataset).

    Example:
        >>> import numpy as np
        >>> checked = check_args(np.int64(32), None, 30, None, None, {"num_workers": np.int64(2)})
        >>> checked.batch_size, checked.budget_s, checked.loader_kwargs
        (32, 30.0, {'num_workers': 2})
        >>> check_args(32, None, float("inf"), None, None, {})
        Traceback (most recent call last):
        ...
        ValueError: budget_s must be a positive number of seconds, got inf; pass a finite number
    """
    if batch_size is None:
        raise ValueError(
            "batch_size=None (no automatic batching) is not supported by the tuner: it counts "
            "samples per batch; pass the batch size your loop uses, or tune a DataLoader "
            "that batches"
        )
    size = positive_int("batch_size", batch_size)
    check_loader_kwargs(loader_kwargs)
    most = non_negative_int("max_workers", max_workers, none_ok=True)
    kwargs = check_sizes(loader_kwargs)
    budget = positive_number("budget_s", budget_s, unit="seconds")
    epochs = positive_int("epochs_hint", epochs_hint, none_ok=True)
    if step_fn is not None and not callable(step_fn):
        raise ValueError(f"step_fn must be callable (it gets one batch), got {step_fn!r}")
    _check_kinds(kwargs)
    return CheckedArgs(size, most, budget, epochs, kwargs)


def check_flags(**flags: object) -> None:
    """``TypeError`` for the first of ``flags`` (``cache``, ``progress``, ``adapt``) that is
    not True or False: ``cache="no"`` would read as true, and read and write the cache.

    Example:
        >>> check_flags(cache=True, progress=False)
        >>> check_flags(cache="no")
        Traceback (most recent call last):
        ...
        TypeError: cache must be True or False, got 'no'
    """
    for name, value in flags.items():
        flag(name, value)


def check_sizes(loader_args: Mapping[str, Any]) -> dict[str, Any]:
    """``loader_args`` (DataLoader's arguments, by name) with its ``batch_size`` (None: no
    automatic batching, as DataLoader takes it), ``num_workers``, ``prefetch_factor`` and
    ``timeout`` as Python numbers, or ``ValueError`` for a bad one: the checks of
    ``tune_loader`` and of a :class:`~trainperf.loader.TunedDataLoader` or
    :class:`~trainperf.loader.AdaptiveDataLoader` built directly, where DataLoader's own
    would raise a bare ``TypeError`` (``'<' not supported between instances of 'str' and
    'int'``), take a ``prefetch_factor`` of 0, or refuse a NumPy ``batch_size``.

    Returns:
        A new dict with the same keys: a NumPy integer or float among those four converted
        (a ``timeout`` keeps its kind: ``np.int64(5)`` becomes ``5``, ``np.float64(5)``
        ``5.0``), every other value as given.

    Example:
        >>> import numpy as np
        >>> check_sizes({"batch_size": np.int64(8), "num_workers": 2, "shuffle": True})
        {'batch_size': 8, 'num_workers': 2, 'shuffle': True}
        >>> check_sizes({"num_workers": "2"})
        Traceback (most recent call last):
        ...
        ValueError: num_workers must be an int >= 0, got '2'
    """
    checked = dict(loader_args)
    if "batch_size" in checked:
        checked["batch_size"] = positive_int("batch_size", checked["batch_size"], none_ok=True)
    checked.update(worker_numbers(checked))
    return checked


def loader_args(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """DataLoader's arguments after ``dataset``, by name, whether given by name or position.

    Raises:
        TypeError: one DataLoader does not take (as DataLoader itself would).

    Example:
        >>> loader_args((4, True), {"num_workers": 2})
        {'batch_size': 4, 'shuffle': True, 'num_workers': 2}
    """
    bound = inspect.signature(DataLoader).bind_partial(None, *args, **kwargs).arguments
    return {name: value for name, value in bound.items() if name != "dataset"}


_FLAGS = {
    "pin_memory": (True, False),
    "persistent_workers": (True, False),
    "drop_last": (True, False),
    "shuffle": (None, True, False),
}


def _check_kinds(loader_kwargs: Mapping[str, Any]) -> None:
    """The caller's functions, generator, sampler, start method and flags, by kind."""
    for name in ("collate_fn", "worker_init_fn"):
        fn = loader_kwargs.get(name)
        if fn is not None and not callable(fn):
            raise ValueError(f"{name} must be None or callable, got {fn!r}")
    generator = loader_kwargs.get("generator")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(
            f"generator must be None or a torch.Generator, got {generator!r}: pass "
            "torch.Generator().manual_seed(seed)"
        )
    sampler = loader_kwargs.get("sampler")
    if sampler is not None and not hasattr(sampler, "__iter__"):
        raise ValueError(
            f"sampler must be None or an iterable of indices (a torch Sampler), got {sampler!r}"
        )
    if sampler is not None:
        _fresh_sampler(sampler)
        if loader_kwargs.get("shuffle"):
            raise ValueError(
                f"sampler={sampler!r} with shuffle=True: DataLoader takes one or the other "
                "(they are mutually exclusive); drop shuffle=True and shuffle in the "
                "sampler (torch.utils.data.RandomSampler(dataset))"
            )
    if loader_kwargs.get("multiprocessing_context") is not None:
        checked_context(loader_kwargs["multiprocessing_context"])
    for name, allowed in _FLAGS.items():
        if name in loader_kwargs:
            choice(name, loader_kwargs[name], allowed)


_STREAM_FIX = (
    "shuffle inside the dataset's __iter__ (a new order of its shards or files each epoch), "
    "or a buffer-shuffle (keep a buffer of items and yield one drawn at random from it)"
)


def check_stream_order(dataset: Any, loader_kwargs: Mapping[str, Any]) -> None:
    """Refuse ``shuffle=True`` or a ``sampler`` for an ``IterableDataset``, whose order is
    its own: DataLoader refuses them too, but only as the first pool starts, without a fix.

    Raises:
        ValueError: ``dataset`` is an ``IterableDataset`` and ``loader_kwargs`` has
            ``shuffle=True`` or a ``sampler``.

    Example:
        >>> class Stream(IterableDataset):
        ...     def __iter__(self): return iter(range(4))
        >>> check_stream_order(Stream(), {"shuffle": False})
        >>> check_stream_order(Stream(), {"shuffle": True})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: shuffle=True with an IterableDataset (Stream): ...
    """
    if not isinstance(dataset, IterableDataset):
        return
    name = type(dataset).__name__
    if loader_kwargs.get("shuffle"):
        raise ValueError(
            f"shuffle=True with an IterableDataset ({name}): DataLoader cannot shuffle a "
            f"stream (it has no indices to draw); drop shuffle=True and {_STREAM_FIX}"
        )
    sampler = loader_kwargs.get("sampler")
    if sampler is not None:
        raise ValueError(
            f"sampler={sampler!r} with an IterableDataset ({name}): DataLoader takes no "
            f"sampler for a stream (it has no indices to draw); drop sampler= and {_STREAM_FIX}"
        )


def _fresh_sampler(sampler: Any) -> None:
    """Refuse a ``sampler`` that is a one-shot iterator (``iter(indices)``, a generator):
    the measurements read it again and again, and would use up the indices the loader
    then never gets."""
    try:
        fresh_stream(sampler, "tuning")
    except ValueError as e:
        raise ValueError(
            f"sampler={sampler!r} is a one-shot iterator: tuning reads the sampler again and "
            "again, and would use up the indices your loader then never gets; pass a list of "
            "indices or a torch Sampler (they start afresh on each iter())"
        ) from e


def checked_context(context: Any) -> Any:
    """``context`` (a start method's name or a multiprocessing context), checked now rather
    than when the first workers start.

    Raises:
        ValueError: it is neither.

    Example:
        >>> checked_context("fork")
        'fork'
        >>> checked_context("sapwn")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: multiprocessing_context='sapwn' is neither a start method of this platform ...
    """
    if isinstance(context, multiprocessing.context.BaseContext):
        return context
    methods = torch.multiprocessing.get_all_start_methods()
    if isinstance(context, str) and context in methods:
        return context
    raise ValueError(
        f"multiprocessing_context={context!r} is neither a start method of this platform "
        f"({', '.join(methods)}) nor a multiprocessing context: pass one of those names or "
        "multiprocessing.get_context(name)"
    )


def check_loader_kwargs(loader_kwargs: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` for a DataLoader argument ``tune_loader`` cannot pass through.

    ``num_workers``, ``prefetch_factor``, ``pin_memory`` and ``persistent_workers`` are the
    caller's current setting (see :mod:`trainperf.loader._user`), so they are taken.

    Raises:
        ValueError: ``batch_sampler`` (the tuner batches with ``batch_size``), or a name
            DataLoader does not take (the message lists those it does).

    Example:
        >>> check_loader_kwargs({"num_workers": 4, "pin_memory": True})
        >>> check_loader_kwargs({"num_worker": 4})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: unknown DataLoader argument 'num_worker'; choices: ...
    """
    for k in loader_kwargs:
        if k == "batch_sampler":
            raise ValueError(
                "batch_sampler is not supported: tune_loader batches with batch_size; pass "
                "sampler= (and drop_last=) instead"
            )
        if k not in _ALLOWED:
            raise ValueError(
                f"unknown DataLoader argument {k!r}; choices: {', '.join(sorted(_ALLOWED))}"
            )
