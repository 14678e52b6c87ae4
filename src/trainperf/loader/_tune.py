"""``tune_loader`` and ``autotune_loader``: the public entry points of the DataLoader tuner."""

from __future__ import annotations

import dataclasses
import inspect
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import psutil
import torch
from torch.utils.data import DataLoader

from trainperf.device import resolve_device
from trainperf.limits import HostLimits, host_limits, local_world_size, usable_cpus
from trainperf.loader import _cache
from trainperf.loader._faults import start_method
from trainperf.loader._measure import measure
from trainperf.loader._progress import ProgressBar
from trainperf.loader._report import CandidateResult, TuningReport
from trainperf.loader._search import Search, default_max_workers, safety_margin

__all__ = ["TunedDataLoader", "autotune_loader", "tune_loader"]

_TUNED = ("num_workers", "prefetch_factor")
_ALLOWED = frozenset(inspect.signature(DataLoader.__init__).parameters) - {
    "self",
    "dataset",
    "batch_size",
}


class TunedDataLoader(DataLoader):  # type: ignore[type-arg]
    """A plain :class:`torch.utils.data.DataLoader` that also carries the tuning report.

    Attributes:
        tuning_report: the :class:`TuningReport` its settings came from.
    """

    tuning_report: TuningReport


def _check_args(
    batch_size: int,
    max_workers: int | None,
    budget_s: float,
    epochs_hint: int | None,
    step_fn: Callable[[Any], Any] | None,
    loader_kwargs: Mapping[str, Any],
) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    if max_workers is not None and (
        isinstance(max_workers, bool) or not isinstance(max_workers, int) or max_workers < 0
    ):
        raise ValueError(f"max_workers must be None or an int >= 0, got {max_workers!r}")
    if (
        isinstance(budget_s, bool)
        or not isinstance(budget_s, (int, float))
        or not budget_s > 0
        or math.isinf(budget_s)
    ):
        raise ValueError(f"budget_s must be a positive number of seconds, got {budget_s!r}")
    if epochs_hint is not None and (
        isinstance(epochs_hint, bool) or not isinstance(epochs_hint, int) or epochs_hint < 1
    ):
        raise ValueError(f"epochs_hint must be None or an int >= 1, got {epochs_hint!r}")
    if step_fn is not None and not callable(step_fn):
        raise ValueError(f"step_fn must be callable (it gets one batch), got {step_fn!r}")
    for k in loader_kwargs:
        if k in _TUNED:
            raise ValueError(
                f"{k} is what tune_loader chooses, so it cannot be passed in; bound the search "
                f"with max_workers= instead"
            )
        if k == "batch_sampler":
            raise ValueError(
                "batch_sampler is not supported: tune_loader batches with batch_size; pass "
                "sampler= (and drop_last=) instead"
            )
        if k not in _ALLOWED:
            raise ValueError(
                f"unknown DataLoader argument {k!r}; choices: {', '.join(sorted(_ALLOWED))}"
            )


def _time_step(
    dataset: Any,
    batch_size: int,
    loader_kwargs: Mapping[str, Any],
    step_fn: Callable[[Any], Any],
    device: torch.device,
    deadline: float,
) -> tuple[float, float]:
    """``step_fn`` alone: one warm-up call, then up to 5 timed calls (1 s).

    Returns its samples/s and the CPU seconds it costs per sample (this process's CPU time
    until ``step_fn`` returns, all threads counted, not the synchronisation the tuner adds
    after it), from which the main process's share of the cores follows. Each batch is
    moved to ``device`` first (outside the timed region), as the training loop would do; on
    CUDA the device is synchronised before and after each call so the time is the step's
    and not a queue's.
    """
    from trainperf.device import to_device

    kwargs = {k: v for k, v in loader_kwargs.items() if k in ("shuffle", "sampler", "collate_fn")}
    loader: DataLoader[Any] = DataLoader(dataset, batch_size=batch_size, **kwargs)
    it = iter(loader)
    cuda = device.type == "cuda"
    name = getattr(step_fn, "__qualname__", None) or repr(step_fn)
    spent, cpu, calls, samples = 0.0, 0.0, 0, 0
    for i in range(6):
        try:
            batch = next(it)
        except StopIteration:
            it = iter(loader)
            batch = next(it)
        try:
            batch = to_device(batch, device)
            if cuda:
                torch.cuda.synchronize(device)
        except Exception as e:
            raise RuntimeError(
                f"moving a batch to {device} for step_fn failed: {e!r}; step_fn gets the batch "
                f"on the tuning device, so its tensors (or objects with a .to method) must move "
                f"there"
            ) from e
        t, c = time.perf_counter(), time.process_time()
        try:
            step_fn(batch)
            # CPU time stops before the tuner's own synchronize: waiting on it may spin, and
            # a training loop does not synchronise after every step.
            c_end = time.process_time()
            if cuda:
                torch.cuda.synchronize(device)
        except Exception as e:
            raise RuntimeError(
                f"step_fn {name} raised on a batch of the dataset (moved to {device}): {e!r}; "
                f"tune_loader calls step_fn(batch) like one training step"
            ) from e
        if i > 0:  # the first call pays for lazy initialisation
            spent += time.perf_counter() - t
            cpu += c_end - c
            calls += 1
            samples += batch_size
        if calls and (spent > 1.0 or time.perf_counter() > deadline):
            break
    if not calls:
        return math.inf, 0.0
    return samples / max(spent, 1e-9), cpu / samples


def main_process_cores(
    cpus: int,
    step_cpu_per_sample: float | None = None,
    samples_per_s: float = 0.0,
) -> float:
    """Cores kept for the main process: one when the training step is unknown (no
    ``step_fn``), else the step's CPU seconds per sample times the samples per second it
    will process (at most ``cpus``).

    Example:
        >>> main_process_cores(16), main_process_cores(16, 0.0005, 2000.0)
        (1.0, 1.0)
        >>> main_process_cores(16, 2e-6, 5000.0), main_process_cores(2, 0.01, 500.0)
        (0.01, 2.0)
    """
    if step_cpu_per_sample is None:
        return 1.0
    return round(min(float(cpus), max(0.0, step_cpu_per_sample * samples_per_s)), 2)


def _loader_ceiling(baseline: CandidateResult, cpus: int) -> float:
    """Samples/s the loading could reach with every usable core, from ``num_workers=0``
    (an upper bound: the main process's demand is judged at the fastest the step could be
    fed)."""
    rate = baseline.samples_per_s or 0.0
    return cpus * rate / min(1.0, max(0.01, baseline.main_cpu or 1.0))


def cores_for_workers(cpus: int, main_cores: float) -> int:
    """Whole cores the workers may keep busy: the rest after ``main_cores``, at least 1.

    Example:
        >>> cores_for_workers(16, 1.0), cores_for_workers(2, 0.02), cores_for_workers(2, 2.0)
        (15, 2, 1)
    """
    return max(1, math.floor(cpus - main_cores + 0.5))


def _persistent(
    choice: CandidateResult,
    epochs_hint: int | None,
    samples_per_epoch: int | None,
    batch_size: int,
) -> tuple[bool, str | None]:
    n, rate = choice.num_workers, choice.samples_per_s
    if n == 0:
        return False, None
    if epochs_hint == 1:
        return False, "persistent_workers=False: one epoch, so there is no restart to save"
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


def _final_kwargs(
    loader_kwargs: Mapping[str, Any],
    batch_size: int,
    choice: Mapping[str, Any],
    notes: list[str],
) -> dict[str, Any]:
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
    return out


def _from_cache(
    entry: Mapping[str, Any],
    limits: HostLimits,
    loader_kwargs: Mapping[str, Any],
    batch_size: int,
    common: dict[str, Any],
    started: float,
) -> TuningReport | None:
    """A report built from a cache entry, or None when it is malformed or no longer fits.

    The main process's share is the entry's (measured with ``step_fn``); an entry without
    one kept the default core.
    """
    try:
        best = dict(entry["best"])
        candidates = tuple(CandidateResult(**c) for c in entry["candidates"])
        int(best["num_workers"])
        need, shm = int(entry["memory_needed"]), int(entry["shm_needed"])
        notes = [str(n) for n in entry.get("notes", [])]
        rate = entry.get("samples_per_s")
        base = entry.get("baseline_samples_per_s")
        step = entry.get("step_samples_per_s")
        main_cores = float(entry.get("main_cores", main_process_cores(common["cpus"])))
        worker_cpus = int(entry.get("worker_cpus", cores_for_workers(common["cpus"], main_cores)))
    except (KeyError, TypeError, ValueError):
        return None
    if need > limits.memory_available - safety_margin(limits.memory_available):
        return None
    if limits.shm_free is not None and shm > 0.9 * limits.shm_free:
        return None
    notes.append(f"settings from the cache ({_cache.cache_file()}); cache=False re-tunes")
    return TuningReport(
        best_kwargs=_final_kwargs(loader_kwargs, batch_size, best, []),
        samples_per_s=rate,
        baseline_samples_per_s=base,
        step_samples_per_s=step,
        candidates=candidates,
        elapsed_s=time.perf_counter() - started,
        from_cache=True,
        notes=tuple(notes),
        worker_cpus=worker_cpus,
        main_cores=main_cores,
        **common,
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
    ``RuntimeWarning`` saying why. No worker outlives the call.

    Args:
        dataset: a map-style or iterable dataset.
        batch_size: samples per batch.
        device: where batches go; ``pin_memory`` is only considered for CUDA, and on CUDA
            the host-to-device copy is part of the measurement. None or ``"auto"``:
            :func:`trainperf.best_device` (see :func:`trainperf.device.resolve_device`).
        max_workers: the largest ``num_workers`` to consider (default: four per usable CPU,
            2 to 64; 0 measures ``num_workers=0`` only).
        budget_s: hard wall-clock limit for the whole tuning, in seconds.
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
            each timed call.
        cache: reuse (and store) the choice in the user cache directory.
        progress: draw a progress bar on stderr.
        **loader_kwargs: other DataLoader arguments (``shuffle``, ``sampler``,
            ``collate_fn``, ``drop_last``, ``worker_init_fn``, ``multiprocessing_context``,
            ...), passed through unchanged. ``pin_memory`` or ``persistent_workers`` given
            here are kept as given. ``timeout`` doubles as the hang limit while measuring.

    Returns:
        A :class:`TuningReport`; ``DataLoader(dataset, **report.best_kwargs)`` builds the
        loader.

    Raises:
        ValueError: a bad argument (an invalid ``device`` included),
            ``num_workers``/``prefetch_factor``/``batch_sampler`` in ``loader_kwargs``, an
            empty loader, or a bad ``LOCAL_WORLD_SIZE``/``SLURM_NTASKS_PER_NODE``.
        TypeError: ``device`` is not a str, int, torch.device or None.
        DeviceError: CUDA (or MPS) asked for but not available, or a CUDA index beyond the
            visible GPUs.
        RuntimeError: the dataset fails in the main process, a batch cannot be moved to
            ``device`` for ``step_fn``, or ``step_fn`` raises.

    Example:
        >>> from torch.utils.data import TensorDataset
        >>> ds = TensorDataset(torch.randn(256, 8))
        >>> report = tune_loader(ds, 32, device="cpu", max_workers=0, budget_s=5,
        ...                      cache=False, progress=False, shuffle=True)
        >>> report.best_kwargs["num_workers"], report.best_kwargs["shuffle"]
        (0, True)
    """
    started = time.perf_counter()
    _check_args(batch_size, max_workers, budget_s, epochs_hint, step_fn, loader_kwargs)
    deadline = started + budget_s
    dev = resolve_device(device)
    cuda = dev.type == "cuda"
    limits = host_limits()
    cpus = usable_cpus(local_world_size(), limits=limits)
    main_cores = main_process_cores(cpus)  # until step_fn has been measured
    worker_cpus = cores_for_workers(cpus, main_cores)
    n_max = default_max_workers(cpus) if max_workers is None else max_workers
    method = start_method(loader_kwargs)
    user_pin = loader_kwargs.get("pin_memory")
    user_persistent = loader_kwargs.get("persistent_workers")
    pin_options = (
        (bool(user_pin),) if user_pin is not None else ((True, False) if cuda else (False,))
    )
    common: dict[str, Any] = {
        "budget_s": float(budget_s),
        "limits": limits,
        "cpus": cpus,
        "max_workers": n_max,
        "device": str(dev),
        "batch_size": batch_size,
    }

    key = None
    if cache:
        key = _cache.make_key(
            _cache.key_fields(
                dataset,
                batch_size,
                cpus=cpus,
                device_type=dev.type,
                max_workers=n_max,
                epochs_hint=epochs_hint,
                step_fn=step_fn,
                loader_kwargs=loader_kwargs,
            )
        )
        entry = _cache.read_entry(key)
        if entry is not None:
            hit = _from_cache(entry, limits, loader_kwargs, batch_size, common, started)
            if hit is not None:
                return hit

    bar = ProgressBar(float(budget_s), enabled=progress)
    measure_kwargs = {
        k: v for k, v in loader_kwargs.items() if k not in ("pin_memory", "persistent_workers")
    }
    user_timeout = float(loader_kwargs.get("timeout") or 0.0)
    batch_s = [1.0]  # seconds per batch in the main process, known after the baseline

    def hang_timeout(n: int) -> float:
        if user_timeout > 0:
            return user_timeout
        spawn_extra = 0.0 if method == "fork" else 20.0
        return max(10.0, 20.0 * batch_s[0] * max(1.0, n / worker_cpus)) + spawn_extra

    def run(n: int, pf: int | None, pin: bool) -> CandidateResult:
        bar.update(f"measuring workers={n} prefetch={pf or '-'}", force=True)
        r = measure(
            dataset,
            batch_size,
            measure_kwargs,
            num_workers=n,
            prefetch_factor=pf,
            pin_memory=pin,
            deadline=deadline,
            hang_timeout_s=hang_timeout(n),
            device=dev if cuda else None,
            shm_free=limits.shm_free,
            on_tick=bar.update,
        )
        done = "-" if r.samples_per_s is None else f"{r.samples_per_s:,.0f}/s"
        bar.update(f"workers={n} prefetch={pf or '-'}: {done}", force=True)
        return r

    try:
        try:
            baseline = run(0, None, pin_options[0])
        except ValueError:
            raise
        except Exception as e:
            raise RuntimeError(
                f"the dataset fails in the main process (num_workers=0), so there is nothing "
                f"to tune: {e!r}"
            ) from e
        if baseline.samples_per_s:
            batch_s[0] = batch_size / baseline.samples_per_s
        step_rate = None
        if step_fn is not None and time.perf_counter() < deadline:
            step_rate, step_cpu = _time_step(
                dataset, batch_size, loader_kwargs, step_fn, dev, deadline
            )
            # The main process steps as fast as batches arrive, up to the step's own speed.
            fed = min(step_rate, _loader_ceiling(baseline, cpus))
            main_cores = main_process_cores(cpus, step_cpu, fed)
            worker_cpus = cores_for_workers(cpus, main_cores)
        search = Search(
            measure=run,
            out_of_time=lambda: time.perf_counter() >= deadline - 0.05,
            worker_cpus=worker_cpus,
            main_cores=main_cores,
            max_workers=n_max,
            memory_available=limits.memory_available,
            shm_free=limits.shm_free,
            start_method=method,
            pin_options=pin_options,
            step_samples_per_s=step_rate,
            main_rss=psutil.Process().memory_info().rss,
        )
        choice = search.run(baseline)
    finally:
        bar.close()

    notes = list(search.notes)
    samples_per_epoch = (
        _cache.length(loader_kwargs["sampler"])
        if "sampler" in loader_kwargs
        else _cache.length(dataset)
    )
    if user_persistent is not None:
        persistent = bool(user_persistent)
    else:
        persistent, why = _persistent(choice, epochs_hint, samples_per_epoch, batch_size)
        if why:
            notes.append(why)
    if user_persistent and choice.num_workers == 0:
        notes.append("persistent_workers=True dropped: it needs num_workers > 0")
    best = {
        "num_workers": choice.num_workers,
        "prefetch_factor": choice.prefetch_factor,
        "pin_memory": choice.pin_memory,
        "persistent_workers": persistent,
    }
    best_kwargs = _final_kwargs(loader_kwargs, batch_size, best, notes)
    # A num_workers=0 forced by failing or refused workers (a crash, too little /dev/shm or
    # memory, the budget) is not a choice to keep: the next call tunes again, so it can see a
    # fixed dataset or a bigger /dev/shm.
    forced = choice.num_workers == 0 and any(
        c.num_workers > 0 and c.fault is not None and c.fault != "cpu" for c in search.results
    )
    if key is not None and forced:
        notes.append(
            "not cached: workers failed or were refused (see the candidates), so the next call "
            "tunes again"
        )
    if key is not None and choice.ok and not forced:
        entry = {
            "best": best,
            "samples_per_s": choice.samples_per_s,
            "baseline_samples_per_s": baseline.samples_per_s,
            "step_samples_per_s": step_rate,
            "worker_cpus": worker_cpus,
            "main_cores": main_cores,
            "memory_needed": search.memory_needed(
                choice.num_workers, choice.prefetch_factor, choice.pin_memory
            )
            if choice.num_workers
            else 0,
            "shm_needed": search.shm_needed(choice.num_workers, choice.prefetch_factor),
            "candidates": [dataclasses.asdict(c) for c in search.results],
            "notes": notes,
        }
        try:
            _cache.write_entry(key, entry)
        except OSError as e:
            notes.append(f"the choice could not be cached: {e}")
    return TuningReport(
        best_kwargs=best_kwargs,
        samples_per_s=choice.samples_per_s,
        baseline_samples_per_s=baseline.samples_per_s,
        step_samples_per_s=step_rate,
        candidates=tuple(search.results),
        elapsed_s=time.perf_counter() - started,
        notes=tuple(notes),
        worker_cpus=worker_cpus,
        main_cores=main_cores,
        **common,
    )


def autotune_loader(
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
) -> TunedDataLoader:
    """:func:`tune_loader`, then the DataLoader built from ``report.best_kwargs``.

    The result is an ordinary ``DataLoader`` (a subclass that adds one attribute): the
    report is ``loader.tuning_report``. Arguments, errors and warnings are those of
    :func:`tune_loader`.

    Returns:
        The tuned DataLoader.

    Example:
        >>> from torch.utils.data import TensorDataset
        >>> loader = autotune_loader(TensorDataset(torch.randn(128, 4)), 16, device="cpu",
        ...                          max_workers=0, budget_s=5, cache=False, progress=False)
        >>> loader.num_workers, loader.tuning_report.num_workers, len(loader)
        (0, 0, 8)
    """
    report = tune_loader(
        dataset,
        batch_size,
        device=device,
        max_workers=max_workers,
        budget_s=budget_s,
        epochs_hint=epochs_hint,
        step_fn=step_fn,
        cache=cache,
        progress=progress,
        **loader_kwargs,
    )
    loader = TunedDataLoader(dataset, **report.best_kwargs)
    loader.tuning_report = report
    return loader
