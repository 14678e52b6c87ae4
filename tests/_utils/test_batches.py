"""trainperf._utils.batches: bytes and samples of nested batches."""

from __future__ import annotations

import torch

from trainperf._utils.batches import batch_bytes, samples_in


def test_batch_bytes_walks_nested_batches() -> None:
    import numpy as np

    batch = {"x": torch.zeros(2, 3), "meta": [np.zeros(4, dtype=np.int16), "name", 3]}
    assert batch_bytes(batch) == 2 * 3 * 4 + 4 * 2


def test_samples_in_reads_the_first_tensor_when_it_is_plausible() -> None:
    assert samples_in({"x": torch.zeros(3, 2), "y": torch.zeros(9)}, 8) == 3  # a short last batch
    assert samples_in([torch.zeros(16, 2)], 8) == 8  # larger than a batch: not the sample axis
    assert samples_in(torch.tensor(1.0), 8) == 8  # a scalar has no sample axis
    assert samples_in({"ids": [1, 2, 3]}, 8) == 8  # no tensor at all
