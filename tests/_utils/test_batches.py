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


def test_batch_length_counts_per_sample_lists_by_their_items() -> None:
    import numpy as np

    from trainperf._utils.batches import batch_length

    # collate_fn=list: 8 (HWC image, label) samples, and detection's tuple(zip(*samples)).
    per_sample = [(np.zeros((224, 224, 3), np.uint8), 1) for _ in range(8)]
    assert batch_length(per_sample) == 8
    # before: 224, the height of the image
    assert batch_length(tuple(zip(*per_sample, strict=True))) == 8
    chw = [(torch.zeros(3, 16, 16), {"boxes": torch.zeros(2, 4)}) for _ in range(8)]
    assert batch_length(tuple(zip(*chw, strict=True))) == 8  # before: 3, the channels
    # A list below the top level that is one input's parts (two views, each of the batch's
    # n samples): the other fields agree on n, not on the list's 2.
    assert batch_length(([torch.zeros(5, 8), torch.zeros(5, 8)], torch.zeros(5))) == 5
