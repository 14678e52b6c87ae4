"""trainperf.amp._tf32: reading, switching and restoring TF32 through either torch API."""

from __future__ import annotations

import pytest
import torch

from trainperf.amp import _tf32


def test_enable_tf32_leaves_both_apis_readable(restore_tf32: None) -> None:
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False  # the state a legacy-API user leaves behind
    _tf32.enable_tf32()
    # Reading the legacy flags raises on torch >= 2.9 if the two APIs were mixed.
    assert torch.get_float32_matmul_precision() == "high"
    assert torch.backends.cuda.matmul.allow_tf32 is True
    assert torch.backends.cudnn.allow_tf32 is True
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"
        assert torch.backends.cudnn.conv.fp32_precision == "tf32"


@pytest.mark.skipif(
    not hasattr(getattr(torch.backends.cudnn, "conv", None), "fp32_precision"),
    reason="this torch has no per-backend fp32_precision API",
)
def test_enable_tf32_after_the_new_api_turned_it_off(restore_tf32: None) -> None:
    torch.backends.cudnn.conv.fp32_precision = "ieee"
    _tf32.enable_tf32()
    assert torch.backends.cudnn.conv.fp32_precision == "tf32"
    assert torch.backends.cuda.matmul.fp32_precision == "tf32"


def test_tf32_context_switches_and_restores_even_after_an_error(restore_tf32: None) -> None:
    torch.set_float32_matmul_precision("highest")
    before = _tf32.tf32_state()
    with _tf32.tf32(True) as state:
        assert state == _tf32.TF32State(matmul=True, cudnn=True) == _tf32.tf32_state()
    assert _tf32.tf32_state() == before
    with pytest.raises(KeyError, match="inside"), _tf32.tf32(False):
        assert _tf32.tf32_state() == _tf32.TF32State(matmul=False, cudnn=False)
        raise KeyError("inside")
    assert _tf32.tf32_state() == before
    switch = _tf32.tf32(1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="enabled must be True or False, got 1"), switch:
        pass


@pytest.mark.skipif(
    not hasattr(getattr(torch.backends.cuda, "matmul", None), "fp32_precision"),
    reason="this torch has no per-backend fp32_precision API",
)
def test_tf32_state_reads_after_the_new_api_made_legacy_getters_raise(restore_tf32: None) -> None:
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    torch.backends.cudnn.conv.fp32_precision = "ieee"  # rnn stays tf32: legacy reads raise
    with pytest.raises(RuntimeError, match="mix of the legacy and new APIs"):
        torch.get_float32_matmul_precision()
    assert _tf32.tf32_state() == _tf32.TF32State(matmul=True, cudnn=False)
    with _tf32.tf32(False):
        assert _tf32.tf32_state() == _tf32.TF32State(matmul=False, cudnn=False)
    assert torch.backends.cuda.matmul.fp32_precision == "tf32"
    assert torch.backends.cudnn.conv.fp32_precision == "ieee"
    assert _tf32.tf32_state() == _tf32.TF32State(matmul=True, cudnn=False)
