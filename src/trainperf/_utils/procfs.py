"""``/proc/<pid>/stat``, read the one way: the fields after the command name.

Example:
    >>> import os
    >>> stat_fields(os.getpid())[0] in "RS"  # field 3: the state, running or sleeping
    True
    >>> stat_fields(2**22 + 1) is None  # above Linux's pid_max
    True
"""

from __future__ import annotations

__all__ = ["stat_fields"]


def stat_fields(pid: int, proc: str = "/proc") -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` from field 3 (the state) on, or None when there is
    no such process (or no ``/proc``). The command name (field 2) may hold spaces and
    parentheses: the fields are counted after its last ``)``."""
    try:
        with open(f"{proc}/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    if ")" not in text:
        return None
    return text[text.rindex(")") + 1 :].split()
