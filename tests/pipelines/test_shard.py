"""trainperf.pipelines._shard: the (rank, world_size) a loader reads."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trainperf.pipelines._shard import resolve_shard


@pytest.mark.parametrize(
    "shard", [(np.int64(1), 2), (1, np.int32(2)), (np.uint8(1), np.int64(2)), (torch.tensor(1), 2)]
)
def test_shard_takes_numpy_and_torch_integers_as_python_ints(shard: tuple[int, int]) -> None:
    rank, world = resolve_shard(shard)
    assert (rank, world) == (1, 2)
    assert type(rank) is int and type(world) is int


@pytest.mark.parametrize(
    "shard", [(True, 2), (0, np.bool_(True)), (torch.tensor(False), 2), (0.0, 2), ("0", 2)]
)
def test_shard_refuses_bools_floats_and_strings(shard: tuple[object, object]) -> None:
    with pytest.raises(ValueError, match=r"shard must be 'auto', None or a \(rank, world_size\)"):
        resolve_shard(shard)  # type: ignore[arg-type]


def test_shard_out_of_range_names_both_numbers() -> None:
    with pytest.raises(ValueError, match=r"0 <= rank < world_size, got rank=2, world_size=2"):
        resolve_shard((np.int64(2), np.int64(2)))


def test_more_ranks_than_images_with_drop_says_batch_size_cannot_help() -> None:
    # 5 images over 8 ranks, last_batch="drop": each rank gets 0 images, so no batch_size
    # helps, yet the message said "lower batch_size".
    from trainperf.pipelines._shard import shard_plan

    with pytest.raises(ValueError, match=r"8 ranks but only 5 images.*last_batch='keep'") as e:
        shard_plan(5, 1, 0, 8, "drop")
    assert "lower batch_size" not in str(e.value)
    with pytest.raises(ValueError, match=r"batch_size=2 is larger than the 1 images"):
        shard_plan(5, 2, 0, 3, "drop")
