"""trainperf.device._containers: how to_device walks and rebuilds each type of container."""

from __future__ import annotations

import array
import collections
import dataclasses
import types
from collections.abc import MutableSequence
from typing import Any

import pytest
import torch

from trainperf.device import to_device

META = torch.device("meta")


class Slots(MutableSequence):  # type: ignore[type-arg]
    """A mutable sequence that keeps its items in a slot, out of reach of a shallow copy."""

    __slots__ = ("_items",)

    def __init__(self, items: Any = ()) -> None:
        self._items = list(items)

    def __getitem__(self, i: Any) -> Any:
        return self._items[i]

    def __setitem__(self, i: Any, value: Any) -> None:
        self._items[i] = value

    def __delitem__(self, i: Any) -> None:
        del self._items[i]

    def __len__(self) -> int:
        return len(self._items)

    def insert(self, i: int, value: Any) -> None:
        self._items.insert(i, value)


def test_deques_user_lists_and_other_mutable_sequences_are_walked() -> None:
    x = torch.ones(2)
    bounded = collections.deque([x, "id"], maxlen=5)
    user = collections.UserList([x])
    user.tag = "kept"  # type: ignore[attr-defined]
    slots = Slots([x])
    out = to_device([bounded, user, slots], "meta")
    assert type(out[0]) is collections.deque and out[0].maxlen == 5
    assert out[0][0].device == META and out[0][1] == "id"
    assert type(out[1]) is collections.UserList and out[1][0].device == META
    assert out[1].tag == "kept"
    assert type(out[2]) is Slots and out[2][0].device == META
    assert bounded[0] is x and user[0] is x and slots[0] is x  # the inputs are as they were


def test_byte_arrays_and_arrays_stay_leaves() -> None:
    raw, numbers = bytearray(b"ab"), array.array("i", [1, 2])
    out = to_device({"raw": raw, "numbers": numbers}, "meta")
    assert out["raw"] is raw and out["numbers"] is numbers


def test_simple_namespaces_are_walked() -> None:
    ns = types.SimpleNamespace(x=torch.ones(1), name="a")
    out = to_device(ns, "meta")
    assert type(out) is types.SimpleNamespace and out.x.device == META and out.name == "a"
    assert ns.x.device.type == "cpu"


@dataclasses.dataclass
class Collated:
    x: torch.Tensor
    lengths: torch.Tensor = dataclasses.field(init=False)  # set later, by a collate step

    def __post_init__(self) -> None:
        self.mask = self.x > 0  # derived in __post_init__: an attribute, not a field


def test_dataclass_attributes_that_are_not_fields_move_and_unset_fields_are_skipped() -> None:
    batch = Collated(torch.ones(2))
    out = to_device(batch, "meta")  # `lengths` unset: no AttributeError
    assert out.x.device == META and out.mask.device == META
    assert not hasattr(out, "lengths") and batch.mask.device.type == "cpu"
    batch.lengths = torch.tensor([2])
    assert to_device(batch, "meta").lengths.device == META


@dataclasses.dataclass
class Node:
    value: torch.Tensor
    parent: Any = None


def test_a_dataclass_that_refers_to_itself_is_moved_once() -> None:
    node = Node(torch.ones(1))
    node.parent = node
    out = to_device(node, "meta")
    assert out.parent is out and out.value.device == META and node.parent is node


Tagged = collections.namedtuple("Tagged", "a b")


class TaggedPair(Tagged):
    """A namedtuple subclass whose instances carry attributes."""


class TaggedTuple(tuple):  # type: ignore[type-arg]
    pass


def test_tuple_and_namedtuple_subclasses_keep_their_attributes() -> None:
    pair = TaggedPair(torch.ones(1), 1)
    pair.meta = {"ids": [1, 2]}  # type: ignore[attr-defined]
    plain = TaggedTuple([torch.ones(1)])
    plain.info = "x"  # type: ignore[attr-defined]
    out_pair, out_plain = to_device([pair, plain], "meta")
    assert type(out_pair) is TaggedPair and out_pair.a.device == META
    assert out_pair.meta == {"ids": [1, 2]}
    assert type(out_plain) is TaggedTuple and out_plain[0].device == META
    assert out_plain.info == "x"


def test_a_parameter_stays_a_parameter_and_a_leaf() -> None:
    frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)
    trained = torch.nn.Parameter(torch.ones(2))
    out = to_device({"frozen": frozen, "trained": trained}, "cpu", dtype=torch.float16)
    for name, moved in out.items():
        assert type(moved) is torch.nn.Parameter, name
        assert moved.is_leaf and moved.grad_fn is None and moved.dtype == torch.float16
    assert not out["frozen"].requires_grad and out["trained"].requires_grad
    assert type(to_device(trained, "meta")) is torch.nn.Parameter
    assert to_device(trained, "cpu") is trained  # already there: not copied


def test_storages_move() -> None:
    storage = torch.UntypedStorage(8)
    out = to_device({"s": storage}, "meta")
    assert out["s"].device == META and out["s"].nbytes() == 8
    assert to_device(storage, "cpu") is storage


@pytest.mark.parametrize("kind", [list, collections.deque])
def test_values_a_mapping_makes_on_the_fly_are_not_mistaken_for_one_another(kind: Any) -> None:
    # Each look-up makes a fresh container, freed once moved: its id may come back for the
    # next one, which must not be taken for the first.
    class Fresh(collections.abc.Mapping):  # type: ignore[type-arg]
        def __init__(self, moved: dict[int, Any] | None = None) -> None:
            self.moved = moved  # what to_device rebuilds it from

        def __getitem__(self, key: int) -> Any:
            if self.moved is not None:
                return self.moved[key]
            return kind([torch.full((1,), float(key))])

        def __iter__(self) -> Any:
            return iter(range(50))

        def __len__(self) -> int:
            return 50

    out = to_device(Fresh(), "cpu", dtype=torch.float16)
    assert [out[k][0].item() for k in range(50)] == [float(k) for k in range(50)]


def test_a_container_without_tensors_that_cannot_be_rebuilt_passes_through() -> None:
    # Before: sys.version_info in a batch was a TypeError ("cannot rebuild a version_info"),
    # and os.stat_result and time.struct_time came back without their extra fields.
    import os
    import sys
    import time

    stat, local = os.stat("."), time.localtime(0)
    batch = {"x": torch.ones(1), "v": sys.version_info, "stat": stat, "time": local}
    out = to_device(batch, "meta")
    assert out["x"].device == META
    assert out["v"] is sys.version_info and out["stat"] is stat and out["time"] is local
    assert out["stat"].st_mtime_ns == stat.st_mtime_ns and out["time"].tm_zone == local.tm_zone


def test_a_chain_map_moves_every_map() -> None:
    # Before: the moved values went into a copy of maps[0], while maps[1:] (shared with the
    # caller) kept the old tensors, shadowed ones included.
    shown, hidden, other = torch.ones(1), torch.zeros(1), torch.ones(2)
    first, second = {"a": shown}, {"a": hidden, "b": other}
    chain = collections.ChainMap(first, second)
    out = to_device(chain, "meta")
    assert type(out) is collections.ChainMap and len(out.maps) == 2
    assert out.maps[0].keys() == {"a"} and out.maps[1].keys() == {"a", "b"}
    assert all(t.device == META for m in out.maps for t in m.values())
    assert chain.maps == [first, second] and first["a"] is shown and second["a"] is hidden
    assert to_device(chain, "meta", skip_keys="b").maps[1]["b"] is other
