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
    check_nccl_shm,
    check_p2p,
    nccl_shm_need,
)

MiB = 2**20
GiB = 2**30
SEGMENT = 4096 + 524288 + 4915200 + 4 * MiB  # the 9,637,888 bytes of nccl#342


def sweep(busbw: float, ranks: int = 8, backend: str = "nccl") -> AllReduceSweep:
    rows = (
        SweepRow(MiB, 50, 0.001, busbw / 4, busbw / 4),
        SweepRow(64 * MiB, 10, 0.01, busbw, busbw),
    )
    return AllReduceSweep(backend, ranks, "cuda" if backend == "nccl" else "cpu", rows)


NVLINK = LinkEstimate("nvlink", 450.0, "NVLink 18 links x 25 GB/s = 450.0 GB/s")
LOOPBACK = LinkEstimate("loopback", 1.0, "loopback TCP 1.00 GB/s")

# --------------------------------------------------------------------------- nccl_shm


def test_nccl_shm_need_is_ranks_channels_peers_segments() -> None:
    assert SEGMENT == 9637888
    assert nccl_shm_need(8)[0] == 8 * 2 * 2 * SEGMENT
    assert nccl_shm_need(2)[0] == 2 * 2 * 1 * SEGMENT  # one peer only
    assert nccl_shm_need(1)[0] == 0
    _, rule = nccl_shm_need(4)
    assert rule == "4 ranks x 2 channels x 2 peers x 9.2 MiB segments"


def test_nccl_shm_need_follows_the_buffer_variables() -> None:
    env = {"NCCL_BUFFSIZE": str(MiB), "NCCL_MIN_NCHANNELS": "4"}
    assert nccl_shm_need(8, env)[0] == 8 * 4 * 2 * (SEGMENT - 3 * MiB)
    # NCCL reads "lots" as a 0-byte buffer (no use: the default counts) and 1 channel as 1.
    junk = {"NCCL_BUFFSIZE": "lots", "NCCL_MIN_NCHANNELS": "1"}
    assert nccl_shm_need(8, junk)[0] == nccl_shm_need(8)[0]


@pytest.mark.parametrize(
    ("raw", "simple"),
    [("16k", 16), ("1_000", 1), ("010", 8), ("0x10", 16), (" 16", 16), ("\t16\n", 16),
     ("08", 4 * MiB), ("0b100", 4 * MiB), ("0o10", 4 * MiB), ("-2", 4 * MiB),
     ("99999999999999999999", 4 * MiB), (str(2**32 + 16), 16), (str(2**32), 4 * MiB)],
)  # fmt: skip
def test_nccl_shm_need_reads_nccl_buffsize_with_strtoll_as_nccl_does(raw: str, simple: int) -> None:
    # NCCL: strtoll(value, NULL, 0), its default only on overflow or -2, stored in an int; a
    # size of 0 or less cannot work, so the estimate keeps the default for it.
    need = nccl_shm_need(2, {"NCCL_BUFFSIZE": raw})[0]
    assert need == 2 * 2 * 1 * (SEGMENT - 4 * MiB + simple)


def test_nccl_shm_need_clamps_min_nchannels_as_nccl_does() -> None:
    assert nccl_shm_need(2, {"NCCL_MIN_NCHANNELS": "1000"})[0] == 2 * 64 * 1 * SEGMENT
    assert nccl_shm_need(2, {"NCCL_MIN_NCHANNELS": "010"})[0] == 2 * 8 * 1 * SEGMENT
    assert nccl_shm_need(2, {"NCCL_MIN_NCHANNELS": "-5"})[0] == 2 * 2 * 1 * SEGMENT


@pytest.mark.parametrize("raw", ["16M", "1_000", "010", "lots", "0", "99999999999999999999"])
def test_nccl_shm_names_a_buffer_size_nccl_misreads(raw: str) -> None:
    check = check_nccl_shm(16 * GiB, 8, backend="nccl", env={"NCCL_BUFFSIZE": raw})
    assert check.verdict == "warn" and f"NCCL_BUFFSIZE={raw!r}" in check.value
    assert "NCCL_BUFFSIZE=4194304" in check.fix
    small = check_nccl_shm(64 * MiB, 8, backend="nccl", env={"NCCL_BUFFSIZE": raw})
    assert small.verdict == "fail" and "--shm-size" in small.fix and "plain decimal" in small.fix


@pytest.mark.parametrize("raw", ["4194304", "0x400000", " 4194304", "+4194304"])
def test_nccl_shm_is_quiet_about_a_buffer_size_read_as_written(raw: str) -> None:
    check = check_nccl_shm(16 * GiB, 8, backend="nccl", env={"NCCL_BUFFSIZE": raw})
    assert check.verdict == "ok" and check.fix == ""


@pytest.mark.parametrize("ranks", [0, -1, 2.0, True, "8"])
def test_nccl_shm_refuses_a_rank_count_that_is_not_a_positive_int(ranks: object) -> None:
    with pytest.raises(ValueError, match=r"ranks must be an int >= 1, got "):
        check_nccl_shm(16 * GiB, ranks, backend="nccl")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"ranks must be an int >= 1, got "):
        nccl_shm_need(ranks)  # type: ignore[arg-type]


def test_nccl_shm_refuses_a_negative_gpu_count() -> None:
    with pytest.raises(ValueError, match=r"gpus must be None or an int >= 0, got -1"):
        check_nccl_shm(16 * GiB, 2, backend="gloo", gpus=-1)


@pytest.mark.parametrize("gpus", [0, 1])
def test_nccl_shm_is_a_skip_with_fewer_than_two_gpus(gpus: int) -> None:
    # One NCCL rank per GPU: with 0 or 1 there are no two ranks on this host to share memory.
    check = check_nccl_shm(16 * MiB, 2, backend="gloo", gpus=gpus)
    assert check.verdict == "skip" and check.fix == ""
    assert f"{gpus} GPU" in check.value and "one rank per GPU" in check.value
    assert check_nccl_shm(16 * MiB, 2, backend="gloo", gpus=2).verdict == "warn"


def test_dockers_64_mb_fails_eight_nccl_ranks_but_not_two() -> None:
    small = check_nccl_shm(64 * MiB, 8, backend="nccl")
    assert small.verdict == "fail"
    assert "294 MiB" in small.value and "8 ranks" in small.value
    assert "--shm-size" in small.fix and "unhandled system error" in small.fix
    assert check_nccl_shm(64 * MiB, 2, backend="nccl").verdict == "ok"  # ~37 MiB
    assert check_nccl_shm(16 * GiB, 8, backend="nccl").verdict == "ok"


def test_a_small_shm_under_gloo_is_a_warning_naming_nccl() -> None:
    check = check_nccl_shm(16 * MiB, 2, backend="gloo")
    assert check.verdict == "warn" and "gloo does not use /dev/shm" in check.fix


def test_nccl_shm_with_shm_disabled_or_absent() -> None:
    off = check_nccl_shm(16 * MiB, 8, backend="nccl", env={"NCCL_SHM_DISABLE": "1"})
    assert off.verdict == "ok" and "NCCL_SHM_DISABLE=1" in off.value
    # Read as NCCL reads it: "01" and "0x1" are 1; 2 leaves shared memory on.
    assert (
        check_nccl_shm(16 * MiB, 8, backend="nccl", env={"NCCL_SHM_DISABLE": "0x1"}).verdict == "ok"
    )
    assert (
        check_nccl_shm(16 * MiB, 8, backend="nccl", env={"NCCL_SHM_DISABLE": "2"}).verdict == "fail"
    )


def test_no_dev_shm_on_linux_fails_nccl_as_a_small_one_does() -> None:
    # Before: a skip, "no /dev/shm here", where check_shm fails and NCCL's SHM transport
    # (and its proxy's segments) cannot open a file there.
    missing = check_nccl_shm(None, 8, backend="nccl", platform="linux")
    assert missing.verdict == "fail"
    assert "no /dev/shm here" in missing.value and "294 MiB" in missing.value
    assert missing.fix.startswith("NCCL fails at start-up")
    assert "mount a tmpfs at /dev/shm" in missing.fix and "enlarge" not in missing.fix
    gloo = check_nccl_shm(None, 8, backend="gloo", platform="linux")
    assert gloo.verdict == "warn" and "mount a tmpfs at /dev/shm" in gloo.fix
    # One rank has no peer to share memory with; NCCL_SHM_DISABLE=1 turns the transport off.
    assert check_nccl_shm(None, 1, backend="nccl", platform="linux").verdict == "ok"
    off = check_nccl_shm(None, 8, backend="nccl", env={"NCCL_SHM_DISABLE": "1"}, platform="linux")
    assert off.verdict == "ok" and off.value.startswith("no /dev/shm here; NCCL_SHM_DISABLE=1")


def test_no_dev_shm_off_linux_is_a_skip() -> None:
    check = check_nccl_shm(None, 8, backend="nccl", platform="win32")
    assert check.verdict == "skip" and "NCCL runs on Linux only" in check.value


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


@pytest.mark.parametrize("backend", ["NCCL", "cpu:gloo,cuda:nccl"])
def test_nccl_shm_fails_nccl_however_the_backend_names_it(backend: str) -> None:
    # Before: anything but exactly "nccl" was judged as gloo, a warning.
    assert check_nccl_shm(64 * 2**20, 8, backend=backend).verdict == "fail"


def test_nccl_shm_refuses_a_backend_that_is_no_string() -> None:
    with pytest.raises(TypeError, match=r"backend must be a str such as 'nccl'"):
        check_nccl_shm(64 * 2**20, 8, backend=None)  # type: ignore[arg-type]


def test_an_unreadable_shm_is_unknown_to_nccl_not_missing() -> None:
    check = check_nccl_shm(
        None, 8, backend="nccl", platform="linux", shm_error="EACCES: Permission denied"
    )
    assert check.verdict == "warn"
    assert "could not read /dev/shm" in check.value and "EACCES" in check.value
    assert "294 MiB" in check.value and "df -h /dev/shm" in check.fix
    assert check_nccl_shm(None, 8, backend="nccl", platform="linux").verdict == "fail"
