"""Fixtures of the amp tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from trainperf.amp import _tf32


@pytest.fixture
def restore_tf32() -> Iterator[None]:
    """TF32 settings are process-wide: put back the legacy flags and every fp32_precision
    setting (torch >= 2.9) as the test found them."""
    saved = _tf32._snapshot()
    yield
    _tf32._restore(saved)
