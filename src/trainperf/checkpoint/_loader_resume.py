"""Whether and where a saved DataLoader pass goes on in the loader it is restored into (for
:mod:`._loader_state`): what a pass's position means (:func:`pass_length`,
:func:`pass_shape`), why a pass cannot be continued (:func:`resume_note`), where it resumes
when only the batch size changed (:func:`rebatched`), and the end-of-pass draw a finished
pass's sampler made on its way to StopIteration (:func:`tail_pulls`, :func:`draw_tail`).

A batch size changed alone keeps the saved order only for samplers whose order the batch
size does not change (:func:`_order_ignores_batch_size`): torch's own, exact types (a
length-grouped or bucketing sampler built with the batch size orders the samples otherwise
for another one), and only when the world size and rank are known to be the saved ones (a
shard of 9 samples is 3 long on 3 replicas and on 4); any other loader restarts the pass
with a warning, as for another dataset.
"""

from __future__ import annotations

import collections
import itertools
import sys
from collections.abc import Mapping
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

from trainperf._utils.format import plural
from trainperf.checkpoint._dataset_states import put_back
from trainperf.checkpoint._sampler_states import SamplerStates, replaying

__all__ = ["draw_tail", "pass_length", "pass_shape", "rebatched", "resume_note", "tail_pulls"]


def pass_length(loader: DataLoader[Any]) -> int | None:
    """The batches per pass of ``loader``; None when it has no length."""
    if isinstance(loader.dataset, IterableDataset):
        return None
    try:
        return len(loader)
    except TypeError:
        return None


def _sized(obj: Any) -> int | None:
    try:
        return len(obj)
    except Exception:  # advisory: a __len__ that raises must not fail the save
        return None


def _layout(chain: list[Any]) -> tuple[Any, Any]:
    """``(world size, rank)`` the pass was sharded for: a ``DistributedSampler``'s in
    ``chain``, else ``(1, 0)``: without one every rank reads the whole dataset, in an order
    the process group does not change, so a pass saved on one world size goes on exactly
    on another."""
    for sampler in chain:
        if isinstance(sampler, DistributedSampler):
            return sampler.num_replicas, sampler.rank
    return 1, 0


def pass_shape(loader: DataLoader[Any], chain: list[Any]) -> dict[str, Any]:
    """What a pass's position means: the dataset's and the sampler's sizes, the batch size
    (another one with the same number of batches per pass puts other samples in the
    batches already consumed), and the world size and rank (``replicas``, ``rank``) of the
    sampler ``chain`` (:func:`._sampler_states.sampler_chain`), which another one shards
    otherwise with the same shard size."""
    if isinstance(loader.dataset, IterableDataset):
        return {}
    samples = _sized(loader.sampler)  # first: len() of distributed_loader's takes the layout
    replicas, rank = _layout(chain)
    return {
        "dataset": _sized(loader.dataset),
        "samples": samples,
        "batch_size": loader.batch_size,
        "replicas": replicas,
        "rank": rank,
    }


def _batch_size_free_samplers() -> tuple[type, ...]:
    """torch's samplers whose order the batch size does not change, and ``distributed_loader``'s
    (a ``DistributedSampler``; looked up only once ``trainperf.ddp`` is loaded, as it must be
    for one to exist)."""
    known: tuple[type, ...] = (
        SequentialSampler,
        RandomSampler,
        SubsetRandomSampler,
        WeightedRandomSampler,
        DistributedSampler,
    )
    helpers = sys.modules.get("trainperf.ddp._helpers")
    return known if helpers is None else (*known, helpers._AutoEpochSampler)


def _order_ignores_batch_size(chain: list[Any]) -> bool:
    """Whether ``chain``'s batches are consecutive runs of an order the batch size does not
    change: torch's own ``BatchSampler`` over the samplers above, exact types (a subclass,
    or a sampler of your own, may be built with the batch size and order by it)."""
    known = _batch_size_free_samplers()
    return (
        len(chain) >= 2
        and type(chain[0]) is BatchSampler
        and all(type(sampler) in known for sampler in chain[1:])
    )


def resume_note(loader: DataLoader[Any], chain: list[Any], saved: Mapping[str, Any]) -> str | None:
    """Why the saved pass cannot be continued here, or None when it can."""
    if isinstance(loader.dataset, IterableDataset):
        return (
            "an IterableDataset has no sampler to skip the consumed batches at, so its "
            f"pass restarts (the checkpoint had consumed {saved['position']} batches of it)"
        )
    if getattr(loader, "in_order", True) is False:
        return "with in_order=False the consumed batches are not the first ones: the pass restarts"
    length = pass_length(loader)
    if saved["length"] is not None and length != saved["length"]:
        return (
            f"it has {length} batches per pass, but {saved['length']} when the checkpoint "
            "was saved (another dataset, batch size or world size): the pass restarts"
        )
    shape, was = pass_shape(loader, chain), saved.get("shape") or {}
    changed = [f"{k} {was[k]} -> {shape[k]}" for k in shape if k in was and shape[k] != was[k]]
    if changed:
        return (
            f"its {', '.join(changed)} changed since the checkpoint was saved (the same number of "
            "batches per pass, but the consumed ones held other samples): the pass restarts"
        )
    return None


def _batch_sizes(
    loader: DataLoader[Any], chain: list[Any], saved: Mapping[str, Any]
) -> tuple[int, int] | None:
    """The saved and the new batch size when only the batch size changed since the save
    (the same dataset and sampler sizes, world size and rank: a file that has none
    recorded cannot tell) and ``chain``'s order does not depend on it; None otherwise."""
    shape, was = pass_shape(loader, chain), saved.get("shape") or {}
    old, new = was.get("batch_size"), shape.get("batch_size")
    if old is None or new is None or old == new:
        return None
    same = ("dataset", "samples", "replicas", "rank")
    if any(shape[k] is None or was.get(k) != shape[k] for k in same):
        return None
    return (old, new) if _order_ignores_batch_size(chain) else None


def rebatched(
    loader: DataLoader[Any], chain: list[Any], saved: Mapping[str, Any]
) -> tuple[int, str | None] | None:
    """Where the saved pass resumes in ``loader``'s batches when only its batch size changed
    since the save, and what to warn of (None when it resumes exactly); None when the batch
    size is the same, something else changed too, or the sampler ``chain`` is not one whose
    order the batch size leaves alone (:func:`_order_ignores_batch_size`).

    That order does not depend on the batch size (the batches are consecutive runs of it),
    so the pass goes on in the saved order after the samples consumed, ``position * old
    batch size``; when the new batch size does not divide them, after the whole batches of
    it below them, so the few in between are seen again rather than never.
    """
    sizes = _batch_sizes(loader, chain, saved)
    if sizes is None or getattr(loader, "in_order", True) is False:
        return None
    old, new = sizes
    consumed = saved["position"] * old
    position, again = divmod(consumed, new)
    if not again:
        return position, None
    return position, (
        f"its batch size changed from {old} to {new} since the checkpoint was saved: the "
        f"pass resumes in the saved order after {plural(position, 'batch', 'batches')} of "
        f"{new} (sample {position * new}), so the last {plural(again, 'sample')} of the "
        f"{consumed} consumed ({plural(saved['position'], 'batch', 'batches')} of {old}) "
        f"{'is' if again == 1 else 'are'} seen again (a batch size that divides {consumed} "
        "resumes exactly)"
    )


def tail_pulls(loader: DataLoader[Any], chain: list[Any], saved: Mapping[str, Any]) -> int:
    """How many of ``loader``'s batches the saved pass, finished, had handed out: its
    position, or, when only the batch size changed (as :func:`rebatched` tells it),
    ``loader``'s whole pass (the saved pass's sampler had drawn all of its order, which the
    position counts in batches of the old size: replayed in smaller ones it would stop short
    of the sampler's end)."""
    length = pass_length(loader)
    if length is None or _batch_sizes(loader, chain, saved) is None:
        return int(saved["position"])
    return length


def draw_tail(
    chain: list[Any],
    gen: torch.Generator | None,
    start: SamplerStates,
    pulls: int,
    shared: list[tuple[Any, Any]],
) -> None:
    """Draw what the sampler draws after its last index, as the uninterrupted run's did on
    its way to StopIteration after the save at the pass's last batch: ``RandomSampler``
    with a ``generator`` draws one more permutation there, so without it the next pass
    would shuffle otherwise. The pass's ``pulls`` (:func:`tail_pulls`) are replayed from its
    start, then the one that ended it, from the saved states of the dataset's generators it
    ``shared``; only the sampler chain's generators keep what it drew
    (:func:`._sampler_states.replaying`)."""
    with replaying(chain, gen):
        start.apply(chain, gen)
        it = iter(chain[0])
        collections.deque(itertools.islice(it, pulls), maxlen=0)
        put_back(shared)
        next(it, None)  # the pull that ended the pass (bounded: a sampler may never end)
