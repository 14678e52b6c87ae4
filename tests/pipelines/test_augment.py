"""trainperf.pipelines._augment: crop boxes, eval geometry, flips and normalisation."""

from __future__ import annotations

import random

import pytest
import torch

from trainperf.pipelines import IMAGENET_MEAN, IMAGENET_STD
from trainperf.pipelines._augment import (
    center_resize_crop,
    eval_geometry,
    normalize,
    random_flip,
    sample_crop_box,
    sample_seed,
)

PIL = pytest.importorskip("PIL.Image")
torchvision = pytest.importorskip("torchvision")


def test_crop_boxes_follow_random_resized_crop() -> None:
    rng = random.Random(0)
    areas = []
    for _ in range(300):
        top, left, h, w = sample_crop_box(375, 500, rng)
        assert 0 <= top <= 375 - h and 0 <= left <= 500 - w
        areas.append(h * w / (375 * 500))
        assert 3 / 4 * 0.9 <= w / h <= 4 / 3 * 1.1
    assert 0.07 <= min(areas) < 0.2 and max(areas) > 0.9
    # Nothing fits a 1000x10 strip at these ratios: the centred fallback.
    assert sample_crop_box(10, 1000, random.Random(1)) == (0, 493, 10, 13)


@pytest.mark.parametrize(("h", "w"), [(375, 500), (500, 375), (97, 131), (64, 64), (61, 140)])
def test_eval_geometry_is_torchvisions(h: int, w: int) -> None:
    import torchvision.transforms as T

    img = torch.arange(h * w, dtype=torch.float64).reshape(1, h, w)
    new_h, new_w, top, left = eval_geometry(h, w, 56)
    resized = T.Resize(int(56 / 0.875), antialias=True)(img)
    assert resized.shape[-2:] == (new_h, new_w)
    assert torch.equal(T.CenterCrop(56)(resized), resized[:, top : top + 56, left : left + 56])


def test_normalize_is_bit_identical_to_totensor_normalize() -> None:
    import torchvision.transforms as T

    pixels = torch.randint(0, 256, (2, 3, 5, 7), dtype=torch.uint8)
    expected = torch.stack(
        [T.Normalize(IMAGENET_MEAN, IMAGENET_STD)(p.float().div(255)) for p in pixels]
    )
    assert torch.equal(normalize(pixels, IMAGENET_MEAN, IMAGENET_STD), expected)


def test_random_flip_and_center_crop() -> None:
    batch = torch.arange(8.0).reshape(2, 1, 1, 4)
    assert random_flip(batch, [False, True]).tolist() == [[[[0, 1, 2, 3]]], [[[7, 6, 5, 4]]]]
    assert random_flip(batch, [False, False]) is batch
    img = torch.randint(0, 256, (3, 90, 120), dtype=torch.uint8)
    out = center_resize_crop(img, 48)
    assert out.shape == (3, 48, 48) and torch.equal(out, out.round())


def test_every_image_of_every_epoch_draws_from_its_own_seed() -> None:
    # ImageNet-scale: image i + 1,000,003 of one epoch met image i of the next (a product
    # mix with that modulus), so a fifth of ImageNet-1k replayed another image's crops.
    big = 1_000_003
    cases = [(0, 0, big), (0, 1, 0), (0, 0, 2 * big), (0, 2, 0), (1, 0, 0), (0, big, 0)]
    assert len({sample_seed(*c) for c in cases}) == len(cases)
    grid = {(s, e, i) for s in range(4) for e in range(30) for i in range(300)}
    assert len({sample_seed(*c) for c in grid}) == len(grid)
