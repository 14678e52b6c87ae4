"""``tune_loader``: the public entry point of the DataLoader tuner.

A call checks its arguments (:mod:`trainperf.loader._args`) and, with every random number
generator saved (:mod:`trainperf.loader._rng`), settles the device and the limits it works
in; under DDP only local rank 0 goes on, and the host's other ranks receive its result
(:mod:`trainperf.loader._share`). It returns a cached choice that still fits
(:mod:`trainperf.loader._cached`), or measures ``num_workers=0`` and ``step_fn``
(:mod:`trainperf.loader._step`), checks that an ``IterableDataset`` shards across workers
(:mod:`trainperf.loader._iterable`), searches (:mod:`trainperf.loader._search`) over
measurements (:mod:`trainperf.loader._measure`) and turns the choice into DataLoader
arguments (:mod:`trainperf.loader._choice`). ``autotune_loader`` builds the loader
(:mod:`trainperf.loader._autotune`). What a call settles first is in
:mod:`trainperf.loader._tune_setup`, the measurements the search starts from in
:mod:`trainperf.loader._tune_prepare`, and the check that a cache hit still describes the
dataset in :mod:`trainperf.loader._tune_stale`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from trainperf._utils.validate import fresh_stream
from trainperf.loader import _cache, _cached, _iterable, _share
from trainperf.loader._args import check_args, check_flags, check_stream_order
from trainperf.loader._budget import overrun_note
from trainperf.loader._choice import (
    NOT_CACHED,
    best_settings,
    final_kwargs,
    forced_fallback,
    has_set_epoch,
)
from trainperf.loader._progress import ProgressBar
from trainperf.loader._report import CandidateResult, TuningReport
from trainperf.loader._rng import (
    callers_generators,
    dataset_generators,
    preserved_generators,
    preserved_rng,
)
from trainperf.loader._tune_prepare import (
    _for_measuring,
    _main_batch_s,
    _prepare,
    _Prepared,
    main_rss,
)
from trainperf.loader._tune_setup import _set_up, _Setup
from trainperf.loader._tune_stale import _changed_since
from trainperf.loader._user import given_settings, judge, user_config

# main_rss: imported from here by trainperf.loader._autotune.
__all__ = ["main_rss", "tune_loader"]


@dataclass(frozen=True)
class _Call:
    """One call's arguments, checked, and what it settled before measuring."""

    dataset: Any
    loader_kwargs: dict[str, Any]
    epochs_hint: int | None
    step_fn: Callable[[Any], Any] | None
    cache: bool
    progress: bool
    setup: _Setup
    started: float


def _finish(
    call: _Call, key: str | None, prepared: _Prepared, choice: CandidateResult
) -> TuningReport:
    """The report of a search that chose ``choice``; stored in the cache unless forced."""
    search, setup, loader_kwargs = prepared.search, call.setup, call.loader_kwargs
    notes = list(search.notes)
    samples_per_epoch = _cache.length(loader_kwargs.get("sampler", call.dataset))
    persistent = loader_kwargs.get("persistent_workers")
    best = best_settings(
        choice,
        persistent,
        call.epochs_hint,
        samples_per_epoch,
        setup.batch_size,
        notes,
        set_epoch=has_set_epoch(call.dataset),
    )
    best_kwargs = final_kwargs(loader_kwargs, setup.batch_size, best, notes)
    forced = forced_fallback(choice, search.results)
    if key is not None and forced:
        notes.append(NOT_CACHED)
    user = user_config(loader_kwargs)
    elapsed = time.perf_counter() - call.started
    step = prepared.shares.step
    over = overrun_note(
        setup.budget_s,
        elapsed,
        _main_batch_s(prepared.baseline, setup.batch_size),
        None if step is None else step.longest_s,
    )
    report = TuningReport(
        best_kwargs=best_kwargs,
        samples_per_s=choice.samples_per_s,
        baseline_samples_per_s=prepared.baseline.samples_per_s,
        step_samples_per_s=prepared.shares.step_samples_per_s,
        candidates=tuple(search.results),
        elapsed_s=elapsed,
        notes=tuple(notes),
        worker_cpus=prepared.shares.worker_cpus,
        main_cores=prepared.shares.main_cores,
        user_setting=None
        if user is None
        else judge(search, choice, user, given_settings(loader_kwargs)),
        **setup.report_fields(),
    )
    if key is not None and choice.ok and not forced:
        n, pf, pin = choice.num_workers, choice.prefetch_factor, choice.pin_memory
        memory = search.memory_needed(n, pf, pin) if n else 0
        report = _cached.store(key, report, best, memory, search.shm_needed(n, pf))
        report = dataclasses.replace(report, elapsed_s=time.perf_counter() - call.started)
    if over is None:
        return report
    # Added after the entry was stored: the overrun is this call's, not the next hit's.
    return dataclasses.replace(report, notes=(*report.notes, over))


def _tune_here(call: _Call, key: str | None) -> TuningReport:
    """Answer from the cache entry ``key`` (None: no cache), else measure in this process."""
    setup = call.setup
    deadline = call.started + setup.budget_s
    misfit = None  # why a stored entry was not used, for the new report's notes
    if key is not None:
        hit, misfit = _cached.cached_report(
            key,
            setup.share,
            call.loader_kwargs,
            setup.report_fields(),
            iterable=_iterable.is_iterable(call.dataset),
        )
        if hit is not None:
            misfit = _changed_since(call, hit.baseline_samples_per_s, deadline)
            if misfit is None:  # the check loaded batches: part of the call's time
                return dataclasses.replace(hit, elapsed_s=time.perf_counter() - call.started)
    bar = ProgressBar(setup.budget_s, enabled=call.progress)
    try:
        measured = _for_measuring(call.dataset, call.loader_kwargs)
        prepared = _prepare(call.dataset, measured, call.step_fn, setup, deadline, bar)
        choice = prepared.search.run(prepared.baseline)
    finally:
        bar.close()
    report = _finish(call, key, prepared, choice)
    if misfit is None:
        return report
    # Added after _finish stored the entry: the note is about this call, not the next hit.
    return dataclasses.replace(report, notes=(misfit, *report.notes))


def _tuned(call: _Call) -> TuningReport:
    """Tuned in this process, or once per host under DDP (:mod:`trainperf.loader._share`)."""
    peers, why_not = _share.local_peers()
    fields_key = None
    if call.cache or peers is not None:
        setup = call.setup
        fields_key = _cached.entry_key(
            call.dataset,
            setup.batch_size,
            cpus=setup.cpus,
            device_type=setup.device.type,
            max_workers=setup.max_workers,
            epochs_hint=call.epochs_hint,
            step_fn=call.step_fn,
            loader_kwargs=call.loader_kwargs,
        )
    key = fields_key if call.cache else None
    if peers is None or fields_key is None:
        report = _tune_here(call, key)
        if why_not is not None:
            report = dataclasses.replace(report, notes=(*report.notes, why_not))
        return report
    share_key = _share.call_key(peers.host, fields_key)
    if peers.local_rank == 0:
        return _share.tune_and_send(peers, share_key, lambda: _tune_here(call, key))
    return _share.receive_or_tune(
        peers,
        share_key,
        call.setup.budget_s + _share.GRACE_S,
        lambda sender, entry: _cached.report_from_share(
            entry, call.loader_kwargs, call.setup.report_fields(), call.started, sender
        ),
        # Measured from now: the wait must not eat this rank's own budget.
        lambda: _tune_here(dataclasses.replace(call, started=time.perf_counter()), key),
    )


def tune_loader(
    dataset: Any,
    batch_size: int,
    *,
    device: str | torch.device | None = None,
    max_workers: int | None = None,
    budget_s: float = 30.0,
    epochs_hint: int | None = None,
    step_fn: Callable[[Any], Any] | None = None,
    cache: bool = True,
    progress: bool = True,
    **loader_kwargs: Any,
) -> TuningReport:
    """Choose ``num_workers``, ``prefetch_factor``, ``pin_memory`` and ``persistent_workers``
    for ``DataLoader(dataset, batch_size)`` by measuring steady-state throughput.

    ``num_workers=0`` is measured first; a prediction from its cost picks the first worker
    count, and a short climb refines it (see :mod:`trainperf.loader`). Workers are limited
    to the usable CPUs (affinity and cgroup quota, divided by the processes on this host,
    :func:`trainperf.limits.local_world_size`) minus what the main process needs — one core
    when the training step is unknown, what ``step_fn`` was measured to use when given —
    unless they mostly wait; to available memory (cgroup-aware) and to free ``/dev/shm``. A
    worker that crashes, hangs (see ``timeout``) or cannot be pickled marks its candidate failed;
    if no worker configuration works the result is ``num_workers=0`` with a
    ``RuntimeWarning`` saying why. A first batch (loaded with ``num_workers=0``) that cannot be
    pickled, so that workers could not send it back, rules out every worker count before any
    pool is started. One worker is measured before a pool of several, and a
    count the memory cannot hold is never started (it is listed as skipped, with the
    figures); a worker killed by SIGKILL is reported as likely out of memory. An
    ``IterableDataset`` that does not shard its stream across workers (each would replay
    it) keeps ``num_workers=0``, with a ``RuntimeWarning`` showing the fix. No worker
    outlives the call, even if this process is killed.

    Every random number generator is left as the call found it (python's ``random``,
    numpy's global generator, torch's CPU and CUDA generators, the ``generator`` and
    sampler generator passed in, and the generators the dataset owns as attributes, its
    wrapped ``.dataset``'s included; :mod:`trainperf.loader._rng`), so a seeded run trains
    the same whether the settings were measured, read from the cache, or not tuned at all.

    Under DDP (a process group initialised and several ranks on this host) local rank 0
    tunes and the host's other ranks receive its choice (``report.shared_from``); a rank
    that gets nothing within ``budget_s`` + 30 s tunes on its own
    (:mod:`trainperf.loader._share`). Call it on every rank with the same arguments.

    Any number below (``loader_kwargs``' ``num_workers``, ``prefetch_factor`` and ``timeout``
    too) may be a NumPy integer or float, as read from an array or a config: it is taken as
    the Python number it equals, so the report, the loader and the cache entry are the same.

    Args:
        dataset: a map-style or iterable dataset.
        batch_size: samples per batch.
        device: where batches go; ``pin_memory`` is only considered for CUDA, and on CUDA
            the host-to-device copy is part of the measurement. None or ``"auto"``:
            :func:`trainperf.best_device` (see :func:`trainperf.device.resolve_device`).
        max_workers: the largest ``num_workers`` to consider (default: four per usable CPU,
            2 to 64; 0 measures ``num_workers=0`` only).
        budget_s: wall-clock budget for the whole tuning, in seconds. Worker pools are cut
            at the deadline; work in this process (a batch loaded with ``num_workers=0``, a
            ``step_fn`` call) cannot be interrupted, so none is started that the previous
            one says would end after it, and the call returns within ``budget_s`` plus at
            most one such piece; the report's notes say when it ran over, and why
            (:mod:`trainperf.loader._budget`).
        epochs_hint: epochs the loader will run; with 1, workers are never kept alive
            between epochs. None means several.
        step_fn: your training step, called as ``step_fn(batch)``; timed on a few batches in
            this process so workers stop being added once loading outruns it, and the CPU it
            uses until it returns is what the main process keeps (instead of one whole
            core), so a GPU step that queues its kernels and returns leaves most of its core
            to workers. When the main process does nothing but take batches,
            ``step_fn=lambda batch: None`` says so. The batch is
            moved to ``device`` first (:func:`trainperf.device.to_device`, not timed), so a
            step written for GPU tensors works; on CUDA the device is synchronised around
            each timed call. The calls (up to six) are real: a step that trains trains the
            model, and only when measuring (a cached answer calls nothing), so a seeded
            run starts from other weights on its first run than on later ones. To keep
            them, ``saved = copy.deepcopy((model.state_dict(), opt.state_dict()))`` before
            and ``model.load_state_dict(saved[0]); opt.load_state_dict(saved[1])`` after,
            or tune before seeding and building the model you train.
        cache: reuse (and store) the choice in the user cache directory.
        progress: draw a progress bar on stderr.
        **loader_kwargs: other DataLoader arguments (``shuffle``, ``sampler``,
            ``collate_fn``, ``drop_last``, ``worker_init_fn``, ``multiprocessing_context``,
            ...), passed through unchanged. ``pin_memory`` or ``persistent_workers`` given
            here are kept as given. ``num_workers`` (with ``prefetch_factor``) is your
            current setting: measured as one candidate when it fits the limits and
            ``max_workers``, and judged in ``report.user_setting`` (kept, or what replaced
            it and why; :mod:`trainperf.loader._user`). ``timeout`` doubles as the hang
            limit while measuring.

    Returns:
        A :class:`TuningReport`; ``DataLoader(dataset, **report.best_kwargs)`` builds the
        loader.

    Raises:
        ValueError: a bad argument (an invalid ``device``, a negative ``num_workers``, a
            ``prefetch_factor`` without workers included), ``batch_sampler`` in
            ``loader_kwargs``, an empty loader, a dataset or ``sampler`` that is a one-shot
            iterator (a generator, an ``__iter__`` that only returns ``self``: tuning would
            use up its samples), an ``IterableDataset`` with ``shuffle=True`` or a
            ``sampler`` (its order is its own), or a bad
            ``LOCAL_WORLD_SIZE``/``SLURM_NTASKS_PER_NODE``/``LOCAL_RANK``.
        TypeError: ``device`` is not a str, int, torch.device or None; ``cache`` or
            ``progress`` is not True or False.
        DeviceError: CUDA (or MPS) asked for but not available, or a CUDA index beyond the
            visible GPUs.
        RuntimeError: the dataset fails in the main process, a batch cannot be moved to
            ``device`` for ``step_fn``, or ``step_fn`` raises; under DDP, tuning failed on
            local rank 0 (raised on the others, quoting its error).

    Example:
        >>> from torch.utils.data import TensorDataset
        >>> ds = TensorDataset(torch.randn(256, 8))
        >>> report = tune_loader(ds, 32, device="cpu", max_workers=0, budget_s=5,
        ...                      cache=False, progress=False, shuffle=True)
        >>> report.best_kwargs["num_workers"], report.best_kwargs["shuffle"]
        (0, True)
    """
    started = time.perf_counter()
    # From here on the numbers are Python's (a NumPy scalar passed in is converted).
    args = check_args(batch_size, max_workers, budget_s, epochs_hint, step_fn, loader_kwargs)
    check_stream_order(dataset, args.loader_kwargs)
    check_flags(cache=cache, progress=progress)
    fresh_stream(dataset, "tuning")
    owned = dataset_generators(dataset)
    kwargs = args.loader_kwargs
    with preserved_rng(callers_generators(kwargs)), preserved_generators(owned):
        setup = _set_up(args.batch_size, device, args.max_workers, args.budget_s, kwargs)
        cap, _ = _iterable.tail_batches(dataset, kwargs)
        if cap is not None and cap < setup.max_workers:
            setup = dataclasses.replace(setup, max_workers=cap)
        call = _Call(dataset, kwargs, args.epochs_hint, step_fn, cache, progress, setup, started)
        return _tuned(call)
