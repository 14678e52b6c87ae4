"""trainperf.checkpoint._prefix: strip_prefix, unwrap_model and load_state_dict for DataParallel,
DDP and torch.compile prefixes."""

from __future__ import annotations

import collections
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.checkpoint._common import FIXTURES, GPU_FILES, Net, assert_same
from trainperf.checkpoint import (
    LoadResult,
    load_checkpoint,
    load_state_dict,
    save_checkpoint,
    strip_prefix,
    unwrap_model,
)
from trainperf.checkpoint._prefix import check_state_dict
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
    with pytest.raises(StateDictMismatchError, match=r"23 missing key\(s\).*\.\.\.and 13 more"):
        load_state_dict(model, {"0.weight": torch.ones(1, 1)})


def test_whole_checkpoint_passed_as_state_dict_loads_its_model_entry() -> None:
    # Until issue 14.7 this was an error with a hint; now the entry that fits is found.
    ckpt = {"model": Net().state_dict(), "epoch": 1}
    assert load_state_dict(Net(), ckpt).source == "checkpoint['model']"


def test_strict_false_loads_what_fits() -> None:
    src = load_checkpoint(FIXTURES / "cuda_compiled_state_dict.pt")
    src["extra.weight"] = torch.ones(1)
    del src["_orig_mod.bn.running_var"]
    net = Net(classes=5)
    fc_before = net.fc.weight.clone()
    with pytest.warns(UserWarning, match=r"loaded 6 of 9 model keys: 1 missing"):
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


def test_check_state_dict_raises_what_the_load_would_and_changes_nothing() -> None:
    model = nn.Linear(2, 2)
    before = model.weight.detach().clone()
    with pytest.raises(StateDictMismatchError, match=r"none of the state dict's 2 keys"):
        check_state_dict(model, nn.Linear(3, 3).state_dict())
    with pytest.raises(TypeError, match=r"state_dict must be a mapping"):
        check_state_dict(model, 3)
    check_state_dict(model, nn.DataParallel(nn.Linear(2, 2)).state_dict())  # it fits
    assert torch.equal(model.weight, before)


def test_load_state_dict_needs_a_mapping() -> None:
    with pytest.raises(TypeError, match=r"state_dict must be a mapping.*got list"):
        load_state_dict(Net(), [1, 2])  # type: ignore[arg-type]


# --------------------------------------------------------- nothing fits / partial loads


def lightning_like(net: nn.Module) -> dict[str, torch.Tensor]:
    """A LightningModule's state dict: the model is an attribute, so keys start with ``model.``."""
    return {f"model.{k}": v for k, v in net.state_dict().items()}


@pytest.mark.parametrize("strict", [True, False])
def test_nothing_matched_raises_whatever_strict_says(strict: bool) -> None:
    net = Net()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    with pytest.raises(StateDictMismatchError, match=r"none of the state dict's 9 keys") as info:
        load_state_dict(net, lightning_like(Net()), strict=strict)
    text = str(info.value)
    assert "nothing would be loaded" in text
    assert ("an error even with strict=False" in text) == (not strict)
    assert "model keys: conv.weight, conv.bias, bn.weight, ...and 6 more" in text
    assert "state-dict keys: model.conv.weight, model.conv.bias, model.bn.weight, ..." in text
    assert "{k[6:]: v for k, v in state_dict.items() if k.startswith('model.')}" in text
    assert "pass strict=False" not in text  # the advice that loaded nothing
    assert len(info.value.missing) == 9 and len(info.value.unexpected) == 9
    assert_same(net.state_dict(), before)


class _NetInModel(nn.Module):
    """A network with a submodule of its own called ``model`` (as in many timm / HF nets)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
        self.head = nn.Linear(4, 2)


def test_the_suggested_fix_for_an_extra_prefix_loads() -> None:
    # A LightningModule whose network is self.model, with a loss holding a weight of its own:
    # keys model.model.0.weight, model.head.weight, loss.weight.
    lit = nn.Module()
    lit.model = _NetInModel()
    lit.loss = nn.CrossEntropyLoss(weight=torch.ones(2))
    state_dict = lit.state_dict()
    model = _NetInModel()
    with pytest.raises(StateDictMismatchError, match=r"prefix 'model\.' is removed") as info:
        load_state_dict(model, state_dict)
    call = str(info.value).split("e.g. a LightningModule): ")[1].splitlines()[0]
    result = eval(
        call,
        {"load_state_dict": load_state_dict, "strip_prefix": strip_prefix},
        {"model": model, "state_dict": state_dict},
    )
    assert result.complete
    assert_same(model.state_dict(), lit.model.state_dict())


@pytest.mark.parametrize(
    ("make_model", "state_dict", "fix"),
    [
        (Net, {}, r"the state dict is empty"),
        (Net, {"model": {"head.w": torch.ones(1)}, "epoch": 1}, r"whole checkpoint.*no dict"),
        (Net, Net().fc.state_dict(), r"submodule 'fc'.*model\.get_submodule\('fc'\)"),
        (Net, {"head.w": torch.ones(1)}, r"saved from another architecture"),
        (
            lambda: nn.Linear(8, 5),
            nn.Linear(8, 10).state_dict(),
            r"2 keys match by name, but every one has another shape: weight checkpoint",
        ),
    ],
    ids=["empty", "whole-checkpoint", "submodule", "other-model", "all-shapes-differ"],
)
def test_nothing_matched_names_the_likely_fix(
    make_model: Any, state_dict: dict[str, Any], fix: str
) -> None:
    with pytest.raises(StateDictMismatchError, match=fix):
        load_state_dict(make_model(), state_dict, strict=False)


def test_partial_load_with_strict_false_warns_with_counts() -> None:
    sd = Net().state_dict()
    del sd["fc.weight"], sd["fc.bias"]
    sd["head.weight"] = torch.ones(1)
    with pytest.warns(UserWarning, match=r"loaded 7 of 9 model keys: 2 missing \(fc\.weight"):
        result = load_state_dict(Net(), sd, strict=False)
    assert result.missing == ("fc.weight", "fc.bias") and result.unexpected == ("head.weight",)
    with pytest.warns(UserWarning, match=r"1 unexpected \(head\.weight\)"):
        load_state_dict(Net(), sd, strict=False)


@pytest.mark.parametrize("strict", [True, False])
def test_complete_load_warns_nothing(strict: bool) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_state_dict(Net(), nn.DataParallel(Net()).state_dict(), strict=strict).complete


def test_an_averaged_models_file_loads_into_an_averaged_model_unstripped() -> None:
    # Its `module.` is a real submodule: load_state_dict removes a prefix only when that
    # makes more keys fit, so n_averaged and module.* go where they were saved from.
    torch.manual_seed(1)
    swa = torch.optim.swa_utils.AveragedModel(Net())
    swa.update_parameters(Net())
    target = torch.optim.swa_utils.AveragedModel(Net())
    result = load_state_dict(target, swa.state_dict())
    assert result.complete and int(target.n_averaged) == 1
    assert_same(target.state_dict(), swa.state_dict())
    # Into the bare network, the prefix goes and n_averaged is named as the one left over.
    with pytest.raises(StateDictMismatchError, match=r"n_averaged is the update counter"):
        load_state_dict(Net(), swa.state_dict())


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("value", ["meta", "list"])
def test_a_value_without_data_is_refused_before_anything_is_copied(
    strict: bool, value: str
) -> None:
    state = dict(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)).state_dict())
    if value == "meta":
        with torch.device("meta"):
            state["1.bias"] = torch.empty(2)  # saved before the model was materialised
    else:
        state["1.bias"] = [0.0, 0.0]
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(StateDictMismatchError, match=r"'1\.bias': a (meta tensor|list)"):
        load_state_dict(model, state, strict=strict)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())  # unchanged


@pytest.mark.parametrize("strict", [True, False])
def test_a_buffer_whose_name_ends_in_extra_state_is_checked_like_any_other(strict: bool) -> None:
    model = nn.Module()
    model.lin = nn.Linear(2, 2)
    model.register_buffer("pos_extra_state", torch.zeros(3))  # an ordinary buffer
    state = {k: v + 1 for k, v in model.state_dict().items()}
    state["pos_extra_state"] = torch.empty(3, device="meta")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(StateDictMismatchError, match=r"'pos_extra_state': a meta tensor"):
        load_state_dict(model, state, strict=strict)
    assert_same(model.state_dict(), before)  # nothing was loaded


class _WithExtraState(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.extra: Any = None

    def get_extra_state(self) -> Any:
        return torch.zeros(1)

    def set_extra_state(self, state: Any) -> None:
        self.extra = state


@pytest.mark.parametrize("nested", [False, True])
def test_a_modules_extra_state_may_be_any_object(nested: bool) -> None:
    owner = _WithExtraState()
    model = nn.Sequential(owner) if nested else owner
    key = "0._extra_state" if nested else "_extra_state"
    state = dict(model.state_dict())
    assert isinstance(state[key], torch.Tensor)  # the model's is a tensor, the file's a dict
    state[key] = {"calls": 3}
    assert load_state_dict(model, state).complete
    assert owner.extra == {"calls": 3}


def test_an_old_batchnorm_state_without_its_counter_loads_as_torch_loads_it() -> None:
    old = {k: v for k, v in Net().state_dict().items() if not k.endswith("num_batches_tracked")}
    model = Net()
    assert load_state_dict(model, old).complete  # torch fills num_batches_tracked in
    assert torch.equal(model.bn.running_var, old["bn.running_var"])
    versioned = collections.OrderedDict(old)
    versioned._metadata = Net().state_dict()._metadata  # type: ignore[attr-defined]
    with pytest.raises(StateDictMismatchError, match=r"missing .*bn\.num_batches_tracked"):
        load_state_dict(Net(), versioned)  # a state dict of today's torch lacks it for real


def test_a_key_that_fits_as_it_is_is_not_stripped_into_another_parameter() -> None:
    class Both(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(3))
            self.module = nn.Module()
            self.module.weight = nn.Parameter(torch.zeros(3))

    model = Both()
    with pytest.warns(UserWarning, match=r"1 missing \(weight\)"):
        load_state_dict(model, {"module.weight": torch.ones(3)}, strict=False)
    assert torch.equal(model.module.weight, torch.ones(3))
    assert torch.equal(model.weight, torch.zeros(3))


def _encoder_and_head(compiled: bool) -> nn.Module:
    model = nn.Module()
    model.encoder = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    model.head = nn.Linear(4, 2)
    if compiled:  # a compiled submodule, as scripts compile only the backbone
        model.encoder = torch.compile(model.encoder)
    return model


@pytest.mark.parametrize(("saved_compiled", "live_compiled"), [(True, False), (False, True)])
def test_a_compiled_submodules_weights_load_either_way(
    saved_compiled: bool, live_compiled: bool
) -> None:
    saved = _encoder_and_head(saved_compiled)
    live = _encoder_and_head(live_compiled)
    state = saved.state_dict()  # as torch.save wrote it: encoder._orig_mod.* when compiled
    assert load_state_dict(live, state).complete
    for a, b in zip(live.state_dict().values(), saved.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_save_checkpoint_drops_a_compiled_submodules_layer(tmp_path: Path) -> None:
    model = _encoder_and_head(compiled=True)
    path = save_checkpoint({"model": model, "sd": model.state_dict()}, tmp_path / "c.pt")
    loaded = torch.load(path, weights_only=True)
    for entry in ("model", "sd"):
        assert not [k for k in loaded[entry] if "_orig_mod" in k]
        _encoder_and_head(compiled=False).load_state_dict(loaded[entry])  # plain torch loads it


def test_a_state_dict_with_compiled_and_plain_copies_of_one_module_is_refused() -> None:
    from trainperf.checkpoint._keys import drop_compile_layers

    with pytest.raises(ValueError, match=r"mixes compiled and plain copies of one module"):
        drop_compile_layers({"enc._orig_mod.w": torch.ones(1), "enc.w": torch.ones(1)})


def _quantized() -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch deprecates quantize_per_tensor
        return torch.quantize_per_tensor(torch.rand(2, 2), 0.1, 0, torch.quint8)


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype")
@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize(
    ("make", "why"),
    [
        (
            lambda: torch.eye(2).to_sparse(),
            r"a sparse tensor \(layout torch\.sparse_coo\).*to_dense",
        ),
        (lambda: torch.eye(2).to_sparse_csr(), r"a sparse tensor \(layout torch\.sparse_csr\)"),
        (_quantized, r"a quantized tensor \(torch\.quint8\).*dequantize"),
        (
            lambda: torch.zeros(2, 2, dtype=torch.bits8),
            r"of dtype torch\.bits8, which torch cannot copy",
        ),
        (lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(2)]), r"a nested tensor"),
    ],
    ids=["sparse", "csr", "quantized", "bits8", "nested"],
)
def test_a_value_torch_cannot_copy_is_refused_before_anything_is_copied(
    strict: bool, make: Any, why: str
) -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = {k: torch.full_like(v, 7.0) for k, v in before.items()}
    state["1.weight"] = make()
    with pytest.raises(StateDictMismatchError, match=rf"'1\.weight': {why}.*nothing was loaded"):
        load_state_dict(model, state, strict=strict)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())  # unchanged


def test_values_torch_converts_on_copy_still_load() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    state = {"0.weight": torch.ones(2, 2, dtype=torch.int64), "0.bias": torch.ones(1).expand(2)}
    assert load_state_dict(model, state).complete
    assert torch.equal(model[0].weight, torch.ones(2, 2))


@pytest.mark.parametrize("strict", [None, "false", "False", 0.5])
def test_load_state_dict_strict_must_be_a_bool(strict: Any) -> None:
    # strict=None loaded part of the state dict (as strict=False), and strict="false" was
    # strict: both read as the other setting, with no error.
    model, before = Net(), Net().state_dict()
    model.load_state_dict(before)
    partial = {k: v for k, v in before.items() if not k.endswith("bias")}
    with pytest.raises(ValueError, match=rf"strict must be one of \(True, False\), got {strict!r}"):
        load_state_dict(model, partial, strict=strict)
    assert_same(model.state_dict(), before)
