"""trainperf.checkpoint._prefix: strip_prefix, unwrap_model and load_state_dict for DataParallel,
DDP and torch.compile prefixes."""

from __future__ import annotations

import collections

import pytest
import torch
from torch import nn

from tests.checkpoint._common import FIXTURES, GPU_FILES, Net, assert_same
from trainperf.checkpoint import (
    LoadResult,
    load_checkpoint,
    load_state_dict,
    strip_prefix,
    unwrap_model,
)
from trainperf.errors import StateDictMismatchError

# -------------------------------------------------------------------- strip_prefix


def test_strip_prefix_any_combination_and_order() -> None:
    sd = {
        "module._orig_mod.a": 1,
        "_orig_mod.module.b": 2,
        "module.module.c": 3,
        "d": 4,
        "modules.e": 5,
    }
    out = strip_prefix(sd)
    assert out == {"a": 1, "b": 2, "c": 3, "d": 4, "modules.e": 5}
    assert list(sd) == [
        "module._orig_mod.a",
        "_orig_mod.module.b",
        "module.module.c",
        "d",
        "modules.e",
    ]
    assert strip_prefix({"backbone.x": 1}, "backbone.") == {"x": 1}
    assert strip_prefix({"module.": 1}) == {"module.": 1}  # nothing would be left
    assert strip_prefix({"module": 1, "_orig_mod": 2}) == {"module": 1, "_orig_mod": 2}


def test_strip_prefix_keeps_type_and_metadata() -> None:
    sd = load_checkpoint(FIXTURES / "cuda_ddp_state_dict.pt")
    out = strip_prefix(sd)
    assert type(out) is collections.OrderedDict
    assert list(out) == list(Net().state_dict())
    assert dict(out._metadata) == {
        "": {"version": 1},
        "conv": {"version": 1},
        "bn": {"version": 2},
        "fc": {"version": 1},
    }
    assert "module" in sd._metadata  # the input is untouched


def test_strip_prefix_collision() -> None:
    with pytest.raises(ValueError, match=r"'fc.w' and 'module.fc.w' both become 'fc.w'"):
        strip_prefix({"fc.w": 1, "module.fc.w": 2})


@pytest.mark.parametrize("prefixes", [("",), (), ("module.", "")])
def test_strip_prefix_rejects_empty_prefixes(prefixes: tuple[str, ...]) -> None:
    with pytest.raises(ValueError, match="prefixes must be non-empty strings"):
        strip_prefix({"a": 1}, prefixes)


# ------------------------------------------------------------------ load_state_dict


def wrappings(net: nn.Module) -> dict[str, nn.Module]:
    return {
        "plain": net,
        "dataparallel": nn.DataParallel(net),
        "compiled": torch.compile(net),
        "compiled-dataparallel": torch.compile(nn.DataParallel(net)),
        "dataparallel-compiled": nn.DataParallel(torch.compile(net)),
    }


@pytest.mark.parametrize("name", GPU_FILES)
@pytest.mark.parametrize(
    "wrap", ["plain", "dataparallel", "compiled", "compiled-dataparallel", "dataparallel-compiled"]
)
def test_fixtures_load_into_any_wrapping(name: str, wrap: str) -> None:
    sd = load_checkpoint(FIXTURES / name)
    net = Net()
    model = wrappings(net)[wrap]
    result = load_state_dict(model, sd)
    assert result == LoadResult() and result.complete
    assert_same(net.state_dict(), strip_prefix(sd))
    assert unwrap_model(model) is net


def test_unwrap_model() -> None:
    net = Net()
    for wrapped in wrappings(net).values():
        assert unwrap_model(wrapped) is net
    with pytest.raises(TypeError, match=r"unwrap_model expects an nn\.Module, got dict"):
        unwrap_model({})  # type: ignore[arg-type]


def test_submodule_really_named_module_is_not_overstripped() -> None:
    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.module = nn.Linear(2, 2)

    src = Holder()
    for sd in (src.state_dict(), nn.DataParallel(src).state_dict()):
        dst = Holder()
        assert load_state_dict(dst, sd).complete
        assert torch.equal(dst.module.weight.cpu(), src.module.weight.cpu())


def test_mismatch_reports_missing_unexpected_and_shapes_together() -> None:
    sd = strip_prefix(load_checkpoint(FIXTURES / "cuda_ddp_state_dict.pt"))
    sd["extra.weight"] = torch.ones(1)
    del sd["bn.running_var"]
    model = nn.DataParallel(Net(classes=5))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(StateDictMismatchError) as info:
        load_state_dict(model, sd)
    err = info.value
    assert err.missing == ["bn.running_var"]
    assert err.unexpected == ["extra.weight"]
    assert err.mismatched == [("fc.weight", (10, 8), (5, 8)), ("fc.bias", (10,), (5,))]
    text = str(err)
    assert "does not fit Net" in text
    assert "1 missing key(s) (in the model, not the state dict): bn.running_var" in text
    assert "1 unexpected key(s) (in the state dict, not the model): extra.weight" in text
    assert "2 shape mismatch(es): fc.weight checkpoint (10, 8) vs model (5, 8)" in text
    assert "strict=False" in text
    assert_same(model.state_dict(), before)  # nothing was loaded


def test_mismatch_lists_at_most_ten_names() -> None:
    model = nn.Sequential(*[nn.Linear(1, 1) for _ in range(12)])
    with pytest.raises(StateDictMismatchError, match=r"24 missing key\(s\).*\.\.\.and 14 more"):
        load_state_dict(model, {})


def test_whole_checkpoint_passed_as_state_dict_gets_a_hint() -> None:
    ckpt = {"model": Net().state_dict(), "epoch": 1}
    with pytest.raises(StateDictMismatchError, match=r"looks like a whole checkpoint.*\['model'\]"):
        load_state_dict(Net(), ckpt)


def test_strict_false_loads_what_fits() -> None:
    src = load_checkpoint(FIXTURES / "cuda_compiled_state_dict.pt")
    src["extra.weight"] = torch.ones(1)
    del src["_orig_mod.bn.running_var"]
    net = Net(classes=5)
    fc_before = net.fc.weight.clone()
    result = load_state_dict(torch.compile(net), src, strict=False)
    assert result == LoadResult(
        missing=("bn.running_var",),
        unexpected=("extra.weight",),
        mismatched=(("fc.weight", (10, 8), (5, 8)), ("fc.bias", (10,), (5,))),
    )
    assert not result.complete
    assert torch.equal(net.conv.weight, src["_orig_mod.conv.weight"])
    assert torch.equal(net.fc.weight, fc_before)
    with pytest.raises(AttributeError):
        result.missing = ()  # type: ignore[misc]


def test_load_state_dict_needs_a_mapping() -> None:
    with pytest.raises(TypeError, match=r"state_dict must be a mapping.*got list"):
        load_state_dict(Net(), [1, 2])  # type: ignore[arg-type]
