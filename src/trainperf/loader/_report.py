"""What the DataLoader tuner measured and chose: :class:`CandidateResult`, :class:`TuningReport`.

The table ``str(report)`` prints is drawn in :mod:`._report_table`, the chart of
:meth:`TuningReport.plot` in :mod:`._report_plot`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from trainperf._utils.format import format_bytes
from trainperf.limits import HostLimits
from trainperf.loader._report_table import report_table

__all__ = ["CandidateResult", "FaultKind", "Status", "TuningReport", "UserSetting", "format_bytes"]

Status = Literal["ok", "failed", "skipped"]
"""``ok``: measured; ``failed``: tried and broke; ``skipped``: not tried, predicted unsafe or
pointless."""

FaultKind = Literal[
    "crash", "hang", "pickle", "shm", "memory", "cpu", "error", "budget", "unsharded"
]
"""Why a candidate failed or was skipped:

- ``crash``: a worker died (a segfault, ``os._exit``, a signal other than SIGKILL, ...);
- ``hang``: no batch arrived within the timeout, or, when the budget cut the timeout short,
  within what was left of it (then the budget may simply be too short);
- ``pickle``: the dataset (or ``collate_fn``/``worker_init_fn``) cannot be sent to workers
  started with ``spawn``/``forkserver``, or the batches ``collate_fn`` returns cannot be sent
  back from workers (:mod:`trainperf.loader._picklable`);
- ``shm``: ``/dev/shm`` is (or would be) too small for the batches in flight;
- ``memory``: skipped, workers plus batches in flight would not fit in available memory;
  failed, a worker was killed by SIGKILL (exit code -9), most likely by the out-of-memory
  killer;
- ``cpu``: the workers would need more cores than are left after the main process's share;
- ``error``: the dataset (or ``worker_init_fn``) raised inside a worker, or a process ran
  out of file descriptors ("Too many open files", even in torch's "unable to open shared
  memory object");
- ``budget``: the time budget ran out before a steady-state window was timed;
- ``unsharded``: an ``IterableDataset`` that does not shard its stream across workers (two
  workers yielded the same items), so every worker would replay the whole stream.
"""


@dataclass(frozen=True)
class CandidateResult:
    """One DataLoader configuration the tuner considered.

    Attributes:
        num_workers: worker processes (0: loading in the main process).
        prefetch_factor: batches each worker keeps in flight (None when ``num_workers=0``).
        pin_memory: whether batches were copied to page-locked memory.
        status: ``"ok"``, ``"failed"`` or ``"skipped"``.
        samples_per_s: steady-state throughput (median of the timed windows), None unless ok.
        spread: (max - min) / median of the windows' throughputs; small means trustworthy.
        windows: timed windows.
        batches: batches inside the timed windows.
        startup_s: seconds from ``iter(loader)`` to the first batch (worker start-up plus
            one batch).
        worker_peak_rss: peak resident memory of all workers together, in bytes. Pages
            shared with the main process count in every worker, so this overstates the
            memory really used; see ``worker_uss``.
        worker_uss: private memory one worker is expected to reach over the run, in bytes: the
            largest worker's measured USS plus its growth per sample projected over the
            dataset (a forked worker copies the pages of the Python objects it reads), capped
            at the main process's private memory; what one more worker costs.
        worker_cpu: CPU cores the workers demanded during the windows (time running plus
            time waiting for a CPU, so other load on the host does not hide it).
        main_cpu: the same for the measuring thread of the main process.
        batch_bytes: bytes of tensor data in one batch.
        elapsed_s: wall time spent on this candidate, start-up and shutdown included.
        fault: why it failed or was skipped (see :data:`FaultKind`), else None.
        reason: a sentence saying what went wrong and the fix, else None.
    """

    num_workers: int
    prefetch_factor: int | None
    pin_memory: bool
    status: Status
    samples_per_s: float | None = None
    spread: float | None = None
    windows: int = 0
    batches: int = 0
    startup_s: float | None = None
    worker_peak_rss: int | None = None
    worker_uss: int | None = None
    worker_cpu: float | None = None
    main_cpu: float | None = None
    batch_bytes: int | None = None
    elapsed_s: float = 0.0
    fault: FaultKind | None = None
    reason: str | None = None

    @property
    def ok(self) -> bool:
        """True when the candidate was measured successfully."""
        return self.status == "ok" and self.samples_per_s is not None

    def label(self) -> str:
        """A short name of the configuration: ``"workers=4 prefetch=2 pin=no"``.

        Example:
            >>> CandidateResult(4, 2, False, "ok").label()
            'workers=4 prefetch=2 pin=no'
            >>> CandidateResult(0, None, True, "skipped").label()
            'workers=0 prefetch=- pin=yes'
        """
        pf = "-" if self.prefetch_factor is None else str(self.prefetch_factor)
        return f"workers={self.num_workers} prefetch={pf} pin={'yes' if self.pin_memory else 'no'}"

    def to_dict(self) -> dict[str, Any]:
        """Every field by name, JSON-safe; ``CandidateResult(**c.to_dict())`` is ``c`` again.

        This is how the tuner's cache stores a candidate.

        Example:
            >>> c = CandidateResult(2, 2, False, "ok", samples_per_s=250.0)
            >>> d = c.to_dict()
            >>> d["num_workers"], d["samples_per_s"], d["fault"], CandidateResult(**d) == c
            (2, 250.0, None, True)
        """
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class UserSetting:
    """The caller's own ``num_workers`` (and ``prefetch_factor``, ``pin_memory``), measured as
    one candidate, and the verdict on it.

    Attributes:
        given: the caller's ``num_workers``, ``prefetch_factor``, ``pin_memory`` and
            ``persistent_workers``, as passed.
        num_workers: the configuration measured as the caller's: ``num_workers`` as given...
        prefetch_factor: ...``prefetch_factor`` as given, else DataLoader's default (2 with
            workers, None without)...
        pin_memory: ...and ``pin_memory`` as given, else DataLoader's default (False).
        kept: whether ``best_kwargs`` keeps this configuration.
        samples_per_s: its measured throughput (None when it was not measured).
        verdict: why it was kept, or why not and what was chosen instead.
    """

    given: dict[str, Any]
    num_workers: int
    prefetch_factor: int | None
    pin_memory: bool
    kept: bool
    samples_per_s: float | None
    verdict: str

    def to_dict(self) -> dict[str, Any]:
        """Every field by name, JSON-safe; ``UserSetting(**s.to_dict())`` is ``s`` again.

        Example:
            >>> s = UserSetting({"num_workers": 0}, 0, None, False, True, 90.0, "the fastest")
            >>> UserSetting(**s.to_dict()) == s, s.to_dict()["kept"]
            (True, True)
        """
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        """One line: the setting as given, kept or replaced, and why.

        Example:
            >>> print(UserSetting({"num_workers": 1, "pin_memory": True}, 1, 2, True, False,
            ...                   100.0, "workers=3 prefetch=2 pin=yes is 2.50x as fast"))
            ... # doctest: +NORMALIZE_WHITESPACE
            your setting num_workers=1, pin_memory=True: replaced:
            workers=3 prefetch=2 pin=yes is 2.50x as fast
        """
        given = ", ".join(f"{k}={v!r}" for k, v in self.given.items())
        return f"your setting {given}: {'kept' if self.kept else 'replaced'}: {self.verdict}"


def _json_value(value: Any) -> Any:
    """``value`` if JSON holds it, else a description: a function or class by its qualified
    name, a multiprocessing context by its start method, anything else by its repr.

    Example:
        >>> _json_value({"shuffle": True, "collate_fn": len, "ids": (1, 2)})
        {'shuffle': True, 'collate_fn': 'builtins.len', 'ids': [1, 2]}
    """
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _json_value(v) for k, v in value.items()}
    if hasattr(value, "get_start_method"):
        return str(value.get_start_method())
    name = getattr(value, "__qualname__", None)
    if callable(value) and isinstance(name, str):
        return f"{getattr(value, '__module__', None) or '?'}.{name}"
    return repr(value)


@dataclass(frozen=True)
class TuningReport:
    """The result of :func:`trainperf.loader.tune_loader`.

    Attributes:
        best_kwargs: keyword arguments for ``DataLoader(dataset, **best_kwargs)``: the
            chosen ``num_workers``, ``prefetch_factor``, ``pin_memory`` and
            ``persistent_workers``, ``batch_size``, and the caller's own keyword arguments
            (``collate_fn``, ``shuffle``, ``sampler``, ...) unchanged.
        samples_per_s: measured steady-state throughput of the chosen configuration (None
            when nothing could be measured within the budget).
        baseline_samples_per_s: the same for ``num_workers=0``.
        step_samples_per_s: throughput of the caller's ``step_fn`` alone, when given.
        candidates: every configuration considered, in the order tried.
        elapsed_s: wall time of the whole tuning (or of the cache lookup).
        budget_s: the wall-clock budget it ran under.
        limits: the CPU, memory and shared-memory limits that bounded the search.
        cpus: CPUs usable by this process (its share when several local ranks run).
        worker_cpus: whole cores the workers may keep busy: ``cpus - main_cores``, rounded,
            at least 1.
        max_workers: the largest ``num_workers`` considered.
        device: the device batches are meant for (``"cpu"``, ``"cuda:0"``, ...).
        batch_size: the batch size tuned for.
        from_cache: True when the settings came from the cache without measuring.
        notes: remarks on the decisions (fallbacks, budget, persistence, cache).
        main_cores: cores kept for the main process: 1.0 when no ``step_fn`` was given (the
            training step is unknown), else the cores ``step_fn`` was measured to use.
        user_setting: the caller's own ``num_workers`` (and friends) and the verdict on
            it (see :class:`UserSetting`); None when ``num_workers`` was not passed.
        shared_from: under DDP, the global rank whose local rank 0 tuned these settings
            and sent them to this rank; None when this process tuned (or read the cache).
    """

    best_kwargs: dict[str, Any]
    samples_per_s: float | None
    baseline_samples_per_s: float | None
    step_samples_per_s: float | None
    candidates: tuple[CandidateResult, ...]
    elapsed_s: float
    budget_s: float
    limits: HostLimits
    cpus: int
    worker_cpus: int
    max_workers: int
    device: str
    batch_size: int
    from_cache: bool = False
    notes: tuple[str, ...] = field(default=())
    main_cores: float = 1.0
    user_setting: UserSetting | None = None
    shared_from: int | None = None

    @property
    def num_workers(self) -> int:
        """The chosen ``num_workers``."""
        return int(self.best_kwargs["num_workers"])

    @property
    def speedup(self) -> float | None:
        """Chosen throughput over ``num_workers=0`` throughput (None when unknown)."""
        if not self.samples_per_s or not self.baseline_samples_per_s:
            return None
        return self.samples_per_s / self.baseline_samples_per_s

    def chosen(self) -> CandidateResult | None:
        """The measured candidate that matches ``best_kwargs`` (None if it was not measured).

        Example:
            >>> from trainperf.limits import HostLimits
            >>> zero = CandidateResult(0, None, False, "ok", samples_per_s=100.0)
            >>> two = CandidateResult(2, 2, False, "ok", samples_per_s=250.0)
            >>> report = TuningReport(
            ...     {"num_workers": 2, "prefetch_factor": 2, "pin_memory": False},
            ...     250.0, 100.0, None, (zero, two), 1.0, 5.0,
            ...     HostLimits(4, 4, None, 4, 2**33, None, 2**32, None, None), 4, 3, 8, "cpu", 32)
            >>> report.chosen() is two, report.chosen().label()
            (True, 'workers=2 prefetch=2 pin=no')
        """
        pf = self.best_kwargs.get("prefetch_factor")
        for c in self.candidates:
            if (
                c.ok
                and c.num_workers == self.num_workers
                and c.prefetch_factor == pf
                and c.pin_memory == bool(self.best_kwargs.get("pin_memory", False))
            ):
                return c
        return None

    def to_dict(self) -> dict[str, Any]:
        """The report as plain dicts, lists, strings and numbers (``json.dumps`` takes it).

        Every field by name, plus ``num_workers`` and ``speedup``. ``candidates`` are
        :meth:`CandidateResult.to_dict`, ``limits`` the :class:`~trainperf.limits.HostLimits`
        fields, ``user_setting`` :meth:`UserSetting.to_dict`, and ``best_kwargs`` values JSON
        cannot hold (a ``collate_fn``, a sampler) are described: functions and classes by
        qualified name, anything else by repr.

        Example:
            >>> import json
            >>> from trainperf.limits import HostLimits
            >>> zero = CandidateResult(0, None, False, "ok", samples_per_s=100.0)
            >>> report = TuningReport(
            ...     {"num_workers": 0, "collate_fn": len}, 100.0, 100.0, None, (zero,), 1.0,
            ...     5.0, HostLimits(4, 4, None, 4, 2**33, None, 2**32, None, None), 4, 3, 8,
            ...     "cpu", 32)
            >>> data = json.loads(json.dumps(report.to_dict()))
            >>> data["best_kwargs"], data["speedup"], data["candidates"][0]["status"]
            ({'num_workers': 0, 'collate_fn': 'builtins.len'}, 1.0, 'ok')
        """
        return {
            "best_kwargs": _json_value(self.best_kwargs),
            "num_workers": self.num_workers,
            "samples_per_s": self.samples_per_s,
            "baseline_samples_per_s": self.baseline_samples_per_s,
            "speedup": self.speedup,
            "step_samples_per_s": self.step_samples_per_s,
            "candidates": [c.to_dict() for c in self.candidates],
            "elapsed_s": self.elapsed_s,
            "budget_s": self.budget_s,
            "limits": dataclasses.asdict(self.limits),
            "cpus": self.cpus,
            "worker_cpus": self.worker_cpus,
            "main_cores": self.main_cores,
            "max_workers": self.max_workers,
            "device": self.device,
            "batch_size": self.batch_size,
            "from_cache": self.from_cache,
            "notes": list(self.notes),
            "user_setting": None if self.user_setting is None else self.user_setting.to_dict(),
            "shared_from": self.shared_from,
        }

    def __str__(self) -> str:
        return report_table(self)

    def plot(self, path: str | os.PathLike[str]) -> Path:
        """Save a chart of throughput against ``num_workers`` to ``path`` (PNG, SVG, PDF...).

        One line per (prefetch_factor, pin_memory) pair; the chosen configuration is starred
        and the ``step_fn`` throughput, when known, drawn as a horizontal line.

        Args:
            path: the image file to write; its suffix picks the format (none: a PNG at
                exactly ``path``).

        Returns:
            ``path`` as a :class:`~pathlib.Path`.

        Raises:
            FileNotFoundError: the folder ``path`` is in does not exist (before drawing).
            IsADirectoryError: ``path`` is a folder.
            ModuleNotFoundError: matplotlib is not installed.

        Example:
            >>> from trainperf.limits import HostLimits
            >>> r = TuningReport({"num_workers": 0}, None, None, None, (), 0.0, 1.0,
            ...                  HostLimits(2, 2, None, 2, 2**33, None, 2**32, None, None),
            ...                  2, 1, 4, "cpu", 8)
            >>> try:
            ...     _ = r.plot("/tmp/trainperf-doctest-plot.png")
            ... except ModuleNotFoundError as e:
            ...     print("pip install" in str(e))
            ... else:
            ...     print(True)
            True
        """
        from trainperf.loader._report_plot import plot_report

        return plot_report(self, path)
