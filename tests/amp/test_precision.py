"""trainperf.amp._precision: the "auto" policy per device, and what a device supports."""

from __future__ import annotations

import platform

import pytest
import torch

from tests.amp._helpers import fake_gpu
from trainperf.amp import MixedPrecision, _mixed, _precision, choose_precision
from trainperf.errors import DeviceError

# --------------------------------------------------------------------------- the "auto" policy


@pytest.mark.parametrize(
    ("gpu", "capability", "dtype", "scaler"),
    [
        ("P40", (6, 1), torch.float32, False),
        ("V100", (7, 0), torch.float16, True),
        ("T4", (7, 5), torch.float16, True),
        ("A100", (8, 0), torch.bfloat16, False),
        ("H200", (9, 0), torch.bfloat16, False),
    ],
)
def test_auto_policy_follows_the_compute_capability(
    monkeypatch: pytest.MonkeyPatch,
    gpu: str,
    capability: tuple[int, int],
    dtype: torch.dtype,
    scaler: bool,
) -> None:
    fake_gpu(monkeypatch, capability)
    assert choose_precision("cuda:0") == dtype
    mp = MixedPrecision("cuda:0")
    assert (mp.dtype, mp.uses_scaler) == (dtype, scaler)
    assert f"compute capability {capability[0]}.{capability[1]}" in repr(mp)
    assert f"dtype={_mixed._NAMES[dtype]}" in repr(mp)


@pytest.mark.parametrize(("kernels", "dtype"), [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_policy_on_cpu_depends_on_bf16_kernels(
    monkeypatch: pytest.MonkeyPatch, kernels: bool, dtype: torch.dtype
) -> None:
    monkeypatch.setattr(_precision, "cpu_has_bf16_kernels", lambda: kernels)
    assert choose_precision("cpu") == dtype
    assert MixedPrecision("cpu").dtype == dtype


def fake_cpu(
    monkeypatch: pytest.MonkeyPatch,
    machine: str,
    *,
    avx512_bf16: bool | None,
    amx: bool | None,
    onednn: bool,
) -> None:
    """A CPU of ``machine``; None removes a torch.cpu check (a torch that lacks it)."""
    monkeypatch.setattr(platform, "machine", lambda: machine)
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: True)
    for name, value in (
        ("_is_avx512_bf16_supported", avx512_bf16),
        ("_is_amx_tile_supported", amx),
    ):
        if value is None:
            monkeypatch.delattr(torch.cpu, name, raising=False)
        else:
            monkeypatch.setattr(torch.cpu, name, lambda value=value: value)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: onednn)


@pytest.mark.parametrize(
    ("cpu", "machine", "avx512_bf16", "amx", "native"),
    [
        # oneDNN says yes on every AVX-512BW/VL/DQ CPU; only these flags mean native bf16.
        ("Cascade Lake", "x86_64", False, False, False),
        ("Cooper Lake / Zen 4", "x86_64", True, False, True),
        ("Sapphire Rapids", "x86_64", True, True, True),
        ("AMX only", "AMD64", False, True, True),
        ("a torch without the checks", "x86_64", None, None, False),
    ],
)
def test_x86_cpu_needs_avx512_bf16_or_amx_not_just_onednn(
    monkeypatch: pytest.MonkeyPatch,
    cpu: str,
    machine: str,
    avx512_bf16: bool | None,
    amx: bool | None,
    native: bool,
) -> None:
    fake_cpu(monkeypatch, machine, avx512_bf16=avx512_bf16, amx=amx, onednn=True)
    assert _precision.cpu_has_bf16_kernels() is native
    dtype, why = _precision.auto_precision(torch.device("cpu"))
    assert dtype == (torch.bfloat16 if native else torch.float32)
    assert ("has native bf16" if native else "no native bf16") in why


@pytest.mark.parametrize("onednn", [True, False])
def test_arm_cpu_keeps_the_onednn_check(monkeypatch: pytest.MonkeyPatch, onednn: bool) -> None:
    # The x86 flags are False on Arm; oneDNN's answer decides there.
    fake_cpu(monkeypatch, "aarch64", avx512_bf16=False, amx=False, onednn=onednn)
    assert _precision.cpu_has_bf16_kernels() is onednn
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    assert _precision.cpu_has_bf16_kernels() is False


def test_auto_policy_for_mps_and_unknown_devices() -> None:
    assert _precision.auto_precision(torch.device("mps"))[0] == torch.float16
    assert choose_precision("meta") == torch.float32


def test_explicit_precision_overrides_the_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpu(monkeypatch, (9, 0))
    mp = MixedPrecision("cuda", precision="fp16")
    assert (mp.dtype, mp.uses_scaler) == (torch.float16, True)
    assert "requested fp16 with loss scaling" in mp.reason
    assert MixedPrecision("cuda", precision="fp32").dtype == torch.float32


# --------------------------------------------------------------------------- misuse


def test_bf16_on_a_gpu_without_native_bf16_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpu(monkeypatch, (7, 5))
    with pytest.raises(
        DeviceError, match=r"precision='bf16' needs compute capability >= 8\.0.*7\.5"
    ):
        MixedPrecision("cuda", precision="bf16")


def test_fp16_on_pascal_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpu(monkeypatch, (6, 1))
    with pytest.warns(UserWarning, match="usually slower than fp32"):
        mp = MixedPrecision("cuda", precision="fp16")
    assert mp.uses_scaler


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_half_precision_without_autocast_support_is_an_error(
    monkeypatch: pytest.MonkeyPatch, precision: str
) -> None:
    monkeypatch.setattr(_precision, "autocast_supports", lambda device_type, dtype: False)
    with pytest.raises(ValueError, match=rf"precision='{precision}' needs {precision} autocast"):
        MixedPrecision("cpu", precision=precision)  # type: ignore[arg-type]
