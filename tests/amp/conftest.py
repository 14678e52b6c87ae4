"""Fixtures of the amp tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture
def restore_tf32() -> Iterator[None]:
    """TF32 flags are process-wide; put them back through the legacy setters, which leave
    both the legacy and the new (torch >= 2.9) APIs readable."""
    matmul = torch.get_float32_matmul_precision()
    cudnn = torch.backends.cudnn.allow_tf32
    yield
    torch.backends.cudnn.allow_tf32 = cudnn
    torch.set_float32_matmul_precision(matmul)
