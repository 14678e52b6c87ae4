"""Fixtures shared by the checkpoint tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

# torch.compile, the first optimizer step, DistributedDataParallel and
# use_deterministic_algorithms each import torch._dynamo (about 2 s here) the first time.
# Importing it while collecting keeps that one-time cost out of whichever test happens to run
# first, so --durations (and the slow marker) measure the tests themselves.
import torch._dynamo

from trainperf.checkpoint import save_checkpoint


@pytest.fixture
def old(tmp_path: Path) -> Path:
    """A checkpoint already on disk that failed saves must leave alone."""
    path = tmp_path / "ckpt.pt"
    save_checkpoint({"gen": 0, "w": torch.arange(4.0)}, path)
    return path
