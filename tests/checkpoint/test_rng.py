"""trainperf.checkpoint._rng: every generator's state round-trips, as weights-only data."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from trainperf.checkpoint import load_checkpoint, save_checkpoint
from trainperf.checkpoint._rng import rng_state, set_rng_state


def _draw() -> tuple[float, float, float, float]:
    numpy = (float(np.random.rand()), float(np.random.randn()))
    return (random.random(), *numpy, torch.rand(1).item())


def test_states_round_trip_through_a_weights_only_file(tmp_path: Path) -> None:
    random.seed(1)
    np.random.seed(2)
    np.random.randn()  # leaves a cached Gaussian in NumPy's state
    torch.manual_seed(3)
    path = save_checkpoint({"rng": rng_state()}, tmp_path / "rng.pt")
    expected = _draw()
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    saved = torch.load(path, weights_only=True)["rng"]  # plain torch.load, weights only
    set_rng_state(saved)
    assert _draw() == expected
    set_rng_state(load_checkpoint(path)["rng"])
    assert _draw() == expected


def test_cuda_states_are_not_read_where_cuda_was_never_started() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        pytest.skip("CUDA was started by an earlier test here")
    assert rng_state()["cuda"] is None
    assert not torch.cuda.is_initialized()


def test_a_state_that_is_not_ours_is_refused() -> None:
    with pytest.raises(ValueError, match=r"not a generator state .*\['cuda', 'numpy'\] missing"):
        set_rng_state({"python": random.getstate(), "torch": torch.get_rng_state()})


def test_gpu_states_without_the_gpus_are_skipped_with_a_warning() -> None:
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    state = rng_state()
    state["cuda"] = [torch.zeros(16, dtype=torch.uint8)] * 2
    with pytest.warns(UserWarning, match=r"random states of 2 CUDA device\(s\), but 0 are visible"):
        set_rng_state(state)
