"""Batches of any size: :func:`batches_from` a dataset, and the check that ``sample(n)`` keeps
its word.

The tuner calls ``sample(n)`` once per batch size it tries and reuses the batch for every
step of that size, so building it is not timed: the input pipeline's speed is the loader
tuner's business (:func:`trainperf.autotune_loader`), not the batch size's.

Why not ``batch_sampler_from``, the name the issue suggested: a PyTorch ``batch_sampler``
yields lists of *indices*, while this returns a *batch* of samples; the name would promise
the wrong thing.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, default_collate

from trainperf._utils.batches import batch_length, path_sizes, tensor_leaves
from trainperf._utils.rng import dataset_generators
from trainperf._utils.validate import fresh_stream, positive_int

__all__ = [
    "DatasetBatches",
    "batch_length",
    "batches_from",
    "checked_batch",
    "referenced_generators",
    "referenced_values",
    "sample_generators",
]


_LOADER_GIVEN = (
    "{what} a DataLoader: its items are whole batches, so n of them would be n batches; "
    "pass its dataset and collate_fn: batches_from(loader.dataset, "
    "collate_fn=loader.collate_fn)"
)


class DatasetBatches:
    """``sample(n)``: a batch of the first ``n`` samples of a dataset, cycling when it is
    shorter, collated with ``collate_fn`` (``default_collate`` by default).

    Built by :func:`batches_from`. The same ``n`` always gives the same samples, so every
    batch size is timed on the same data and nothing random is drawn by the indexing.

    Attributes:
        dataset: the map-style or iterable dataset the samples come from.
        collate_fn: what turns a list of samples into a batch.
    """

    def __init__(self, dataset: Any, collate_fn: Callable[[list[Any]], Any] | None = None):
        if collate_fn is not None and not callable(collate_fn):
            raise ValueError(
                f"collate_fn must be callable (it gets a list of samples), got {collate_fn!r}"
            )
        if isinstance(dataset, torch.utils.data.DataLoader):
            raise ValueError(_LOADER_GIVEN.format(what="batches_from() got"))
        fresh_stream(dataset, "batches_from()")
        self.dataset = dataset
        self.collate_fn: Callable[[list[Any]], Any] = collate_fn or default_collate

    def _samples(self, n: int) -> list[Any]:
        if isinstance(self.dataset, IterableDataset) or not hasattr(self.dataset, "__getitem__"):
            return self._iterated(n)
        try:
            size = len(self.dataset)
        except TypeError as e:
            raise ValueError(
                f"batches_from() needs a dataset with __len__ and __getitem__, or an iterable "
                f"dataset; {type(self.dataset).__name__} has __getitem__ but no length"
            ) from e
        if size == 0:
            raise ValueError("batches_from() got an empty dataset: there is no sample to batch")
        return [self.dataset[i % size] for i in range(n)]

    def _iterated(self, n: int) -> list[Any]:
        out: list[Any] = []
        while len(out) < n:
            before = len(out)
            it: Iterator[Any] = iter(self.dataset)
            for item in it:
                out.append(item)
                if len(out) == n:
                    break
            if len(out) == before:
                raise ValueError("batches_from() got an empty dataset: there is no sample to batch")
        return out

    def __call__(self, n: int) -> Any:
        """A batch of ``n`` samples.

        Raises:
            ValueError: ``n`` is not an int >= 1, or the dataset is empty.
        """
        n = positive_int("n", n)
        return self.collate_fn(self._samples(n))

    def __repr__(self) -> str:
        name = getattr(self.collate_fn, "__qualname__", repr(self.collate_fn))
        return f"batches_from({type(self.dataset).__name__}, collate_fn={name})"


def batches_from(
    dataset: Any, collate_fn: Callable[[list[Any]], Any] | None = None
) -> DatasetBatches:
    """The ``sample`` argument of :func:`trainperf.tune_batch_size`, built from a dataset.

    ``sample(n)`` collates the first ``n`` samples (cycling through a shorter dataset) with
    ``collate_fn``, as a ``DataLoader(dataset, batch_size=n, collate_fn=collate_fn)`` would;
    pass the ``collate_fn`` your DataLoader uses.

    Args:
        dataset: a map-style dataset (``__len__`` and ``__getitem__``) or an iterable one.
        collate_fn: turns a list of samples into a batch; ``default_collate`` when None.

    Returns:
        A :class:`DatasetBatches` (a callable: ``sample(n)``).

    Raises:
        ValueError: ``collate_fn`` is not callable, or ``dataset`` is a DataLoader (its
            items are batches: pass ``loader.dataset`` and ``loader.collate_fn``), or a
            one-shot iterator (a generator, an ``__iter__`` that only returns ``self``:
            reading it would use up samples the training loop then never sees). Calling
            the result raises ``ValueError`` for an empty dataset or an ``n`` that is not an
            int >= 1.

    Example:
        >>> import torch
        >>> from torch.utils.data import TensorDataset
        >>> sample = batches_from(TensorDataset(torch.arange(10.0), torch.arange(10)))
        >>> x, y = sample(4)
        >>> x.tolist(), y.shape
        ([0.0, 1.0, 2.0, 3.0], torch.Size([4]))
        >>> sample(12)[1].tolist()[-3:]   # a short dataset is cycled
        [9, 0, 1]
    """
    return DatasetBatches(dataset, collate_fn)


def _first_shape(batch: Any, batch_dim: int) -> tuple[int, ...] | None:
    """The shape of the tensor (or array) :func:`path_sizes` reads, or None."""
    return next((shape for shape in _shapes(batch) if len(shape) > batch_dim), None)


def checked_batch(sample: Callable[[int], Any], n: int, batch_dim: int = 0) -> Any:
    """``sample(n)``, refused when it does not hold ``n`` samples.

    A batch holds ``n`` samples when its first tensor's size along ``batch_dim`` is ``n``
    (its leading size by default; 1 for a sequence-first ``(seq_len, n, features)`` batch,
    and the first tensor with that dimension counts), or a list or tuple below the top
    level on the way to it has ``n`` items (per-sample tensors, as ``tuple(zip(*samples))``
    collates them for detection models), or it is a list of ``n`` per-sample items:
    containers (dicts, ``(image, target)`` tuples from ``collate_fn=list``) or tensors
    alike in dimensions and dtype (images).

    Raises:
        ValueError: the batch is None (a ``sample`` without ``return``), or it does not
            hold ``n`` samples (the message names another dimension of size ``n``, and the
            ``batch_dim`` to pass, where there is one), it holds tensors but none with
            dimension ``batch_dim``, it is a DataLoader, or it is a one-shot iterator (a
            generator: every step after the first would get nothing).

    Example:
        >>> checked_batch(lambda n: torch.zeros(n, 2), 3).shape
        torch.Size([3, 2])
        >>> checked_batch(lambda n: torch.zeros(7, n, 2), 3, batch_dim=1).shape  # sequence-first
        torch.Size([7, 3, 2])
        >>> checked_batch(lambda n: torch.zeros(8, 2), 3)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: sample(3) returned a batch of 8 samples (...); sample(n) must ... n samples
    """
    batch = sample(n)
    if batch is None:  # no n samples at any n: most likely a sample without its return
        raise ValueError(
            f"sample({n}) returned None: it must return the batch of n samples (a tensor, "
            f"a tuple or list, a dict); did it build the batch but not return it?"
        )
    if isinstance(batch, torch.utils.data.DataLoader):
        raise ValueError(_LOADER_GIVEN.format(what=f"sample({n}) returned"))
    if _one_shot(batch):
        raise ValueError(
            f"sample({n}) returned a one-shot iterator ({type(batch).__name__}; did sample "
            f"use yield?): return the batch itself (a tensor, a tuple or list, a dict), "
            f"which every step of that size reuses"
        )
    sizes = path_sizes(batch, batch_dim=batch_dim)
    if sizes and n not in sizes:
        raise ValueError(_wrong_size(n, sizes, batch_dim) + _other_dims(batch, n, batch_dim))
    if not sizes and isinstance(batch, list):  # n samples of other shapes (lengths vary)
        if batch_dim > 0 and _fields_of_n(batch, n):  # [x, y] collated along dim 0
            _check_has_batch_dim(batch, n, batch_dim)
        if len(batch) != n:
            raise ValueError(
                f"sample({n}) returned a list of {len(batch)} items; it must return n samples"
            )
    elif not sizes and (batch_dim > 0 or not _holds_n_items(batch, n)):
        _check_has_batch_dim(batch, n, batch_dim)
    return batch


def _fields_of_n(batch: list[Any], n: int) -> bool:
    """Every item of ``batch`` is a tensor (or array) of leading size ``n``, and they are
    not ``n`` per-sample tensors alike in dimensions and dtype (sequences the step pads):
    the fields of a batch collated along dimension 0 (``[x, y]``)."""
    if not batch or not all(
        isinstance(v, (torch.Tensor, np.ndarray)) and v.ndim >= 1 and v.shape[0] == n for v in batch
    ):
        return False
    first = batch[0]
    alike = all(v.ndim == first.ndim and v.dtype == first.dtype for v in batch)
    return len(batch) != n or not alike


def _holds_n_items(obj: Any, n: int, depth: int = 0) -> bool:
    """Some list or tuple in ``obj`` has ``n`` items: where there is no tensor with a
    dimension, the only place n samples can be. A list of n texts beside a 0-d temperature
    holds them (text models that tokenize in the step); a number or a string is one value,
    not n samples."""
    if depth > 8 or not isinstance(obj, (Mapping, list, tuple)):
        return False
    if not isinstance(obj, Mapping) and len(obj) == n:
        return True
    values = obj.values() if isinstance(obj, Mapping) else obj
    return any(_holds_n_items(v, n, depth + 1) for v in values)


def _check_has_batch_dim(batch: Any, n: int, batch_dim: int) -> None:
    """Refuse a batch that holds tensors (or arrays) none of which has dimension
    ``batch_dim``: its number of samples could not be checked at any size. Under
    ``batch_dim=0`` those are 0-d tensors (one value, no samples): the fix is in ``sample``,
    not in ``batch_dim``."""
    shapes = _shapes(batch)
    if not shapes:
        return
    seen = ", ".join(str(list(shape)) for shape in shapes[:4])
    seen += ", ..." if len(shapes) > 4 else ""
    if batch_dim == 0:
        raise ValueError(
            f"no tensor in sample({n})'s batch has dimension 0 (shapes {seen}): sample(n) "
            f"must return n samples along dimension 0, e.g. tensors of shape (n, ...), not "
            f"0-d values"
        )
    raise ValueError(
        f"batch_dim={batch_dim}, but no tensor in sample({n})'s batch has dimension "
        f"{batch_dim} (shapes {seen}): pass the dimension that holds the samples "
        f"(batch_dim=0 for (n, ...) tensors, 1 for sequence-first (seq_len, n, ...) ones)"
    )


def _shapes(batch: Any) -> list[tuple[int, ...]]:
    """The shape of each tensor (or array) in a nested batch, in order."""
    return [tuple(int(k) for k in t.shape) for t in tensor_leaves(batch)]


def _one_shot(batch: Any) -> bool:
    """``batch`` is its own iterator (a generator, a ``map``): reading it once uses it up."""
    if isinstance(batch, (torch.Tensor, np.ndarray, Mapping, list, tuple, str, bytes)):
        return False
    try:
        return iter(batch) is batch
    except Exception:  # not iterable: nothing to use up
        return False


def _wrong_size(n: int, sizes: list[int], batch_dim: int = 0) -> str:
    """Why a batch whose sizes on the way to its first tensor are ``sizes`` (the lengths of
    the lists that may be per-sample, then that tensor's size along ``batch_dim``) holds
    no ``n``."""
    along = "leading size" if batch_dim == 0 else f"size along batch_dim={batch_dim}"
    if len(sizes) == 1:
        return (
            f"sample({n}) returned a batch of {sizes[0]} samples (the {along} of its "
            f"first tensor); sample(n) must return exactly n samples"
        )
    lists = ", ".join(str(k) for k in sizes[:-1])
    return (
        f"sample({n}) returned a batch with no size {n} in it: the lists on the way to its "
        f"first tensor hold {lists} items and that tensor's {along} is {sizes[-1]}; "
        f"sample(n) must return exactly n samples"
    )


def _other_dims(batch: Any, n: int, batch_dim: int) -> str:
    """The fix when the first tensor has size ``n`` along another dimension: a
    sequence-first batch (``(seq_len, n, features)``) names its batch dimension. Only a
    hint: a sampler that ignores ``n`` may match a feature size by chance."""
    shape = _first_shape(batch, batch_dim)
    dims = [d for d, k in enumerate(shape or ()) if k == n and d != batch_dim]
    if not dims:
        return ""
    return (
        f". Its first tensor has shape {list(shape or ())}, size {n} along dimension "
        f"{dims[0]}: if that is the batch dimension (a sequence-first batch, as nn.LSTM and "
        f"nn.Transformer take without batch_first=True), pass batch_dim={dims[0]}"
    )


def sample_generators(sample: object) -> list[object]:
    """The random generators a :func:`batches_from` sampler's dataset and ``collate_fn``
    own (reading samples in this process advances them); none for any other ``sample``.

    Example:
        >>> class Noisy(torch.utils.data.Dataset):
        ...     def __init__(self):
        ...         self.rng = torch.Generator()
        >>> ds = Noisy()
        >>> [g is ds.rng for g in sample_generators(batches_from(ds))], sample_generators(print)
        ([True], [])
    """
    if not isinstance(sample, DatasetBatches):
        return []
    return [*dataset_generators(sample.dataset), *dataset_generators(sample.collate_fn)]


def referenced_values(fn: object) -> list[object]:
    """What ``fn`` reads besides its arguments: a function's closure cells, the globals its
    body names and the instance it is bound to; a ``functools.partial``'s function and
    arguments; any other callable object itself (its attributes are then scanned)."""
    if isinstance(fn, functools.partial):
        return [*referenced_values(fn.func), *fn.args, *fn.keywords.values()]
    code = getattr(fn, "__code__", None)
    if not isinstance(code, types.CodeType):
        return [fn]
    cells = []
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            cells.append(cell.cell_contents)
        except ValueError:  # a cell not yet filled
            continue
    names = getattr(fn, "__globals__", {})
    bound = getattr(fn, "__self__", None)
    return [*cells, *(names[n] for n in code.co_names if n in names), bound]


def referenced_generators(*fns: object) -> list[object]:
    """The random generators ``fns`` (``step`` and ``sample``) draw from in this process: a
    ``torch.Generator``, numpy ``Generator`` or ``RandomState``, or ``random.Random`` that a
    function closes over or reads as a global, or that an object it reads (a callable
    object, the instance of a bound method, a dataset) holds among its attributes. Each
    probe advances them: unless they are put back, training draws other batches than a
    run that was not tuned.

    Example:
        >>> g = torch.Generator()
        >>> sample = lambda n: torch.randn(n, 2, generator=g)
        >>> [x is g for x in referenced_generators(sample)], referenced_generators(print)
        ([True], [])
    """
    found: list[object] = []
    for fn in fns:
        values = referenced_values(fn)
        # A namespace of the values themselves: dataset_generators scans attributes.
        among = dataset_generators(
            types.SimpleNamespace(**{f"v{i}": v for i, v in enumerate(values)})
        )
        # Not a module's: torch, numpy and random hold the global generators, which
        # preserved_rng puts back (and scanning a module's names costs thousands of checks).
        owners = [v for v in values if v is not None and not isinstance(v, types.ModuleType)]
        owned = [g for v in owners for g in dataset_generators(v)]
        found += [g for g in (*among, *owned) if all(g is not f for f in found)]
    return found
