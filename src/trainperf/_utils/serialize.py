"""``to_dict()`` for result dataclasses: their fields as a JSON-safe dict."""

from __future__ import annotations

import dataclasses
from typing import Any, cast

__all__ = ["result_dict"]


def _json_safe(value: Any) -> Any:
    # dataclasses.asdict keeps tuples (and named pairs such as next_faster) as tuples.
    if isinstance(value, (tuple, list)):
        return [_json_safe(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    return value


def result_dict(result: Any) -> dict[str, Any]:
    """A result dataclass's fields as a JSON-safe dict (tuples become lists, nesting kept).

    Example:
        >>> from dataclasses import dataclass
        >>> @dataclass(frozen=True)
        ... class Pair:
        ...     names: tuple[str, ...]
        >>> result_dict(Pair(("a", "b")))
        {'names': ['a', 'b']}
    """
    return cast("dict[str, Any]", _json_safe(dataclasses.asdict(result)))
