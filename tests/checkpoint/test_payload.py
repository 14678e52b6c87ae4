"""trainperf.checkpoint._payload: what a Checkpointer file holds, and plain values put back
into the live containers of the state in place."""

from __future__ import annotations

import collections
from typing import Any

from trainperf.checkpoint._payload import RESERVED, restore_into
from trainperf.checkpoint._rng import rng_state


def _saved(**entries: Any) -> dict[str, Any]:
    return {**entries, RESERVED: {"format": 1, "step": 1, "rng": rng_state()}}


def test_deques_are_restored_in_place_when_their_maxlen_matches() -> None:
    # A deque was replaced by the loaded one: the loop's `recent = state["recent"]` kept
    # filling a deque no later save would see.
    recent: collections.deque[int] = collections.deque([9], maxlen=3)
    window: collections.deque[int] = collections.deque(maxlen=2)
    nested: collections.deque[int] = collections.deque()
    state: dict[str, Any] = {"recent": recent, "window": window, "stats": {"q": nested}}
    saved = _saved(
        recent=collections.deque([1, 2, 3], maxlen=3),
        window=collections.deque([1, 2, 3], maxlen=4),
        stats={"q": collections.deque([5])},
    )
    restore_into(state, saved, None, "c.pt", 1)
    assert state["recent"] is recent and list(recent) == [1, 2, 3] and recent.maxlen == 3
    assert state["stats"]["q"] is nested and list(nested) == [5]
    # Another maxlen cannot be set on the live deque, and 2 would drop a saved item.
    assert state["window"] is not window and state["window"].maxlen == 4
    assert list(state["window"]) == [1, 2, 3]


def test_sets_are_restored_in_place_and_frozensets_replaced() -> None:
    seen = {"old"}
    state: dict[str, Any] = {"seen": seen, "tags": frozenset({"x"}), "by": {"ids": {0}}}
    ids = state["by"]["ids"]
    restore_into(state, _saved(seen={"a", "b"}, tags={"y"}, by={"ids": {1, 2}}), None, "c.pt", 1)
    assert state["seen"] is seen and seen == {"a", "b"}
    assert state["by"]["ids"] is ids and ids == {1, 2}
    assert state["tags"] == {"y"}


def test_a_set_is_filled_in_place_from_any_kind_of_set() -> None:
    import collections.abc

    class Frozen(collections.abc.Set):  # set.__ior__ returns NotImplemented for it
        def __init__(self, items: set[int]) -> None:
            self.items = items

        def __contains__(self, x: object) -> bool:
            return x in self.items

        def __iter__(self):  # type: ignore[no-untyped-def]
            return iter(self.items)

        def __len__(self) -> int:
            return len(self.items)

    live = {1, 2}
    state = {"seen": live}
    restore_into(state, _saved(seen=Frozen({3, 4})), None, "c.pt", 1)
    assert state["seen"] is live and live == {3, 4}
