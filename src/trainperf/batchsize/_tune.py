"""``tune_batch_size``: the public entry point of the batch-size tuner.

A call checks its arguments (:mod:`trainperf.batchsize._args`), settles the sizes it may try
and the device, and, with every random number generator saved
(:func:`trainperf._utils.rng.preserved_rng`), returns a cached choice that still fits
(:mod:`trainperf.batchsize._cache`) or saves the training state
(:mod:`trainperf.batchsize._state`), searches (:mod:`trainperf.batchsize._search`) over
probes (:mod:`trainperf.batchsize._probe`) and puts the state back, however the call ends.
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from trainperf._utils.cache import read_entry, write_entry
from trainperf._utils.rng import preserved_generators, preserved_rng
from trainperf._utils.validate import non_negative_int
from trainperf.batchsize import _cache
from trainperf.batchsize._accumulation import accumulation_notes, known_optimizers
from trainperf.batchsize._agree import Agreement
from trainperf.batchsize._args import check_args, check_state, size_space
from trainperf.batchsize._holders import (
    module_generators,
    owning_modules,
    schedulers_held,
    stateful_objects,
    with_live_amp_state,
)
from trainperf.batchsize._memory import HostMemory, MemoryReader, reader_for
from trainperf.batchsize._probe import Prober
from trainperf.batchsize._probe_rules import DEFAULT_PROBE, is_out_of_memory
from trainperf.batchsize._progress import BatchSizeBar
from trainperf.batchsize._report import BatchSizeCandidate, BatchSizeReport, PipelineMemory
from trainperf.batchsize._sample import checked_batch, referenced_generators, sample_generators
from trainperf.batchsize._search import Search
from trainperf.batchsize._sizes import SizeSpace
from trainperf.batchsize._state import SavedState
from trainperf.batchsize._trained import TrainingCheck, unstepped_note
from trainperf.device import resolve_device
from trainperf.limits import HostLimits, host_limits

__all__ = ["tune_batch_size"]


@dataclass(frozen=True)
class _Call:
    """One call's arguments, checked, and what it settled before measuring."""

    step: Callable[[Any], object]
    sample: Callable[[int], Any]
    objects: list[Any]
    owners: list[nn.Module]  # owning_modules(objects)
    device: torch.device
    space: SizeSpace
    agree: Agreement
    global_batch: int | None
    budget_s: float
    headroom: float
    progress: bool
    cache: bool
    num_workers: int
    prefetch_factor: int | None
    started: float
    batch_dim: int = 0

    def usable(self, memory: MemoryReader) -> float | None:
        """``(1 - headroom)`` of the memory limit, the smallest over the ranks (None where
        no rank measures one). Every rank takes part, limit or not: a collective some ranks
        skip would leave the others waiting forever."""
        mine = math.inf if memory.limit is None else (1.0 - self.headroom) * memory.limit
        _, (low,) = self.agree.combine(minima=[mine])
        return None if math.isinf(low) else low

    def report(self, limits: HostLimits, batch_bytes: int | None, **fields: Any) -> BatchSizeReport:
        pipeline = (
            None
            if batch_bytes is None
            else PipelineMemory.of(
                batch_bytes,
                self.num_workers,
                self.prefetch_factor,
                limits.memory_available,
                limits.shm_free,
            )
        )
        return BatchSizeReport(
            elapsed_s=time.perf_counter() - self.started,
            budget_s=self.budget_s,
            headroom=self.headroom,
            device=str(self.device),
            world_size=self.agree.world_size,
            global_batch=self.global_batch,
            pipeline=pipeline,
            **fields,
        )


def _params(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, nn.Module):
        yield from obj.parameters()
    elif isinstance(obj, Optimizer):
        for group in obj.param_groups:
            yield from group["params"]


def _device(device: str | int | torch.device | None, objects: Sequence[Any]) -> torch.device:
    """``device`` parsed; None: where the model's (or else the optimizer's) parameters are,
    else the best device. The meta device is refused: it runs nothing to time and has no
    memory to measure (the parameters themselves are refused by ``check_state``)."""
    if device is None:
        for obj in objects:
            for p in _params(obj):
                return p.device
    resolved = resolve_device(device)
    if resolved.type == "meta":
        raise ValueError(
            f"tune_batch_size got device={device!r}: the meta device computes no values, so "
            "there is no step to time and no memory to measure; pass the device training "
            "runs on (device='cuda', device='cpu'), or None for the model's"
        )
    return resolved


def _from_cache(
    call: _Call, key: str, limits: HostLimits
) -> tuple[BatchSizeReport | None, str | None]:
    """The stored choice (all ranks must hold the same one), or None and why not."""
    path = _cache.cache_path()
    entry = read_entry(key, path)
    usable = call.usable(reader_for(call.device))  # on every rank, entry or not
    why = None if entry is None else _cache.cache_misfit(entry, call.space, usable)
    size = float(entry["batch_size"]) if entry is not None and why is None else 0.0
    (high,), (low,) = call.agree.combine(maxima=[size], minima=[size])
    if entry is None or why is not None or high != low or low == 0:
        if entry is not None and why is None:
            why = "the ranks' cached choices differ"
        return None, None if why is None else f"the cached choice was not used ({why}): tuned again"
    candidates = _cache.parsed_candidates(entry) or ()
    report = call.report(
        limits,
        entry.get("batch_bytes"),
        batch_size=int(entry["batch_size"]),
        accumulation_steps=int(entry["accumulation_steps"]),
        samples_per_s=entry.get("samples_per_s"),
        peak_memory=entry.get("peak_memory"),
        memory_limit=entry.get("memory_limit"),
        candidates=candidates,
        memory_kind=str(entry.get("memory_kind", "unmeasured")),
        from_cache=True,
        notes=(f"batch size from the cache ({path}); cache=False re-tunes",),
    )
    return report, None


def _cut_by_budget(search: Search) -> bool:
    """``budget_s`` cut the search short: a size skipped or not measured again, an
    alternation not run or ended early, or a probe's timing cut (its reason says so)."""
    return search.budget_cut or any("budget" in (c.reason or "") for c in search.results)


def _store(key: str, report: BatchSizeReport, cut: bool) -> BatchSizeReport:
    """Cache the choice, unless ``budget_s`` cut the search short (``cut``): a later call
    with more time would reuse a choice it could have bettered."""
    if cut:
        note = "the choice was not cached: budget_s cut the search short"
        return dataclasses.replace(report, notes=(*report.notes, note))
    data = report.to_dict()
    entry = {k: data[k] for k in _cache.ENTRY_KEYS if k != "batch_bytes"}
    entry["batch_bytes"] = None if report.pipeline is None else report.pipeline.batch_bytes
    try:
        write_entry(key, entry, _cache.cache_path())
    except OSError as e:
        note = f"the choice could not be cached: {e}"
        return dataclasses.replace(report, notes=(*report.notes, note))
    return report


def _no_fit(call: _Call, results: Sequence[BatchSizeCandidate]) -> RuntimeError:
    """The error when no size fits; it suggests only the fixes that can help: a lower
    ``min_size`` above 1, a lower ``headroom`` when a size peaked past it."""
    tried = "; ".join(f"{c.batch_size}: {c.status} ({c.reason})" for c in results) or "none"
    fixes = [f"free memory on {call.device}"]
    if call.headroom > 0 and any(c.status == "over-headroom" for c in results):
        fixes.insert(0, f"lower headroom (now {call.headroom:g})")
    if call.space.min_size > 1:
        fixes.insert(0, f"lower min_size (now {call.space.min_size})")
    fixes.append("make the step use less (trainperf.MixedPrecision, a smaller model)")
    advice = ", ".join(fixes[:-1]) + f", or {fixes[-1]}"
    return RuntimeError(
        f"tune_batch_size found no batch size that fits: {tried}. {advice[0].upper()}{advice[1:]}"
    )


def _notes(
    call: _Call, search: Search, memory: MemoryReader, choice: BatchSizeCandidate
) -> list[str]:
    notes = list(search.notes)
    if isinstance(memory, HostMemory) and memory.samples_steps:
        notes.append(
            "peak memory read after each step (the kernel's high-water mark could not be reset)"
        )
    if memory.kind == "unmeasured":
        notes.append(
            f"peak memory is not measured on {call.device}: only an out-of-memory error "
            f"limits the size"
        )
    if choice.batch_size == call.space.top:
        notes.append(
            "the largest allowed size was chosen: a larger max_size (or global_batch) may be faster"
        )
    if _cut_by_budget(search):
        notes.append(
            f"budget_s={call.budget_s:g} cut the search short: a larger budget may find a "
            f"faster size"
        )
    if call.agree.active:
        notes.append(
            f"tuned in lockstep on {call.agree.world_size} ranks (the slowest rank's "
            f"throughput, the largest peak)"
        )
    return notes


def _training_check(state: SavedState) -> TrainingCheck:
    """What the probes' steps do to the saved parameters and optimizers."""
    optimizers = [o for o, _ in state.param_groups if isinstance(o, Optimizer)]
    return TrainingCheck([p for p, _ in state.flags], optimizers)


def _search(call: _Call) -> tuple[BatchSizeReport, bool]:
    """Measure: save the state, grow and refine, put the state back. Also returns whether
    ``budget_s`` cut the search short."""
    state = SavedState.save(with_live_amp_state(call.objects), owners=call.owners)
    memory = reader_for(call.device)
    deadline = call.started + call.budget_s
    bar = BatchSizeBar(call.budget_s, enabled=call.progress)
    policy = DEFAULT_PROBE
    prober = Prober(
        call.step, call.sample, call.device, memory, state, call.agree, deadline,
        usable=lambda: call.usable(memory), per_rank=call.space.per_rank, policy=policy,
        on_update=lambda text: bar.update(text), optimizers=known_optimizers(call.objects),
        batch_dim=call.batch_dim, check=_training_check(state),
    )  # fmt: skip
    search = Search(
        call.space,
        prober,
        time_left=lambda: call.agree.combine(minima=[deadline - time.perf_counter()])[1][0],
        usable=lambda: call.usable(memory),
        baseline=memory.start_level,
        warmup_steps=policy.min_warmup,
        min_windows=policy.windows.min_windows,
        window_s=policy.windows.min_window_s,
        target_spread=policy.windows.target_spread,
        compare=prober.compare,
    )
    try:
        choice = search.run()
    finally:
        try:
            state.restore()
        finally:  # a restore that raises still frees the memory and ends the bar's line
            memory.free()
            bar.close()
    if choice is None:
        raise _no_fit(call, search.results)
    unstepped = unstepped_note(prober.check)
    if unstepped is not None:
        warnings.warn(f"tune_batch_size: {unstepped}", UserWarning, stacklevel=4)
    report = call.report(
        host_limits(),
        prober.batch_bytes.get(choice.batch_size),
        batch_size=choice.batch_size,
        accumulation_steps=choice.accumulation_steps,
        samples_per_s=choice.samples_per_s,
        peak_memory=choice.peak_memory,
        memory_limit=memory.limit,
        candidates=tuple(search.results),
        memory_kind=memory.kind,
        notes=(
            *_notes(call, search, memory, choice),
            *accumulation_notes(prober.per_rank, prober.optimizer_charged, search.results),
            *(() if unstepped is None else (unstepped,)),
        ),
    )
    return report, _cut_by_budget(search)


def _cache_key(call: _Call) -> Any:
    """The cache entry's key, from the first size's batch; None when building that batch
    runs out of memory (the search then measures that size and marks it ``oom``)."""
    first = call.space.first() or call.space.min_size  # size_space refused no sizes
    try:
        batch = checked_batch(call.sample, first, call.batch_dim)
    except Exception as e:
        if not is_out_of_memory(e):
            raise
        return None
    return _cache.entry_key(
        step=call.step,
        objects=call.objects,
        device=call.device,
        first_batch=batch,
        space=call.space,
        world_size=call.agree.world_size,
        global_batch=call.global_batch,
        headroom=call.headroom,
    )


def _tune(call: _Call) -> BatchSizeReport:
    key = _cache_key(call) if call.cache else None
    if call.agree.any(call.cache and key is None):
        key = None  # a rank could not build its key: no rank reads the cache (collectives)
    misfit = None
    if key is not None:
        hit, misfit = _from_cache(call, key, host_limits())
        if hit is not None:
            return hit
    with schedulers_held(call.objects):
        report, cut = _search(call)
    if misfit is not None:
        report = dataclasses.replace(report, notes=(misfit, *report.notes))
    return report if key is None else _store(key, report, cut)


def tune_batch_size(
    step: Callable[[Any], object],
    sample: Callable[[int], Any],
    *,
    model: Any = None,
    optimizer: Any = None,
    device: str | int | torch.device | None = None,
    min_size: int = 1,
    max_size: int | None = None,
    global_batch: int | None = None,
    budget_s: float = 60.0,
    headroom: float = 0.1,
    progress: bool = True,
    cache: bool = True,
    num_workers: int = 0,
    prefetch_factor: int | None = None,
    batch_dim: int = 0,
) -> BatchSizeReport:
    """The batch size that trains fastest here, found by measuring your own training step.

    Sizes grow geometrically from ``min_size`` until throughput stops rising by more than
    the measurement's spread, memory passes the headroom, or a size runs out of memory
    (the error is caught); then the sizes between the best and its neighbours are tried,
    and the fastest few are measured against each other in alternating windows, so that a
    host whose load changes between measurements does not decide
    (:mod:`trainperf.batchsize._search`, :mod:`trainperf.batchsize._compare`). Each size
    runs warm-up steps and then timed windows until they agree, with its peak memory
    measured; the choice is always a size that ran. Tuning leaves training exactly where
    it was: the state of ``model`` and ``optimizer`` (parameters, gradients, optimizer
    moments, BatchNorm statistics, train/eval modes), of the optimizers, LR schedulers,
    ``GradScaler`` and :class:`trainperf.MixedPrecision` objects found without being passed,
    of the model an ``optimizer`` passed without it steps and of the model's EMA or SWA
    averages (``AveragedModel``), every random
    number generator (python, numpy, torch CPU and CUDA), those a
    :func:`trainperf.batches_from` dataset owns, those the model's layers hold and those
    ``step`` and ``sample`` close over, read as globals or hold as attributes are put back
    bit for bit, however the call ends.

    Under DDP (a process group initialised) call it on every rank with the same
    arguments: the ranks tune in lockstep and choose the same size
    (:mod:`trainperf.batchsize._agree`).

    Args:
        step: your training step on one batch: forward, backward, optimizer step
            (``step(batch)``; what it returns is ignored). It must train what ``model``
            and ``optimizer`` hold: a step that makes no gradient and changes no parameter
            of theirs is refused, one that never changes a parameter is warned about
            (:mod:`trainperf.batchsize._trained`).
        sample: ``sample(n)`` returns a batch of ``n`` samples (its first tensor's size
            along ``batch_dim`` must be ``n``); :func:`trainperf.batches_from` builds one
            from a dataset. The batch is moved to ``device`` once per size (not timed) and
            reused.
        model: the module ``step`` trains, or a tuple of objects with ``state_dict`` and
            ``load_state_dict``; saved before probing and restored after. ``model=()``:
            ``step`` changes no state. One of ``model`` and ``optimizer`` is required.
        optimizer: its optimizer, or a tuple (optimizer, scheduler, ``GradScaler``,
            :class:`trainperf.MixedPrecision`, ...); saved and restored likewise. The
            optimizers stepping the model's parameters, the LR schedulers driving an
            optimizer, every live MixedPrecision and ``GradScaler``, and the modules owning
            the parameters of an optimizer passed without them are found; while
            tuning runs, every scheduler's ``step()``, passed or found, does nothing.
        device: where ``step`` runs; None: where the model's parameters are, else
            :func:`trainperf.best_device` (parsed by :func:`trainperf.device.resolve_device`).
        min_size: the smallest batch size tried.
        max_size: the largest (None: no bound but memory and ``global_batch``).
        global_batch: keep this effective batch: only sizes that divide ``global_batch /
            world_size`` are tried, and ``accumulation_steps`` makes up the rest. None:
            the fastest size, with ``accumulation_steps=1``.
        budget_s: wall-clock budget in seconds; no size is started that would not finish
            in it (the first size always runs).
        headroom: the fraction of the memory limit kept free: the chosen size peaks at most
            at ``(1 - headroom)`` of it (CUDA: the GPU's free memory plus what this process
            already holds; CPU: the host memory available, :func:`trainperf.host_limits`).
        progress: draw a progress bar on stderr.
        cache: reuse (and store) the choice in the user cache directory, keyed like the
            DataLoader tuner's cache (model class and size, device, dtype, batch shape, the
            step function's body...); a search ``budget_s`` cut short is not stored.
        num_workers: the DataLoader workers that will feed training, for the report's
            input-pipeline memory (``report.pipeline``).
        prefetch_factor: their prefetch factor (None: DataLoader's 2 with workers).
        batch_dim: the dimension of the batch's first tensor that holds the samples: 0
            (the leading one), or 1 for a sequence-first ``(seq_len, n, features)`` batch
            (``nn.LSTM``, ``nn.Transformer`` without ``batch_first=True``). The first tensor
            with that dimension is checked, and only it (a later tensor may hold the
            samples along another dimension: a ``(n, seq_len)`` padding mask). Never
            guessed: a batch refused at 0 whose first tensor has size ``n`` along another
            dimension names it in the error.

    Returns:
        A :class:`BatchSizeReport`: ``batch_size`` per step and ``accumulation_steps``.

    Raises:
        ValueError: a bad argument (see :mod:`trainperf.batchsize._args`): neither
            ``model`` nor ``optimizer`` given, a lazy module not yet run, a model or
            ``device`` on the meta device; ``global_batch``
            not divisible by the world size, ``batch_dim`` not an int >= 0, or
            ``sample(n)`` returning a batch of another size, one whose tensors have no
            dimension ``batch_dim``, or a one-shot iterator (a generator); ``step``
            trained nothing it was given (no gradient made, no parameter of ``model`` or
            ``optimizer`` changed, in a whole probe).
        TypeError: ``model`` or ``optimizer`` holds an object without ``state_dict`` and
            ``load_state_dict``; ``device`` has the wrong type.
        DeviceError: the device asked for is not available.
        RuntimeError: no size fits (even ``min_size`` runs out of memory or peaks past the
            headroom).
        Exception: whatever ``step`` or ``sample`` raises other than an out-of-memory
            error, after the state is restored.

    Warns:
        UserWarning: ``step`` made gradients but changed no parameter and stepped no
            optimizer in all the steps tuning ran (no ``optimizer.step()``?); the report's
            notes say so too.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> model = nn.Linear(8, 1)
        >>> opt = torch.optim.Adam(model.parameters())
        >>> def step(batch):
        ...     x, y = batch
        ...     opt.zero_grad()
        ...     nn.functional.mse_loss(model(x), y).backward()
        ...     opt.step()
        >>> sample = lambda n: (torch.randn(n, 8), torch.randn(n, 1))
        >>> report = tune_batch_size(step, sample, model=model, optimizer=opt, device="cpu",
        ...                          min_size=8, max_size=8, global_batch=32,
        ...                          budget_s=0.5, progress=False, cache=False)
        >>> report.batch_size, report.accumulation_steps, report.chosen().status
        (8, 4, 'ok')
        >>> len(opt.state)    # the optimizer is as it was: no moments yet
        0
    """
    started = time.perf_counter()
    args = check_args(
        step, sample, min_size=min_size, max_size=max_size, global_batch=global_batch,
        budget_s=budget_s, headroom=headroom, num_workers=num_workers,
        prefetch_factor=prefetch_factor, progress=progress, cache=cache,
    )  # fmt: skip
    batch_dim = non_negative_int("batch_dim", batch_dim)
    check_state(model, optimizer)
    objects = stateful_objects(model, optimizer)
    # The model an optimizer passed without it steps: one scan of every live object, for
    # its generators (below) and its saved state (_search).
    owners = owning_modules(objects)
    agree = Agreement()
    space = size_space(args.min_size, args.max_size, args.global_batch, agree.world_size)
    call = _Call(
        step, sample, objects, owners, _device(device, objects), space, agree,
        args.global_batch, args.budget_s, args.headroom, progress, cache, args.num_workers,
        args.prefetch_factor, started, batch_dim,
    )  # fmt: skip
    generators = [
        *sample_generators(sample),
        *referenced_generators(step, sample),
        *module_generators(objects, owners),
    ]
    with preserved_rng(), preserved_generators(generators):
        return _tune(call)
