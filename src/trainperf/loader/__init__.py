"""Choose DataLoader settings by measurement: :func:`tune_loader` and :func:`autotune_loader`.

A starved input pipeline is the commonest reason a rented GPU idles. The tuner measures the
steady-state throughput of a few DataLoader configurations (not a grid) within a time
budget and returns the fastest one that fits the CPUs, memory and ``/dev/shm`` of this
process, without leaving a worker behind when a configuration crashes or hangs, or when
the process itself is killed.

- :mod:`._tune`: the entry points (with :mod:`._tune_setup`, :mod:`._tune_prepare`,
  :mod:`._tune_stale`); :mod:`._autotune`: ``autotune_loader`` and the loader
  it returns, whose workers die with their parent; :mod:`._adapt`: with ``adapt=True``, a
  loader that retunes itself between epochs, by the rules of :mod:`._adapt_rules` (its
  epoch timing :mod:`._adapt_timed`, decisions :mod:`._adapt_retune`, worker pools
  :mod:`._adapt_pool`), and whose iterators stop their workers once dropped
  (:mod:`._adapt_epoch`);
  :mod:`._args`: the argument checks; :mod:`._rng`: every random number generator left
  as the call found it; :mod:`._budget`: what ``budget_s`` guarantees;
- :mod:`._iterable`: an ``IterableDataset`` that does not shard its stream across workers,
  found on a short probe and kept at ``num_workers=0``; :mod:`._picklable`: a first batch
  that workers could not send back (it cannot be pickled), kept at ``num_workers=0`` too;
- :mod:`._measure`: timing one configuration and catching worker faults (:mod:`._faults`),
  with :mod:`._workers` (the pool's processes: watched, measured, stopped), :mod:`._fetch`
  (its DataLoader, every wait cut to the deadline), :mod:`._windows` (start-up and prefetch
  buffer excluded, repeated windows until they agree),
  :mod:`._memory` (worker memory projected over the run) and
  :mod:`trainperf._utils.batches`;
- :mod:`._step`: ``step_fn`` timed alone, and the cores it leaves to workers;
- :mod:`._search`: prediction from the single-process cost, then a short climb;
- :mod:`._user`: the caller's own ``num_workers`` measured as one candidate, and judged;
- :mod:`._choice`: ``persistent_workers`` and the DataLoader arguments of the choice;
- :mod:`._report`: :class:`TuningReport`, :class:`CandidateResult` and :class:`UserSetting`
  (their table :mod:`._report_table`, chart :mod:`._report_plot`);
- :mod:`._cache`: the JSON cache under the user cache directory; :mod:`._cached`: the
  entries ``tune_loader`` reads and writes there (and hands to other local ranks);
- :mod:`._share`: under DDP, tuning once per host on local rank 0;
- :mod:`._progress`: the progress bar.

Example:
    >>> import torch
    >>> from torch.utils.data import TensorDataset
    >>> from trainperf.loader import autotune_loader
    >>> loader = autotune_loader(TensorDataset(torch.randn(64, 4)), 8, device="cpu",
    ...                          max_workers=0, budget_s=5, cache=False, progress=False)
    >>> isinstance(loader, torch.utils.data.DataLoader), loader.tuning_report.from_cache
    (True, False)
"""

from __future__ import annotations

from trainperf._utils.public import set_public_module
from trainperf.loader._adapt import AdaptiveDataLoader, TuningChange
from trainperf.loader._autotune import TunedDataLoader, autotune_loader
from trainperf.loader._cache import cache_file
from trainperf.loader._measure import measure
from trainperf.loader._report import (
    CandidateResult,
    FaultKind,
    Status,
    TuningReport,
    UserSetting,
)
from trainperf.loader._tune import tune_loader
from trainperf.loader._windows import WindowPolicy

__all__ = [
    "AdaptiveDataLoader",
    "CandidateResult",
    "FaultKind",
    "Status",
    "TunedDataLoader",
    "TuningChange",
    "TuningReport",
    "UserSetting",
    "WindowPolicy",
    "autotune_loader",
    "cache_file",
    "measure",
    "tune_loader",
]

set_public_module(globals(), __all__, __name__)
