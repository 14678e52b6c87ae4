"""The batch size that trains fastest, found by measurement: :func:`tune_batch_size`.

Throughput per sample flattens (or falls) well before memory is full, and the largest size
that fits a quick probe often runs out of memory later. The tuner runs your own training
step at a few sizes (geometric growth, then refinement around the best), times each in
steady state, measures its peak memory, catches out-of-memory errors, and returns the
fastest size that ran within the memory headroom, with the gradient accumulation that keeps
your effective batch.

- :mod:`._tune`: the entry point; :mod:`._args`: its argument checks;
- :mod:`._search`: the pure search rules (growth, refinement, memory prediction, choice);
- :mod:`._probe`: one size run: warm-up, timed windows, out-of-memory recovery (its rules
  in :mod:`._probe_rules`), and :mod:`._trained`: whether ``step`` trained;
- :mod:`._memory`: peak memory and its limit (CUDA allocator, host RSS);
- :mod:`._state`: the model, optimizer and other state saved and restored, and
  :mod:`._holders`: the optimizers, schedulers and MixedPrecisions found unpassed;
- :mod:`._agree`: under DDP, every rank deciding alike;
- :mod:`._sample`: :func:`batches_from` a dataset, and the check of ``sample(n)``;
- :mod:`._report`: :class:`BatchSizeReport`, :class:`BatchSizeCandidate`,
  :class:`PipelineMemory` (with :mod:`._plot`);
- :mod:`._cache`: the cached choices; :mod:`._progress`: the progress bar.

A training script (the guide, ``docs/batch-size.md``, says more)::

    report = tune_batch_size(step, batches_from(train_set), model=model, optimizer=opt,
                             global_batch=256)
    print(report)                    # every size tried, and why this one
    loader = DataLoader(train_set, batch_size=report.batch_size, shuffle=True)
    # ... then step the optimizer every report.accumulation_steps batches

Example:
    >>> import torch
    >>> from torch.utils.data import TensorDataset
    >>> from trainperf.batchsize import batches_from
    >>> sample = batches_from(TensorDataset(torch.randn(100, 3)))
    >>> [x.shape for x in sample(16)]
    [torch.Size([16, 3])]
"""

from __future__ import annotations

from trainperf._utils.public import set_public_module
from trainperf.batchsize._report import (
    BatchSizeCandidate,
    BatchSizeReport,
    CandidateStatus,
    PipelineMemory,
)
from trainperf.batchsize._sample import DatasetBatches, batches_from
from trainperf.batchsize._tune import tune_batch_size

__all__ = [
    "BatchSizeCandidate",
    "BatchSizeReport",
    "CandidateStatus",
    "DatasetBatches",
    "PipelineMemory",
    "batches_from",
    "tune_batch_size",
]

set_public_module(globals(), __all__, __name__)
