"""The link an all_reduce should reach (``doctor/_interconnect.py``): NVLink, PCIe, loopback."""

from __future__ import annotations

import json
import sys
import threading

import pytest

from tests.doctor._fakes import gpu, link_nvml
from trainperf.doctor import (
    AllReduceSweep,
    GpuLink,
    LinkEstimate,
    LoopbackBaseline,
    SweepRow,
    check_all_reduce,
    link_estimate,
    loopback_estimate,
    measure_loopback,
    pcie_gb_per_s,
    read_gpu_links,
)
from trainperf.doctor._interconnect import read_p2p_blocked


def test_pcie_bandwidth_per_direction_after_encoding() -> None:
    assert pcie_gb_per_s(3, 16) == pytest.approx(15.76)
    assert pcie_gb_per_s(4, 16) == pytest.approx(31.504)
    assert pcie_gb_per_s(5, 16) == pytest.approx(63.008)
    assert pcie_gb_per_s(1, 1) == 0.25  # 8b/10b: 2.5 GT/s carries 250 MB/s
    assert pcie_gb_per_s(None, 16) is None and pcie_gb_per_s(4, None) is None
    assert pcie_gb_per_s(9, 16) is None  # a generation that does not exist (yet)


def test_nvlink_on_every_gpu_is_the_slowest_gpus_links_times_their_speed() -> None:
    links = [GpuLink(0, 18, 26.562, 5, 16), GpuLink(1, 12, 26.562, 5, 16)]
    estimate = link_estimate(links)
    assert estimate.kind == "nvlink"
    assert estimate.gb_per_s == pytest.approx(12 * 26.562)
    assert "12 links" in estimate.detail and "slowest of 2" in estimate.detail


def test_nvlink_without_a_reported_speed_has_no_figure() -> None:
    estimate = link_estimate([GpuLink(0, 12, None, 4, 16), GpuLink(1, 12, None, 4, 16)])
    assert (estimate.kind, estimate.gb_per_s) == ("nvlink", None)
    assert "not reported" in estimate.detail


def test_pcie_when_any_gpu_lacks_nvlink_and_the_slowest_link_counts() -> None:
    links = [GpuLink(0, 4, 25.0, 4, 16), GpuLink(1, 0, None, 3, 16), GpuLink(2, 0, None, 4, 8)]
    estimate = link_estimate(links)
    assert estimate.kind == "pcie"
    assert estimate.gb_per_s == pytest.approx(pcie_gb_per_s(4, 8))  # 15.75 < Gen3 x16's 15.76
    assert "Gen4 x8" in estimate.detail and "NVLink only on [0]" in estimate.detail


def test_pcie_without_generation_and_no_gpus_give_no_figure() -> None:
    assert link_estimate([GpuLink(0, 0, None, None, 16)]).gb_per_s is None
    assert link_estimate([]) == LinkEstimate("unknown", None, "no GPU links to read")


@pytest.mark.parametrize("width", [0, -1, 0xFFFFFFFF, 3])
def test_pcie_width_that_is_no_lane_count_gives_no_figure(width: int) -> None:
    # Before: -1 gave -1.969 GB/s and NVML's 0xFFFFFFFF ("not available") 8.5 PB/s, so the
    # all_reduce check failed a healthy link against a bogus figure.
    assert pcie_gb_per_s(4, width) is None
    estimate = link_estimate([GpuLink(0, 0, None, 4, 16), GpuLink(1, 0, None, 4, width)])
    assert (estimate.kind, estimate.gb_per_s) == ("pcie", None)
    assert f"cuda:1's PCIe width reported as {width}, no lane count" in estimate.detail


def test_pcie_width_nvml_gives_0_for_reads_as_unknown_and_says_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A virtualised GPU whose NVML reports a link width of 0, next to one that cannot say.
    cards: list[dict[str, object]] = [
        {"links": [], "gen": 4, "width": 0},
        {"links": [], "gen": None, "width": None},
    ]
    monkeypatch.setitem(sys.modules, "pynvml", link_nvml(cards))
    estimate = link_estimate(read_gpu_links([gpu(0), gpu(1)]))
    assert estimate.gb_per_s is None
    assert "cuda:0's PCIe width reported as 0" in estimate.detail
    assert "cuda:1's PCIe generation not reported by NVML" in estimate.detail
    sweep = AllReduceSweep("nccl", 2, "cuda", (SweepRow(2**26, 10, 0.01, 12.0, 12.0),))
    check = check_all_reduce(sweep, estimate)
    assert check.verdict == "ok" and "nothing to compare with" in check.value


def test_loopback_estimate_uses_the_measured_socket() -> None:
    estimate = loopback_estimate(LoopbackBaseline(0.8, 3.2))
    assert (estimate.kind, estimate.gb_per_s) == ("loopback", 0.8)
    assert "0.80 GB/s" in estimate.detail and "memcpy 3.20" in estimate.detail
    failed = loopback_estimate(LoopbackBaseline(None, 3.2))
    assert failed.gb_per_s is None and "could not be measured" in failed.detail


def test_results_are_json_safe() -> None:
    for obj in (
        GpuLink(0, 1, 25.0, 4, 16),
        LinkEstimate("pcie", 31.5, "x"),
        LoopbackBaseline(1.0, 2.0),
    ):
        assert json.loads(json.dumps(obj.to_dict())) == obj.to_dict()


def test_read_gpu_links_from_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    cards: list[dict[str, object]] = [
        {"links": [1] * 18, "speed": 26562, "gen": 5, "width": 16},
        {"links": [1, 1, 0, 1], "speed": None, "gen": 4, "width": 16},
        {"links": [], "gen": None, "width": None},  # no NVLink, PCIe queries unsupported
    ]
    monkeypatch.setitem(sys.modules, "pynvml", link_nvml(cards))
    found = read_gpu_links([gpu(i) for i in range(3)])
    assert found == [
        GpuLink(0, 18, 26.562, 5, 16),
        GpuLink(1, 3, None, 4, 16),
        GpuLink(2, 0, None, None, None),
    ]


def test_read_gpu_links_without_nvml_or_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    assert read_gpu_links([]) == []
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    assert read_gpu_links([gpu(0)]) == []


def test_read_p2p_blocked_names_the_pair_and_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    cards: list[dict[str, object]] = [{"links": []}, {"links": []}, {"links": []}]
    monkeypatch.setitem(sys.modules, "pynvml", link_nvml(cards, p2p={(0, 2): 3}))
    gpus = [gpu(i) for i in range(3)]
    assert read_p2p_blocked(gpus) == ["cuda:0-cuda:2 IOH_TOPOLOGY_NOT_SUPPORTED"]
    assert read_p2p_blocked(gpus[:1]) == []


def test_measure_loopback_measures_both_and_leaves_no_thread() -> None:
    before = threading.active_count()
    baseline = measure_loopback(8 * 2**20, repeats=1)
    assert baseline.socket_gb_per_s is not None and baseline.socket_gb_per_s > 0
    assert baseline.memcpy_gb_per_s > 0
    assert threading.active_count() == before


def test_measure_loopback_reports_a_failed_socket_as_unknown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import trainperf.doctor._interconnect as interconnect

    def refuse() -> tuple[object, object]:
        raise OSError("no loopback in this sandbox")

    monkeypatch.setattr(interconnect, "_socket_pair", refuse)
    baseline = measure_loopback(2**20, repeats=1)
    assert baseline.socket_gb_per_s is None and baseline.memcpy_gb_per_s > 0


@pytest.mark.parametrize("total_bytes", [0, -1, "8MiB", 2.0**20, float("nan"), True])
def test_measure_loopback_refuses_a_size_that_is_not_a_positive_int(total_bytes: object) -> None:
    # Before: a string or NaN raised a bare TypeError, and 0 a ZeroDivisionError.
    with pytest.raises(ValueError, match=r"total_bytes must be an int >= 1, got "):
        measure_loopback(total_bytes)  # type: ignore[arg-type]


@pytest.mark.parametrize("repeats", [0, "2", 1.5])
def test_measure_loopback_refuses_a_repeat_count_that_is_no_positive_int(
    repeats: object,
) -> None:
    # Before: 0 raised "max() arg is an empty sequence", and a string a bare TypeError.
    with pytest.raises(ValueError, match=r"repeats must be an int >= 1, got "):
        measure_loopback(2**20, repeats=repeats)  # type: ignore[arg-type]


@pytest.mark.requires_cuda
def test_real_gpu_links_are_read_from_nvml() -> None:
    import trainperf

    found = trainperf.gpus()
    links = read_gpu_links(found)
    assert [link.index for link in links] == [g.index for g in found]
    for link in links:
        assert link.pcie_generation is None or 1 <= link.pcie_generation <= 6
        assert link.nvlink_links >= 0
    assert link_estimate(links).kind in ("nvlink", "pcie", "unknown")


def test_a_loopback_peer_that_hangs_up_fails_the_measurement(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import socket

    import trainperf.doctor._interconnect as interconnect

    def closed_pair() -> tuple[socket.socket, socket.socket]:
        first, second = socket.socketpair()
        first.shutdown(socket.SHUT_WR)  # second reads end-of-stream, first cannot send
        return first, second

    monkeypatch.setattr(interconnect, "_socket_pair", closed_pair)
    with pytest.raises(OSError, match="loopback measurement failed"):
        interconnect._duplex_seconds(2**20, 2**16)
