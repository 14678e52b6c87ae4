"""What the chosen configuration becomes: ``persistent_workers`` and the DataLoader arguments.

The search picks ``num_workers``, ``prefetch_factor`` and ``pin_memory``; these rules add
``persistent_workers`` (:func:`persistent_workers`) and turn the choice and the caller's own
arguments into ``TuningReport.best_kwargs`` (:func:`final_kwargs`). Both the fresh path and
the cache path of :func:`trainperf.loader.tune_loader` end here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from trainperf.loader._report import CandidateResult

__all__ = [
    "NOT_CACHED",
    "SET_EPOCH",
    "best_settings",
    "final_kwargs",
    "forced_fallback",
    "has_set_epoch",
    "persistent_workers",
]

SET_EPOCH = (
    "persistent_workers=False: the dataset (or one it wraps) has set_epoch(), and workers kept "
    "between epochs hold their own copy of it, which dataset.set_epoch(e) never reaches; pass "
    "persistent_workers=True to keep them anyway"
)
NOT_CACHED = (
    "not cached: workers failed or were refused (see the candidates), so the next call tunes again"
)


def persistent_workers(
    choice: CandidateResult,
    epochs_hint: int | None,
    samples_per_epoch: int | None,
    batch_size: int,
    *,
    set_epoch: bool = False,
) -> tuple[bool, str | None]:
    """Whether to keep the workers between epochs, and the note that says why (or None).

    Kept when re-creating them each epoch (their start-up minus one batch's production)
    costs at least 1 % of an epoch, or when that cannot be told; never for one epoch or
    without workers, nor for a dataset with ``set_epoch`` (``set_epoch=True``): the
    caller's ``dataset.set_epoch(e)`` changes the main process's copy, and workers kept
    between epochs hold their own, so every epoch would shuffle alike.

    Example:
        >>> c = CandidateResult(4, 2, False, "ok", samples_per_s=1000.0, startup_s=2.0)
        >>> persistent_workers(c, None, 10_000, 10)
        (True, 'persistent_workers=True: worker start-up (1.96 s) is 19.6 % of an epoch (10.0 s)')
        >>> persistent_workers(c, 1, 10_000, 10)[0]
        False
    """
    n, rate = choice.num_workers, choice.samples_per_s
    if n == 0:
        return False, None
    if epochs_hint == 1:
        return False, "persistent_workers=False: one epoch, so there is no restart to save"
    if set_epoch:
        return False, SET_EPOCH
    if rate is None or choice.startup_s is None:
        return True, None
    # Start-up minus one batch's production: what re-creating the workers each epoch costs.
    overhead = max(0.0, choice.startup_s - n * batch_size / rate)
    if samples_per_epoch is None:
        return True, None
    epoch_s = samples_per_epoch / rate
    if overhead >= 0.01 * epoch_s:
        return True, (
            f"persistent_workers=True: worker start-up ({overhead:.2f} s) is "
            f"{100 * overhead / max(epoch_s, 1e-9):.1f} % of an epoch ({epoch_s:.1f} s)"
        )
    return False, (
        f"persistent_workers=False: worker start-up ({overhead:.2f} s) is under 1 % of an "
        f"epoch ({epoch_s:.1f} s)"
    )


def has_set_epoch(dataset: object, depth: int = 0) -> bool:
    """Whether ``dataset``, or a dataset it wraps (a ``Subset``'s or ``random_split``'s
    ``.dataset``, a ``ConcatDataset``'s ``.datasets``), takes ``set_epoch(e)`` (Hugging Face
    and webdataset streams, datasets that reshuffle or resample by epoch): the caller calls
    it on the dataset they hold, which may be the wrapped one.

    Example:
        >>> from torch.utils.data import Subset
        >>> class Epoched:
        ...     def set_epoch(self, epoch): ...
        >>> has_set_epoch(Epoched()), has_set_epoch(Subset(Epoched(), [0])), has_set_epoch([])
        (True, True, False)
    """
    if callable(getattr(dataset, "set_epoch", None)):
        return True
    if depth >= 4:
        return False
    inner = getattr(dataset, "dataset", None)
    if inner is not None and not isinstance(inner, (str, bytes)):
        return has_set_epoch(inner, depth + 1)
    parts = getattr(dataset, "datasets", None)
    if isinstance(parts, (list, tuple)):
        return any(has_set_epoch(d, depth + 1) for d in parts[:16])
    return False


def best_settings(
    choice: CandidateResult,
    user_persistent: object,
    epochs_hint: int | None,
    samples_per_epoch: int | None,
    batch_size: int,
    notes: list[str],
    *,
    set_epoch: bool = False,
) -> dict[str, Any]:
    """The four tuned settings of ``choice`` (the cache stores them as ``"best"``).

    ``persistent_workers`` is the caller's when given, else :func:`persistent_workers`;
    the notes that explain it are appended to ``notes``.

    Example:
        >>> notes = []
        >>> best_settings(CandidateResult(0, None, False, "ok"), True, None, 64, 8, notes)
        {'num_workers': 0, 'prefetch_factor': None, 'pin_memory': False, 'persistent_workers': True}
        >>> notes
        ['persistent_workers=True dropped: it needs num_workers > 0']
    """
    if user_persistent is not None:
        persistent = bool(user_persistent)
    else:
        persistent, why = persistent_workers(
            choice, epochs_hint, samples_per_epoch, batch_size, set_epoch=set_epoch
        )
        if why:
            notes.append(why)
    if user_persistent and choice.num_workers == 0:
        notes.append("persistent_workers=True dropped: it needs num_workers > 0")
    return {
        "num_workers": choice.num_workers,
        "prefetch_factor": choice.prefetch_factor,
        "pin_memory": choice.pin_memory,
        "persistent_workers": persistent,
    }


def final_kwargs(
    loader_kwargs: Mapping[str, Any],
    batch_size: int,
    choice: Mapping[str, Any],
    notes: list[str],
) -> dict[str, Any]:
    """``best_kwargs``: the caller's arguments, ``batch_size`` and the tuned settings.

    DataLoader rejects ``prefetch_factor``, ``persistent_workers=True`` and a
    ``multiprocessing_context`` with ``num_workers=0``, so they are dropped then (a dropped
    context is noted in ``notes``).

    Example:
        >>> notes = []
        >>> kw = final_kwargs({"shuffle": True, "multiprocessing_context": "spawn"}, 8,
        ...                   {"num_workers": 0, "prefetch_factor": None, "pin_memory": False,
        ...                    "persistent_workers": True}, notes)
        >>> kw["batch_size"], kw["shuffle"], kw["persistent_workers"], "prefetch_factor" in kw
        (8, True, False, False)
        >>> notes
        ['multiprocessing_context dropped: it needs num_workers > 0']
    """
    out: dict[str, Any] = {**loader_kwargs, "batch_size": batch_size}
    n = int(choice["num_workers"])
    out["num_workers"] = n
    out["pin_memory"] = bool(choice["pin_memory"])
    if n > 0:
        out["prefetch_factor"] = int(choice["prefetch_factor"] or 2)
        out["persistent_workers"] = bool(choice["persistent_workers"])
    else:
        # DataLoader rejects these with num_workers=0.
        out.pop("prefetch_factor", None)
        out["persistent_workers"] = False
        if out.pop("multiprocessing_context", None) is not None:
            notes.append("multiprocessing_context dropped: it needs num_workers > 0")
        if out.pop("timeout", 0):
            notes.append("timeout dropped: it needs num_workers > 0")
    return out


def forced_fallback(choice: CandidateResult, candidates: list[CandidateResult]) -> bool:
    """A ``num_workers=0`` choice forced by failing or refused workers (a crash, too little
    ``/dev/shm`` or memory, the budget), which is not a choice to keep: the next call tunes
    again, so it can see a fixed dataset or a bigger ``/dev/shm``. Workers refused for want
    of cores are a real choice.

    Example:
        >>> zero = CandidateResult(0, None, False, "ok", samples_per_s=100.0)
        >>> crashed = CandidateResult(2, 2, False, "failed", fault="crash")
        >>> too_many = CandidateResult(2, 2, False, "skipped", fault="cpu")
        >>> forced_fallback(zero, [zero, crashed]), forced_fallback(zero, [zero, too_many])
        (True, False)
    """
    return choice.num_workers == 0 and any(
        c.num_workers > 0 and c.fault is not None and c.fault != "cpu" for c in candidates
    )
