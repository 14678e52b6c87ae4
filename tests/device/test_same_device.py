"""trainperf.device._same_device: check_same_device over a model and nested inputs."""

from __future__ import annotations

import collections
import dataclasses
import types
from typing import Any, NamedTuple

import pytest
import torch

from trainperf.device import check_same_device, to_device
from trainperf.errors import DeviceMismatchError

META = torch.device("meta")


class Pair(NamedTuple):
    x: torch.Tensor
    label: int


@dataclasses.dataclass
class Batch:
    images: torch.Tensor
    ids: list[str]


def test_check_same_device_returns_the_common_device() -> None:
    model = torch.nn.BatchNorm1d(2)  # parameters and buffers
    assert check_same_device(model, torch.ones(3, 2), extra=[{"m": torch.ones(1)}]) == torch.device(
        "cpu"
    )
    assert check_same_device(None, torch.ones(1, device="meta")) == META


def test_check_same_device_names_parameters_and_inputs_per_device() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2)).to("meta")
    batch = {"ids": [torch.ones(1), torch.ones(1, device="meta")]}
    with pytest.raises(DeviceMismatchError, match="on 2 devices") as info:
        check_same_device(model, Pair(torch.ones(1), 0), x=batch)
    message = str(info.value)
    meta_line = next(line for line in message.splitlines() if line.strip().startswith("meta:"))
    cpu_line = next(line for line in message.splitlines() if line.strip().startswith("cpu:"))
    assert "parameter 0.weight" in meta_line and "parameter 0.bias" in meta_line
    assert "more" in meta_line  # 4 parameters, 3 buffers, 1 input: only a few are listed
    assert cpu_line.strip() == "cpu: input arg0.x, input x['ids'][0]"
    assert "model.to('meta')" in message


def test_check_same_device_inputs_only_and_dataclasses() -> None:
    item = Batch(torch.ones(1, device="meta"), ["a"])
    with pytest.raises(
        DeviceMismatchError, match=r"cpu: input arg0\[1\]\n  meta: input item\.images"
    ):
        check_same_device(None, ["no tensor", torch.ones(1)], item=item)


@dataclasses.dataclass
class MovableBatch:
    """A user batch dataclass with its own .to, as training code often has."""

    images: torch.Tensor
    labels: torch.Tensor

    def to(self, device: torch.device) -> MovableBatch:
        return MovableBatch(self.images.to(device), self.labels.to(device))


class Encoding(collections.UserDict):  # type: ignore[type-arg]
    """A Mapping with .to, like Hugging Face's BatchEncoding."""

    def to(self, device: torch.device) -> Encoding:
        return Encoding({k: v.to(device) for k, v in self.items()})


class Holder:
    """Neither a mapping nor a dataclass: tensors kept as attributes, and a cycle."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x
        self.me = self

    def to(self, device: torch.device) -> Holder:
        return Holder(self.x.to(device))


def test_check_same_device_looks_inside_objects_with_their_own_to() -> None:
    batch = MovableBatch(torch.ones(2, device="meta"), torch.ones(2))
    with pytest.raises(
        DeviceMismatchError, match=r"meta: input batch\.images\n  cpu: input batch\.labels"
    ):
        check_same_device(None, batch=batch)
    encoding = Encoding(input_ids=torch.ones(1), mask=torch.ones(1, device="meta"))
    with pytest.raises(DeviceMismatchError, match=r"meta: input enc\['mask'\]"):
        check_same_device(torch.nn.Linear(1, 1), enc=encoding)
    with pytest.raises(DeviceMismatchError, match=r"meta: input h\.x\n"):
        check_same_device(torch.nn.Linear(1, 1), h=Holder(torch.ones(1, device="meta")))
    assert check_same_device(None, batch.to(torch.device("meta"))) == META


class SlottedPair(tuple):  # type: ignore[type-arg]
    """A tuple with .to and no __dict__ nor _fields: only its positions can be walked."""

    __slots__ = ()

    def to(self, device: torch.device) -> SlottedPair:
        return SlottedPair(t.to(device) for t in self)


def test_check_same_device_looks_inside_a_packed_sequence_by_field() -> None:
    from torch.nn.utils.rnn import pack_padded_sequence

    model = torch.nn.LSTM(3, 4).to("meta")
    packed = pack_padded_sequence(torch.randn(5, 2, 3), torch.tensor([5, 3]))
    with pytest.raises(DeviceMismatchError, match=r"cpu: input arg0\.data\n"):
        check_same_device(model, packed)
    # batch_sizes stays on the CPU (the RNNs want it there): not a mismatch.
    assert check_same_device(model, to_device(packed, "meta")) == META


class LengthsBatch(NamedTuple):
    """A batch whose own .to keeps the lengths on the CPU, where pack_padded_sequence wants them."""

    x: torch.Tensor
    lengths: torch.Tensor

    def to(self, device: torch.device | str) -> LengthsBatch:
        return LengthsBatch(self.x.to(device), self.lengths)


def test_check_same_device_leaves_a_namedtuples_own_to_to_place_its_fields() -> None:
    model = torch.nn.LSTM(3, 4).to("meta")
    batch = LengthsBatch(torch.randn(5, 2, 3), torch.tensor([5, 3])).to("meta")
    assert batch.lengths.device.type == "cpu"
    assert check_same_device(model, batch) == META


def test_check_same_device_walks_a_slotted_tuple_with_to_by_position() -> None:
    pair = SlottedPair((torch.ones(1), torch.ones(1, device="meta")))
    with pytest.raises(DeviceMismatchError, match=r"cpu: input p\[0\]\n  meta: input p\[1\]"):
        check_same_device(None, p=pair)


def test_check_same_device_needs_a_tensor() -> None:
    with pytest.raises(ValueError, match="found no tensors"):
        check_same_device(torch.nn.ReLU(), "text", n=3)


@pytest.mark.parametrize("first", [torch.ones(2), {"x": torch.ones(2)}, [torch.ones(2)]])
def test_check_same_device_names_the_fix_for_inputs_passed_as_the_model(first: object) -> None:
    # check_same_device(x, y) and check_same_device(batch) are easy slips; an AttributeError
    # about named_parameters would not say that the first argument is the model.
    with pytest.raises(
        TypeError, match=r"module must be an nn\.Module or None.*check_same_device\(None"
    ):
        check_same_device(first, torch.ones(2))  # type: ignore[arg-type]


def test_check_same_device_takes_an_input_named_like_its_parameters() -> None:
    # Before: module=... and tensors=... clashed with the parameters' names ("got multiple
    # values for argument 'module'"); an input may be called anything.
    model = torch.nn.Linear(2, 2).to("meta")
    on_meta = torch.ones(1, device="meta")
    assert check_same_device(model, module=on_meta, tensors=on_meta) == META
    with pytest.raises(DeviceMismatchError, match=r"input module\.weight"):
        check_same_device(model, module=torch.nn.Linear(1, 1))
    with pytest.raises(DeviceMismatchError, match=r"input named_tensors"):
        check_same_device(None, on_meta, named_tensors=torch.ones(1, 1))


# ------------------------------------------------------------------- containers to_device walks


@dataclasses.dataclass
class MaskedBatch:
    x: torch.Tensor
    later: torch.Tensor = dataclasses.field(init=False)  # set by a later collate step

    def __post_init__(self) -> None:
        self.mask = torch.ones(1, device="meta")  # not a field: an attribute all the same


@pytest.mark.parametrize(
    "holder",
    [
        lambda m: collections.deque([m]),
        lambda m: collections.UserList([m]),
        lambda m: types.SimpleNamespace(m=m),
    ],
    ids=["deque", "UserList", "SimpleNamespace"],
)
def test_check_same_device_looks_inside_deques_user_lists_and_namespaces(holder: object) -> None:
    hidden = holder(torch.ones(1, device="meta"))  # type: ignore[operator]
    with pytest.raises(DeviceMismatchError, match=r"cpu: input arg0\n  meta: input arg1"):
        check_same_device(None, torch.ones(1), hidden)


def test_check_same_device_sees_a_dataclass_attribute_that_is_no_field() -> None:
    batch = MaskedBatch(torch.ones(1))  # `later` unset: skipped, not an AttributeError
    with pytest.raises(DeviceMismatchError, match=r"cpu: input b\.x\n  meta: input b\.mask"):
        check_same_device(None, b=batch)


def test_check_same_device_stops_at_reference_cycles() -> None:
    looped: list[object] = [torch.ones(1)]
    looped.append(looped)
    mapping: dict[str, object] = {"x": torch.ones(1, device="meta")}
    mapping["self"] = mapping
    assert check_same_device(None, looped) == torch.device("cpu")
    with pytest.raises(DeviceMismatchError, match=r"cpu: input arg0\[0\]\n  meta: input m\['x'\]"):
        check_same_device(None, looped, m=mapping)


def test_check_same_device_lets_a_cpu_scalar_go_with_any_device() -> None:
    # PyTorch moves a 0-dim CPU tensor to the other operand's device: model(x) / temperature.
    model = torch.nn.Linear(4, 2).to("meta")
    temperature = torch.tensor(0.5)
    assert check_same_device(model, torch.ones(3, 4, device="meta"), t=temperature) == META
    assert check_same_device(None, temperature, step=torch.tensor(3)) == torch.device("cpu")
    with pytest.raises(DeviceMismatchError) as info:  # a CPU tensor of one element is not one
        check_same_device(model, torch.ones(1), t=temperature)
    cpu_line = next(line for line in str(info.value).splitlines() if "cpu:" in line)
    assert cpu_line.strip() == "cpu: input arg0, input t"


def _data_parallel(model: torch.nn.Module, device_ids: list[int], source: str) -> Any:
    """An nn.DataParallel as built on a GPU host (on this CPU one it gets no devices)."""
    wrapped = torch.nn.DataParallel(model)
    wrapped.device_ids = device_ids
    wrapped.src_device_obj = torch.device(source)
    return wrapped


def test_check_same_device_wants_a_data_parallel_module_on_device_ids_0() -> None:
    # Both on one device, but DataParallel(device_ids=[1, 0]) wants the module on cuda:1.
    wrapped = _data_parallel(torch.nn.Linear(2, 2), [1, 0], "cuda:1")
    with pytest.raises(DeviceMismatchError, match=r"device_ids\[0\], cuda:1") as info:
        check_same_device(wrapped, torch.ones(3, 2))
    message = str(info.value)
    assert "cpu: parameter module.weight, parameter module.bias" in message
    assert "model.to('cuda:1')" in message


def test_check_same_device_lets_data_parallel_scatter_inputs_from_anywhere() -> None:
    wrapped = _data_parallel(torch.nn.Linear(2, 2).to("meta"), [0], "meta")
    assert check_same_device(wrapped, torch.ones(3, 2), x={"a": torch.ones(1)}) == META


def test_check_same_device_fix_names_no_model_where_there_is_none() -> None:
    with pytest.raises(DeviceMismatchError) as info:
        check_same_device(None, torch.ones(1), torch.ones(1, device="meta"))
    assert "Fix: move them to one device, e.g. batch = trainperf.to_device(batch, 'cpu')." in str(
        info.value
    )
    assert "model.to" not in str(info.value)


@pytest.fixture
def fake_group() -> Any:
    """A process group of two ranks in this one process (DistributedDataParallel needs one)."""
    dist = pytest.importorskip("torch.distributed")
    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    dist.init_process_group("fake", rank=0, world_size=2, store=fake_pg.FakeStore())
    yield
    dist.destroy_process_group()


def _ddp(model: torch.nn.Module, device_ids: list[int] | None, device_type: str) -> Any:
    """A DistributedDataParallel as built on a GPU host (on this CPU one it gets no
    device_ids: it keeps them only for a module on one GPU)."""
    wrapped = torch.nn.parallel.DistributedDataParallel(model)
    wrapped.device_ids = device_ids
    wrapped.device_type = device_type
    return wrapped


def test_check_same_device_lets_ddp_with_device_ids_move_inputs(fake_group: None) -> None:
    # Before: DistributedDataParallel(device_ids=[i]) moves its inputs to cuda:i in forward,
    # yet a CPU batch was reported as a mismatch.
    wrapped = _ddp(torch.nn.Linear(2, 2), [0], "cpu")
    got = check_same_device(wrapped, torch.ones(3, 2, device="meta"), x={"a": torch.ones(1)})
    assert got == torch.device("cpu", 0)


def test_check_same_device_sees_through_torch_compile(fake_group: None) -> None:
    # torch.compile(model) wraps the DDP or DataParallel model, whose forward still moves the
    # inputs: a CPU batch was reported as a mismatch.
    ddp = torch.compile(_ddp(torch.nn.Linear(2, 2), [0], "cpu"))
    assert check_same_device(ddp, torch.ones(3, 2, device="meta")) == torch.device("cpu", 0)
    dp = torch.compile(_data_parallel(torch.nn.Linear(2, 2), [1, 0], "cuda:1"))
    with pytest.raises(DeviceMismatchError, match=r"DataParallel\(device_ids=\[1, 0\]\)"):
        check_same_device(dp, torch.ones(3, 2))


def test_check_same_device_wants_a_ddp_module_on_device_ids_0(fake_group: None) -> None:
    wrapped = _ddp(torch.nn.Linear(2, 2), [1], "cuda")
    with pytest.raises(DeviceMismatchError, match=r"device_ids\[0\], cuda:1") as info:
        check_same_device(wrapped, torch.ones(3, 2))
    assert "DistributedDataParallel(device_ids=[1]) needs" in str(info.value)
    assert "cpu: parameter module.weight, parameter module.bias" in str(info.value)


def test_check_same_device_checks_the_inputs_of_ddp_without_device_ids(fake_group: None) -> None:
    # Without device_ids (a CPU or multi-device module) DDP moves nothing.
    wrapped = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
    assert wrapped.device_ids is None
    assert check_same_device(wrapped, torch.ones(3, 2)) == torch.device("cpu")
    with pytest.raises(DeviceMismatchError, match="input arg0"):
        check_same_device(wrapped, torch.ones(3, 2, device="meta"))


@dataclasses.dataclass
class _Held:
    x: torch.Tensor


class _OwnTo:
    def __init__(self, x: torch.Tensor) -> None:
        self.x = x

    def to(self, device: object) -> _OwnTo:
        return _OwnTo(self.x.to(device))  # type: ignore[call-overload]


UNMOVED_HOLDERS = {  # DDP and DataParallel move tensors only through tuples, lists and dicts
    "dataclass": _Held,
    "namespace": lambda x: types.SimpleNamespace(x=x),
    "user_dict": lambda x: collections.UserDict(x=x),  # a Hugging Face BatchEncoding's base
    "own_to": _OwnTo,
    "inside_moved_containers": lambda x: [{"a": (_Held(x),)}],
}


@pytest.mark.parametrize("make", UNMOVED_HOLDERS.values(), ids=UNMOVED_HOLDERS.keys())
def test_check_same_device_checks_inputs_ddp_does_not_move(fake_group: None, make: Any) -> None:
    # Before: every input of a DDP with device_ids went unchecked, yet its forward hands a
    # dataclass, SimpleNamespace, UserDict or object with its own .to to the module unmoved.
    wrapped = _ddp(torch.nn.Linear(2, 2), [0], "cpu")
    with pytest.raises(DeviceMismatchError, match=r"meta: input arg0") as info:
        check_same_device(wrapped, make(torch.ones(1, 2, device="meta")))
    assert "trainperf.to_device(batch, 'cpu:0')" in str(info.value)
    assert "model.to" not in str(info.value)
    assert check_same_device(wrapped, make(torch.ones(1, 2))) == torch.device("cpu", 0)


def test_check_same_device_checks_inputs_data_parallel_does_not_move() -> None:
    wrapped = _data_parallel(torch.nn.Linear(2, 2).to("meta"), [0], "meta")
    with pytest.raises(DeviceMismatchError, match=r"cpu: input batch\.x"):
        check_same_device(wrapped, batch=_Held(torch.ones(3, 2)))
    # Tensors reached through tuples, lists, dicts (subclasses too) and PackedSequence move.
    packed = torch.nn.utils.rnn.pack_sequence([torch.ones(2, 2), torch.ones(1, 2)])
    moved = (Pair(torch.ones(1), 0), [collections.OrderedDict(p=packed)], {"t": torch.ones(2)})
    assert check_same_device(wrapped, *moved, scalar=_Held(torch.tensor(0.5))) == META


def test_check_same_device_needs_a_tensor_under_data_parallel() -> None:
    # Before: a DataParallel wrapping a module without parameters, given no tensor input,
    # returned device_ids[0] instead of the documented ValueError. (DDP refuses such a
    # module when it is built.)
    wrapped = _data_parallel(torch.nn.ReLU(), [0], "meta")
    with pytest.raises(ValueError, match="found no tensors"):
        check_same_device(wrapped, [{"ids": [1, 2]}])
    assert check_same_device(wrapped, [torch.ones(1)]) == META
