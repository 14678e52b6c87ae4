"""trainperf.amp._tf32: reading, switching and restoring TF32 through either torch API."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.amp._helpers import (
    PRECISION_TREE,
    needs_precision_tree,
    reset_tf32,
    tf32_reads,
    tf32_reads_as_parents_change,
)
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


# ----------------------------------------------------------------- both APIs, in and after tf32()


def _set(path: str, value: str) -> Callable[[], None]:
    """A setup that sets ``torch.backends.<path>.fp32_precision`` (``""``: the root)."""

    def setup() -> None:
        backend: Any = torch.backends
        for part in filter(None, path.split(".")):
            backend = getattr(backend, part)
        backend.fp32_precision = value

    return setup


def _legacy(matmul: str, cudnn: bool) -> Callable[[], None]:
    def setup() -> None:
        torch.set_float32_matmul_precision(matmul)
        torch.backends.cudnn.allow_tf32 = cudnn

    return setup


def _then(*setups: Callable[[], None]) -> Callable[[], None]:
    def setup() -> None:
        for step in setups:
            step()

    return setup


# What a user (or another library) may have set before entering tf32(): the legacy flags, the
# new per-backend settings, and mixes of both that make the legacy getters raise.
LEGACY_SETUPS = {
    "legacy highest": _legacy("highest", cudnn=True),
    "legacy off": _legacy("highest", cudnn=False),
    "legacy high": _legacy("high", cudnn=True),
    "legacy medium": _legacy("medium", cudnn=False),
}
TREE_SETUPS = {
    "root tf32": _set("", "tf32"),
    "root tf32 over legacy cudnn off": _then(_legacy("highest", cudnn=False), _set("", "tf32")),
    "root bf16 through mkldnn's setter": _set("mkldnn", "bf16"),
    "cpu matmul bf16": _set("mkldnn.matmul", "bf16"),
    "cuda matmul tf32": _set("cuda.matmul", "tf32"),
    "cudnn conv ieee": _set("cudnn.conv", "ieee"),
    "cudnn ieee over legacy cudnn off": _then(_legacy("high", cudnn=False), _set("cudnn", "ieee")),
    "legacy high then cuda matmul ieee": _then(
        _legacy("high", cudnn=True), _set("cuda.matmul", "ieee")
    ),
}
SETUPS = [pytest.param(s, id=name) for name, s in LEGACY_SETUPS.items()] + [
    pytest.param(s, id=name, marks=needs_precision_tree) for name, s in TREE_SETUPS.items()
]


@pytest.mark.parametrize("enabled", [True, False])
@pytest.mark.parametrize("setup", SETUPS)
def test_tf32_puts_back_every_setting_as_either_api_reads_it(
    restore_tf32: None, setup: Callable[[], None], enabled: bool
) -> None:
    reset_tf32()
    setup()
    expected = tf32_reads_as_parents_change()  # also whether each setting follows its parent
    reset_tf32()
    setup()
    before = tf32_reads()
    with _tf32.tf32(enabled):
        pass
    assert tf32_reads() == before
    with pytest.raises(KeyError, match="inside"), _tf32.tf32(enabled):
        raise KeyError("inside")
    assert tf32_reads() == before
    if PRECISION_TREE:
        assert tf32_reads_as_parents_change() == expected


@pytest.mark.parametrize("enabled", [True, False])
@pytest.mark.parametrize("setup", SETUPS)
def test_inside_tf32_both_apis_agree(
    restore_tf32: None, setup: Callable[[], None], enabled: bool
) -> None:
    reset_tf32()
    setup()
    with _tf32.tf32(enabled) as state:
        reads = tf32_reads()
        assert _tf32.tf32_state() == state == _tf32.TF32State(matmul=enabled, cudnn=enabled)
    assert reads["get_float32_matmul_precision()"] == ("high" if enabled else "highest")
    assert reads["cuda.matmul.allow_tf32"] is enabled
    assert reads["cudnn.allow_tf32"] is enabled
    if PRECISION_TREE:
        off = ("ieee", "none")  # "none" that inherits nothing is full fp32 too
        assert reads["cuda.matmul.fp32_precision"] == ("tf32" if enabled else "ieee")
        for op in ("conv", "rnn"):
            got = reads[f"cudnn.{op}.fp32_precision"]
            assert got == "tf32" if enabled else got in off


@needs_precision_tree
def test_tf32_state_says_what_torch_applies_where_the_legacy_getter_does_not_raise(
    restore_tf32: None,
) -> None:
    reset_tf32()
    torch.set_float32_matmul_precision("high")
    torch.backends.cuda.matmul.fp32_precision = "ieee"  # cuBLAS now runs full fp32
    assert torch.get_float32_matmul_precision() == "high"  # ... which the legacy getter hides
    assert _tf32.tf32_state() == _tf32.TF32State(matmul=False, cudnn=True)


@pytest.mark.slow
@needs_precision_tree
def test_tf32_keeps_torch_s_start_value_for_cudnn_where_it_can() -> None:
    # A fresh process: cuDNN's conv and rnn hold torch's internal start value (TF32 unless a
    # parent setting says otherwise), which no API can set back once it is overwritten.
    code = (
        "import json, torch\n"
        "from tests.amp._helpers import tf32_reads, tf32_reads_as_parents_change\n"
        "from trainperf.amp._tf32 import tf32\n"
        "def parents_back():\n"
        "    for backend in ('generic', 'cuda', 'mkldnn'):\n"
        "        torch._C._set_fp32_precision_setter(backend, 'all', 'none')\n"
        "expected = tf32_reads_as_parents_change()\n"
        "parents_back()\n"
        "with tf32(True):\n"
        "    pass\n"
        "kept = tf32_reads_as_parents_change() == expected\n"
        "parents_back()\n"
        "before = tf32_reads()\n"
        "with tf32(False):\n"
        "    pass\n"
        "print(json.dumps([kept, tf32_reads() == before]))\n"
    )
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [True, True]


@pytest.mark.usefixtures("restore_tf32")
def test_a_torch_whose_private_accessors_differ_falls_back_to_the_legacy_api(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from trainperf.amp import _tf32

    # A mix of the two APIs, where the legacy getters raise.
    torch.backends.cuda.matmul.fp32_precision = "tf32"  # type: ignore[attr-defined]
    torch.backends.cudnn.conv.fp32_precision = "ieee"  # type: ignore[attr-defined]
    getter = torch._C._get_fp32_precision_getter

    def other_signature(*args: object) -> str:
        raise TypeError("_get_fp32_precision_getter(): incompatible function arguments")

    monkeypatch.setattr(torch._C, "_get_fp32_precision_getter", other_signature)
    assert not _tf32._has_tree()
    assert isinstance(_tf32.tf32_state(), _tf32.TF32State)  # never raising, as documented
    with _tf32.tf32(True) as state:
        assert state == _tf32.TF32State(matmul=True, cudnn=True)
    monkeypatch.setattr(torch._C, "_get_fp32_precision_getter", getter)
