"""Human-readable formatting shared by reports: :func:`format_bytes`."""

from __future__ import annotations

__all__ = ["format_bytes", "plural"]


def format_bytes(n: float | None) -> str:
    """``1536 * 2**20`` -> ``"1.5 GiB"``; None -> ``"-"``.

    GiB with one decimal from 1 GiB up, whole MiB from 1 MiB, whole KiB from 1 KiB, bytes
    below (not "0 KiB").

    Args:
        n: a number of bytes, or None when unknown.

    Returns:
        The size in words, e.g. ``"300 MiB"``.

    Example:
        >>> format_bytes(1536 * 2**20), format_bytes(300 * 2**20), format_bytes(None)
        ('1.5 GiB', '300 MiB', '-')
        >>> format_bytes(2048), format_bytes(512)
        ('2 KiB', '512 B')
    """
    if n is None:
        return "-"
    if n >= 2**30:
        return f"{n / 2**30:.1f} GiB"
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
