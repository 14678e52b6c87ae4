"""The optimizer's share of a step, charged as gradient accumulation will run it.

With ``global_batch`` set, training at micro-batch ``b`` runs ``per_rank / b`` forward and
backward passes per optimizer step (``per_rank = global_batch / world_size``). A probe runs
the caller's whole ``step`` once per micro-batch, optimizer step included, so a small ``b``
would be charged ``per_rank / b - 1`` optimizer steps that training never runs, and the
tuner would lean towards large sizes. Each timed window therefore times the optimizers'
``step`` (:class:`OptimizerClock`, from their step hooks) and counts it once per
``per_rank`` samples (:func:`accumulated_seconds`). The report says which was done
(:func:`accumulation_notes`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from types import TracebackType
from typing import Any

import torch
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from trainperf.batchsize._report import BatchSizeCandidate

__all__ = ["OptimizerClock", "accumulated_seconds", "accumulation_notes", "known_optimizers"]


def accumulated_seconds(seconds: float, optimizer_s: float, size: int, per_rank: int) -> float:
    """The seconds that steps at micro-batch ``size`` would take in training that steps the
    optimizer once per ``per_rank`` samples, from ``seconds`` measured with one optimizer
    step per micro-batch, ``optimizer_s`` of them in the optimizer: each micro-batch keeps
    ``size / per_rank`` of its optimizer time.

    Example:
        >>> # 10 ms forward+backward and 20 ms optimizer at 8; accumulated 8 times to 64
        >>> round(accumulated_seconds(0.030, 0.020, 8, 64), 6)
        0.0125
        >>> accumulated_seconds(0.030, 0.020, 64, 64)  # no accumulation: as measured
        0.03
    """
    return seconds - optimizer_s + optimizer_s * size / per_rank


def accumulation_notes(
    per_rank: int | None, charged: bool, candidates: Sequence[BatchSizeCandidate]
) -> tuple[str, ...]:
    """What the report says about the optimizer's share (nothing unless a measured size
    accumulates).

    Example:
        >>> c = BatchSizeCandidate(8, "ok", samples_per_s=100.0, accumulation_steps=8)
        >>> accumulation_notes(64, True, [c])[0][:44]
        'samples/s count the optimizer step once per '
        >>> accumulation_notes(None, False, [c])
        ()
    """
    if per_rank is None or not any(
        c.samples_per_s is not None and c.accumulation_steps > 1 for c in candidates
    ):
        return ()
    if charged:
        return (
            f"samples/s count the optimizer step once per {per_rank} samples (per rank), as "
            f"accumulation runs it: its share of each step was timed and charged accordingly",
        )
    return (
        "no optimizer step was timed (no optimizer passed, nor found stepping model's "
        "parameters, or step stepped none of them): "
        f"if step runs one, each micro-batch was charged a whole optimizer step, which "
        f"accumulation runs once per {per_rank} samples, so sizes below that look slower "
        f"than they train",
    )


def known_optimizers(objects: Iterable[Any]) -> list[Optimizer]:
    """The optimizers among ``objects``, and those the schedulers among them drive, each once.

    Example:
        >>> m = torch.nn.Linear(2, 2)
        >>> opt = torch.optim.SGD(m.parameters(), lr=0.1)
        >>> sched = torch.optim.lr_scheduler.StepLR(opt, 1)
        >>> known_optimizers([m, sched, opt]) == [opt]
        True
    """
    found: list[Optimizer] = []
    for obj in objects:
        opt = obj if isinstance(obj, Optimizer) else getattr(obj, "optimizer", None)
        if isinstance(opt, Optimizer) and all(opt is not seen for seen in found):
            found.append(opt)
    return found


class OptimizerClock:
    """Time spent in the ``step`` of ``optimizers`` while the ``with`` block runs.

    Step pre- and post-hooks mark each step's start and end: ``time.perf_counter()`` off
    CUDA; on CUDA, timing events recorded on the device's current stream, read by
    :meth:`seconds` once the caller has synchronised (nothing here synchronises). A step
    inside another (an optimizer subclass whose ``step`` calls its parent's, both hooked;
    a wrapper optimizer that steps an inner one) counts once. The hooks are removed when
    the block ends, however it ends.

    Example:
        >>> w = torch.nn.Parameter(torch.ones(2))
        >>> opt = torch.optim.SGD([w], lr=0.1)
        >>> with OptimizerClock([opt], torch.device("cpu")) as clock:
        ...     w.sum().backward()
        ...     opt.step()
        >>> clock.steps, clock.seconds() > 0, len(opt._optimizer_step_pre_hooks)
        (1, True, 0)
    """

    def __init__(self, optimizers: Sequence[Optimizer], device: torch.device) -> None:
        self._optimizers = optimizers
        self._device = device
        self._handles: list[RemovableHandle] = []
        self._depth = 0
        self._start: Any = None
        self._spans: list[tuple[Any, Any]] = []

    @property
    def steps(self) -> int:
        """Optimizer steps timed (outermost ones)."""
        return len(self._spans)

    def __enter__(self) -> OptimizerClock:
        try:
            for opt in self._optimizers:
                self._handles.append(opt.register_step_pre_hook(self._pre))
                self._handles.append(opt.register_step_post_hook(self._post))
        except BaseException:
            self._remove()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._remove()

    def _remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _mark(self) -> Any:
        if self._device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(self._device))
        return event

    def _pre(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        if self._depth == 0:
            self._start = self._mark()
        self._depth += 1

    def _post(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._spans.append((self._start, self._mark()))

    def seconds(self) -> float:
        """Seconds in the timed steps; on CUDA, call it after synchronising the device."""
        if self._device.type != "cuda":
            return float(sum(end - start for start, end in self._spans))
        return float(sum(start.elapsed_time(end) for start, end in self._spans)) / 1000.0
