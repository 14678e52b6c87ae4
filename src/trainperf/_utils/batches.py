"""What a batch holds: bytes of tensor data and the number of samples, for any nesting.

A batch is whatever the ``collate_fn`` returns: a tensor, a tuple, a dict of lists of
tensors and strings. Tensors and NumPy arrays are its payload; everything else (ids,
file names) is neither counted as bytes nor as samples.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

__all__ = ["batch_bytes", "samples_in", "tensor_leaves"]


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
    """Samples in a batch: the first tensor's leading size when it is plausible.

    Example:
        >>> samples_in((torch.zeros(5, 3), torch.zeros(5)), 8), samples_in(["a", "b"], 8)
        (5, 8)
    """
    for leaf in _leaves(batch):
        if leaf.ndim >= 1:
            n = int(leaf.shape[0])
            return n if 1 <= n <= batch_size else batch_size
        break
    return batch_size
