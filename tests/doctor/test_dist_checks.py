"""The interconnect checks (``doctor/_dist_checks.py``): each rule on made-up figures."""

from __future__ import annotations

import pytest

from trainperf.doctor import (
    AllReduceSweep,
    IommuGroup,
    LinkEstimate,
    SweepRow,
    acs_redirecting_bridges,
    check_all_reduce,
    check_iommu,
    check_p2p,
)

MiB = 2**20


def sweep(busbw: float, ranks: int = 8, backend: str = "nccl") -> AllReduceSweep:
    rows = (
        SweepRow(MiB, 50, 0.001, busbw / 4, busbw / 4),
        SweepRow(64 * MiB, 10, 0.01, busbw, busbw),
    )
    return AllReduceSweep(backend, ranks, "cuda" if backend == "nccl" else "cpu", rows)


NVLINK = LinkEstimate("nvlink", 450.0, "NVLink 18 links x 25 GB/s = 450.0 GB/s")
LOOPBACK = LinkEstimate("loopback", 1.0, "loopback TCP 1.00 GB/s")

# --------------------------------------------------------------------------- all_reduce


def test_all_reduce_near_the_link_is_ok() -> None:
    check = check_all_reduce(sweep(360.0), NVLINK)
    assert check.verdict == "ok"
    assert "360.00 GB/s at 64 MiB = 80% of NVLink 18 links" in check.value


def test_all_reduce_under_half_the_link_warns_and_under_a_tenth_fails() -> None:
    half = check_all_reduce(sweep(200.0), NVLINK)
    assert half.verdict == "warn" and "NCCL_DEBUG=INFO" in half.fix and "p2p" in half.fix
    assert check_all_reduce(sweep(40.0), NVLINK).verdict == "fail"
    pcie = LinkEstimate("pcie", 31.5, "PCIe Gen4 x16 = 31.5 GB/s")
    assert check_all_reduce(sweep(20.0), pcie).verdict == "ok"
    assert check_all_reduce(sweep(12.0), pcie).verdict == "warn"


def test_gloo_on_loopback_warns_under_a_quarter_and_never_fails() -> None:
    assert check_all_reduce(sweep(0.6, 2, "gloo"), LOOPBACK).verdict == "ok"
    slow = check_all_reduce(sweep(0.2, 2, "gloo"), LOOPBACK)
    assert slow.verdict == "warn" and "load" in slow.fix
    assert check_all_reduce(sweep(0.001, 2, "gloo"), LOOPBACK).verdict == "warn"


def test_all_reduce_failed_unknown_link_or_nothing_timed() -> None:
    failed = check_all_reduce(None, NVLINK, "rank 1 of 8 raised RuntimeError: NCCL error")
    assert failed.verdict == "fail" and "rank 1 of 8" in failed.value
    unknown = check_all_reduce(sweep(100.0), LinkEstimate("nvlink", None, "speed not reported"))
    assert unknown.verdict == "ok" and "nothing to compare" in unknown.value
    assert check_all_reduce(sweep(100.0), None).verdict == "ok"
    empty = AllReduceSweep("gloo", 2, "cpu", ())
    assert check_all_reduce(empty, LOOPBACK).verdict == "skip"


# --------------------------------------------------------------------------- iommu / ACS

LSPCI = """\
0000:00:01.0 PCI bridge: Intel Corporation Device 1bbc (rev 11) (prog-if 00 [Normal decode])
\tCapabilities: [220 v1] Access Control Services
\t\tACSCap:\tSrcValid+ TransBlk+ ReqRedir+ CmpltRedir+ UpstreamFwd+ EgressCtrl- DirectTrans-
\t\tACSCtl:\tSrcValid+ TransBlk- ReqRedir+ CmpltRedir+ UpstreamFwd+ EgressCtrl- DirectTrans-
0000:17:00.0 3D controller: NVIDIA Corporation GH100 [H100 SXM5 80GB] (rev a1)
\tSubsystem: NVIDIA Corporation Device 16c1
0000:20:02.0 PCI bridge: PLX Technology, Inc. PEX 88096
\t\tACSCap:\tSrcValid+ TransBlk+ ReqRedir+
\t\tACSCtl:\tSrcValid- TransBlk- ReqRedir-
"""


def test_acs_bridges_are_the_ones_with_srcvalid_plus_in_acsctl() -> None:
    assert acs_redirecting_bridges(LSPCI) == ("0000:00:01.0",)  # ACSCap's SrcValid+ is no vote
    assert acs_redirecting_bridges("") == ()


def test_iommu_needs_two_gpus() -> None:
    check = check_iommu("", [], None, gpu_count=1, acs_note="lspci not installed")
    assert check.verdict == "skip" and "lspci not installed" in check.value


def test_iommu_translating_gpu_dma_warns_and_passthrough_is_ok() -> None:
    gpus = ("0000:17:00.0",)
    translated = check_iommu("intel_iommu=on", [IommuGroup("12", "DMA-FQ", gpus)], [], 8)
    assert translated.verdict == "warn" and "iommu=pt" in translated.fix
    assert "GPU groups DMA-FQ" in translated.value and "intel_iommu=on" in translated.value
    passthrough = check_iommu("iommu=pt", [IommuGroup("12", "identity", gpus)], [], 8)
    assert passthrough.verdict == "ok" and "ACS off" in passthrough.value


def test_iommu_without_type_files_reads_the_command_line() -> None:
    groups = [IommuGroup("3", None, ("0000:17:00.0",))]
    assert check_iommu("intel_iommu=on", groups, [], 8).verdict == "warn"
    assert check_iommu("intel_iommu=on iommu=pt", groups, [], 8).verdict == "ok"
    assert check_iommu("amd_iommu=on", groups, [], 8).verdict == "warn"
    assert check_iommu("quiet", [], [], 8).verdict == "ok"  # no groups: IOMMU off


def test_acs_on_a_bridge_warns_with_the_setpci_fix() -> None:
    check = check_iommu("", [], ["0000:00:01.0"], gpu_count=4)
    assert check.verdict == "warn"
    assert "ACS SrcValid+ on 0000:00:01.0" in check.value
    assert "setpci" in check.fix and "NCCL_P2P_DISABLE=1" in check.fix
    unknown = check_iommu("", [], None, gpu_count=4, acs_note="lspci needs root")
    assert unknown.verdict == "ok" and "ACS: unknown (lspci needs root)" in unknown.value


# --------------------------------------------------------------------------- p2p


def test_p2p_faster_than_through_host_memory_is_ok() -> None:
    check = check_p2p(2, with_p2p=40.0, without_p2p=12.0)
    assert check.verdict == "ok" and "(3.33x)" in check.value


def test_p2p_slower_than_through_host_memory_warns() -> None:
    check = check_p2p(2, with_p2p=5.0, without_p2p=12.0)
    assert check.verdict == "warn" and "slower than going through host memory" in check.fix
    assert "NCCL_P2P_DISABLE=1" in check.fix


def test_p2p_that_fails_while_p2p_off_works_is_broken() -> None:
    check = check_p2p(4, with_error="timed out after 20 s", without_p2p=12.0)
    assert check.verdict == "fail" and "timed out" in check.value
    assert "NCCL_P2P_DISABLE=1" in check.fix and "ACS" in check.fix
    both = check_p2p(4, with_error="x", without_error="y")
    assert both.verdict == "fail" and "all_reduce check" in both.fix


def test_p2p_that_works_while_p2p_off_fails_is_not_said_to_fail_either_way() -> None:
    # Docker's 64 MB /dev/shm: P2P works, the path through host memory (SHM) does not.
    check = check_p2p(2, with_p2p=40.0, without_error="unhandled system error")
    assert check.verdict == "warn"
    assert "with P2P works (40.0 GB/s" in check.value and "unhandled system error" in check.value
    assert "None" not in check.value and "either way" not in check.fix
    assert "nccl_shm" in check.fix


def test_p2p_skips_without_two_gpus_or_measurements() -> None:
    assert check_p2p(1).verdict == "skip"
    assert check_p2p(4).verdict == "skip"
    blocked = check_p2p(4, nvml_blocked=["cuda:0-cuda:1 IOH_TOPOLOGY_NOT_SUPPORTED"])
    assert blocked.verdict == "warn" and "IOH_TOPOLOGY" in blocked.value
    measured = check_p2p(4, with_p2p=10.0, without_p2p=10.0, nvml_blocked=["cuda:0-cuda:1 X"])
    assert measured.verdict == "warn" and "nccl_shm" in measured.fix


@pytest.mark.parametrize("without", [0.0])
def test_p2p_against_a_zero_baseline_is_not_a_division_error(without: float) -> None:
    assert check_p2p(2, with_p2p=1.0, without_p2p=without).verdict == "ok"


@pytest.mark.parametrize("gpu_count", [-1, 2.0, True, "8", None])
def test_iommu_and_p2p_refuse_a_gpu_count_that_is_not_a_non_negative_int(gpu_count: object) -> None:
    # Before: a negative count was a silent skip ("peer-to-peer needs 2+ GPUs").
    with pytest.raises(ValueError, match=r"gpu_count must be an int >= 0, got "):
        check_iommu("", [], [], gpu_count)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"gpu_count must be an int >= 0, got "):
        check_p2p(gpu_count)  # type: ignore[arg-type]


@pytest.mark.parametrize("bandwidth", [float("nan"), float("inf"), -1.0, "40", True])
def test_p2p_refuses_a_bandwidth_that_is_no_measurement(bandwidth: object) -> None:
    # Before: NaN was "ok" ("nan GB/s"), and a string raised a bare TypeError.
    with pytest.raises(ValueError, match=r"with_p2p must be .*GB/s >= 0.*got "):
        check_p2p(8, with_p2p=bandwidth, without_p2p=18.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"without_p2p must be .*GB/s >= 0.*got "):
        check_p2p(8, with_p2p=40.0, without_p2p=bandwidth)  # type: ignore[arg-type]


def test_p2p_reads_numpy_bandwidths() -> None:
    np = pytest.importorskip("numpy")
    check = check_p2p(8, with_p2p=np.float32(3.0), without_p2p=np.float64(18.0))
    assert check.verdict == "warn" and "3.0 GB/s" in check.value


GPU_GROUPS = [IommuGroup("3", None, ("0000:17:00.0",))]  # a kernel without the type file


@pytest.mark.parametrize(
    "cmdline",
    [
        "intel_iommu=on iommu.passthrough=1",
        "amd_iommu=on iommu.passthrough=on",
        "intel_iommu=on iommu.passthrough=y",
        "intel_iommu=on iommu=soft,pt",
        "intel_iommu=on,igfx_off iommu=pt",
        "intel_iommu=on intel_iommu=off",
        "intel_iommu=off",
        "amd_iommu=off",
        "amd_iommu=fullflush,off",
        "intel_iommu=on iommu=off",
        "iommu.passthrough=0 iommu=pt",  # the last setting wins
        "intel_iommu=on iommu.passthrough=0 iommu.passthrough=1",
    ],
)
def test_iommu_reads_passthrough_from_the_command_line_as_the_kernel_does(cmdline: str) -> None:
    # Before: only iommu=pt, alone and exactly so, was passthrough; iommu.passthrough=1 was not.
    check = check_iommu(cmdline, GPU_GROUPS, [], 8)
    assert check.verdict == "ok", check


@pytest.mark.parametrize(
    "cmdline",
    [
        "iommu.passthrough=0",
        "iommu.passthrough=off",
        "iommu=nopt",
        "iommu=pt iommu.passthrough=0",  # the last setting wins
        "intel_iommu=on iommu=pt iommu=nopt",
        "intel_iommu=on,igfx_off",
        "intel_iommu=off intel_iommu=on",
        "intel_iommu=on iommu.passthrough=bogus",  # a value the kernel refuses changes nothing
    ],
)
def test_iommu_reads_translation_from_the_command_line_as_the_kernel_does(cmdline: str) -> None:
    check = check_iommu(cmdline, GPU_GROUPS, [], 8)
    assert check.verdict == "warn" and "translates GPU DMA" in check.fix, check


def test_iommu_names_the_passthrough_parameter_it_read() -> None:
    check = check_iommu("iommu.passthrough=1", GPU_GROUPS, [], 8)
    assert "iommu.passthrough=1" in check.value


@pytest.mark.parametrize("speed", [0.0, float("nan"), float("inf"), -1.0])
def test_all_reduce_against_a_link_of_no_real_speed_has_nothing_to_compare_with(
    speed: float,
) -> None:
    # NVML can report an NVLink speed of 0: the check divided by it (ZeroDivisionError out
    # of doctor --dist), or printed "nan%".
    sweep = AllReduceSweep("nccl", 2, "cuda", (SweepRow(2**26, 10, 0.01, 6.7, 6.7),))
    check = check_all_reduce(sweep, LinkEstimate("nvlink", speed, "NVLink 4 links x 0 GB/s"))
    assert check.verdict == "ok" and "nothing to compare with" in check.value
    assert "nan" not in check.value and "inf" not in check.value
