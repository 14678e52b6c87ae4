"""``batches_from`` a dataset, and the check that ``sample(n)`` holds ``n`` samples."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

from tests._utils._streams import Fresh, Resets, assert_refused_unread
from trainperf.batchsize import DatasetBatches, batches_from
from trainperf.batchsize._sample import batch_length, checked_batch


class Stream(IterableDataset[int]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.n))


def test_a_map_style_dataset_is_batched_from_its_start_and_cycled() -> None:
    sample = batches_from(TensorDataset(torch.arange(5)))
    assert isinstance(sample, DatasetBatches)
    (x,) = sample(3)
    assert x.tolist() == [0, 1, 2]
    (x,) = sample(7)
    assert x.tolist() == [0, 1, 2, 3, 4, 0, 1]
    assert "TensorDataset" in repr(sample)


def test_an_iterable_dataset_is_read_from_the_start_again_when_short() -> None:
    assert batches_from(Stream(3))(5).tolist() == [0, 1, 2, 0, 1]


def test_collate_fn_builds_the_batch() -> None:
    sample = batches_from(TensorDataset(torch.arange(4)), collate_fn=lambda items: len(items))
    assert sample(3) == 3


def test_bad_datasets_and_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="empty dataset"):
        batches_from(TensorDataset(torch.zeros(0)))(2)
    with pytest.raises(ValueError, match="empty dataset"):
        batches_from(Stream(0))(2)
    with pytest.raises(ValueError, match=r"n must be an int >= 1, got 0"):
        batches_from(TensorDataset(torch.zeros(3)))(0)
    with pytest.raises(ValueError, match="collate_fn must be callable"):
        batches_from(TensorDataset(torch.zeros(3)), collate_fn="stack")  # type: ignore[arg-type]


class NoLength(Dataset[int]):
    def __getitem__(self, i: int) -> int:
        return i


def test_a_dataset_with_getitem_but_no_length_is_named() -> None:
    with pytest.raises(ValueError, match="NoLength has __getitem__ but no length"):
        batches_from(NoLength())(2)


def test_batch_length_reads_the_first_tensor_or_counts_a_list() -> None:
    assert batch_length({"ids": ["a", "b"], "x": np.zeros((3, 2))}) == 3
    assert batch_length([torch.tensor(1.0), torch.zeros(4)]) == 4  # 0-d tensors say nothing
    assert batch_length(["a", "b", "c"]) == 3
    assert batch_length("text") is None


def test_checked_batch_names_the_size_asked_for_and_the_size_returned() -> None:
    with pytest.raises(ValueError, match=r"sample\(4\) returned a batch of 2 samples"):
        checked_batch(lambda n: (torch.zeros(2, 3), torch.zeros(2)), 4)
    assert checked_batch(lambda n: "opaque", 4) == "opaque"  # nothing to check


def test_a_sequence_first_batch_is_refused_with_the_batch_dim_to_pass() -> None:
    # Before: only "returned a batch of 12 samples": nothing said how an nn.LSTM's
    # (seq_len, n, features) batch could be tuned at all.
    seq_first = lambda n: {"x": torch.zeros(12, n, 8), "y": torch.zeros(n)}  # noqa: E731
    with pytest.raises(ValueError, match=r"of 12 samples .* along dimension 1: .* batch_dim=1"):
        checked_batch(seq_first, 4)
    # No other dimension of size n: no hint (a sampler that ignores n).
    with pytest.raises(ValueError, match=r"exactly n samples$"):
        checked_batch(lambda n: torch.zeros(12, 3, 8), 4)


def test_batch_dim_reads_the_first_tensor_with_that_dimension() -> None:
    # A 1-D tensor (lengths) has no dimension 1: the sequence-first tensor after it counts.
    batch = (torch.zeros(4, dtype=torch.int64), torch.zeros(12, 4, 8), torch.zeros(9, 4, 8))
    assert checked_batch(lambda n: batch, 4, batch_dim=1) is batch
    with pytest.raises(ValueError, match=r"of 12 samples \(the size along batch_dim=1 of"):
        checked_batch(lambda n: torch.zeros(3, 12, 4), 3, batch_dim=1)
    with pytest.raises(ValueError, match=r"of 4 samples .* pass batch_dim=0$"):
        checked_batch(lambda n: torch.zeros(3, 4), 3, batch_dim=1)


def test_a_batch_dim_no_tensor_has_is_refused_naming_the_shapes() -> None:
    # Before: no tensor had dimension 2, so nothing was checked: a sampler that ignores n
    # passed at every size, and the tuner timed one batch size under many names.
    batch = {"x": torch.zeros(7, 8), "y": torch.zeros(7)}
    with pytest.raises(
        ValueError,
        match=r"batch_dim=2, but no tensor in sample\(4\)'s batch has dimension 2 "
        r"\(shapes \[7, 8\], \[7\]\): pass the dimension that holds the samples",
    ):
        checked_batch(lambda n: batch, 4, batch_dim=2)
    assert checked_batch(lambda n: ["a", "b"], 2, batch_dim=2) == ["a", "b"]  # no tensor


@pytest.mark.parametrize("fields", [1, 2])
def test_a_list_batch_whose_tensors_lack_batch_dim_names_batch_dim(fields: int) -> None:
    # Before: a list batch ([x], [x, y]: what batches_from(TensorDataset(...)) gives) was
    # read as that many per-sample items ("sample(4) returned a list of 1 items"), where the
    # same batch as a tuple named batch_dim and the shapes.
    with pytest.raises(ValueError, match=r"batch_dim=2, but no tensor in sample\(4\)'s batch"):
        checked_batch(lambda n: [torch.zeros(n, 4)] * fields, 4, batch_dim=2)
    # At n = its number of fields too: [x, y] of unlike tensors is not 2 samples.
    with pytest.raises(ValueError, match=r"batch_dim=2, but no tensor in sample\(2\)'s batch"):
        checked_batch(lambda n: [torch.zeros(n, 4), torch.zeros(n)], 2, batch_dim=2)


def test_a_batch_of_only_0_d_tensors_is_refused_naming_the_shapes() -> None:
    # Before: a 0-d tensor has no dimension 0, so nothing was checked: a sample(n) that
    # returns one value per field passed at every size, and every size timed one sample.
    batch = {"x": torch.tensor(1.0), "y": torch.tensor(2)}
    with pytest.raises(
        ValueError,
        match=r"no tensor in sample\(4\)'s batch has dimension 0 \(shapes \[\], \[\]\): "
        r"sample\(n\) must return n samples along dimension 0, e\.g\. tensors of shape "
        r"\(n, \.\.\.\)",
    ):
        checked_batch(lambda n: batch, 4)
    # A list of n 0-d tensors is n samples (counted by its items), as before.
    assert len(checked_batch(lambda n: [torch.tensor(1.0)] * n, 3)) == 3
    assert checked_batch(lambda n: "opaque", 4) == "opaque"  # no tensor: nothing to check


def test_a_list_of_variable_length_samples_is_counted_under_batch_dim() -> None:
    # A sequence-first LSTM whose step pads the samples itself (pad_sequence -> (L, n)):
    # the check for a tensor with dimension batch_dim refused the list it used to count.
    def sample(n: int) -> list[torch.Tensor]:
        return [torch.zeros(5 + i) for i in range(n)]

    assert len(checked_batch(sample, 3, batch_dim=1)) == 3
    with pytest.raises(ValueError, match=r"returned a list of 4 items; it must return n samples"):
        checked_batch(lambda n: sample(n + 1), 3, batch_dim=1)


def test_batch_dim_reads_only_the_first_tensor_so_a_batch_first_mask_is_accepted() -> None:
    # nn.Transformer without batch_first takes (S, N, E) inputs but (N, S) padding masks:
    # checking every tensor along batch_dim=1 would refuse this batch.
    batch = {"src": torch.zeros(12, 4, 8), "src_key_padding_mask": torch.zeros(4, 12).bool()}
    assert checked_batch(lambda n: batch, 4, batch_dim=1) is batch


def test_a_list_of_per_sample_tensors_holds_as_many_samples_as_items() -> None:
    # Detection models take tuple(zip(*samples)): images of 3 channels each, n of them. The
    # first tensor's leading size (3) is not the batch's; the list's length is.
    def detection(n: int) -> tuple[tuple[torch.Tensor, ...], tuple[dict[str, torch.Tensor], ...]]:
        return tuple(torch.zeros(3, 16, 16) for _ in range(n)), tuple({} for _ in range(n))

    images, _ = checked_batch(detection, 4)
    assert len(images) == 4
    with pytest.raises(ValueError, match=r"no size 4 in it: the lists .* hold 5 items and .* 3;"):
        checked_batch(lambda n: detection(n + 1), 4)  # 5 images, 3 channels: neither is 4
    # detectron2's inputs: a list of per-sample dicts.
    records = checked_batch(lambda n: [{"image": torch.zeros(3, 8, 8)} for _ in range(n)], 4)
    assert len(records) == 4
    with pytest.raises(ValueError, match=r"sample\(4\) returned a batch with no size 4 in it"):
        checked_batch(lambda n: [{"image": torch.zeros(3, 8, 8)} for _ in range(5)], 4)
    # Two views of a batch: a list of 2 tensors, each with the batch's leading size.
    views = checked_batch(lambda n: ([torch.zeros(n, 8), torch.zeros(n, 8)], torch.zeros(n)), 4)
    assert views[0][0].shape[0] == 4
    with pytest.raises(ValueError, match=r"returned a list of 3 items"):
        checked_batch(lambda n: ["a", "b", "c"], 4)


class Detection(Dataset[tuple[torch.Tensor, dict[str, torch.Tensor]]]):
    """An image of 3 channels and its boxes per sample, as detection datasets return."""

    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return torch.zeros(3, 16, 16), {"boxes": torch.zeros(2, 4), "labels": torch.ones(2)}


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_a_list_of_per_sample_items_holds_as_many_samples_as_items(n: int) -> None:
    # Before: collate_fn=list (n (image, target) tuples) and a list of n images were read
    # by the first image's channel count, 3: only n == 3 (or 2, the tuple) was accepted.
    pairs = checked_batch(batches_from(Detection(), collate_fn=list), n)
    assert len(pairs) == n and batch_length(pairs) == n
    images = checked_batch(lambda k: [torch.zeros(3, 16, 8 + k) for _ in range(k)], n)
    assert len(images) == n and batch_length(images) == n


def test_a_list_of_per_sample_items_of_the_wrong_length_is_refused_without_a_wrong_count() -> None:
    with pytest.raises(ValueError, match=r"lists .* hold 5, 2 items and .* leading size is 3;"):
        checked_batch(lambda n: batches_from(Detection(), collate_fn=list)(n + 1), 4)
    with pytest.raises(ValueError, match=r"sample\(4\) returned a batch with no size 4"):
        checked_batch(lambda n: [torch.zeros(3, 16, 16) for _ in range(5)], 4)


def test_a_list_of_unlike_tensors_is_the_batch_s_fields() -> None:
    # [x, y]: features and class indices, each with the batch's leading size.
    def fields(k: int) -> list[torch.Tensor]:
        return [torch.zeros(k, 8), torch.zeros(k, dtype=torch.long)]

    x, y = checked_batch(fields, 4)
    assert len(x) == len(y) == 4 and batch_length(fields(4)) == 4
    with pytest.raises(ValueError, match=r"sample\(2\) returned a batch of 8 samples"):
        checked_batch(lambda n: fields(8), 2)  # 2 fields are not 2 samples


@pytest.mark.parametrize(
    "make", [lambda n: (torch.zeros(1) for _ in range(n)), lambda n: map(torch.zeros, [n])]
)
def test_a_one_shot_iterator_is_refused(make: object) -> None:
    # Before: accepted, and every step after the first got an exhausted iterator.
    message = r"sample\(3\) returned a one-shot iterator \(.*did sample use yield\?\): return the"
    with pytest.raises(ValueError, match=message):
        checked_batch(make, 3)  # type: ignore[arg-type]

    def sample(n: int) -> Iterator[torch.Tensor]:
        yield torch.zeros(n)

    with pytest.raises(ValueError, match=r"\(generator; did sample use yield\?\)"):
        checked_batch(sample, 3)


def test_a_dataloader_is_refused_with_the_fix() -> None:
    loader = DataLoader(TensorDataset(torch.zeros(64, 8)), batch_size=32)
    fix = r"batches_from\(loader.dataset, collate_fn=loader.collate_fn\)"
    with pytest.raises(ValueError, match=r"batches_from\(\) got a DataLoader: its items are "):
        batches_from(loader)
    with pytest.raises(ValueError, match=fix):
        batches_from(loader)
    with pytest.raises(ValueError, match=r"sample\(4\) returned a DataLoader"):
        checked_batch(lambda n: loader, 4)


def test_a_dataset_that_is_its_own_iterator_is_refused_before_a_sample_is_read() -> None:
    assert_refused_unread(batches_from, "batches_from()")


def test_a_stream_that_starts_afresh_gives_batches_again_and_again() -> None:
    for ds in (Fresh(), Resets(16)):
        sample = batches_from(ds)
        assert torch.equal(sample(4), sample(4)) and sample(4).tolist() == [
            [0.0],
            [1.0],
            [2.0],
            [3.0],
        ]


@pytest.mark.parametrize(
    "sample",
    [
        lambda n: {"texts": ["hello world"] * n, "temperature": torch.tensor(0.7)},
        lambda n: (["s"] * n, torch.tensor(1.0)),
        lambda n: {"input_ids": [[1, 2, 3]] * n, "scale": torch.tensor(1.0)},
    ],
    ids=["texts-and-temperature", "tuple-of-texts-and-scale", "id-lists-and-scale"],
)
def test_a_0_d_tensor_beside_n_non_tensor_samples_is_accepted(sample: Callable[[int], Any]) -> None:
    # Before: refused as a batch of only 0-d tensors ("no tensor ... has dimension 0"),
    # though its n samples are the list's items (text models that tokenize in the step).
    batch = sample(4)
    assert checked_batch(lambda n: batch, 4) is batch
    with pytest.raises(ValueError, match=r"sample\(4\)"):  # 3 samples where 4 were asked
        checked_batch(lambda n: sample(3), 4)


@pytest.mark.parametrize(
    "batch",
    [
        (torch.tensor(0.5), 1),
        {"x": torch.tensor(0.5), "id": "a"},
        {"texts": ["a"] * 3, "t": torch.tensor(0.7)},
        {"x": torch.tensor(0.5), "meta": {"ids": [1, 2], "name": "b"}},
    ],
    ids=["tensor-and-number", "tensor-and-string", "3-texts-at-4", "nested-2-ids-at-4"],
)
def test_a_0_d_tensor_beside_nothing_of_n_items_is_refused(batch: Any) -> None:
    # Before: a number or string anywhere counted as "maybe a sample", so these were
    # accepted at every n though nothing in them has n items.
    with pytest.raises(ValueError, match=r"no tensor in sample\(4\)'s batch has dimension 0"):
        checked_batch(lambda n: batch, 4)
