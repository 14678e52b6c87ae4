"""What a batch holds: bytes of tensor data and the number of samples, for any nesting.

A batch is whatever the ``collate_fn`` returns: a tensor, a tuple, a dict of lists of
tensors and strings. Tensors and NumPy arrays are its payload; everything else (ids,
file names) is not counted as bytes. Its samples are counted by one set of rules
(:func:`path_sizes`, :func:`batch_length`) for ``batchsize`` (which checks ``sample(n)``)
and ``monitor`` (which counts what ``w.iter()`` yields); ``loader`` counts its samples/s
with :func:`samples_in`, which agrees with them where a full batch or no tensor tells.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["batch_bytes", "batch_length", "path_sizes", "samples_in", "tensor_leaves"]


def _leaves(obj: Any, depth: int = 0) -> list[Any]:
    if isinstance(obj, (torch.Tensor, np.ndarray)):
        return [obj]
    if depth > 8 or isinstance(obj, (str, bytes)):
        return []
    if isinstance(obj, Mapping):
        return [x for v in obj.values() for x in _leaves(v, depth + 1)]
    if isinstance(obj, (list, tuple)):
        return [x for v in obj for x in _leaves(v, depth + 1)]
    return []


def tensor_leaves(batch: Any) -> list[Any]:
    """The tensors and arrays in a (nested) batch, in order; strings and other values are
    skipped, and nothing below eight levels of nesting is read.

    Example:
        >>> batch = {"x": torch.zeros(4, 3), "y": ["id", np.zeros(2)]}
        >>> [tuple(t.shape) for t in tensor_leaves(batch)]
        [(4, 3), (2,)]
    """
    return _leaves(batch)


def batch_bytes(batch: Any) -> int:
    """Bytes of tensor and array data in a (nested) batch.

    Example:
        >>> batch_bytes({"x": torch.zeros(4, 3), "y": [torch.zeros(4, dtype=torch.int64), "id"]})
        80
    """
    total = 0
    for leaf in _leaves(batch):
        total += leaf.nbytes if isinstance(leaf, np.ndarray) else leaf.element_size() * leaf.numel()
    return total


def samples_in(batch: Any, batch_size: int) -> int:
    """Samples in a batch of at most ``batch_size``: :func:`batch_length`'s count where it
    is a full batch or no tensor gives one, else the first tensor's leading size when it is
    plausible, else ``batch_size``.

    A collated batch's fields in a list (``default_collate`` of ``TensorDataset``'s tuples:
    ``[x]``, ``[x, y]``) read as per-sample items too, so a per-sample count short of a full
    batch is not taken over the tensors' own.

    Example:
        >>> samples_in((torch.zeros(5, 3), torch.zeros(5)), 8), samples_in(["a", "b"], 8)
        (5, 2)
        >>> samples_in([(torch.zeros(3, 4, 4), 0)] * 8, 8)  # collate_fn=list: 8 samples
        8
        >>> samples_in([torch.zeros(5, 3)], 8)  # default_collate of TensorDataset's samples
        5
    """
    n, first = batch_length(batch), _leading_size(batch)
    if n is not None and 1 <= n <= batch_size and (n == batch_size or first is None):
        return n
    return first if first is not None and 1 <= first <= batch_size else batch_size


def _fields_length(batch: Any) -> int | None:
    """The samples of a collated batch's plain fields in a list: ``default_collate`` of
    ``("premise", "hypothesis")`` pairs gives two tuples of as many strings as samples.
    Sequences of one length longer than the list, each of plain values of one type; a list
    of per-sample tuples (``collate_fn=list`` of ``(text, label)``) is as long as its
    samples, and its tuples mix types. None for anything else."""
    if not isinstance(batch, list) or not batch:
        return None
    if not all(isinstance(v, (list, tuple)) for v in batch):
        return None
    lengths = {len(v) for v in batch}
    if len(lengths) != 1 or (m := lengths.pop()) <= len(batch):
        return None
    for field in batch:
        kinds = {type(x) for x in field}
        if len(kinds) != 1 or issubclass(kinds.pop(), (Mapping, list, tuple, torch.Tensor)):
            return None
    return m


def _leading_size(batch: Any) -> int | None:
    """The first tensor's (or array's) leading size; None when the first has no dimension
    or there is none."""
    leaves = _leaves(batch)
    return int(leaves[0].shape[0]) if leaves and leaves[0].ndim >= 1 else None


def path_sizes(obj: Any, depth: int = 0, batch_dim: int = 0) -> list[int]:
    """On the way down to the first tensor or array with a dimension ``batch_dim``: the
    lengths of the lists and tuples below the top level (a list of per-sample tensors, as
    detection models take), then that tensor's size along ``batch_dim``; empty when there
    is no such tensor.

    Example:
        >>> path_sizes((tuple(torch.zeros(3, 8, 8) for _ in range(4)), (1, 2, 3, 4)))
        [4, 3]
    """
    if isinstance(obj, (torch.Tensor, np.ndarray)):
        return [int(obj.shape[batch_dim])] if obj.ndim > batch_dim else []
    if depth > 8 or isinstance(obj, (str, bytes)) or not isinstance(obj, (Mapping, list, tuple)):
        return []
    values = obj.values() if isinstance(obj, Mapping) else obj
    for v in values:
        found = path_sizes(v, depth + 1, batch_dim)
        if found:
            return ([len(obj)] if _per_sample(obj, depth) else []) + found
    return []


def _per_sample(obj: Any, depth: int) -> bool:
    """A list or tuple whose length may be the batch's: below the top level (a list of
    per-sample tensors), or at the top a list of per-sample items: containers (dicts,
    detectron2's inputs; ``(image, target)`` tuples, ``collate_fn=list``) or tensors alike
    in dimensions and dtype (images, torchvision's detection input). A top-level tuple,
    and a list of unlike tensors (``[x, y]``), is the batch's fields."""
    if not isinstance(obj, (list, tuple)):
        return False
    if depth > 0:
        return True
    if not isinstance(obj, list) or not obj:
        return False
    return _alike_containers(obj) or _alike_arrays(obj)


def _alike_containers(items: list[Any]) -> bool:
    """Containers of one shape (:func:`_shape`): the samples of ``collate_fn=list``. A
    collated batch's fields in a list (``[{"img": x}, {"label": y}]``, or ``[[a1, a2], [l1,
    l2]]`` of a siamese pair) differ in keys or in what their tensors hold."""
    if not all(isinstance(v, (Mapping, list, tuple)) for v in items):
        return False
    first = _shape(items[0])
    return all(_shape(v) == first for v in items[1:])


def _shape(obj: Any, depth: int = 0) -> object:
    """What a sample holds, to compare samples by: container types and keys, a sample
    tuple's fields in order, tensors' dimensions and dtypes, other values' types (two levels
    down). A list or tuple inside a sample is summed up by the shapes it holds, not its
    length: COCO's ``(image, [annotations])`` or multi-crop ``([crops], label)`` vary."""
    if isinstance(obj, (torch.Tensor, np.ndarray)):
        return ("array", obj.ndim, str(obj.dtype))
    if depth >= 2 or not isinstance(obj, (Mapping, list, tuple)):
        return type(obj).__name__
    if isinstance(obj, Mapping):
        return ("map", tuple((str(k), _shape(v, depth + 1)) for k, v in obj.items()))
    if depth > 0:
        return (type(obj).__name__, frozenset(_shape(v, depth + 1) for v in obj))
    return (type(obj).__name__, tuple(_shape(v, depth + 1) for v in obj))


def _alike_arrays(items: list[Any]) -> bool:
    """Tensors (or arrays) with a dimension, all of one dtype and number of dimensions: the
    samples of one input. A batch's fields (``x`` of floats, ``y`` of class indices) rarely
    agree in both; where they do (two views ``[a, b]``, ``[x, y]`` of floats) one call
    cannot tell them apart, and either reading is accepted. A sampler that returns the
    wrong number of samples is then still refused at every size but the number of fields,
    and the tuner tries several sizes."""
    first = items[0]
    if not isinstance(first, (torch.Tensor, np.ndarray)) or first.ndim == 0:
        return False
    return all(
        type(v) is type(first) and v.ndim == first.ndim and v.dtype == first.dtype for v in items
    )


def batch_length(batch: Any) -> int | None:
    """Samples in a batch: the items of a top-level list of per-sample items, else the
    sizes on the way to its first tensor (or array), of which the one its fields agree on
    (:func:`_agreed_size`); a list of other things counts its items; None when it cannot
    tell.

    Example:
        >>> batch_length({"x": torch.zeros(5, 3), "y": torch.zeros(5)}), batch_length(["a", "b"])
        (5, 2)
        >>> batch_length([torch.zeros(3, 8, 8) for _ in range(4)])  # 4 images of 3 channels
        4
        >>> batch_length(torch.tensor(3.0)) is None
        True
    """
    fields = _fields_length(batch)
    if fields is not None:
        return fields
    if _per_sample(batch, 0):
        return len(batch)
    sizes = path_sizes(batch)
    if len(sizes) > 1:
        return _agreed_size(batch, sizes)
    if sizes:
        return sizes[0]
    if isinstance(batch, list):
        return len(batch)
    return None


def _agreed_size(batch: Mapping[Any, Any] | Sequence[Any], sizes: list[int]) -> int:
    """Which of ``sizes`` (a list's length, then the first tensor's leading size) counts the
    samples: the list holds per-sample items (detection's ``tuple(zip(*samples))``: its
    length) or one input's parts (two views ``([a, b], y)``: the tensors' leading size).
    The size most of the batch's fields hold tells; the tensor's leading size on a tie (one
    field, ``{"views": [a, b]}``: two views of a batch, as the rule was before fields were
    counted)."""
    fields = batch.values() if isinstance(batch, Mapping) else batch
    held = [path_sizes(v, 1) or ([len(v)] if isinstance(v, (list, tuple)) else []) for v in fields]
    return max(reversed(sizes), key=lambda k: sum(k in h for h in held))
