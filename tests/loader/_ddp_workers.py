"""What the loader's multi-process tests run on every rank (module level, so ranks import it)."""

from __future__ import annotations

import time
from typing import Any

import torch.distributed as dist

from tests.loader._fakes import Waits
from trainperf.loader import _share, tune_loader
from trainperf.loader import _tune_prepare as tune_prepare


def tune_and_count(
    cache: bool, callers: tuple[int, ...] = (0, 1), share_grace_s: float | None = None
) -> dict[str, Any]:
    """``tune_loader`` on the ranks in ``callers``; what it measured here and reported."""
    measured: list[int] = []
    real = tune_prepare.measure

    def counting(*args: Any, **kwargs: Any) -> Any:
        measured.append(kwargs["num_workers"])
        return real(*args, **kwargs)

    if share_grace_s is not None:
        _share.GRACE_S = share_grace_s
    if dist.get_rank() not in callers:
        return {"called": False}
    tune_prepare.measure = counting  # type: ignore[assignment]
    started = time.perf_counter()
    try:
        report = tune_loader(
            Waits(), 4, device="cpu", max_workers=0, budget_s=3.0, cache=cache, progress=False
        )
    finally:
        tune_prepare.measure = real
    return {
        "called": True,
        "measured": measured,
        "best_kwargs": report.best_kwargs,
        "shared_from": report.shared_from,
        "from_cache": report.from_cache,
        "cpus": report.cpus,
        "text": str(report),
        "seconds": time.perf_counter() - started,
    }
