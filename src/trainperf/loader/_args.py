"""The argument checks of :func:`trainperf.loader.tune_loader`, done once on entry."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from torch.utils.data import DataLoader

from trainperf._utils.validate import (
    non_negative_int,
    non_negative_number,
    positive_int,
    positive_number,
)

__all__ = ["check_args", "check_loader_kwargs"]

_ALLOWED = frozenset(inspect.signature(DataLoader.__init__).parameters) - {
    "self",
    "dataset",
    "batch_size",
}


def check_args(
    batch_size: int,
    max_workers: int | None,
    budget_s: float,
    epochs_hint: int | None,
    step_fn: Callable[[Any], Any] | None,
    loader_kwargs: Mapping[str, Any],
) -> None:
    """Raise ``ValueError`` for the first argument ``tune_loader`` cannot take.

    Raises:
        ValueError: a bad ``batch_size``, ``max_workers``, ``budget_s``, ``epochs_hint`` or
            ``step_fn``, a DataLoader argument it rejects (see :func:`check_loader_kwargs`),
            a bad ``num_workers``, ``prefetch_factor`` or ``timeout`` (a finite number of
            seconds >= 0; DataLoader itself lets NaN and infinity through and refuses -1
            only when the final loader is built, after the tuning), or ``prefetch_factor``
            without workers (DataLoader refuses it too).

    Example:
        >>> check_args(32, None, 30.0, None, None, {"shuffle": True})
        >>> check_args(32, None, float("inf"), None, None, {})
        Traceback (most recent call last):
        ...
        ValueError: budget_s must be a positive number of seconds, got inf
    """
    if batch_size is None:
        raise ValueError(
            "batch_size=None (no automatic batching) is not supported by the tuner: it counts "
            "samples per batch; pass the batch size your loop uses, or tune a DataLoader "
            "that batches"
        )
    positive_int("batch_size", batch_size)
    non_negative_int("max_workers", max_workers, none_ok=True)  # None: the default
    positive_number("budget_s", budget_s, unit="seconds")
    positive_int("epochs_hint", epochs_hint, none_ok=True)
    if step_fn is not None and not callable(step_fn):
        raise ValueError(f"step_fn must be callable (it gets one batch), got {step_fn!r}")
    check_loader_kwargs(loader_kwargs)
    _check_callers_workers(loader_kwargs)


def _check_callers_workers(loader_kwargs: Mapping[str, Any]) -> None:
    """The caller's own ``num_workers``, ``prefetch_factor`` and ``timeout``, as DataLoader
    checks them (and, for ``timeout``, NaN and infinity too, which DataLoader lets through)."""
    if "timeout" in loader_kwargs:
        non_negative_number("timeout", loader_kwargs["timeout"], unit="seconds", zero="no timeout")
    n = non_negative_int("num_workers", loader_kwargs.get("num_workers", 0))
    pf = positive_int("prefetch_factor", loader_kwargs.get("prefetch_factor"), none_ok=True)
    if pf is not None and n == 0:
        raise ValueError(
            f"prefetch_factor={pf} needs num_workers > 0 (DataLoader refuses it without "
            f"workers): pass num_workers= with it, or leave prefetch_factor out"
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
