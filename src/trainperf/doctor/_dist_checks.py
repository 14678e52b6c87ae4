"""The interconnect checks of ``trainperf doctor --dist``: pure functions of their inputs.

``all_reduce`` judges the measured bus bandwidth against the link's own figure,
``nccl_shm`` sizes ``/dev/shm`` for NCCL's shared-memory transport, ``iommu`` reads the
IOMMU and PCIe ACS settings that can block peer-to-peer traffic, and ``p2p`` compares an
all_reduce with peer-to-peer allowed against one with ``NCCL_P2P_DISABLE=1``. The network
checks (``nccl_env``, ``ifname``, ``hostname``) are in ``_net_checks``. Import everything
from :mod:`trainperf.doctor`.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from trainperf._utils.format import format_bytes
from trainperf._utils.validate import non_negative_int, positive_int
from trainperf.doctor._checks import Check
from trainperf.doctor._interconnect import LinkEstimate
from trainperf.doctor._net_checks import _C_SPACE, c_strtoll, nccl_one
from trainperf.doctor._sweep import AllReduceSweep

__all__ = [
    "IommuGroup",
    "acs_redirecting_bridges",
    "check_all_reduce",
    "check_iommu",
    "check_nccl_shm",
    "check_p2p",
    "nccl_shm_need",
]

_MiB = 2**20

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

# NCCL's SHM transport: the receiving rank of each (channel, sender) pair allocates one
# /dev/shm segment holding a buffer per protocol (transport/shm.cc, shmRecvSetup): LL
# 512 KiB, LL128 4,915,200 bytes (~4.7 MiB), SIMPLE NCCL_BUFFSIZE (4 MiB), plus a 4 KiB
# header: the 9,637,888 bytes of "Error while creating shared memory segment ... (size
# 9637888)" in nccl#342 (newer versions size it a little smaller, so this errs large).
# NCCL usually sets up 2 channels or more on one host (its INFO log: "Channel 00/02", "Channel
# 01/02"), and within one host its rings and chain trees receive from at most 2 distinct
# peers (the previous and the next rank). An estimate, sized from NCCL's own buffers.
NCCL_LL_BUFFSIZE = 8 * 512 * 8 * 16
NCCL_LL128_BUFFSIZE = 120 * 640 * 8 * 8
NCCL_SIMPLE_BUFFSIZE = 4 * _MiB
NCCL_SHM_HEADER = 4096
NCCL_SHM_CHANNELS = 2
NCCL_SHM_MAX_PEERS = 2


# NCCL clamps NCCL_MIN_NCHANNELS to MAXCHANNELS: 64 in recent releases, 32 in older ones
# (src/include/device.h); 64 errs large.
NCCL_MAX_CHANNELS = 64
# What NCCL_PARAM's default of -2 means: "not set", so a written -2 is not set either.
_NCCL_UNSET = -2


def _c_int(value: int) -> int:
    """``value`` kept to its low 32 bits, as C stores an ``int64_t`` in an ``int``."""
    return (value + 2**31) % 2**32 - 2**31


def _nccl_param(env: Mapping[str, str], name: str) -> tuple[int, str]:
    """``env[name]`` as NCCL's parameter loader (``ncclLoadParam``) reads it, and a note where
    that is not what it says.

    NCCL reads a set, non-empty value with C's ``strtoll(value, NULL, 0)``, keeping its
    default (here -2, "not set") only where that overflows: ``"16k"`` and ``"1_000"`` are 16
    and 1 (it stops at the first other character), ``"08"`` and ``"lots"`` are 0, ``"010"``
    is 8 (octal), ``"0x10"`` and ``" 16"`` are 16.
    """
    raw = env.get(name)
    if not raw:
        return _NCCL_UNSET, ""
    value, end = c_strtoll(raw)
    if value is None:
        return _NCCL_UNSET, f"{name}={raw!r} is out of range (64 bits): NCCL keeps its default"
    digits = raw[:end].lstrip(_C_SPACE).lstrip("+-")
    octal = digits[:1] == "0" and digits[1:2] not in ("x", "X") and int(digits) != abs(value)
    if octal:
        return value, f"NCCL reads {name}={raw!r} as {value} (C's strtoll: a leading 0 is octal)"
    if end == 0 or raw[end:].strip(_C_SPACE):
        how = "C's strtoll stops at the first character that is not a digit"
        return value, f"NCCL reads {name}={raw!r} as {value} ({how})"
    return value, ""


def _nccl_buffsize(env: Mapping[str, str], name: str, default: int) -> tuple[int, str]:
    """A protocol's buffer size as NCCL takes it (``computeBuffSizes``: the variable unless it
    reads as -2, stored in an ``int``), and a note where it is misread. A size NCCL reads as
    0 or less is no buffer it can use: the estimate keeps the default and the note says so."""
    value, note = _nccl_param(env, name)
    if value == _NCCL_UNSET:
        return default, note
    size = _c_int(value)
    if size <= 0:
        raw = env[name]
        return default, f"NCCL reads {name}={raw!r} as a buffer of {size} bytes, which cannot work"
    return size, note


def _nccl_min_channels(env: Mapping[str, str]) -> tuple[int, str]:
    """``NCCL_MIN_NCHANNELS`` as ``ncclMinNchannels`` takes it (0 when not set, clamped to
    0..MAXCHANNELS), and a note where it is misread."""
    value, note = _nccl_param(env, "NCCL_MIN_NCHANNELS")
    if value == _NCCL_UNSET:
        return 0, note
    return min(max(_c_int(value), 0), NCCL_MAX_CHANNELS), note


def _shm_sizes(env: Mapping[str, str]) -> tuple[int, int, list[str]]:
    """``(segment bytes, channels, notes on variables NCCL reads otherwise than written)``."""
    sizes = [
        _nccl_buffsize(env, "NCCL_LL_BUFFSIZE", NCCL_LL_BUFFSIZE),
        _nccl_buffsize(env, "NCCL_LL128_BUFFSIZE", NCCL_LL128_BUFFSIZE),
        _nccl_buffsize(env, "NCCL_BUFFSIZE", NCCL_SIMPLE_BUFFSIZE),
    ]
    min_channels, channel_note = _nccl_min_channels(env)
    notes = [note for _, note in sizes if note] + [channel_note] * bool(channel_note)
    segment = NCCL_SHM_HEADER + sum(size for size, _ in sizes)
    return segment, max(NCCL_SHM_CHANNELS, min_channels), notes


def nccl_shm_need(ranks: int, env: Mapping[str, str] | None = None) -> tuple[int, str]:
    """Bytes of ``/dev/shm`` NCCL's SHM transport needs for ``ranks`` ranks on one host.

    ``ranks x channels x peers x segment``: each rank receives, per channel, from
    ``min(ranks - 1, 2)`` peers, into one segment of LL + LL128 + SIMPLE buffers (their
    sizes from ``NCCL_LL_BUFFSIZE``, ``NCCL_LL128_BUFFSIZE`` and ``NCCL_BUFFSIZE`` when
    set); the channels are ``NCCL_MIN_NCHANNELS`` when set above 2. Each variable is read as
    NCCL reads it (C's ``strtoll`` with base 0: ``"16k"`` is 16 bytes, ``"010"`` is 8); a
    buffer size it reads as 0 or less, which cannot work, counts as the default.

    Args:
        ranks: NCCL ranks on this host (at least 1).
        env: the environment (the buffer and channel variables).

    Returns:
        ``(bytes, the rule in words)``.

    Raises:
        ValueError: ``ranks`` is not an int >= 1.

    Example:
        >>> need, rule = nccl_shm_need(8)
        >>> need // 2**20, rule
        (294, '8 ranks x 2 channels x 2 peers x 9.2 MiB segments')
        >>> nccl_shm_need(2)[0] // 2**20
        36
    """
    ranks = positive_int("ranks", ranks)
    segment, channels, _ = _shm_sizes(env or {})
    peers = min(ranks - 1, NCCL_SHM_MAX_PEERS)
    rule = (
        f"{ranks} ranks x {channels} channels x {peers} peer{'s' * (peers != 1)} x "
        f"{segment / _MiB:.1f} MiB segments"
    )
    return ranks * channels * peers * segment, rule


def check_nccl_shm(
    shm_free: int | None,
    ranks: int,
    *,
    backend: str,
    env: Mapping[str, str] | None = None,
    platform: str = sys.platform,
    shm_error: str | None = None,
    gpus: int | None = None,
) -> Check:
    """``/dev/shm`` against what NCCL's shared-memory transport needs for ``ranks`` ranks.

    NCCL falls back to shared memory between GPUs that cannot reach each other
    peer-to-peer (or with ``NCCL_P2P_DISABLE=1``); a ``/dev/shm`` too small for its
    segments, or none at all, fails the job at start-up with "unhandled system error"
    (torchtitan#853, nccl#342). Docker's default is 64 MB. See :func:`nccl_shm_need` for
    the rule. A buffer or channel variable NCCL reads otherwise than written (``"16k"`` is
    16 bytes) is named, and makes an ``ok`` a ``warn``.

    Args:
        shm_free: free bytes in ``/dev/shm``; None where there is none.
        ranks: ranks on this host (at least 1).
        backend: the backend the job uses (``"nccl"`` in any case, or a per-device string
            that names it, such as ``"cpu:gloo,cuda:nccl"``): a too-small ``/dev/shm`` fails
            NCCL; gloo does not use it (a warning, since the same machine may run NCCL
            later).
        env: the environment (``NCCL_SHM_DISABLE``, buffer sizes).
        platform: ``sys.platform``: on Linux, where NCCL makes its segments as files in
            ``/dev/shm``, a missing ``/dev/shm`` counts as one with nothing free; NCCL
            runs nowhere else, so elsewhere it is a skip.
        shm_error: why ``/dev/shm`` could not be read (``HostLimits.shm_error``): its size
            is unknown, not zero, so a need above nothing is a warning, not a fail.
        gpus: GPUs on this host, where known. NCCL runs one rank per GPU and uses shared
            memory only between ranks on one host, so with fewer than 2 it is a skip.

    Raises:
        ValueError: ``ranks`` is not an int >= 1, or ``gpus`` not an int >= 0.

    Example:
        >>> check_nccl_shm(64 * 2**20, 8, backend="nccl").verdict
        'fail'
        >>> check_nccl_shm(16 * 2**30, 8, backend="nccl").verdict
        'ok'
        >>> check_nccl_shm(None, 8, backend="nccl", platform="linux").verdict
        'fail'
        >>> check_nccl_shm(16 * 2**20, 2, backend="gloo", gpus=1).verdict
        'skip'
    """
    ranks = positive_int("ranks", ranks)
    gpus = non_negative_int("gpus", gpus, none_ok=True)
    env = env or {}
    shm = _shm_state(shm_free, shm_error)
    if gpus is not None and gpus < 2:
        value = (
            f"{shm}; {gpus} GPU{'s' * (gpus != 1)} here: NCCL runs one rank per GPU and uses "
            "shared memory only between ranks on one host"
        )
        return Check("nccl_shm", "skip", value, "")
    if nccl_one(env.get("NCCL_SHM_DISABLE")):  # read as NCCL reads it: "01" and "0x1" too
        return Check("nccl_shm", "ok", f"{shm}; NCCL_SHM_DISABLE=1: NCCL does not use it")
    if shm_free is None and shm_error is None and not platform.startswith("linux"):
        return Check("nccl_shm", "skip", "no /dev/shm here (NCCL runs on Linux only)", "")
    need, rule = nccl_shm_need(ranks, env)
    notes = _shm_sizes(env)[2]
    value = f"{shm}; NCCL's shared-memory transport needs ~{format_bytes(need)} for {rule}"
    value += "".join(f"; {note}" for note in notes)
    plain = (
        "write NCCL's buffer sizes as plain decimal bytes (NCCL_BUFFSIZE=4194304) and "
        "NCCL_MIN_NCHANNELS as a plain decimal count"
    ) * bool(notes)
    if (shm_free or 0) >= need:
        return Check("nccl_shm", "warn" if notes else "ok", value, plain)
    return _shm_short(value, ranks, backend, shm_free, shm_error, plain)


def _shm_state(shm_free: int | None, shm_error: str | None) -> str:
    """``/dev/shm`` in words: its free space, that there is none, or why it was unreadable."""
    if shm_free is None and shm_error is not None:
        return f"could not read /dev/shm ({shm_error})"
    return "no /dev/shm here" if shm_free is None else f"/dev/shm {format_bytes(shm_free)} free"


def _shm_short(
    value: str, ranks: int, backend: str, shm_free: int | None, shm_error: str | None, plain: str
) -> Check:
    """The check where ``/dev/shm`` holds less than NCCL needs (or could not be read)."""
    fix = (
        "enlarge /dev/shm: docker run --shm-size=1g (or --ipc=host); on Kubernetes mount an "
        "emptyDir with medium: Memory at /dev/shm; NCCL_SHM_DISABLE=1 avoids it at the cost "
        "of slower transfers where peer-to-peer is unavailable"
    )
    fix += f"; {plain}" * bool(plain)
    if shm_free is None and shm_error is not None:
        return Check("nccl_shm", "warn", value, f"run `df -h /dev/shm` to see its size; {fix}")
    if shm_free is None:
        fix = fix.replace("enlarge /dev/shm", "mount a tmpfs at /dev/shm", 1)
    if _uses_nccl(backend):
        lead = "NCCL fails at start-up with 'unhandled system error' when it uses it: "
        return Check("nccl_shm", "fail", value, lead + fix)
    lead = f"gloo does not use /dev/shm, but NCCL with {ranks} ranks on this host would fail: "
    return Check("nccl_shm", "warn", value, lead + fix)


def _uses_nccl(backend: str) -> bool:
    """Whether a ``torch.distributed`` backend string runs NCCL: ``"nccl"`` in any case, or a
    per-device one such as ``"cpu:gloo,cuda:nccl"``."""
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str such as 'nccl' or 'gloo', got {backend!r}")
    return "nccl" in backend.lower()


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
    if link is None or link.gb_per_s is None:
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


def _iommu_state(cmdline: str, groups: Sequence[IommuGroup]) -> tuple[str, bool]:
    """The IOMMU in words, and whether GPU DMA is translated (not passthrough)."""
    tokens = dict(t.split("=", 1) for t in cmdline.split() if "=" in t)
    settings = ", ".join(
        f"{k}={tokens[k]}" for k in ("iommu", "intel_iommu", "amd_iommu") if k in tokens
    )
    if not groups:
        return f"no IOMMU groups (IOMMU off{'; ' + settings if settings else ''})", False
    gpu_kinds = {g.kind for g in groups if g.gpus}
    if gpu_kinds and None not in gpu_kinds:
        translated = any(k != "identity" for k in gpu_kinds)
    else:  # no type file: the command line tells whether the IOMMU passes DMA through
        translated = tokens.get("iommu") != "pt" and (
            tokens.get("intel_iommu") == "on" or tokens.get("amd_iommu") not in (None, "off")
        )
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
        cmdline: ``/proc/cmdline`` (``iommu=``, ``intel_iommu=``, ``amd_iommu=``).
        groups: the IOMMU groups (empty: IOMMU off).
        acs_bridges: bridges with ACS ``SrcValid+`` (:func:`acs_redirecting_bridges`);
            None when ``lspci -vvv`` could not be read.
        gpu_count: GPUs on this host; peer-to-peer needs two.
        acs_note: why the ACS state is unknown, when it is.

    Example:
        >>> check_iommu("iommu=pt", [], [], gpu_count=8).verdict
        'ok'
        >>> check_iommu("", [], ["00:01.0"], gpu_count=8).verdict
        'warn'
    """
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
        gpu_count: GPUs on this host.
        with_p2p: peak bus bandwidth (GB/s) with P2P allowed; None when not measured.
        without_p2p: the same with ``NCCL_P2P_DISABLE=1``.
        with_error: why the P2P run failed (a hang ends at the sweep's timeout).
        without_error: why the run without P2P failed.
        nvml_blocked: GPU pairs NVML reports as unable to use P2P, with the reason.

    Example:
        >>> check_p2p(8, with_p2p=40.0, without_p2p=18.0).verdict
        'ok'
        >>> check_p2p(8, with_p2p=3.0, without_p2p=18.0).verdict
        'warn'
        >>> check_p2p(8, with_error="timed out", without_p2p=18.0).verdict
        'fail'
    """
    if gpu_count < 2:
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
