"""What each fix is predicted to gain: pure functions of the measured :class:`Figures`.

Each prediction is a function that returns the :class:`Fix` for one trainperf call (or None
where it does not apply), with ``predicted_speedup`` (samples per second after over before)
and a ``basis`` sentence naming the figures it came from. The verdict rules (``_rules``)
attach them to their verdicts; ``WatchReport.what_if()`` ranks them.

The models, all on the mean step ``T`` (wall time over steps), its data wait ``w`` and the
rest ``c = T - w``, are in the modules of their fixes: ``_predict_loader`` (a faster loader,
GPU decoding), ``_predict_stalls`` (without the stalls), ``_predict_step`` (lower
precision, a larger batch, the GPU) and ``_predict_cpus`` (fewer threads, the host's CPUs
back). This module holds what they share: the wording of the figures and the test for
workers the watch cannot see.
"""

from __future__ import annotations

from trainperf.monitor._figures import Figures, worker_cores

__all__ = ["hidden_workers"]

HIDDEN_WORKERS = 0.1  # child processes' cores that show workers behind a non-DataLoader


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def _cores(n: int) -> str:
    return f"{n} core" if n == 1 else f"{n} cores"


def _speedup(before: float, after: float) -> float:
    return before / after if after > 0 else 1.0


def hidden_workers(f: Figures) -> bool:
    """Child processes busy behind an iterable that is not a DataLoader: workers whose
    settings the watch cannot see."""
    return f.setup.num_workers is None and worker_cores(f) >= HIDDEN_WORKERS
