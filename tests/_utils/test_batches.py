"""trainperf._utils.batches: bytes and samples of nested batches."""

from __future__ import annotations

import torch

from trainperf._utils.batches import batch_bytes, batch_length, samples_in


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


def test_samples_in_counts_a_per_sample_list_by_its_items() -> None:
    # collate_fn=list of (image, label) samples: before, 3 (the channels of the first image).
    per_sample = [(torch.zeros(3, 16, 16), i) for i in range(8)]
    assert samples_in(per_sample, 8) == 8
    assert samples_in([torch.zeros(3, 16, 16) for _ in range(8)], 8) == 8  # bare images
    chw = [(torch.zeros(3, 16, 16), {"boxes": torch.zeros(2, 4)}) for _ in range(8)]
    assert samples_in(tuple(zip(*chw, strict=True)), 8) == 8  # detection's zip(*samples)
    assert samples_in({"images": [torch.zeros(3, 16, 16)] * 8, "labels": torch.zeros(8)}, 8) == 8
    assert samples_in(["a", "b"], 8) == 2  # a short last batch of file names, no tensor


def test_samples_in_keeps_the_figures_of_ordinary_collated_batches() -> None:
    from torch.utils.data import TensorDataset, default_collate

    def collated(samples: list[object]) -> object:
        return default_collate(samples)

    x, y = torch.zeros(5, 3), torch.zeros(5, 3)
    # TensorDataset's tuples collate to a list of fields: [x] and [x, y] are not 1 or 2 samples.
    assert samples_in(collated([TensorDataset(x)[i] for i in range(5)]), 8) == 5
    assert samples_in(collated([TensorDataset(x, y)[i] for i in range(5)]), 8) == 5
    assert samples_in(collated([((a, b), (a, b)) for a, b in zip(x, y, strict=True)]), 8) == 5
    assert samples_in(x, 8) == 5
    assert samples_in((x, torch.zeros(5, dtype=torch.int64)), 8) == 5
    assert samples_in({"x": x, "y": y}, 8) == 5
    assert samples_in({"views": [x, y]}, 8) == 5  # two views of 5 samples, not 2 samples
    assert samples_in([x[:2], y[:2]], 2) == 2  # a full batch reads alike either way
    assert samples_in(torch.zeros(20, 8), 8) == 8  # larger than a batch: not the sample axis


def test_views_of_one_batch_under_one_key_count_the_batch() -> None:
    # {"views": [a, b]} (two augmented views of a batch of 4) counted 2 once fields were
    # weighed and a tie went to the list's length; tune_batch_size then refused sample(4).
    views = {"views": [torch.zeros(4, 3), torch.zeros(4, 3)]}
    assert batch_length(views) == 4
    assert batch_length(([torch.zeros(4, 3), torch.zeros(4, 3)], torch.zeros(4))) == 4


def test_collated_fields_in_a_list_are_not_taken_for_samples() -> None:
    # default_collate of sentence pairs gives two tuples of 32 strings: samples_in counted 2
    # (the tuner's samples/s 16 times too low); of (inputs, targets) dicts two unlike dicts,
    # and of a siamese pair two unlike lists: batch_length counted 2.
    from torch.utils.data import default_collate

    pairs = default_collate([("the cat sat", "a cat was sitting")] * 32)
    assert samples_in(pairs, 32) == 32
    dicts = default_collate([({"img": torch.zeros(3, 8, 8)}, {"label": 1})] * 32)
    siamese = default_collate([((torch.zeros(3, 4, 4), torch.zeros(3, 4, 4)), (1, 0))] * 32)
    assert batch_length(dicts) == batch_length(siamese) == 32
    assert samples_in(["a", "b"], 8) == 2  # plain items still count themselves


def test_per_sample_items_whose_inner_lists_vary_are_still_samples() -> None:
    # COCO's (image, [annotations]) and multi-crop ([crops], label): the inner lists' lengths
    # vary, and the batch was read down its first sample (3, the image's channels).
    coco = [
        (torch.zeros(3, 8, 8), [{"bbox": [0, 0, 1, 1], "category_id": 1}] * (1 + i % 3))
        for i in range(8)
    ]
    crops = [([torch.zeros(3, 4, 4)] * (2 + i % 3), i) for i in range(8)]
    assert batch_length(coco) == batch_length(crops) == 8
    assert samples_in(coco, 8) == samples_in(crops, 8) == 8


def test_a_short_batch_of_per_sample_tuples_counts_its_items() -> None:
    # Taken for a collated batch's fields, a last batch of 3 (text, label) tuples counted 8.
    assert samples_in([("some text", 1), ("more", 0), ("x", 1)], 8) == 3
    assert samples_in([{"text": "a", "label": 1}] * 3, 8) == 3
    from torch.utils.data import default_collate

    assert samples_in(default_collate([("premise", "hypothesis")] * 5), 8) == 5
