"""The interconnect checks of ``trainperf doctor --dist``: pure functions of their inputs.

``all_reduce`` judges the measured bus bandwidth against the link's own figure, ``iommu``
reads the IOMMU and PCIe ACS settings that can block peer-to-peer traffic, and ``p2p``
compares an all_reduce with peer-to-peer allowed against one with ``NCCL_P2P_DISABLE=1``.
``nccl_shm`` (``/dev/shm`` for NCCL's shared-memory transport) is in ``_nccl_shm``, the
network checks (``nccl_env``, ``ifname``, ``hostname``) in ``_net_checks``. Import
everything from :mod:`trainperf.doctor`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from trainperf._utils.format import format_bytes
from trainperf._utils.validate import non_negative_int, non_negative_number
from trainperf.doctor._checks import Check
from trainperf.doctor._interconnect import LinkEstimate
from trainperf.doctor._sweep import AllReduceSweep

__all__ = [
    "IommuGroup",
    "acs_redirecting_bridges",
    "check_all_reduce",
    "check_iommu",
    "check_p2p",
]

# (warn below, fail below) as a fraction of the link's figure. A healthy NVLink or PCIe link
# carries well over half its figure in an all_reduce of 64 MiB and more (nccl-tests); half
# means traffic takes a slower path (host memory instead of peer-to-peer), a tenth means
# sockets. gloo reduces on the CPU and copies through user space: it reached 59-91 % of a
# bare loopback socket on this project's 2-core machine; under a quarter the CPUs are
# contended. A slow CPU-only run is never a failure.
BANDWIDTH_FLOORS: dict[str, tuple[float, float]] = {
    "nvlink": (0.5, 0.1),
    "pcie": (0.5, 0.1),
    "loopback": (0.25, 0.0),
}


def check_all_reduce(
    sweep: AllReduceSweep | None, link: LinkEstimate | None, error: str | None = None
) -> Check:
    """The sweep's peak bus bandwidth against what the link should give.

    Args:
        sweep: the measured sweep; None when it could not run.
        link: the link's figure (:func:`~trainperf.doctor.link_estimate`, or the loopback
            baseline for gloo); None or unknown: reported without a verdict on speed.
        error: why the sweep failed, if it did.

    Example:
        >>> from trainperf.doctor import AllReduceSweep, LinkEstimate, SweepRow
        >>> sweep = AllReduceSweep("nccl", 2, "cuda", (SweepRow(2**26, 10, 0.01, 120.0, 120.0),))
        >>> check_all_reduce(sweep, LinkEstimate("nvlink", 300.0, "NVLink 12 links")).verdict
        'warn'
    """
    if error is not None or sweep is None:
        fix = (
            "rerun with NCCL_DEBUG=INFO (NCCL) or TORCH_DISTRIBUTED_DEBUG=DETAIL to see which "
            "transport fails; the ifname, nccl_env and nccl_shm checks name the usual causes"
        )
        return Check("all_reduce", "fail", f"the all_reduce sweep failed: {error}", fix)
    peak = sweep.peak
    ranks = f"{sweep.backend}, {sweep.world_size} ranks on {sweep.device}"
    if peak is None:
        return Check("all_reduce", "skip", f"{ranks}: no sizes were timed", "")
    measured = (
        f"{ranks}: peak bus bandwidth {peak.busbw_gb_per_s:.2f} GB/s at "
        f"{format_bytes(peak.size_bytes)}"
    )
    if link is None or link.gb_per_s is None or not 0.0 < link.gb_per_s < math.inf:
        # NVML can report a link speed of 0: no figure to divide by.
        detail = link.detail if link is not None else "no link figure"
        return Check("all_reduce", "ok", f"{measured}; {detail}, nothing to compare with")
    fraction = peak.busbw_gb_per_s / link.gb_per_s
    value = f"{measured} = {fraction:.0%} of {link.detail}"
    warn_below, fail_below = BANDWIDTH_FLOORS.get(link.kind, (0.5, 0.1))
    if fraction >= warn_below:
        return Check("all_reduce", "ok", value)
    if link.kind == "loopback":
        fix = (
            "gloo reaches well under the host's own loopback socket: the CPUs are busy (see "
            "the load and threads checks), or GLOO_SOCKET_IFNAME points at a slower interface"
        )
        return Check("all_reduce", "warn", value, fix)
    fix = (
        f"below {warn_below:.0%} of the link, traffic takes a slower path: NCCL_DEBUG=INFO "
        "shows the transport per channel ('via P2P/IPC' or NVLS is the fast one, 'via SHM' "
        "goes through host memory, 'via NET/Socket' through TCP); see the p2p, iommu and "
        "nccl_env checks"
    )
    return Check("all_reduce", "fail" if fraction < fail_below else "warn", value, fix)


# --------------------------------------------------------------------------- IOMMU and ACS


@dataclass(frozen=True)
class IommuGroup:
    """One ``/sys/kernel/iommu_groups/<n>`` entry, as far as doctor needs it.

    Attributes:
        group: the group number.
        kind: the ``type`` file (``"identity"`` = passthrough, ``"DMA"``/``"DMA-FQ"`` =
            translated), None on kernels without it.
        gpus: PCI addresses of NVIDIA GPUs in the group.
    """

    group: str
    kind: str | None
    gpus: tuple[str, ...] = ()


_ACS_CTL = re.compile(r"ACSCtl:\s*(.*)")


def acs_redirecting_bridges(lspci_vvv: str) -> tuple[str, ...]:
    """PCI devices whose ACS control has ``SrcValid+`` in ``lspci -vvv`` output.

    NCCL's troubleshooting guide: if ``lspci -vvv | grep ACSCtl`` shows ``SrcValid+``,
    ACS might be enabled, redirecting peer-to-peer traffic through the CPU root complex.

    Example:
        >>> text = ("00:01.0 PCI bridge: Intel\\n\\tACSCtl:\\tSrcValid+ TransBlk- ReqRedir+\\n"
        ...         "00:02.0 PCI bridge: Intel\\n\\tACSCtl:\\tSrcValid- TransBlk-\\n")
        >>> acs_redirecting_bridges(text)
        ('00:01.0',)
    """
    found: list[str] = []
    device = ""
    for line in lspci_vvv.splitlines():
        if line and not line[0].isspace():
            device = line.split(" ", 1)[0]
            continue
        match = _ACS_CTL.search(line)
        if match and "SrcValid+" in match.group(1) and device not in found:
            found.append(device)
    return tuple(found)


def _kernel_bool(value: str) -> bool | None:
    """``value`` as the kernel's ``kstrtobool`` reads it: ``1``, ``y``, ``t``, ``on`` are true,
    ``0``, ``n``, ``f``, ``off`` false (first letters, any case); None for anything else, which
    the kernel refuses, leaving the setting as it was."""
    first, second = value[:1].lower(), value[1:2].lower()
    if first in ("1", "y", "t") or (first == "o" and second == "n"):
        return True
    if first in ("0", "n", "f") or (first == "o" and second == "f"):
        return False
    return None


def _options(cmdline: str, name: str) -> list[str]:
    """The comma-separated options of every ``name=`` parameter in ``cmdline``, in order."""
    return [
        option
        for token in cmdline.split()
        if token.startswith(f"{name}=")
        for option in token[len(name) + 1 :].split(",")
    ]


def _default_passthrough(cmdline: str) -> bool | None:
    """Whether the command line sets DMA to bypass the IOMMU by default: True for
    ``iommu.passthrough=1`` or ``iommu=pt``, False for ``iommu.passthrough=0`` or
    ``iommu=nopt``, None where it says neither. The kernel applies them in order to one
    setting, so the last one wins."""
    setting: bool | None = None
    for name, _, value in (token.partition("=") for token in cmdline.split()):
        if name == "iommu.passthrough":
            read = _kernel_bool(value)
            setting = setting if read is None else read
        elif name == "iommu":
            for option in value.split(","):  # x86's iommu_setup matches each option's start
                if option.startswith(("pt", "nopt")):
                    setting = option.startswith("pt")
    return setting


def _cmdline_translates(cmdline: str) -> bool:
    """Whether the kernel command line leaves DMA translated, for kernels whose IOMMU groups
    have no ``type`` file. IOMMU groups exist, so some IOMMU is on: a default domain the
    command line sets (:func:`_default_passthrough`) decides. Otherwise DMA counts as
    translated only where a driver is switched on and not off again: ``intel_iommu=on``
    (its last ``on``/``off`` wins), any ``amd_iommu=`` without ``off``, and no ``iommu=off``.
    """
    passthrough = _default_passthrough(cmdline)
    if passthrough is not None:
        return not passthrough
    if any(option.startswith("off") for option in _options(cmdline, "iommu")):
        return False
    intel = False
    for option in _options(cmdline, "intel_iommu"):
        if option.startswith(("on", "off")):
            intel = option.startswith("on")
    amd = _options(cmdline, "amd_iommu")
    return intel or (bool(amd) and not any(option.startswith("off") for option in amd))


def _iommu_state(cmdline: str, groups: Sequence[IommuGroup]) -> tuple[str, bool]:
    """The IOMMU in words, and whether GPU DMA is translated (not passthrough)."""
    tokens = dict(t.split("=", 1) for t in cmdline.split() if "=" in t)
    settings = ", ".join(
        f"{k}={tokens[k]}"
        for k in ("iommu", "iommu.passthrough", "intel_iommu", "amd_iommu")
        if k in tokens
    )
    if not groups:
        return f"no IOMMU groups (IOMMU off{'; ' + settings if settings else ''})", False
    gpu_kinds = {g.kind for g in groups if g.gpus}
    if gpu_kinds and None not in gpu_kinds:
        translated = any(k != "identity" for k in gpu_kinds)
    else:  # no type file: the command line tells whether the IOMMU passes DMA through
        translated = _cmdline_translates(cmdline)
    kinds = "/".join(sorted(k or "?" for k in gpu_kinds)) or "no GPU in a group"
    state = f"IOMMU on, {len(groups)} groups, GPU groups {kinds}"
    return state + (f"; {settings}" if settings else ""), translated


def check_iommu(
    cmdline: str,
    groups: Sequence[IommuGroup],
    acs_bridges: Sequence[str] | None,
    gpu_count: int,
    *,
    acs_note: str = "",
) -> Check:
    """IOMMU and PCIe ACS settings that can block or slow GPU peer-to-peer traffic.

    An IOMMU that translates the GPUs' DMA, or ACS redirection on the PCIe bridges between
    them, sends peer-to-peer traffic up to the CPU root complex: much slower, or a hang
    (nccl#631, nccl#2079; NCCL troubleshooting, "PCI Access Control Services").

    Args:
        cmdline: ``/proc/cmdline`` (``iommu=``, ``iommu.passthrough=``, ``intel_iommu=``,
            ``amd_iommu=``), read as the kernel reads them where the groups have no
            ``type`` file.
        groups: the IOMMU groups (empty: IOMMU off).
        acs_bridges: bridges with ACS ``SrcValid+`` (:func:`acs_redirecting_bridges`);
            None when ``lspci -vvv`` could not be read.
        gpu_count: GPUs on this host (an int >= 0); peer-to-peer needs two.
        acs_note: why the ACS state is unknown, when it is.

    Raises:
        ValueError: ``gpu_count`` is not an int >= 0.

    Example:
        >>> check_iommu("iommu=pt", [], [], gpu_count=8).verdict
        'ok'
        >>> check_iommu("", [], ["00:01.0"], gpu_count=8).verdict
        'warn'
    """
    gpu_count = non_negative_int("gpu_count", gpu_count)
    state, translated = _iommu_state(cmdline, groups)
    if acs_bridges is None:
        acs = f"ACS: unknown ({acs_note or 'lspci -vvv unavailable'})"
    else:
        acs = f"ACS SrcValid+ on {', '.join(acs_bridges)}" if acs_bridges else "ACS off"
    value = f"{state}; {acs}"
    if gpu_count < 2:
        return Check("iommu", "skip", value, "nothing to do: peer-to-peer needs 2+ GPUs")
    problems = []
    if translated:
        problems.append(
            "the IOMMU translates GPU DMA: add iommu=pt to the kernel command line "
            "(passthrough), or disable VT-d/AMD-Vi in the BIOS"
        )
    if acs_bridges:
        problems.append(
            "ACS redirects peer-to-peer traffic through the root complex: disable it "
            "(BIOS, or `setpci -s <bridge> ECAP_ACS+0x6.w=0000` on each bridge as NCCL's "
            "troubleshooting guide shows)"
        )
    if problems:
        fix = (
            "; ".join(problems)
            + "; where the p2p check shows P2P slow or failing, NCCL_P2P_DISABLE=1"
        )
        return Check("iommu", "warn", value, fix)
    return Check("iommu", "ok", value)


# --------------------------------------------------------------------------- P2P on vs off

# P2P slower than this fraction of the host-memory path means peer traffic is redirected.
P2P_SLOWER_FRACTION = 0.9


def _bandwidth(name: str, value: float | None) -> float | None:
    """A measured bus bandwidth as a Python float, None (not measured) kept."""
    return None if value is None else non_negative_number(name, value, unit="GB/s")


def check_p2p(
    gpu_count: int,
    *,
    with_p2p: float | None = None,
    without_p2p: float | None = None,
    with_error: str | None = None,
    without_error: str | None = None,
    nvml_blocked: Sequence[str] = (),
) -> Check:
    """Peer-to-peer between GPUs: an all_reduce with P2P against one with ``NCCL_P2P_DISABLE=1``.

    Args:
        gpu_count: GPUs on this host (an int >= 0).
        with_p2p: peak bus bandwidth (GB/s) with P2P allowed; None when not measured.
        without_p2p: the same with ``NCCL_P2P_DISABLE=1``.
        with_error: why the P2P run failed (a hang ends at the sweep's timeout).
        without_error: why the run without P2P failed.
        nvml_blocked: GPU pairs NVML reports as unable to use P2P, with the reason.

    Raises:
        ValueError: ``gpu_count`` is not an int >= 0, or ``with_p2p`` or ``without_p2p`` is
            neither None nor a finite number >= 0 (a string, NaN).

    Example:
        >>> check_p2p(8, with_p2p=40.0, without_p2p=18.0).verdict
        'ok'
        >>> check_p2p(8, with_p2p=3.0, without_p2p=18.0).verdict
        'warn'
        >>> check_p2p(8, with_error="timed out", without_p2p=18.0).verdict
        'fail'
    """
    with_p2p = _bandwidth("with_p2p", with_p2p)
    without_p2p = _bandwidth("without_p2p", without_p2p)
    if non_negative_int("gpu_count", gpu_count) < 2:
        return Check("p2p", "skip", "peer-to-peer needs 2+ GPUs", "")
    nvml = f"; NVML: no P2P for {', '.join(nvml_blocked)}" if nvml_blocked else ""
    broken_fix = (
        "P2P is broken on this host (ACS or the IOMMU redirecting peer traffic; see the iommu "
        "check): disable ACS / set iommu=pt, or export NCCL_P2P_DISABLE=1 for every job"
    )
    if with_error is not None and without_error is None:
        value = f"all_reduce with P2P failed ({with_error}), with NCCL_P2P_DISABLE=1 it works{nvml}"
        return Check("p2p", "fail", value, broken_fix)
    if with_error is None and without_error is not None:
        measured = "" if with_p2p is None else f" ({with_p2p:.1f} GB/s bus bandwidth)"
        value = (
            f"all_reduce with P2P works{measured}, with NCCL_P2P_DISABLE=1 it failed "
            f"({without_error}){nvml}"
        )
        fix = (
            "NCCL's path through host memory fails (often a /dev/shm too small: see the "
            "nccl_shm check): a job with NCCL_P2P_DISABLE=1 fails here, so keep P2P on"
        )
        return Check("p2p", "warn", value, fix)
    if with_error is not None or without_error is not None:
        value = f"all_reduce failed with P2P ({with_error}) and without ({without_error}){nvml}"
        return Check("p2p", "fail", value, "see the all_reduce check: NCCL fails either way")
    if with_p2p is None or without_p2p is None:
        value = "not measured" + nvml
        return Check("p2p", "warn" if nvml_blocked else "skip", value, broken_fix * bool(nvml))
    ratio = with_p2p / without_p2p if without_p2p else float("inf")
    value = (
        f"P2P {with_p2p:.1f} GB/s vs NCCL_P2P_DISABLE=1 {without_p2p:.1f} GB/s bus bandwidth "
        f"({ratio:.2f}x){nvml}"
    )
    if ratio < P2P_SLOWER_FRACTION:
        fix = "P2P is slower than going through host memory: " + broken_fix
        return Check("p2p", "warn", value, fix)
    if nvml_blocked:
        fix = (
            "NCCL goes through host memory between those GPUs (see nccl_shm); on a PCIe host "
            "see the iommu check"
        )
        return Check("p2p", "warn", value, fix)
    return Check("p2p", "ok", value)
