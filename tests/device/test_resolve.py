"""trainperf.device._resolve: resolve_device, the one parser of every device argument."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from typing import Any

import pytest
import torch

from trainperf.device import resolve_device
from trainperf.errors import DeviceError

META = torch.device("meta")


# --------------------------------------------------------------------------- resolve_device()


def fake_cuda(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_resolve_device_parses_strings_ints_and_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cuda(monkeypatch, 2)
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("cuda") == torch.device("cuda")
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    assert resolve_device(1) == torch.device("cuda", 1)  # an int means a CUDA index
    assert resolve_device(torch.device("cuda", 0), allowed=("cuda",)) == torch.device("cuda", 0)
    assert resolve_device("meta") == META
    # allowed=None takes any type torch knows, where its backend is there.
    monkeypatch.setattr(torch.xpu, "is_available", lambda: True)
    assert resolve_device(torch.device("xpu"), allowed=None) == torch.device("xpu")


def test_resolve_device_none_and_auto_mean_best_device(monkeypatch: pytest.MonkeyPatch) -> None:
    import trainperf.device

    best = torch.device("cuda", 3)
    monkeypatch.setattr(trainperf.device, "best_device", lambda: best)
    assert resolve_device(None) == best
    assert resolve_device("auto") == best
    monkeypatch.setattr(trainperf.device, "best_device", lambda: torch.device("mps"))
    assert resolve_device("auto") == torch.device("mps")
    # A caller that cannot use what "auto" found falls back to the CPU.
    assert resolve_device(None, allowed=("cpu", "cuda")) == torch.device("cpu")


@pytest.mark.parametrize("device", [None, "auto"])
@pytest.mark.parametrize("best", ["cpu", "mps"])
def test_resolve_device_auto_without_an_allowed_device_and_no_cpu_fallback_is_an_error(
    monkeypatch: pytest.MonkeyPatch, device: str | None, best: str
) -> None:
    # Before: the CPU, a type outside allowed=("cuda",), came back.
    import trainperf.device

    monkeypatch.setattr(trainperf.device, "best_device", lambda: torch.device(best))
    message = (
        rf"device={device!r} picks the best device available, but no 'cuda' device is "
        rf"available here \(the best is '{best}'\); this has no CPU fallback: run it on a "
        "host with an NVIDIA GPU"
    )
    with pytest.raises(DeviceError, match=message):
        resolve_device(device, allowed=("cuda",))
    with pytest.raises(DeviceError, match=r"no 'xpu' or 'hpu' device .* where 'xpu' or 'hpu'"):
        resolve_device(device, allowed=("xpu", "hpu"))


def test_resolve_device_without_auto_refuses_none_and_auto() -> None:
    with pytest.raises(TypeError, match=r"device must be a str, int or torch\.device, got None"):
        resolve_device(None, auto=False)
    with pytest.raises(ValueError, match=r"invalid device 'auto': expected 'cpu', 'cuda'"):
        resolve_device("auto", auto=False)


def test_resolve_device_takes_a_numpy_integer_as_an_index(monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: np.int64(0) (an index read from a NumPy config or array) was a TypeError.
    import numpy as np

    fake_cuda(monkeypatch, 2)
    assert resolve_device(np.int64(1)) == torch.device("cuda", 1)
    got = resolve_device(np.uint8(0), allowed=None, auto=False)
    assert got == torch.device("cuda", 0) and type(got.index) is int
    with pytest.raises(ValueError, match="a device index must be >= 0, got -1"):
        resolve_device(np.int32(-1))
    for bad in (np.float64(1.0), np.bool_(True)):
        with pytest.raises(TypeError, match=r"a str, int, torch\.device or None, got"):
            resolve_device(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [1.5, True, [0]])
def test_resolve_device_rejects_wrong_types(bad: Any) -> None:
    got = re.escape(repr(bad))
    with pytest.raises(TypeError, match=rf"a str, int, torch\.device or None, got {got}$"):
        resolve_device(bad)


def test_resolve_device_rejects_invalid_and_disallowed_devices() -> None:
    with pytest.raises(ValueError, match="a device index must be >= 0, got -1"):
        resolve_device(-1)
    with pytest.raises(
        ValueError,
        match=r"invalid device 'gpu': expected 'auto', 'cpu', 'cuda', 'cuda:<i>' \(e\.g\. "
        r"'cuda:1'\), 'mps' or 'meta'$",
    ):
        resolve_device("gpu")
    with pytest.raises(ValueError, match=r"invalid device 'cuda:x': .*, or a torch\.device$"):
        resolve_device("cuda:x", allowed=None, auto=False)
    with pytest.raises(
        ValueError,
        match=r"device 'meta' is not supported here: expected 'cpu', 'cuda' or 'cuda:<i>'",
    ):
        resolve_device(torch.device("meta"), allowed=("cpu", "cuda"), auto=False)
    with pytest.raises(ValueError, match=r"device 'mps' is not supported here: expected 'auto'"):
        resolve_device("mps", allowed=("cpu", "cuda"))


@pytest.mark.parametrize("device", [128, 256, 2**31, 2**70, "cuda:128", "cuda:255", "cuda:2**70"])
def test_resolve_device_refuses_an_index_torch_would_wrap_or_overflow(
    monkeypatch: pytest.MonkeyPatch, device: int | str
) -> None:
    # Before: torch keeps a device index in 8 bits, so 256 and "cuda:256" came back as
    # cuda:0, 128 as cuda:-128 and "cuda:255" as a bare "cuda", all passing the GPU-count
    # check; 2**70 raised torch's "Overflow when unpacking long long".
    fake_cuda(monkeypatch, 200)
    device = device.replace("2**70", str(2**70)) if isinstance(device, str) else device
    index = device if isinstance(device, int) else int(device.split(":")[1])
    where = "" if isinstance(device, int) else rf" in '{device}'"
    with pytest.raises(
        ValueError,
        match=rf"a device index must be <= 127 \(PyTorch keeps it in 8 bits.*\), got "
        rf"{index}{where}: use the index of a visible device, 0 to "
        r"torch\.cuda\.device_count\(\) - 1$",
    ):
        resolve_device(device)
    assert resolve_device(127) == torch.device("cuda", 127)
    assert resolve_device("cuda:127") == torch.device("cuda", 127)


def test_resolve_device_refuses_a_torch_device_whose_index_wrapped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake_cuda(monkeypatch, 2)
    wrapped = torch.device("cuda", 128)  # torch makes this cuda:-128
    with pytest.raises(
        ValueError, match=r"device 'cuda:-128' has a negative index: .* index past 127"
    ):
        resolve_device(wrapped)


@pytest.mark.parametrize(
    "device", ["cuda:01", "cuda:+1", "cuda: 1", "cuda:1:2", "cuda:", "gpu:999"]
)
def test_resolve_device_refuses_an_index_torch_cannot_parse(device: str) -> None:
    expected = rf"invalid device {re.escape(repr(device))}: expected 'auto'"
    with pytest.raises(ValueError, match=expected):
        resolve_device(device)


@pytest.mark.parametrize("device", ["cpu:0", torch.device("cpu", 0)])
def test_resolve_device_makes_cpu_0_plain_cpu(device: str | torch.device) -> None:
    # torch.load maps onto exactly "cpu" (checkpoint's load does the same), and results
    # should name the one CPU device one way.
    got = resolve_device(device)
    assert got == torch.device("cpu") and got.index is None and str(got) == "cpu"


@pytest.mark.parametrize("device", ["cpu:1", "cpu:127", torch.device("cpu", 3)])
def test_resolve_device_refuses_a_cpu_index_other_than_0(device: str | torch.device) -> None:
    # Before: "cpu:1" was accepted, and bench results said device "cpu:1", though torch has
    # one CPU device (a tensor made on "cpu:1" is on "cpu").
    with pytest.raises(
        ValueError,
        match=rf"^device '{device}' does not exist: PyTorch has one CPU device, whatever the "
        r"cores; use device='cpu' \(to pin cores, set the process's affinity: taskset\)$",
    ):
        resolve_device(device)


def test_resolve_device_checks_cuda_is_there(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cuda(monkeypatch, 0)
    for device in ("cuda", 0, torch.device("cuda", 0)):
        with pytest.raises(
            DeviceError,
            match=r"device 'cuda(:0)?' needs CUDA, but CUDA is not available here .*"
            r"use device='cpu' or device='auto' instead",
        ):
            resolve_device(device)
    with pytest.raises(DeviceError, match=r"use device='cpu' instead"):
        resolve_device("cuda", auto=False)
    fake_cuda(monkeypatch, 2)
    with pytest.raises(
        DeviceError,
        match=r"device 'cuda:2' does not exist: only 2 GPU\(s\) are visible \(cuda:0 to cuda:1",
    ):
        resolve_device(2)


def test_a_missing_device_is_not_told_to_use_the_cpu_where_the_cpu_is_not_allowed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake_cuda(monkeypatch, 0)
    with pytest.raises(DeviceError, match="no CPU fallback: run it on a host with an NVIDIA GPU"):
        resolve_device("cuda", allowed=("cuda",))
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(DeviceError, match="no CPU fallback: run it on a Mac with Apple silicon"):
        resolve_device("mps", allowed=("mps",))


def test_resolve_device_checks_mps_is_there(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(DeviceError, match=r"device 'mps' needs Apple's Metal \(MPS\)"):
        resolve_device("mps")
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert resolve_device("mps") == torch.device("mps")


@pytest.mark.slow
def test_resolve_device_does_not_initialise_cuda() -> None:
    code = (
        "import json, torch\n"
        "from trainperf.device import resolve_device\n"
        "resolve_device(None); resolve_device('cpu')\n"
        "try:\n"
        "    resolve_device('cuda:0')\n"
        "except Exception:\n"
        "    pass\n"
        "print(json.dumps(torch.cuda.is_initialized()))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) is False


@pytest.mark.parametrize("device", ["xpu", "xpu:0", "hpu", "mtia", "privateuseone", "xla", "maia"])
def test_resolve_device_checks_other_device_types_are_there(device: str) -> None:
    kind = device.split(":")[0]
    module = getattr(torch, kind, None)
    if module is not None and module.is_available():
        pytest.skip(f"this host has a {kind} device")
    expected = rf"device '{device}' needs PyTorch's '{kind}' backend, but it is not available.*"
    with pytest.raises(DeviceError, match=expected + "install and import.*device='cpu'"):
        resolve_device(device, allowed=None, auto=False)


def test_resolve_device_bounds_another_types_index(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.xpu, "is_available", lambda: True)
    monkeypatch.setattr(torch.xpu, "device_count", lambda: 2)
    assert resolve_device("xpu:1", allowed=None) == torch.device("xpu", 1)
    with pytest.raises(DeviceError, match=r"'xpu:2' does not exist: only 2 xpu device\(s\)"):
        resolve_device("xpu:2", allowed=None)


def test_resolve_device_asks_a_type_without_a_module_to_make_a_tensor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # XLA's plugin (torch_xla) adds no torch.xla: a tensor made there says it works.
    from trainperf.device import _resolve

    made: list[torch.device] = []
    monkeypatch.setattr(_resolve, "_working", set())
    monkeypatch.setattr(torch, "empty", lambda *a, device: made.append(device))
    assert resolve_device("xla", allowed=None) == torch.device("xla")
    assert resolve_device("xla", allowed=None) == torch.device("xla")
    assert made == [torch.device("xla")]  # asked once
