"""trainperf.device._inventory: GPU discovery against a fake NVML, select_gpus, best_device."""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import subprocess
import sys
import types
import warnings
from typing import Any

import pytest
import torch

import trainperf.device._inventory as inventory_mod
from trainperf.device import (
    GpuInfo,
    VisibleDevices,
    best_device,
    gpus,
    parse_visible_devices,
    select_gpus,
)
from trainperf.errors import DeviceError

GiB = 1 << 30


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
    monkeypatch.setattr(inventory_mod, "_cuda_driver_started", lambda: False)
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
    assert select_gpus(1, min_free_memory=0) == [0]  # but 0 asks for nothing
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert select_gpus(1, min_free_memory=1) == [1]


def test_select_gpus_without_gpus(monkeypatch: pytest.MonkeyPatch, fresh_warning: None) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(inventory_mod, "_cuda_driver_started", lambda: False)
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


def test_select_gpus_refuses_once_the_cuda_driver_started(
    fake_nvml: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # torch.cuda.is_available() (best_device() calls it) starts the driver, which reads
    # CUDA_VISIBLE_DEVICES then, while torch.cuda.is_initialized() stays False: select_gpus()
    # set the variable and returned cards CUDA would never use.
    import os

    monkeypatch.setattr(inventory_mod, "_cuda_driver_started", lambda: True)
    with pytest.raises(DeviceError, match=r"no effect.*before torch\.cuda\.is_available\(\)"):
        select_gpus(1)
    assert "CUDA_VISIBLE_DEVICES" not in os.environ


class FakeLibcuda:
    """libcuda as ctypes would open it: ``cuDeviceGetCount`` answers ``status``."""

    def __init__(self, status: int | None) -> None:
        self.status = status
        self.modes: list[int] = []

    def __call__(self, name: str, mode: int = 0) -> Any:
        self.modes.append(mode)
        if self.status is None:
            raise OSError(f"{name}: cannot open shared object file")
        return types.SimpleNamespace(cuDeviceGetCount=lambda _: self.status)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="asks libcuda on Linux only")
@pytest.mark.parametrize(
    ("status", "started"),
    [(None, False), (3, False), (0, True)],  # not loaded; CUDA_ERROR_NOT_INITIALIZED; cuInit ran
)
def test_cuda_driver_started_asks_a_loaded_libcuda_only(
    monkeypatch: pytest.MonkeyPatch, status: int | None, started: bool
) -> None:
    import ctypes
    import os

    libcuda = FakeLibcuda(status)
    monkeypatch.setattr(ctypes, "CDLL", libcuda)
    assert inventory_mod._cuda_driver_started() is started
    assert libcuda.modes and all(mode & os.RTLD_NOLOAD for mode in libcuda.modes)  # never loads


@pytest.mark.parametrize("n", [0, -1, True, 1.0])
def test_select_gpus_rejects_bad_n(fake_nvml: Any, n: Any) -> None:
    with pytest.raises(ValueError, match="n must be an int >= 1"):
        select_gpus(n)


@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf"), "20GB", True])
def test_select_gpus_rejects_bad_min_free_memory(fake_nvml: Any, bad: Any) -> None:
    import os

    with pytest.raises(ValueError, match=r"min_free_memory must be .*bytes >= 0.*got"):
        select_gpus(1, min_free_memory=bad)
    assert "CUDA_VISIBLE_DEVICES" not in os.environ


def test_select_gpus_accepts_numpy_min_free_memory(fake_nvml: Any) -> None:
    np = pytest.importorskip("numpy")
    assert select_gpus(1, min_free_memory=np.int64(25 * GiB)) == [2]


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


def test_best_device_falls_back_to_cuda0_when_nvml_refuses(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before: NVML's refusal (a container without access to it) raised DeviceError out of
    # best_device(), so MixedPrecision() and every device="auto" failed though CUDA worked.
    import trainperf.device._inventory as inventory

    def refuse(**_: Any) -> list[Any]:
        raise DeviceError("NVML refused access while listing GPUs (insufficient permissions)")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(inventory, "gpus", refuse)
    with pytest.warns(RuntimeWarning, match=r"insufficient permissions.*picks cuda:0"):
        assert best_device() == torch.device("cuda", 0)


def test_best_device_mps_then_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert best_device() == torch.device("mps")
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert best_device() == torch.device("cpu")


@pytest.mark.slow
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


@pytest.mark.parametrize("value", ["\u0661", "\uff10,\uff11", "0\u0661"])
def test_parse_visible_devices_reads_ascii_digits_only(value: str) -> None:
    # strtoul reads 0-9 only: an Arabic-Indic or full-width digit is no ordinal for CUDA.
    parsed = parse_visible_devices(value)
    assert parsed.entries == (("0",) if value.startswith("0") else ())
    assert parsed.first_invalid == (None if value.startswith("0") else value.split(",")[0])


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


@pytest.mark.slow
@pytest.mark.requires_cuda
def test_the_driver_probe_sees_the_start_torch_cuda_is_available_makes() -> None:
    # On a GPU: importing torch starts no driver; torch.cuda.is_available() does (without
    # initialising torch's CUDA), and from then select_gpus() refuses.
    code = (
        "import json, torch\n"
        "import trainperf.device._inventory as inv\n"
        "from trainperf.device import select_gpus\n"
        "from trainperf.errors import DeviceError\n"
        "before = inv._cuda_driver_started()\n"
        "available = torch.cuda.is_available()\n"
        "after = inv._cuda_driver_started()\n"
        "try:\n"
        "    select_gpus(1); refused = False\n"
        "except DeviceError:\n"
        "    refused = True\n"
        "print(json.dumps({'before': before, 'available': available, 'after': after,\n"
        "                  'initialised': torch.cuda.is_initialized(), 'refused': refused}))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_NVML_BASED_CUDA_CHECK"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {
        "before": False,
        "available": True,
        "after": True,
        "initialised": False,
        "refused": True,
    }
