"""The caller's own worker settings: measured as one candidate, and the verdict on them.

Scripts build ``DataLoader(dataset, **kwargs)`` with ``num_workers`` (and often
``pin_memory``) in ``kwargs``; handed to the tuner, those are the caller's current setting.
It is measured right after ``num_workers=0`` and before the search (so the budget cannot run
out before it, and the search starts from its measured cost), provided it fits the limits
every candidate must fit (the cores left for workers, memory, ``/dev/shm``) and
``max_workers``. It then competes by the rule every candidate follows (fewest workers within
2 % of the best), and :func:`judge` says whether it was kept and why. ``pin_memory`` and
``persistent_workers`` given are kept as given, as they always were, so only ``num_workers``
and ``prefetch_factor`` can be replaced.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from trainperf.loader._report import CandidateResult, UserSetting
from trainperf.loader._search import TIE, Search

__all__ = ["GIVEN", "UserConfig", "given_settings", "judge", "user_config"]

GIVEN = ("num_workers", "prefetch_factor", "pin_memory", "persistent_workers")
"""The DataLoader arguments that make up the caller's setting."""

UserConfig = tuple[int, "int | None", bool]
"""``(num_workers, prefetch_factor, pin_memory)`` of the caller's setting."""


def user_config(loader_kwargs: Mapping[str, Any]) -> UserConfig | None:
    """The configuration the caller's arguments describe, with DataLoader's defaults for
    what they leave out; None without ``num_workers`` (nothing to compare with).

    Example:
        >>> user_config({"num_workers": 2}), user_config({"num_workers": 0, "pin_memory": 1})
        ((2, 2, False), (0, None, True))
        >>> user_config({"shuffle": True}) is None
        True
    """
    if "num_workers" not in loader_kwargs:
        return None
    n = int(loader_kwargs["num_workers"])
    pf = loader_kwargs.get("prefetch_factor")
    return n, None if n == 0 else int(pf or 2), bool(loader_kwargs.get("pin_memory", False))


def given_settings(loader_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The caller's :data:`GIVEN` arguments, JSON-safe (the flags as bools).

    Example:
        >>> given_settings({"num_workers": 1, "pin_memory": 1, "shuffle": True})
        {'num_workers': 1, 'pin_memory': True}
    """
    out = {k: loader_kwargs[k] for k in GIVEN if k in loader_kwargs}
    for flag in ("pin_memory", "persistent_workers"):
        if flag in out:
            out[flag] = bool(out[flag])
    return out


def _speed(search: Search, c: CandidateResult) -> str:
    with_step = " with step_fn" if search.step_samples_per_s is not None else ""
    return f"{search.objective(c):,.1f} samples/s{with_step}"


def _not_measured(search: Search, user: UserConfig, mine: CandidateResult | None) -> str:
    n = user[0]
    if mine is None and n > search.max_workers:
        return (
            f"not measured: num_workers={n} is above max_workers={search.max_workers}; pass "
            f"max_workers={n} to have it measured"
        )
    if mine is None:
        return "not measured: the search stopped first (num_workers=0 could not be measured)"
    if mine.status == "skipped":
        return f"not measured: {mine.reason}"
    return f"failed ({mine.fault}): {mine.reason}"


def _why_kept(search: Search, mine: CandidateResult) -> str:
    measured = [c for c in search.results if c.ok]
    best = max(measured, key=search.objective)
    if len(measured) == 1:
        return f"the only configuration measured ({_speed(search, mine)})"
    if search.objective(mine) >= search.objective(best):
        return (
            f"the fastest of the {len(measured)} configurations measured ({_speed(search, mine)})"
        )
    return (
        f"within {100 * TIE:g} % of the fastest ({best.label()}: {_speed(search, best)}) and "
        f"the one with the fewest workers"
    )


def _smaller(choice: CandidateResult, mine: CandidateResult) -> str:
    if choice.num_workers < mine.num_workers:
        return "fewer workers"
    if (choice.prefetch_factor or 0) < (mine.prefetch_factor or 0):
        return "a smaller prefetch_factor"
    return f"pin_memory={choice.pin_memory}, preferred on a tie"


def _why_replaced(search: Search, choice: CandidateResult, mine: CandidateResult) -> str:
    problem = search.memory_problem(mine.num_workers, mine.prefetch_factor, mine.pin_memory)
    if problem is not None:
        return (
            f"it ran, but its workers' measured memory would not last the run: {problem[1]}; "
            f"chosen instead: {choice.label()}"
        )
    ours, theirs = search.objective(choice), search.objective(mine)
    if ours > theirs * (1 + TIE):
        return (
            f"{choice.label()} is {ours / theirs:.2f}x as fast ({_speed(search, choice)} against "
            f"{_speed(search, mine)})"
        )
    return (
        f"{choice.label()} is as fast (within {100 * TIE:g} %) with {_smaller(choice, mine)} "
        f"({_speed(search, choice)} against {_speed(search, mine)})"
    )


def judge(
    search: Search, choice: CandidateResult, user: UserConfig, given: Mapping[str, Any]
) -> UserSetting:
    """Whether the search's ``choice`` keeps the caller's configuration ``user``, and why.

    Args:
        search: the finished search (its results include the caller's candidate when it
            was tried).
        choice: what the search chose.
        user: the caller's configuration (:func:`user_config`).
        given: the caller's arguments as passed (:func:`given_settings`).

    Example:
        >>> base = CandidateResult(0, None, False, "ok", samples_per_s=100.0, main_cpu=1.0)
        >>> def measure(n, pf, pin):  # n workers load n times as fast
        ...     return CandidateResult(n, pf, pin, "ok", samples_per_s=100.0 * n)
        >>> s = Search(measure, lambda: False, worker_cpus=4, max_workers=4,
        ...            memory_available=2**36, shm_free=None, start_method="fork",
        ...            user=(1, 2, False))
        >>> choice = s.run(base)
        >>> print(judge(s, choice, (1, 2, False), {"num_workers": 1}))  # doctest: +ELLIPSIS
        your setting num_workers=1: replaced: workers=4 prefetch=2 pin=no is 4.00x as fast ...
    """
    n, pf, pin = user
    mine = search.find(n, pf, pin)
    kept = choice.ok and (choice.num_workers, choice.prefetch_factor, choice.pin_memory) == user
    if mine is None or not mine.ok:
        verdict = f"{_not_measured(search, user, mine)}; chosen instead: {choice.label()}"
    elif kept:
        verdict = _why_kept(search, mine)
    else:
        verdict = _why_replaced(search, choice, mine)
    rate = mine.samples_per_s if mine is not None and mine.ok else None
    return UserSetting(dict(given), n, pf, pin, kept, rate, verdict)
