"""Human-readable formatting shared by reports: :func:`format_bytes`."""

from __future__ import annotations

__all__ = ["format_bytes", "plural"]

# The units shown with one decimal, largest first: (power of 2, name).
_DECIMAL_UNITS = ((60, "EiB"), (50, "PiB"), (40, "TiB"), (30, "GiB"))


def format_bytes(n: float | None) -> str:
    """``1536 * 2**20`` -> ``"1.5 GiB"``; None -> ``"-"``.

    One decimal from 1 GiB up, in the largest unit that fits (GiB, TiB, PiB, EiB: not
    "4294967296.0 GiB"); whole MiB from 1 MiB, whole KiB from 1 KiB, bytes below (not
    "0 KiB").

    Args:
        n: a number of bytes, or None when unknown.

    Returns:
        The size in words, e.g. ``"300 MiB"``.

    Example:
        >>> format_bytes(1536 * 2**20), format_bytes(300 * 2**20), format_bytes(None)
        ('1.5 GiB', '300 MiB', '-')
        >>> format_bytes(2048), format_bytes(512), format_bytes(5 * 2**40)
        ('2 KiB', '512 B', '5.0 TiB')
    """
    if n is None:
        return "-"
    for power, unit in _DECIMAL_UNITS:
        if n >= 2**power:
            return f"{n / 2**power:.1f} {unit}"
    if n >= 2**20:
        return f"{n / 2**20:.0f} MiB"
    if n >= 2**10:
        return f"{n / 2**10:.0f} KiB"
    return f"{n:.0f} B"


def plural(n: int, noun: str, many: str | None = None) -> str:
    """``n`` and the noun, plural unless ``n == 1`` (``many``, or the noun with an "s").

    Example:
        >>> plural(1, "thread"), plural(16, "thread"), plural(2, "process", "processes")
        ('1 thread', '16 threads', '2 processes')
    """
    return f"{n} {noun if n == 1 else many or noun + 's'}"
