"""trainperf.device._move: to_device over nested batches."""

from __future__ import annotations

import collections
import dataclasses
import functools
import types
from collections.abc import Iterator, MutableMapping
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch

from trainperf.device import to_device

META = torch.device("meta")


# --------------------------------------------------------------------------- to_device()


class Pair(NamedTuple):
    x: torch.Tensor
    label: int


@dataclasses.dataclass
class Batch:
    images: torch.Tensor
    ids: list[str]


@dataclasses.dataclass(frozen=True)
class FrozenBatch:
    x: torch.Tensor
    mask: torch.Tensor
    derived: torch.Tensor = dataclasses.field(init=False)
    scale: dataclasses.InitVar[float] = 1.0  # an InitVar without replace()'s help

    def __post_init__(self, scale: float) -> None:
        object.__setattr__(self, "derived", self.x * scale)


class Recorder:
    """A custom batch class with its own .to."""

    def __init__(self) -> None:
        self.moved_to: torch.device | None = None

    def to(self, device: torch.device) -> Recorder:
        self.moved_to = device
        return self


class TaggedList(list):  # type: ignore[type-arg]
    tag = "kept"


class StrictTuple(tuple):  # type: ignore[type-arg]
    def __new__(cls, a: Any, b: Any) -> StrictTuple:  # cannot be built from one iterable
        return super().__new__(cls, (a, b))


def float_cpu(*shape: int) -> torch.Tensor:
    return torch.randn(*shape)


def test_to_device_moves_nested_containers_and_keeps_their_types() -> None:
    default = collections.defaultdict(list, {"a": float_cpu(2)})
    ordered = collections.OrderedDict([("z", float_cpu(1)), ("a", float_cpu(1))])
    array = np.arange(3)
    batch = {
        "list": [float_cpu(2), (float_cpu(3), "keep")],
        "ordered": ordered,
        "default": default,
        "pair": Pair(float_cpu(2), 7),
        "batch": Batch(float_cpu(2), ["a", "b"]),
        "set": {float_cpu(1)},
        "frozenset": frozenset({float_cpu(1)}),
        "tagged": TaggedList([float_cpu(1)]),
        "proxy": types.MappingProxyType({"p": float_cpu(1)}),
        "leaves": ["s", 3, 2.5, None, True, array, torch.Size([2]), torch.float16],
    }
    out = to_device(batch, "meta")
    assert type(out) is dict and list(out) == list(batch)
    assert out["list"][0].device == META and out["list"][1][0].device == META
    assert type(out["list"][1]) is tuple and out["list"][1][1] == "keep"
    assert type(out["ordered"]) is collections.OrderedDict and list(out["ordered"]) == ["z", "a"]
    assert out["ordered"]["a"].device == META
    assert type(out["default"]) is collections.defaultdict
    assert out["default"].default_factory is list and out["default"]["a"].device == META
    assert type(out["pair"]) is Pair and out["pair"].x.device == META and out["pair"].label == 7
    assert type(out["batch"]) is Batch and out["batch"].images.device == META
    assert out["batch"].ids == ["a", "b"]
    assert type(out["set"]) is set and next(iter(out["set"])).device == META
    assert type(out["frozenset"]) is frozenset and next(iter(out["frozenset"])).device == META
    assert type(out["tagged"]) is TaggedList and out["tagged"][0].device == META
    assert type(out["proxy"]) is types.MappingProxyType and out["proxy"]["p"].device == META
    assert out["leaves"][:5] == ["s", 3, 2.5, None, True]
    assert out["leaves"][5] is array and out["leaves"][6:] == [torch.Size([2]), torch.float16]
    # The input is not modified.
    assert batch["list"][0].device.type == "cpu" and ordered["a"].device.type == "cpu"


def test_to_device_frozen_dataclass() -> None:
    frozen = FrozenBatch(float_cpu(2), torch.ones(2, dtype=torch.bool), scale=2.0)
    out = to_device(frozen, "meta", dtype=torch.float16)
    assert type(out) is FrozenBatch
    assert (out.x.device, out.x.dtype) == (META, torch.float16)
    assert (out.mask.device, out.mask.dtype) == (META, torch.bool)
    assert out.derived.device == META  # an init=False field moves too
    assert frozen.x.device.type == "cpu"
    untouched = Batch(images=None, ids=["a"])  # type: ignore[arg-type]
    assert to_device(untouched, "meta").ids == ["a"]


def test_to_device_dtype_casts_floats_only() -> None:
    batch = {
        "f32": float_cpu(2),
        "f64": torch.zeros(2, dtype=torch.float64),
        "labels": torch.tensor([1, 2]),
        "mask": torch.tensor([True, False]),
        "complex": torch.zeros(2, dtype=torch.complex64),
        "u8": torch.zeros(2, dtype=torch.uint8),
    }
    out = to_device(batch, "cpu", dtype=torch.bfloat16)
    assert {k: v.dtype for k, v in out.items()} == {
        "f32": torch.bfloat16,
        "f64": torch.bfloat16,
        "labels": torch.int64,
        "mask": torch.bool,
        "complex": torch.complex64,
        "u8": torch.uint8,
    }
    assert torch.equal(out["f32"], batch["f32"].to(torch.bfloat16))


def test_to_device_returns_tensors_already_in_place_without_copying() -> None:
    x = float_cpu(3)
    labels = torch.tensor([1])
    out = to_device((x, labels), torch.device("cpu"), dtype=torch.float32)
    assert out[0] is x and out[1] is labels


def test_to_device_calls_to_on_objects_and_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # cuda:1 must exist
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    rec = Recorder()
    model = torch.nn.Linear(2, 2)
    out = to_device({"rec": rec, "model": [model]}, "meta")
    assert out["rec"].moved_to == META and rec.moved_to is None  # .to ran on a copy
    assert out["model"][0] is model and model.weight.device == META  # modules move in place
    assert to_device(rec, 1).moved_to == torch.device("cuda", 1)  # an int: a CUDA index
    assert to_device(rec, torch.device("cpu")).moved_to == torch.device("cpu")


class InPlaceEncoding(dict):  # type: ignore[type-arg]
    """Hugging Face's BatchEncoding: a mapping whose .to replaces its data in place."""

    def __init__(self, data: dict[str, torch.Tensor]) -> None:
        super().__init__(data)
        self.data = data

    def to(self, device: torch.device) -> InPlaceEncoding:
        self.data = {k: v.to(device) for k, v in self.data.items()}
        return self


def test_to_device_leaves_a_batch_whose_to_moves_in_place_where_it_was() -> None:
    batch = InPlaceEncoding({"input_ids": torch.tensor([1, 2])})
    out = to_device({"enc": batch}, "meta")
    assert out["enc"].data["input_ids"].device == META
    assert batch.data["input_ids"].device == torch.device("cpu")  # the caller's is kept


class DictBatch:
    """A batch class whose .to moves the tensors inside its dict and list in place."""

    def __init__(self) -> None:
        self.tensors = {"x": float_cpu(1)}
        self.masks = [torch.ones(1, dtype=torch.bool)]

    def to(self, device: torch.device) -> DictBatch:
        for key, value in self.tensors.items():
            self.tensors[key] = value.to(device)
        self.masks[:] = [mask.to(device) for mask in self.masks]
        return self


def test_to_device_leaves_the_callers_dicts_and_lists_inside_a_to_object_alone() -> None:
    batch = DictBatch()
    out = to_device(batch, "meta")
    assert out.tensors["x"].device == META and out.masks[0].device == META
    assert batch.tensors["x"].device == torch.device("cpu")  # was moved with the copy
    assert batch.masks[0].device == torch.device("cpu")


class Uncopyable:
    def __copy__(self) -> Uncopyable:
        raise RuntimeError("holds a lock")

    def to(self, device: torch.device) -> None:
        self.moved_to = device


def test_to_device_moves_an_object_that_cannot_be_copied_itself() -> None:
    obj = Uncopyable()
    assert to_device(obj, "meta") is obj and obj.moved_to == META


def test_to_device_moves_tensor_subclasses() -> None:
    param = torch.nn.Parameter(float_cpu(2))
    out = to_device([param], "meta", dtype=torch.float16)
    assert (out[0].device, out[0].dtype) == (META, torch.float16)


@pytest.mark.parametrize("bad", ["gpu", "cuda:x", "", "cpu:0:1"])
def test_to_device_rejects_bad_device_strings(bad: str) -> None:
    with pytest.raises(ValueError, match=f"invalid device {bad!r}.*'cuda:1'"):
        to_device(float_cpu(1), bad)


def test_to_device_rejects_bad_device_values() -> None:
    with pytest.raises(ValueError, match="device index must be >= 0, got -1"):
        to_device(float_cpu(1), -1)
    for bad in (True, 1.5, None):
        with pytest.raises(TypeError, match=r"device must be a str, int or torch.device"):
            to_device(float_cpu(1), bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.complex64, "float16"])
def test_to_device_rejects_non_float_dtype(dtype: Any) -> None:
    with pytest.raises(ValueError, match="floating dtype"):
        to_device(float_cpu(1), "cpu", dtype=dtype)


def test_to_device_names_a_container_it_cannot_rebuild() -> None:
    with pytest.raises(TypeError, match=r"cannot rebuild a StrictTuple.*\.to\(device\)"):
        to_device(StrictTuple(float_cpu(1), 2), "meta")


@pytest.mark.requires_cuda
def test_to_device_pinned_non_blocking_to_cuda_and_back() -> None:
    batch = {"x": torch.randn(1024).pin_memory(), "y": torch.arange(4).pin_memory()}
    out = to_device(batch, "cuda", non_blocking=True, dtype=torch.float16)
    back = to_device(out, "cpu", non_blocking=True)
    torch.cuda.synchronize()  # a non-blocking device-to-host copy is read only after a sync
    assert out["x"].device.type == "cuda" and out["x"].dtype == torch.float16
    assert torch.equal(back["x"], batch["x"].half()) and torch.equal(back["y"], batch["y"])


# ------------------------------------------------------------------- cases from the peers' tests


@pytest.mark.parametrize(
    ("source", "pinned", "target", "expected"),
    [
        ("cpu", True, "cuda", True),  # the one case that overlaps: pinned host to accelerator
        ("cpu", True, "cuda:1", True),
        ("cpu", True, "xpu", True),
        ("cpu", False, "cuda", False),  # pageable memory: the copy is synchronous anyway
        ("cuda", False, "cpu", False),  # device to host: read before it lands otherwise
        ("cuda:0", False, "cuda:1", False),
        ("cpu", True, "cpu", False),  # a CPU target never
        ("cpu", True, "mps", False),  # MPS: a race, as Lightning notes (pytorch#83015)
        ("cpu", True, "meta", False),
    ],
)
def test_non_blocking_only_from_pinned_host_memory_to_an_accelerator(
    source: str, pinned: bool, target: str, expected: bool
) -> None:
    from trainperf.device._move import copies_async

    assert copies_async(torch.device(source), pinned, torch.device(target)) is expected


class _ToRecorder:
    """Stands in for Tensor.to: records the keyword arguments and moves nothing."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __call__(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.calls.append(kwargs)
        return tensor


def _nested() -> Any:
    return {
        "x": float_cpu(2),
        "list": [float_cpu(1), torch.tensor([1])],
        "tuple": (float_cpu(1),),
        "param": [torch.nn.Parameter(float_cpu(1))],  # a subclass: the slow path
        "pair": Pair(float_cpu(1), 3),
    }


@pytest.mark.parametrize("pinned", [False, True])
@pytest.mark.parametrize("dtype", [None, torch.float16])
def test_to_device_never_asks_a_host_target_for_a_non_blocking_copy(
    monkeypatch: pytest.MonkeyPatch, pinned: bool, dtype: torch.dtype | None
) -> None:
    recorder = _ToRecorder()
    monkeypatch.setattr(torch.Tensor, "to", recorder)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: pinned)
    for target in ("cpu", "meta"):
        to_device(_nested(), target, non_blocking=True, dtype=dtype)
    assert len(recorder.calls) == 2 * 6
    assert not [kw for kw in recorder.calls if kw.get("non_blocking")]


def test_to_device_copies_async_only_what_is_pinned(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # "cuda" must resolve
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    recorder = _ToRecorder()
    monkeypatch.setattr(torch.Tensor, "to", recorder)
    pinned = _nested()
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: self is pinned["x"])
    to_device(pinned, "cuda", non_blocking=True)
    assert [kw.get("non_blocking", False) for kw in recorder.calls] == [True] + [False] * 5
    recorder.calls.clear()
    to_device(pinned, "cuda", non_blocking=False)
    assert not [kw for kw in recorder.calls if kw.get("non_blocking")]


class _Forgetful:
    """Lightning's wrongly implemented transferable type: .to forgets to return self."""

    def __init__(self, tensor: torch.Tensor, should_return: bool) -> None:
        self.tensor = tensor
        self.should_return = should_return

    def to(self, device: torch.device) -> _Forgetful | None:
        self.tensor = self.tensor.to(device)
        return self if self.should_return else None


@pytest.mark.parametrize("should_return", [False, True])
def test_to_device_keeps_an_object_whose_to_returns_none(should_return: bool) -> None:
    obj = _Forgetful(float_cpu(1), should_return)
    out = to_device(obj, "meta")
    assert isinstance(out, _Forgetful) and out.tensor.device == META
    assert obj.tensor.device == torch.device("cpu")  # the copy moved, not the caller's
    nested = to_device({"o": [obj]}, torch.device("meta"))["o"][0]
    assert isinstance(nested, _Forgetful) and nested.tensor.device == META


class AttributeStore(MutableMapping):  # type: ignore[type-arg]
    """A mapping that keeps its items in an attribute, as many batch classes do."""

    def __init__(self, items: dict[str, Any] | None = None, tag: str = "") -> None:
        self._store: dict[str, Any] = dict(items or {})
        self.tag = tag

    def __getitem__(self, key: str) -> Any:
        return self._store[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self._store[key] = value

    def __delitem__(self, key: str) -> None:
        del self._store[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._store)

    def __len__(self) -> int:
        return len(self._store)


class SlotStore(AttributeStore):
    """The same, but the store is a slot that no attribute copy can see."""

    __slots__ = ("_store",)

    def __init__(self, items: dict[str, Any] | None = None) -> None:
        self._store = dict(items or {})


def test_to_device_leaves_the_callers_mapping_as_it_was() -> None:
    x, ids = float_cpu(2), "id-7"
    for batch in (
        AttributeStore({"x": x, "ids": ids}, tag="train"),
        SlotStore({"x": x, "ids": ids}),
        collections.UserDict({"x": x, "ids": ids}),  # Accelerate's test_send_to_device case
    ):
        out = to_device(batch, "meta")
        assert type(out) is type(batch) and out is not batch
        assert out["x"].device == META and out["ids"] == ids
        assert batch["x"] is x, type(batch).__name__  # the caller's batch did not change
    kept = to_device(AttributeStore({"x": x}, tag="train"), "meta")
    assert kept.tag == "train"  # state outside the items survives the copy


@dataclasses.dataclass
class CachedBatch:
    var: torch.Tensor

    @functools.cached_property
    def doubled(self) -> torch.Tensor:
        return self.var * 2


class Doubling:
    """A base class whose cached property the dataclass below inherits."""

    var: torch.Tensor

    @functools.cached_property
    def doubled(self) -> torch.Tensor:
        return self.var * 2


@dataclasses.dataclass(frozen=True)
class FrozenCachedBatch(Doubling):
    var: torch.Tensor


class CachedDict(dict):  # type: ignore[type-arg]
    @functools.cached_property
    def total(self) -> torch.Tensor:
        return sum(self.values())  # type: ignore[return-value]


def test_to_device_drops_cached_property_values() -> None:
    # Lightning's test_apply_to_collection_with_cached_property_dataclass, moved to a device.
    for cls in (CachedBatch, FrozenCachedBatch):
        before = cls(float_cpu(1))
        assert before.doubled.device.type == "cpu"  # computed and cached on the CPU
        after = to_device(before, "meta")
        assert after.var.device == META and after.doubled.device == META, cls.__name__
        assert before.doubled.device.type == "cpu"  # the original keeps its own
    mapping = CachedDict(a=float_cpu(1))
    assert mapping.total.device.type == "cpu"
    assert to_device(mapping, "meta").total.device == META


def test_to_device_skip_keys_leaves_those_entries_as_they_are() -> None:
    # Accelerate's send_to_device(..., skip_keys=...): the key is skipped in every mapping.
    kept = float_cpu(2)
    batch = {"x": float_cpu(2), "keep": kept, "inner": {"keep": [kept], "y": float_cpu(1)}}
    out = to_device(batch, "meta", skip_keys="keep")
    assert out["x"].device == META and out["inner"]["y"].device == META
    assert out["keep"] is kept and out["inner"]["keep"][0] is kept
    ordered = collections.OrderedDict(keep=kept, z=float_cpu(1))
    store = AttributeStore({"keep": kept, "z": float_cpu(1)})
    for mapping in to_device([ordered, store], "meta", skip_keys=["keep", "absent"]):
        assert mapping["keep"] is kept and mapping["z"].device == META
    assert to_device(batch, "meta", skip_keys=())["keep"].device == META


@pytest.mark.parametrize("bad", [3, [["keep"]], b"keep"])
def test_to_device_rejects_bad_skip_keys(bad: Any) -> None:
    expected = r"skip_keys must be a str or an iterable of hashable keys, such as \['labels'\], got"
    with pytest.raises(TypeError, match=expected):
        to_device(float_cpu(1), "meta", skip_keys=bad)


# --------------------------------------------------------------------- what the batch shares


def test_to_device_keeps_a_tensor_that_appears_twice_one_tensor() -> None:
    weight = float_cpu(4)
    for device, dtype in (("meta", None), ("cpu", torch.float16)):
        tied = to_device(
            {"enc": weight, "dec": weight, "both": [weight, (weight,)]}, device, dtype=dtype
        )
        assert tied["enc"] is tied["dec"] is tied["both"][0] is tied["both"][1][0]
    param = torch.nn.Parameter(float_cpu(2))  # the slow path shares too
    out = to_device([param, {"p": param}], "meta")
    assert out[0] is out[1]["p"]
    half = to_device((weight, weight), "cpu", dtype=torch.float16)
    half[0][0] = 100  # one tensor: a write through one name shows through the other
    assert half[1][0].item() == 100


def test_to_device_keeps_a_shared_container_shared() -> None:
    inner = [float_cpu(1)]
    pair = (float_cpu(1), 1)
    mapping = {"x": float_cpu(1)}
    out = to_device(
        {"p": inner, "q": inner, "t1": pair, "t2": pair, "m": [mapping, mapping]}, "meta"
    )
    assert out["p"] is out["q"] and out["t1"] is out["t2"] and out["m"][0] is out["m"][1]
    out["p"].append("new")  # one list, as in the input
    assert out["q"][-1] == "new"


def test_to_device_moves_a_container_that_holds_itself() -> None:
    looped: list[Any] = [float_cpu(1)]
    looped.append(looped)
    out = to_device(looped, "meta")
    assert out[0].device == META and out[1] is out
    mapping: dict[str, Any] = {"x": float_cpu(1)}
    mapping["self"] = mapping
    mapping["via_tuple"] = (mapping,)
    moved = to_device(mapping, "meta", dtype=torch.float16)
    assert moved["self"] is moved and moved["via_tuple"][0] is moved
    assert moved["x"].device == META and looped[1] is looped  # the input is as it was


def test_to_device_moves_a_view_as_a_tensor_of_its_own() -> None:
    # Documented: Tensor.to copies a view alone, so it no longer shares its base's memory.
    base = torch.arange(4.0)
    out = to_device({"base": base, "view": base[:2]}, "cpu", dtype=torch.float16)
    out["base"][0] = 100
    assert out["view"][0].item() == 0


# --------------------------------------------------------------------------- channels_last


def test_to_device_channels_last_moves_and_converts_4d_float_tensors_in_one_walk() -> None:
    from trainperf.device._move import to_device_channels_last

    image = torch.randn(2, 3, 4, 4)
    weight = torch.nn.Parameter(torch.randn(4, 3, 2, 2))
    batch = TaggedList([image, weight, torch.ones(2, 3, 4, 4, dtype=torch.int64), image])
    out = to_device_channels_last(batch, "meta")
    cl = torch.channels_last
    assert type(out) is TaggedList and all(t.device == META for t in out)
    assert out[0].is_contiguous(memory_format=cl) and out[3] is out[0]
    assert isinstance(out[1], torch.nn.Parameter) and out[1].is_contiguous(memory_format=cl)
    assert out[2].is_contiguous()  # integer tensors keep their layout
    # to_device itself keeps every layout.
    assert to_device(image.contiguous(memory_format=cl), "meta").is_contiguous(memory_format=cl)
    assert to_device(image, "meta").is_contiguous()
