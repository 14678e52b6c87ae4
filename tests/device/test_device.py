"""trainperf.device: GPU discovery against a fake NVML, batch moves, device checks, seeds."""

from __future__ import annotations

import collections
import dataclasses
import json
import random
import re
import subprocess
import sys
import types
import warnings
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import trainperf.device._inventory as inventory_mod
import trainperf.device._seed as seed_mod
from trainperf.device import (
    GpuInfo,
    VisibleDevices,
    best_device,
    check_same_device,
    gpus,
    parse_visible_devices,
    resolve_device,
    seed_everything,
    select_gpus,
    to_device,
    worker_init_fn,
)
from trainperf.errors import DeviceError, DeviceMismatchError

GiB = 1 << 30
META = torch.device("meta")

# --------------------------------------------------------------------------- a fake NVML


@dataclasses.dataclass
class FakeCard:
    name: str
    uuid: str
    pci: str
    cc: tuple[int, int] | None
    total: int
    free: int | None  # None: memory queries are not supported
    util: int | None  # None: utilisation queries are not supported
    migs: list[FakeCard] = dataclasses.field(default_factory=list)


def fake_cards() -> list[FakeCard]:
    """NVML order = PCI order. FASTEST_FIRST (by compute capability) is 3, 1, 2, 0."""
    return [
        FakeCard("Tesla P40", "GPU-11111111-aaaa", "00000000:1A:00.0", (6, 1), 24 * GiB, 20 * GiB,
                 3),
        FakeCard(
            "NVIDIA A100-SXM4-40GB",
            "GPU-22221111-bbbb",
            "00000000:3B:00.0",
            (8, 0),
            40 * GiB,
            10 * GiB,
            None,  # MIG mode on: no utilisation
            migs=[
                FakeCard("A100 MIG 3g.20gb", "MIG-33333333-cccc", "", None, 20 * GiB, 9 * GiB,
                         None),
                FakeCard("A100 MIG 3g.20gb", "MIG-44444444-dddd", "", None, 20 * GiB, 2 * GiB,
                         None),
            ],
        ),
        FakeCard(
            "NVIDIA A100-SXM4-40GB", "GPU-22229999-eeee", "00000000:5E:00.0", (8, 0), 40 * GiB,
            30 * GiB, 70,
        ),
        FakeCard(
            "NVIDIA H100 80GB HBM3", "GPU-55555555-ffff", "00000000:86:00.0", (9, 0), 80 * GiB,
            5 * GiB, 99,
        ),
    ]  # fmt: skip


def make_fake_nvml(cards: list[FakeCard], init_error: str | None = None) -> Any:
    """A module object with pynvml's names, serving ``cards``; counts its calls."""
    nvml: Any = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    nvml.NVMLError = NVMLError
    for name in ("LibraryNotFound", "DriverNotLoaded", "NoPermission", "NotSupported", "NotFound",
                 "Unknown"):  # fmt: skip
        setattr(nvml, f"NVMLError_{name}", type(f"NVMLError_{name}", (NVMLError,), {}))
    nvml.calls = collections.Counter()

    def init() -> None:
        nvml.calls["init"] += 1
        if init_error:
            raise getattr(nvml, f"NVMLError_{init_error}")(f"fake {init_error}")

    def shutdown() -> None:
        nvml.calls["shutdown"] += 1

    def memory(h: FakeCard) -> Any:
        if h.free is None:
            raise nvml.NVMLError_NotSupported("Not Supported")
        return types.SimpleNamespace(total=h.total, used=h.total - h.free, free=h.free)

    def utilization(h: FakeCard) -> Any:
        if h.util is None:
            raise nvml.NVMLError_NotSupported("Not Supported")
        return types.SimpleNamespace(gpu=h.util, memory=0)

    def capability(h: FakeCard) -> tuple[int, int]:
        if h.cc is None:
            raise nvml.NVMLError_NotSupported("Not Supported")
        return h.cc

    def mig_mode(h: FakeCard) -> list[int]:
        nvml.calls["mig"] += 1
        if not h.migs:
            raise nvml.NVMLError_NotSupported("Not Supported")
        return [1, 1]

    def mig_handle(h: FakeCard, slot: int) -> FakeCard:
        if slot >= len(h.migs):
            raise nvml.NVMLError_NotFound("Not Found")
        return h.migs[slot]

    nvml.nvmlInit = init
    nvml.nvmlShutdown = shutdown
    nvml.nvmlDeviceGetCount = lambda: len(cards)
    nvml.nvmlDeviceGetHandleByIndex = lambda i: cards[i]
    nvml.nvmlDeviceGetUUID = lambda h: h.uuid
    nvml.nvmlDeviceGetName = lambda h: h.name.encode()  # old bindings return bytes
    nvml.nvmlDeviceGetMemoryInfo = memory
    nvml.nvmlDeviceGetUtilizationRates = utilization
    nvml.nvmlDeviceGetCudaComputeCapability = capability
    nvml.nvmlDeviceGetPciInfo = lambda h: types.SimpleNamespace(busId=h.pci.encode())
    nvml.nvmlDeviceGetMigMode = mig_mode
    nvml.nvmlDeviceGetMaxMigDeviceCount = lambda h: 7
    nvml.nvmlDeviceGetMigDeviceHandleByIndex = mig_handle
    return nvml


@pytest.fixture
def fake_nvml(monkeypatch: pytest.MonkeyPatch) -> Any:
    nvml = make_fake_nvml(fake_cards())
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    # On a GPU machine an earlier test may have started CUDA; the fake cards are not torch's.
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    return nvml


@pytest.fixture
def fresh_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(inventory_mod, "_nvml_warned", False)


_KEEP = "keep the current value"


def nvml_indices(env: str | None = _KEEP, order: str | None = _KEEP) -> list[int]:
    """NVML indices of gpus() in CUDA order, after setting (or, with None, unsetting) the env."""
    import os

    for key, value in (("CUDA_VISIBLE_DEVICES", env), ("CUDA_DEVICE_ORDER", order)):
        if value is None:
            os.environ.pop(key, None)
        elif value is not _KEEP:
            os.environ[key] = value
    found = gpus()
    assert [g.index for g in found] == list(range(len(found)))
    return [g.nvml_index for g in found]


def our_warnings(record: list[warnings.WarningMessage]) -> list[warnings.WarningMessage]:
    return [w for w in record if "found no NVIDIA driver" in str(w.message)]


# --------------------------------------------------------------------------- gpus()


def test_gpus_reports_every_field(fake_nvml: Any) -> None:
    found = gpus()
    h100 = found[0]
    assert h100 == GpuInfo(
        index=0,
        nvml_index=3,
        uuid="GPU-55555555-ffff",
        name="NVIDIA H100 80GB HBM3",
        memory_total=80 * GiB,
        memory_used=75 * GiB,
        memory_free=5 * GiB,
        utilization=99,
        compute_capability=(9, 0),
        pci_bus_id="00000000:86:00.0",
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        h100.index = 1  # type: ignore[misc]


def test_gpus_unsupported_queries_give_none(
    fake_nvml: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    by_nvml = {g.nvml_index: g for g in gpus()}
    assert by_nvml[1].utilization is None  # the MIG-mode A100
    assert by_nvml[1].memory_free == 10 * GiB
    cards = fake_cards()
    cards[0].free = None
    cards[0].cc = None
    monkeypatch.setitem(sys.modules, "pynvml", make_fake_nvml(cards))
    p40 = next(g for g in gpus() if g.nvml_index == 0)
    assert (p40.memory_total, p40.memory_used, p40.memory_free) == (None, None, None)
    assert p40.compute_capability is None


def test_gpus_default_order_is_fastest_first(fake_nvml: Any) -> None:
    assert nvml_indices() == [3, 1, 2, 0]
    assert nvml_indices(order="FASTEST_FIRST") == [3, 1, 2, 0]
    assert nvml_indices(order="something-cuda-ignores") == [3, 1, 2, 0]


def test_gpus_pci_bus_id_order_is_nvml_order(fake_nvml: Any) -> None:
    assert nvml_indices(order="PCI_BUS_ID") == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("env", "order", "expected"),
    [
        ("2,0", "PCI_BUS_ID", [2, 0]),
        (" 1 , 3", "PCI_BUS_ID", [1, 3]),
        ("0", None, [3]),  # ordinals follow CUDA_DEVICE_ORDER: 0 is the fastest card
        ("3,0", None, [0, 3]),
        ("1gpu", "PCI_BUS_ID", [1]),  # read like strtoul, as CUDA does
    ],
)
def test_gpus_visible_ordinals(
    fake_nvml: Any, env: str, order: str | None, expected: list[int]
) -> None:
    assert nvml_indices(env, order) == expected


def test_gpus_visible_uuids_and_prefixes(fake_nvml: Any) -> None:
    assert nvml_indices("GPU-55555555-ffff,GPU-1111") == [3, 0]
    assert nvml_indices("GPU-22229") == [2]
    assert nvml_indices("GPU-55555555-FFFF") == [3]  # hex digits in either case, as in CUDA
    assert nvml_indices("55555555-ffff") == []  # but the GPU- prefix is required
    # "GPU-2222" matches two cards: ambiguous, so the list ends there.
    assert nvml_indices("GPU-1111,GPU-2222,GPU-5555") == [0]


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ("1,7,2", [1]),  # 7 does not exist
        ("1,abc,2", [1]),
        ("-1,0", []),
        ("0,GPU-nope,1", [0]),
        ("GPU-1111,GPU-nope,GPU-5555", [0]),
        ("1,", [1]),
    ],
)
def test_gpus_first_invalid_entry_truncates(fake_nvml: Any, env: str, expected: list[int]) -> None:
    assert nvml_indices(env, "PCI_BUS_ID") == expected


def test_gpus_empty_string_hides_all_and_duplicates_are_invalid(fake_nvml: Any) -> None:
    assert nvml_indices("", "PCI_BUS_ID") == []
    assert nvml_indices("1,1", "PCI_BUS_ID") == []
    assert nvml_indices("0,2,0", "PCI_BUS_ID") == []
    assert nvml_indices("GPU-1111,GPU-11111111-aaaa", "PCI_BUS_ID") == []  # prefix + full


def test_gpus_first_entry_sets_the_notation(fake_nvml: Any) -> None:
    # Another notation ends the list, as in CUDA: the same card again does not empty it.
    assert nvml_indices("GPU-11111111,0", "PCI_BUS_ID") == [0]
    assert nvml_indices("GPU-11111111,1", "PCI_BUS_ID") == [0]
    assert nvml_indices("2,GPU-11111111", "PCI_BUS_ID") == [2]
    assert nvml_indices("GPU-5555,MIG-3333") == [3]
    assert nvml_indices("GPU-") == []  # a bare prefix is no UUID (CUDA agrees)


def test_gpus_mig_ids(fake_nvml: Any) -> None:
    assert nvml_indices() == [3, 1, 2, 0]
    assert fake_nvml.calls["mig"] == 0  # MIG instances are looked up only when named
    import os

    os.environ["CUDA_VISIBLE_DEVICES"] = "MIG-4444,MIG-33333333-cccc,MIG-9999"
    first, second = gpus()
    assert (first.uuid, second.uuid) == ("MIG-44444444-dddd", "MIG-33333333-cccc")
    assert (first.index, first.nvml_index, first.memory_free) == (0, 1, 2 * GiB)
    assert first.utilization is None
    assert first.compute_capability == (8, 0)  # from the parent card
    assert first.pci_bus_id == "00000000:3B:00.0"


def test_gpus_always_shuts_nvml_down(fake_nvml: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    gpus()
    gpus()
    assert fake_nvml.calls["init"] == fake_nvml.calls["shutdown"] == 2

    def refuse() -> int:
        raise fake_nvml.NVMLError_NoPermission("Insufficient Permissions")

    monkeypatch.setattr(fake_nvml, "nvmlDeviceGetCount", refuse)
    with pytest.raises(DeviceError, match="refused access"):
        gpus()
    assert fake_nvml.calls["init"] == fake_nvml.calls["shutdown"] == 3


def test_gpus_uses_torch_uuids_once_cuda_is_initialised(
    fake_nvml: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    props = {0: "22229999-eeee", 1: "11111111-aaaa"}  # torch prints UUIDs without "GPU-"
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(uuid=props[i])
    )
    # The variable says otherwise, but CUDA already read it (maybe before it was changed).
    assert nvml_indices("3") == [2, 0]
    props[1] = "00000000-unknown"
    assert nvml_indices("3") == [0]  # no exact mapping: back to the variable (fastest first)


def test_gpus_without_pynvml_returns_empty_and_warns_once(
    monkeypatch: pytest.MonkeyPatch, fresh_warning: None
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` fail
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert gpus() == []
        assert gpus() == []
    assert len(our_warnings(record)) == 1
    assert "cannot import pynvml" in str(our_warnings(record)[0].message)


@pytest.mark.parametrize("error", ["LibraryNotFound", "DriverNotLoaded"])
def test_gpus_without_driver_returns_empty_and_warns_once(
    monkeypatch: pytest.MonkeyPatch, fresh_warning: None, error: str
) -> None:
    nvml = make_fake_nvml(fake_cards(), init_error=error)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert gpus() == []
        assert gpus() == []
    assert len(our_warnings(record)) == 1
    assert f"fake {error}" in str(our_warnings(record)[0].message)
    assert nvml.calls["shutdown"] == 0  # nothing to shut down after a failed init


def test_gpus_permission_error_is_not_masked(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = make_fake_nvml(fake_cards(), init_error="NoPermission")
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    with pytest.raises(DeviceError, match=r"refused access.*'video'.*--gpus all") as info:
        gpus()
    assert isinstance(info.value.__cause__, nvml.NVMLError_NoPermission)


def test_gpus_other_nvml_failure_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", make_fake_nvml(fake_cards(), init_error="Unknown"))
    with pytest.raises(DeviceError, match=r"NVML failed.*nvidia-smi"):
        gpus()


def test_gpus_with_the_real_pynvml(fresh_warning: None) -> None:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        first = gpus()
        second = gpus()
    # Without a driver: [] and one warning; with one: the same cards both times, no warning.
    assert [g.uuid for g in first] == [g.uuid for g in second]
    assert len(our_warnings(record)) == (0 if first else 1)


# --------------------------------------------------------------------------- select_gpus()


def test_select_gpus_ranks_by_free_memory_and_sets_uuids(fake_nvml: Any) -> None:
    import os

    assert select_gpus(2) == [2, 0]  # 30 GiB and 20 GiB free
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "GPU-22229999-eeee,GPU-11111111-aaaa"
    assert nvml_indices() == [2, 0]  # the emptiest card is now cuda:0
    assert select_gpus() == [2]


def test_select_gpus_chooses_among_visible_cards_only(fake_nvml: Any) -> None:
    import os

    os.environ["CUDA_VISIBLE_DEVICES"] = "GPU-5555,GPU-1111"  # not the 30 GiB card
    assert select_gpus(1) == [0]
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "GPU-11111111-aaaa"


def test_select_gpus_min_free_memory(fake_nvml: Any) -> None:
    import os

    assert select_gpus(1, min_free_memory=25 * GiB) == [2]
    os.environ.pop("CUDA_VISIBLE_DEVICES")
    with pytest.raises(DeviceError, match=r"needs 2 GPU\(s\) with >= 25.0 GiB free") as info:
        select_gpus(2, min_free_memory=25 * GiB)
    message = str(info.value)
    for expected in ("Tesla P40", "20.0 GiB free", "NVIDIA H100 80GB HBM3", "5.0 GiB free", "30.0"):
        assert expected in message
    assert "CUDA_VISIBLE_DEVICES" not in os.environ  # a failed selection changes nothing


def test_select_gpus_too_few(fake_nvml: Any) -> None:
    with pytest.raises(DeviceError, match=r"needs 5 GPU\(s\); found: cuda:0 NVIDIA H100"):
        select_gpus(5)


def test_select_gpus_unknown_free_memory_ranks_last(monkeypatch: pytest.MonkeyPatch) -> None:
    cards = fake_cards()[:2]
    cards[0].free = None
    monkeypatch.setitem(sys.modules, "pynvml", make_fake_nvml(cards))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert select_gpus(2) == [1, 0]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-1111")  # the P40 alone
    with pytest.raises(DeviceError, match=r"cuda:0 Tesla P40 .*free memory unknown"):
        select_gpus(1, min_free_memory=1)  # it cannot show it has even 1 byte free
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert select_gpus(1, min_free_memory=1) == [1]


def test_select_gpus_without_gpus(monkeypatch: pytest.MonkeyPatch, fresh_warning: None) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    with pytest.warns(RuntimeWarning), pytest.raises(DeviceError, match="found: no GPUs"):
        select_gpus(1)


def test_select_gpus_refuses_after_cuda_init(
    fake_nvml: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(DeviceError, match=r"before CUDA is initialised.*no effect"):
        select_gpus(1)
    assert "CUDA_VISIBLE_DEVICES" not in os.environ


@pytest.mark.parametrize("n", [0, -1, True, 1.0])
def test_select_gpus_rejects_bad_n(fake_nvml: Any, n: Any) -> None:
    with pytest.raises(ValueError, match="n must be an int >= 1"):
        select_gpus(n)


def test_select_gpus_rejects_negative_memory(fake_nvml: Any) -> None:
    with pytest.raises(ValueError, match="min_free_memory must be >= 0"):
        select_gpus(1, min_free_memory=-1)


# --------------------------------------------------------------------------- best_device()


def test_best_device_picks_the_emptiest_visible_gpu(
    fake_nvml: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert best_device() == torch.device("cuda", 2)  # order 3,1,2,0: the 30 GiB card is cuda:2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,2")  # the H100 and the P40
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert best_device() == torch.device("cuda", 1)


def test_best_device_falls_back_to_cuda0(
    monkeypatch: pytest.MonkeyPatch, fresh_warning: None
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setitem(sys.modules, "pynvml", None)
    with pytest.warns(RuntimeWarning):
        assert best_device() == torch.device("cuda", 0)
    # NVML sees more cards than CUDA does (a mismatch): never name a device CUDA lacks.
    monkeypatch.setitem(sys.modules, "pynvml", make_fake_nvml(fake_cards()))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert best_device() == torch.device("cuda", 0)


def test_best_device_mps_then_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert best_device() == torch.device("mps")
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert best_device() == torch.device("cpu")


def test_best_device_does_not_initialise_cuda() -> None:
    code = (
        "import json, warnings, torch\n"
        "warnings.simplefilter('ignore')\n"
        "from trainperf.device import best_device, gpus\n"
        "d = best_device(); gpus()\n"
        "print(json.dumps({'device': str(d), 'initialised': torch.cuda.is_initialized()}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["initialised"] is False
    assert result["device"].split(":")[0] in {"cuda", "mps", "cpu"}


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
    # allowed=None takes any type torch knows; only CUDA and MPS are checked for presence.
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


def test_resolve_device_without_auto_refuses_none_and_auto() -> None:
    with pytest.raises(TypeError, match=r"device must be a str, int or torch\.device, got None"):
        resolve_device(None, auto=False)
    with pytest.raises(ValueError, match=r"invalid device 'auto': expected 'cpu', 'cuda'"):
        resolve_device("auto", auto=False)


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


def test_resolve_device_checks_mps_is_there(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(DeviceError, match=r"device 'mps' needs Apple's Metal \(MPS\)"):
        resolve_device("mps")
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert resolve_device("mps") == torch.device("mps")


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


# --------------------------------------------------------------------------- to_device()


class Pair(NamedTuple):
    x: torch.Tensor
    label: int


@dataclasses.dataclass
class Batch:
    images: torch.Tensor
    ids: list[str]


@dataclasses.dataclass(frozen=True)
class FrozenBatch:
    x: torch.Tensor
    mask: torch.Tensor
    derived: torch.Tensor = dataclasses.field(init=False)
    scale: dataclasses.InitVar[float] = 1.0  # an InitVar without replace()'s help

    def __post_init__(self, scale: float) -> None:
        object.__setattr__(self, "derived", self.x * scale)


class Recorder:
    """A custom batch class with its own .to."""

    def __init__(self) -> None:
        self.moved_to: torch.device | None = None

    def to(self, device: torch.device) -> Recorder:
        self.moved_to = device
        return self


class TaggedList(list):  # type: ignore[type-arg]
    tag = "kept"


class StrictTuple(tuple):  # type: ignore[type-arg]
    def __new__(cls, a: Any, b: Any) -> StrictTuple:  # cannot be built from one iterable
        return super().__new__(cls, (a, b))


def float_cpu(*shape: int) -> torch.Tensor:
    return torch.randn(*shape)


def test_to_device_moves_nested_containers_and_keeps_their_types() -> None:
    default = collections.defaultdict(list, {"a": float_cpu(2)})
    ordered = collections.OrderedDict([("z", float_cpu(1)), ("a", float_cpu(1))])
    array = np.arange(3)
    batch = {
        "list": [float_cpu(2), (float_cpu(3), "keep")],
        "ordered": ordered,
        "default": default,
        "pair": Pair(float_cpu(2), 7),
        "batch": Batch(float_cpu(2), ["a", "b"]),
        "set": {float_cpu(1)},
        "frozenset": frozenset({float_cpu(1)}),
        "tagged": TaggedList([float_cpu(1)]),
        "proxy": types.MappingProxyType({"p": float_cpu(1)}),
        "leaves": ["s", 3, 2.5, None, True, array, torch.Size([2]), torch.float16],
    }
    out = to_device(batch, "meta")
    assert type(out) is dict and list(out) == list(batch)
    assert out["list"][0].device == META and out["list"][1][0].device == META
    assert type(out["list"][1]) is tuple and out["list"][1][1] == "keep"
    assert type(out["ordered"]) is collections.OrderedDict and list(out["ordered"]) == ["z", "a"]
    assert out["ordered"]["a"].device == META
    assert type(out["default"]) is collections.defaultdict
    assert out["default"].default_factory is list and out["default"]["a"].device == META
    assert type(out["pair"]) is Pair and out["pair"].x.device == META and out["pair"].label == 7
    assert type(out["batch"]) is Batch and out["batch"].images.device == META
    assert out["batch"].ids == ["a", "b"]
    assert type(out["set"]) is set and next(iter(out["set"])).device == META
    assert type(out["frozenset"]) is frozenset and next(iter(out["frozenset"])).device == META
    assert type(out["tagged"]) is TaggedList and out["tagged"][0].device == META
    assert type(out["proxy"]) is types.MappingProxyType and out["proxy"]["p"].device == META
    assert out["leaves"][:5] == ["s", 3, 2.5, None, True]
    assert out["leaves"][5] is array and out["leaves"][6:] == [torch.Size([2]), torch.float16]
    # The input is not modified.
    assert batch["list"][0].device.type == "cpu" and ordered["a"].device.type == "cpu"


def test_to_device_frozen_dataclass() -> None:
    frozen = FrozenBatch(float_cpu(2), torch.ones(2, dtype=torch.bool), scale=2.0)
    out = to_device(frozen, "meta", dtype=torch.float16)
    assert type(out) is FrozenBatch
    assert (out.x.device, out.x.dtype) == (META, torch.float16)
    assert (out.mask.device, out.mask.dtype) == (META, torch.bool)
    assert out.derived.device == META  # an init=False field moves too
    assert frozen.x.device.type == "cpu"
    untouched = Batch(images=None, ids=["a"])  # type: ignore[arg-type]
    assert to_device(untouched, "meta").ids == ["a"]


def test_to_device_dtype_casts_floats_only() -> None:
    batch = {
        "f32": float_cpu(2),
        "f64": torch.zeros(2, dtype=torch.float64),
        "labels": torch.tensor([1, 2]),
        "mask": torch.tensor([True, False]),
        "complex": torch.zeros(2, dtype=torch.complex64),
        "u8": torch.zeros(2, dtype=torch.uint8),
    }
    out = to_device(batch, "cpu", dtype=torch.bfloat16)
    assert {k: v.dtype for k, v in out.items()} == {
        "f32": torch.bfloat16,
        "f64": torch.bfloat16,
        "labels": torch.int64,
        "mask": torch.bool,
        "complex": torch.complex64,
        "u8": torch.uint8,
    }
    assert torch.equal(out["f32"], batch["f32"].to(torch.bfloat16))


def test_to_device_returns_tensors_already_in_place_without_copying() -> None:
    x = float_cpu(3)
    labels = torch.tensor([1])
    out = to_device((x, labels), torch.device("cpu"), dtype=torch.float32)
    assert out[0] is x and out[1] is labels


def test_to_device_calls_to_on_objects_and_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # cuda:1 must exist
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    rec = Recorder()
    model = torch.nn.Linear(2, 2)
    out = to_device({"rec": rec, "model": [model]}, "meta")
    assert out["rec"] is rec and rec.moved_to == META
    assert out["model"][0] is model and model.weight.device == META  # modules move in place
    to_device(rec, 1)
    assert rec.moved_to == torch.device("cuda", 1)  # an int means a CUDA index
    to_device(rec, torch.device("cpu"))
    assert rec.moved_to == torch.device("cpu")


def test_to_device_moves_tensor_subclasses() -> None:
    param = torch.nn.Parameter(float_cpu(2))
    out = to_device([param], "meta", dtype=torch.float16)
    assert (out[0].device, out[0].dtype) == (META, torch.float16)


@pytest.mark.parametrize("bad", ["gpu", "cuda:x", "", "cpu:0:1"])
def test_to_device_rejects_bad_device_strings(bad: str) -> None:
    with pytest.raises(ValueError, match=f"invalid device {bad!r}.*'cuda:1'"):
        to_device(float_cpu(1), bad)


def test_to_device_rejects_bad_device_values() -> None:
    with pytest.raises(ValueError, match="device index must be >= 0, got -1"):
        to_device(float_cpu(1), -1)
    for bad in (True, 1.5, None):
        with pytest.raises(TypeError, match=r"device must be a str, int or torch.device"):
            to_device(float_cpu(1), bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.complex64, "float16"])
def test_to_device_rejects_non_float_dtype(dtype: Any) -> None:
    with pytest.raises(ValueError, match="floating dtype"):
        to_device(float_cpu(1), "cpu", dtype=dtype)


def test_to_device_names_a_container_it_cannot_rebuild() -> None:
    with pytest.raises(TypeError, match=r"cannot rebuild a StrictTuple.*\.to\(device\)"):
        to_device(StrictTuple(float_cpu(1), 2), "meta")


@pytest.mark.requires_cuda
def test_to_device_pinned_non_blocking_to_cuda_and_back() -> None:
    batch = {"x": torch.randn(1024).pin_memory(), "y": torch.arange(4).pin_memory()}
    out = to_device(batch, "cuda", non_blocking=True, dtype=torch.float16)
    back = to_device(out, "cpu", non_blocking=True)
    torch.cuda.synchronize()  # a non-blocking device-to-host copy is read only after a sync
    assert out["x"].device.type == "cuda" and out["x"].dtype == torch.float16
    assert torch.equal(back["x"], batch["x"].half()) and torch.equal(back["y"], batch["y"])


def test_parse_visible_devices_reads_like_cuda() -> None:
    assert parse_visible_devices("1, 3") == VisibleDevices("index", ("1", "3"), None)
    assert parse_visible_devices("+1,2gpu,x,0") == VisibleDevices("index", ("1", "2"), "x")
    assert parse_visible_devices("") == VisibleDevices("index", (), "")
    assert parse_visible_devices("-1").first_invalid == "-1"
    assert parse_visible_devices("GPU-ab,0") == VisibleDevices("GPU-", ("GPU-ab",), "0")
    assert parse_visible_devices("MIG-1,GPU-2").entries == ("MIG-1",)
    assert parse_visible_devices("GPU-").entries == ()  # a bare prefix is no UUID
    assert parse_visible_devices("0,2,0").duplicates == ("0",)
    assert parse_visible_devices("GPU-aB,GPU-Ab").duplicates == ("GPU-Ab",)


def test_gpus_reads_the_environment_it_is_given(fake_nvml: Any) -> None:
    env = {"CUDA_VISIBLE_DEVICES": "1,0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert [g.nvml_index for g in gpus(env=env)] == [1, 0]
    assert [g.nvml_index for g in gpus(env={})] == [3, 1, 2, 0]
    assert gpus(env={"CUDA_VISIBLE_DEVICES": ""}) == []
    assert len(gpus()) == 4  # os.environ has neither variable (the fixture removed them)


def test_nvml_session_shuts_down_and_maps_errors(fake_nvml: Any) -> None:
    with inventory_mod.nvml_session() as nvml:
        assert nvml is fake_nvml and nvml.calls["init"] == 1
    assert fake_nvml.calls["shutdown"] == 1
    with (
        pytest.raises(DeviceError, match="NVML failed while sampling"),
        inventory_mod.nvml_session("sampling") as nvml,
    ):
        raise nvml.NVMLError_Unknown("boom")
    assert fake_nvml.calls["shutdown"] == 2


def test_nvml_session_without_a_driver_yields_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", make_fake_nvml([], "DriverNotLoaded"))
    reasons: list[str] = []
    with inventory_mod.nvml_session(on_missing=reasons.append) as nvml:
        assert nvml is None
    assert reasons == ["fake DriverNotLoaded"]
    monkeypatch.setitem(sys.modules, "pynvml", make_fake_nvml([], "NoPermission"))
    with pytest.raises(DeviceError, match="refused access"), inventory_mod.nvml_session():
        pass


# --------------------------------------------------------------------------- check_same_device()


def test_check_same_device_returns_the_common_device() -> None:
    model = torch.nn.BatchNorm1d(2)  # parameters and buffers
    assert check_same_device(model, torch.ones(3, 2), extra=[{"m": torch.ones(1)}]) == torch.device(
        "cpu"
    )
    assert check_same_device(None, torch.ones(1, device="meta")) == META


def test_check_same_device_names_parameters_and_inputs_per_device() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2)).to("meta")
    batch = {"ids": [torch.ones(1), torch.ones(1, device="meta")]}
    with pytest.raises(DeviceMismatchError, match="on 2 devices") as info:
        check_same_device(model, Pair(torch.ones(1), 0), x=batch)
    message = str(info.value)
    meta_line = next(line for line in message.splitlines() if line.strip().startswith("meta:"))
    cpu_line = next(line for line in message.splitlines() if line.strip().startswith("cpu:"))
    assert "parameter 0.weight" in meta_line and "parameter 0.bias" in meta_line
    assert "more" in meta_line  # 4 parameters, 3 buffers, 1 input: only a few are listed
    assert cpu_line.strip() == "cpu: input arg0.x, input x['ids'][0]"
    assert "model.to('meta')" in message


def test_check_same_device_inputs_only_and_dataclasses() -> None:
    item = Batch(torch.ones(1, device="meta"), ["a"])
    with pytest.raises(
        DeviceMismatchError, match=r"cpu: input arg0\[1\]\n  meta: input item\.images"
    ):
        check_same_device(None, ["no tensor", torch.ones(1)], item=item)


@dataclasses.dataclass
class MovableBatch:
    """A user batch dataclass with its own .to, as training code often has."""

    images: torch.Tensor
    labels: torch.Tensor

    def to(self, device: torch.device) -> MovableBatch:
        return MovableBatch(self.images.to(device), self.labels.to(device))


class Encoding(collections.UserDict):  # type: ignore[type-arg]
    """A Mapping with .to, like Hugging Face's BatchEncoding."""

    def to(self, device: torch.device) -> Encoding:
        return Encoding({k: v.to(device) for k, v in self.items()})


class Holder:
    """Neither a mapping nor a dataclass: tensors kept as attributes, and a cycle."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x
        self.me = self

    def to(self, device: torch.device) -> Holder:
        return Holder(self.x.to(device))


def test_check_same_device_looks_inside_objects_with_their_own_to() -> None:
    batch = MovableBatch(torch.ones(2, device="meta"), torch.ones(2))
    with pytest.raises(
        DeviceMismatchError, match=r"meta: input batch\.images\n  cpu: input batch\.labels"
    ):
        check_same_device(None, batch=batch)
    encoding = Encoding(input_ids=torch.ones(1), mask=torch.ones(1, device="meta"))
    with pytest.raises(DeviceMismatchError, match=r"meta: input enc\['mask'\]"):
        check_same_device(torch.nn.Linear(1, 1), enc=encoding)
    with pytest.raises(DeviceMismatchError, match=r"meta: input h\.x\n"):
        check_same_device(torch.nn.Linear(1, 1), h=Holder(torch.ones(1, device="meta")))
    assert check_same_device(None, batch.to(torch.device("meta"))) == META


def test_check_same_device_needs_a_tensor() -> None:
    with pytest.raises(ValueError, match="found no tensors"):
        check_same_device(torch.nn.ReLU(), "text", n=3)


# --------------------------------------------------------------------------- seeds


@pytest.fixture
def restore_determinism() -> Iterator[None]:
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    rng = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    yield
    torch.use_deterministic_algorithms(saved[0])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[1], saved[2]
    random.setstate(rng[0])
    np.random.set_state(rng[1])
    torch.set_rng_state(rng[2])


def draws() -> tuple[float, float, list[float]]:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_seed_everything_reproduces_draws(restore_determinism: None) -> None:
    import os

    assert seed_everything(123) == 123
    first = draws()
    seed_everything(123)
    assert draws() == first
    seed_everything(124)
    assert draws() != first
    assert os.environ["PYTHONHASHSEED"] == "124"
    assert seed_everything(np.int64(5)) == 5  # type: ignore[arg-type]
    assert seed_everything(2**32 - 1) == 2**32 - 1


def test_seed_everything_deterministic(restore_determinism: None) -> None:
    import os

    torch.use_deterministic_algorithms(False)
    seed_everything(0)  # deterministic=False leaves the settings alone
    assert not torch.are_deterministic_algorithms_enabled()
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ or os.environ["CUBLAS_WORKSPACE_CONFIG"]
    seed_everything(0, deterministic=True)
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"


@pytest.mark.parametrize("seed", [-1, 2**32])
def test_seed_everything_range(seed: int) -> None:
    with pytest.raises(ValueError, match=r"seed must be in \[0, 2\*\*32 - 1\]"):
        seed_everything(seed)


@pytest.mark.parametrize("seed", [1.5, "1", True, None])
def test_seed_everything_type(seed: Any) -> None:
    with pytest.raises(TypeError, match="seed must be an int"):
        seed_everything(seed)


class WorkerDraws(Dataset[tuple[int, int, int, float]]):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> tuple[int, int, int, float]:
        info = torch.utils.data.get_worker_info()
        assert info is not None
        return info.id, torch.initial_seed(), int(np.random.randint(2**31)), random.random()


def run_loader(seed: int) -> list[tuple[int, int, int, float]]:
    loader = DataLoader(
        WorkerDraws(),
        batch_size=None,
        num_workers=2,
        worker_init_fn=worker_init_fn,
        generator=torch.Generator().manual_seed(seed),
    )
    return [tuple(int(v) if i < 3 else float(v) for i, v in enumerate(item)) for item in loader]  # type: ignore[misc]


def test_worker_init_fn_gives_distinct_reproducible_worker_seeds() -> None:
    first = run_loader(0)
    assert run_loader(0) == first
    assert run_loader(1) != first
    by_worker: dict[int, tuple[int, int]] = {}
    for wid, seed, draw, _ in first:
        by_worker.setdefault(wid, (seed, draw))  # each worker's first item
    assert set(by_worker) == {0, 1}
    assert by_worker[0][1] != by_worker[1][1]  # distinct NumPy streams
    for wid, (seed, draw) in by_worker.items():
        # The worker's first NumPy draw is the one worker_init_fn's seeding gives.
        expected = np.random.RandomState(seed_mod._worker_seed_state(seed)).randint(2**31)
        assert draw == expected, wid
        assert next(r for w, _, _, r in first if w == wid) == random.Random(seed).random()


def test_worker_init_fn_outside_a_worker(restore_determinism: None) -> None:
    torch.manual_seed(11)
    worker_init_fn(0)
    a = draws()[:2]
    worker_init_fn(1)
    b = draws()[:2]
    worker_init_fn(0)
    assert draws()[:2] == a != b
    with pytest.raises(ValueError, match="worker_id must be >= 0, got -1"):
        worker_init_fn(-1)
