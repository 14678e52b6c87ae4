"""The ``CUDA_VISIBLE_DEVICES`` check of ``trainperf doctor``: a pure function of the
variable's value and the GPUs NVML sees. Import it from :mod:`trainperf.doctor`.
"""

from __future__ import annotations

import re

from trainperf.device import VisibleDevices, parse_visible_devices
from trainperf.doctor._checks import Check, CheckStatus

__all__ = ["check_visible_devices"]


_CUDA_ORDERS = ("FASTEST_FIRST", "PCI_BUS_ID")
# An index entry with nothing after its number (a sign and leading zeros are read as numbers).
_NUMBER = re.compile(r"\+?[0-9]+")


def _hides_all(first: str) -> bool:
    """A first entry set to hide every GPU: empty, negative, or SLURM's ``NoDevFiles`` (a job
    given no GPU)."""
    return first == "" or first.startswith("-") or first == "NoDevFiles"


def _unreadable_entry(bad: str, parsed: VisibleDevices) -> str:
    """Why CUDA cannot read ``bad``: junk, or an entry in another notation than the first's."""
    if not parsed.entries:  # the first entry itself
        return f"{bad!r} is neither an index nor a GPU- or MIG- UUID"
    kind = "an index" if parsed.notation == "index" else f"a {parsed.notation} UUID"
    other = bad.startswith(("GPU-", "MIG-")) or bad.lstrip("+").isdigit()
    mixing = " (entries cannot mix indices, GPU- and MIG- UUIDs)" if other else ""
    return f"{bad!r} is not {kind}, as the first entry sets{mixing}"


def _setting(value: str | None) -> str:
    return "unset" if value is None else repr(value)


def _list_end(visible: str, parsed: VisibleDevices) -> str | None:
    """A note when the list stops at a negative index after readable entries: CUDA's
    documented way to end it early (``0,2,-1,1`` shows 0 and 2), so meant, not a typo; None
    when it stops anywhere else, or nowhere."""
    bad = parsed.first_invalid
    if bad is None or not parsed.entries or re.fullmatch(r"-[0-9]+", bad) is None:
        return None
    ignored = [e.strip() for e in visible.split(",")][len(parsed.entries) + 1 :]
    after = [e for e in ignored if e]
    tail = f"; CUDA ignores {', '.join(map(repr, after))} after it" if after else ""
    return f" (the list ends at {bad!r}{tail})"


def check_visible_devices(
    visible: str | None, order: str | None, gpu_count: int, *, shown: int | None = None
) -> Check:
    """``CUDA_VISIBLE_DEVICES`` and ``CUDA_DEVICE_ORDER`` sanity.

    The list is read with :func:`trainperf.device.parse_visible_devices`, the rules
    :func:`trainperf.gpus` applies. CUDA reads it once, at start-up; the first entry sets the
    notation (indices or UUIDs); it stops at the first entry it cannot parse, in another
    notation, or that does not exist, shows nothing when an entry repeats, and numbers the
    GPUs fastest first unless ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, so on a multi-GPU host an
    integer index need not be the GPU ``nvidia-smi`` shows under it. A negative index after
    readable entries ends the list on purpose (CUDA's docs: ``0,2,-1,1`` shows 0 and 2). On a
    host without GPUs the list changes nothing, and is not judged.

    Args:
        visible: ``CUDA_VISIBLE_DEVICES``, None when unset.
        order: ``CUDA_DEVICE_ORDER``, None when unset.
        gpu_count: physical GPUs (NVML's count, which ignores ``CUDA_VISIBLE_DEVICES``).
        shown: the GPUs :func:`trainperf.gpus` finds visible under it (None: not known):
            UUIDs are checked against the cards only through it.

    Example:
        >>> check_visible_devices("1,3", None, gpu_count=4).verdict
        'warn'
        >>> check_visible_devices("1,3", "PCI_BUS_ID", gpu_count=4).verdict
        'ok'
    """
    value = f"CUDA_VISIBLE_DEVICES={_setting(visible)}, CUDA_DEVICE_ORDER={_setting(order)}"
    # The list is judged whatever the order says: CUDA ignores an order it does not know and
    # numbers the GPUs fastest first, which _check_entries assumes for any order but PCI_BUS_ID.
    check = _check_list(value, visible, order, gpu_count, shown)
    if order is None or order in _CUDA_ORDERS:
        return check
    fix = f"CUDA ignores CUDA_DEVICE_ORDER={order!r}: use one of {list(_CUDA_ORDERS)}"
    verdict: CheckStatus = "fail" if check.verdict == "fail" else "warn"
    return Check("visible_devices", verdict, check.value, "; ".join(filter(None, (check.fix, fix))))


def _check_list(
    value: str, visible: str | None, order: str | None, gpu_count: int, shown: int | None
) -> Check:
    """``CUDA_VISIBLE_DEVICES`` itself: what it hides, where CUDA stops reading it."""
    if visible is None:
        return Check("visible_devices", "ok", value + f" (all {gpu_count} GPU(s) visible)")
    parsed = parse_visible_devices(visible)
    entries = parsed.entries
    bad = parsed.first_invalid
    if not entries and bad is not None and (_hides_all(bad) or not gpu_count):
        return Check(
            "visible_devices",
            "warn" if gpu_count else "ok",
            value + " (hides every GPU)",
            "unset CUDA_VISIBLE_DEVICES to use the GPUs" if gpu_count else "",
        )
    if not gpu_count:
        return Check("visible_devices", "ok", value + " (no GPU here: CUDA shows none either way)")
    end = _list_end(visible, parsed)
    if end is not None:
        value += end
    elif bad is not None:
        visible_part = f"only {', '.join(entries)} are visible" if entries else "no GPU is visible"
        why = _unreadable_entry(bad, parsed)
        fix = f"{why}: CUDA stops reading the list there, so {visible_part}"
        return Check("visible_devices", "fail", value, fix)
    return _check_entries(value, visible, parsed, order, gpu_count, shown)


def _check_entries(
    value: str,
    visible: str,
    parsed: VisibleDevices,
    order: str | None,
    gpu_count: int,
    shown: int | None,
) -> Check:
    """The readable entries of a list on a host with GPUs: indices that exist, no repeats,
    UUIDs that match, and the numbering they are read in."""
    entries = parsed.entries
    if parsed.notation == "index":
        missing = next((e for e in entries if int(e) >= gpu_count), None)
        if missing is not None:
            fix = (
                f"index {missing} does not exist ({gpu_count} GPU(s)): CUDA stops reading the "
                "list there; `nvidia-smi -L` lists the GPUs"
            )
            return Check("visible_devices", "fail", value, fix)
    if parsed.duplicates:
        fix = "a GPU is listed twice, and CUDA then makes no GPU visible: list each once"
        return Check("visible_devices", "fail", value, fix)
    if parsed.notation != "index" and shown is not None and shown < len(entries):
        fix = (
            f"only {shown} of its {len(entries)} UUID(s) make a GPU visible: CUDA stops at a "
            "UUID that matches no card here or several (too short a prefix), and shows none "
            "when one card is named twice (a prefix and a longer one); `nvidia-smi -L` lists "
            "the UUIDs"
        )
        return Check("visible_devices", "fail", value, fix)
    warnings = [_index_tails(visible, parsed)] if parsed.notation == "index" else []
    if parsed.notation == "index" and gpu_count > 1 and order != "PCI_BUS_ID":
        warnings.append(
            "CUDA numbers GPUs fastest-first, nvidia-smi by PCI bus: index "
            f"{entries[0]} here need not be nvidia-smi's GPU {entries[0]}. Set "
            "CUDA_DEVICE_ORDER=PCI_BUS_ID, or list UUIDs (trainperf.select_gpus() does)"
        )
    fix = "; ".join(filter(None, warnings))
    return Check("visible_devices", "warn" if fix else "ok", value, fix)


def _index_tails(visible: str, parsed: VisibleDevices) -> str:
    """What CUDA drops from index entries with more after the number (``"0 1"`` or ``"0;1"``
    reads as GPU 0 alone, like C's ``strtoul``), as a fix; "" when every entry is a number."""
    raw = [e.strip() for e in visible.split(",")][: len(parsed.entries)]
    tails = [(e, n) for e, n in zip(raw, parsed.entries, strict=True) if not _NUMBER.fullmatch(e)]
    if not tails:
        return ""
    read = ", ".join(f"{e!r} as {n}" for e, n in tails)
    return (
        f"CUDA reads {read}: an index ends at its first non-digit, and the rest of the entry "
        "is ignored; separate GPUs with commas (CUDA_VISIBLE_DEVICES=0,1)"
    )
