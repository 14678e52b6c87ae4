"""trainperf._utils.seed_draw: another generator draws the seed; the sampler reads the caller's."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from trainperf._utils.seed_draw import sampler_generator, seed_drawn_from


def test_the_callers_generator_comes_back_however_the_block_ends() -> None:
    mine, scratch = torch.Generator(), torch.Generator()
    loader = DataLoader([1, 2], generator=mine)
    with pytest.raises(RuntimeError, match="could not start"), seed_drawn_from(loader, scratch):
        assert loader.generator is scratch and sampler_generator(loader) is mine
        raise RuntimeError("the pool could not start")
    assert loader.generator is mine and sampler_generator(loader) is mine
    assert "_trainperf_real_generator" not in loader.__dict__  # nothing left to pickle


def test_a_loader_without_a_generator_reads_none() -> None:
    loader = DataLoader([1, 2])
    with seed_drawn_from(loader, torch.Generator()):
        assert sampler_generator(loader) is None
    assert loader.generator is None


def test_a_block_inside_another_still_reads_the_callers_generator() -> None:
    # A resumed pass's scratch draw around an adaptive loader's own: the inner block took the
    # outer scratch generator for the caller's, and its exit dropped the outer record.
    mine, outer, inner = torch.Generator(), torch.Generator(), torch.Generator()
    loader = DataLoader([1, 2], generator=mine)
    with seed_drawn_from(loader, outer):
        with seed_drawn_from(loader, inner):
            assert loader.generator is inner and sampler_generator(loader) is mine
        assert loader.generator is outer and sampler_generator(loader) is mine
    assert loader.generator is mine and "_trainperf_real_generator" not in loader.__dict__
