"""The ``nccl_shm`` check of ``trainperf doctor --dist``: ``/dev/shm`` against NCCL's needs.

:func:`nccl_shm_need` sizes what NCCL's shared-memory transport allocates in ``/dev/shm``
for a number of ranks on one host, reading NCCL's buffer and channel variables as NCCL
reads them; :func:`check_nccl_shm` judges the free space against it. Pure functions of
their inputs; the other interconnect checks are in ``_dist_checks`` and ``_net_checks``.
Import everything from :mod:`trainperf.doctor`.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Mapping

from trainperf._utils.format import format_bytes
from trainperf._utils.validate import non_negative_int, positive_int
from trainperf.doctor._checks import Check
from trainperf.doctor._net_checks import _C_SPACE, c_strtoll, nccl_one

__all__ = ["check_nccl_shm", "nccl_shm_need"]

_MiB = 2**20

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
_BACKENDS = ("nccl", "gloo")  # what the rules judge: NCCL, or a backend that is not NCCL
# What NCCL_PARAM's default of -2 means: "not set", so a written -2 is not set either.
_NCCL_UNSET = -2


_PLAIN = (
    "write NCCL's buffer sizes as plain decimal bytes (NCCL_BUFFSIZE=4194304) and "
    "NCCL_MIN_NCHANNELS as a plain decimal count"
)


def _c_int(value: int) -> int:
    """``value`` kept to its low 32 bits, as C stores an ``int64_t`` in an ``int``."""
    return (value + 2**31) % 2**32 - 2**31


def _nccl_int(env: Mapping[str, str], name: str) -> tuple[int | None, str]:
    """``env[name]`` as NCCL stores it in an ``int`` (None: not set, see :func:`_nccl_param`),
    and a note where that is not what it says: past 32 bits only the low 32 are kept
    (``2**32 + 16`` is 16)."""
    value, note = _nccl_param(env, name)
    if value == _NCCL_UNSET:
        return None, note
    kept = _c_int(value)
    if kept != value:
        how = f"NCCL keeps it in a 32-bit int: the low 32 bits of {value}"
        note = f"NCCL reads {name}={env[name]!r} as {kept} ({how})"
    return kept, note


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
    size, note = _nccl_int(env, name)
    if size is None:
        return default, note
    if size <= 0:
        raw = env[name]
        return default, f"NCCL reads {name}={raw!r} as a buffer of {size} bytes, which cannot work"
    return size, note


def _nccl_min_channels(env: Mapping[str, str]) -> tuple[int, str]:
    """``NCCL_MIN_NCHANNELS`` as ``ncclMinNchannels`` takes it (0 when not set, clamped to
    0..MAXCHANNELS), and a note where it is misread."""
    value, note = _nccl_int(env, "NCCL_MIN_NCHANNELS")
    if value is None:
        return 0, note
    return min(max(value, 0), NCCL_MAX_CHANNELS), note


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
    NCCL reads it (C's ``strtoll`` with base 0: ``"16k"`` is 16 bytes, ``"010"`` is 8; past
    32 bits, the low 32 bits); a buffer size it reads as 0 or less (``"nan"`` is 0), which
    cannot work, counts as the default. Each variable read otherwise than written is named
    in a ``RuntimeWarning``.

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
    need, rule, notes = _shm_need(ranks, env or {})
    for note in notes:  # check_nccl_shm names them in its value instead
        warnings.warn(f"nccl_shm_need(): {note}; {_PLAIN}", RuntimeWarning, stacklevel=2)
    return need, rule


def _shm_need(ranks: int, env: Mapping[str, str]) -> tuple[int, str, list[str]]:
    """``(bytes, the rule in words, notes on variables NCCL reads otherwise than written)``
    for ``ranks`` ranks (checked): see :func:`nccl_shm_need`."""
    segment, channels, notes = _shm_sizes(env)
    peers = min(ranks - 1, NCCL_SHM_MAX_PEERS)
    rule = (
        f"{ranks} ranks x {channels} channels x {peers} peer{'s' * (peers != 1)} x "
        f"{segment / _MiB:.1f} MiB segments"
    )
    return ranks * channels * peers * segment, rule, notes


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
            memory only between ranks on one host, so with fewer than 2 it is a skip. More
            ``ranks`` than ``gpus`` NCCL refuses at start-up ("Duplicate GPU detected"): a
            fail with NCCL (1 GPU or more), a warning with gloo (2 GPUs or more).

    Raises:
        ValueError: ``ranks`` is not an int >= 1, or ``shm_free`` or ``gpus`` not an int
            >= 0 (or None).

    Example:
        >>> check_nccl_shm(64 * 2**20, 8, backend="nccl").verdict
        'fail'
        >>> check_nccl_shm(16 * 2**30, 8, backend="nccl").verdict
        'ok'
        >>> check_nccl_shm(None, 8, backend="nccl", platform="linux").verdict
        'fail'
        >>> check_nccl_shm(16 * 2**20, 2, backend="gloo", gpus=1).verdict
        'skip'
        >>> check_nccl_shm(16 * 2**30, 8, backend="nccl", gpus=4).verdict
        'fail'
    """
    ranks = positive_int("ranks", ranks)
    if shm_free is not None:
        shm_free = non_negative_int("shm_free", shm_free, none_ok=True)
    gpus = non_negative_int("gpus", gpus, none_ok=True)
    env = env or {}
    shm = _shm_state(shm_free, shm_error)
    nccl = _uses_nccl(backend)
    if gpus is not None and ranks > gpus >= (1 if nccl else 2):
        return _more_ranks_than_gpus(shm, ranks, gpus, nccl)
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
    need, rule, notes = _shm_need(ranks, env)
    value = f"{shm}; NCCL's shared-memory transport needs ~{format_bytes(need)} for {rule}"
    value += "".join(f"; {note}" for note in notes)
    plain = _PLAIN * bool(notes)
    if (shm_free or 0) >= need:
        return Check("nccl_shm", "warn" if notes else "ok", value, plain)
    return _shm_short(value, ranks, backend, shm_free, shm_error, plain)


def _shm_state(shm_free: int | None, shm_error: str | None) -> str:
    """``/dev/shm`` in words: its free space, that there is none, or why it was unreadable."""
    if shm_free is None and shm_error is not None:
        return f"could not read /dev/shm ({shm_error})"
    return "no /dev/shm here" if shm_free is None else f"/dev/shm {format_bytes(shm_free)} free"


def _more_ranks_than_gpus(shm: str, ranks: int, gpus: int, nccl: bool) -> Check:
    """The check where NCCL refuses the ranks: more of them than GPUs on this host."""
    value = (
        f"{shm}; {ranks} ranks on {gpus} GPU{'s' * (gpus != 1)}: NCCL runs one rank per GPU "
        "and refuses two on one at start-up ('Duplicate GPU detected')"
    )
    fix = (
        f"start at most {gpus} ranks on this host, one per GPU (torchrun "
        f"--nproc-per-node={gpus}), each calling torch.cuda.set_device(local_rank)"
    )
    if nccl:
        return Check("nccl_shm", "fail", value, fix)
    return Check("nccl_shm", "warn", value, f"gloo runs them, but NCCL would not: {fix}")


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
    per-device one such as ``"cpu:gloo,cuda:nccl"``.

    Raises:
        TypeError: ``backend`` is not a str.
        ValueError: it names no backend, or one other than nccl and gloo.
    """
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str such as 'nccl' or 'gloo', got {backend!r}")
    names = []
    for part in backend.lower().split(","):
        device, colon, name = part.rpartition(":")
        names.append(name.strip() if not colon or device.strip() else "")
    if not set(names) <= set(_BACKENDS):
        raise ValueError(
            f"backend must be 'nccl' or 'gloo' (in any case), or a per-device string of them "
            f"such as 'cpu:gloo,cuda:nccl', got {backend!r}; pass the backend the job gives "
            "torch.distributed.init_process_group"
        )
    return "nccl" in names
