"""trainperf.checkpoint._search: load_state_dict given a whole checkpoint finds the part that
fits the model (timm, Lightning, Fabric, a script's {"model": ...}) by keys and shapes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.checkpoint._common import PEERS, assert_manifest, tiny_mlp
from trainperf.checkpoint import load_checkpoint, load_state_dict
from trainperf.errors import StateDictMismatchError


@pytest.mark.parametrize(
    ("fixture", "name", "ema", "source"),
    [
        ("timm/checkpoint-0.pth.tar", "state_dict", False, "checkpoint['state_dict']"),
        ("timm/checkpoint-0.pth.tar", "state_dict_ema", True, "checkpoint['state_dict_ema']"),
        (
            "lightning/trainer.ckpt",
            "state_dict",
            False,
            "checkpoint['state_dict'] (prefix 'model.' removed)",
        ),
        ("lightning/fabric.ckpt", "model", False, "checkpoint['model']"),
        ("research_numpy.pt", "model", False, "checkpoint['model']"),
    ],
    ids=["timm", "timm-ema", "lightning-trainer", "fabric", "research"],
)
def test_whole_checkpoint_loads_the_part_that_fits(
    fixture: str, name: str, ema: bool, source: str
) -> None:
    model = tiny_mlp()
    result = load_state_dict(model, load_checkpoint(PEERS / fixture), ema=ema)
    assert result.complete and result.source == source
    assert f"loaded from {source}" in str(result) and result.to_dict()["source"] == source
    assert_manifest(model.state_dict(), fixture, name)


def test_plain_model_entry_is_found_and_bit_identical() -> None:
    saved = tiny_mlp()
    with torch.no_grad():
        saved[0].weight.add_(1)
    ckpt = {"epoch": 3, "model": saved.state_dict(), "optimizer": {"state": {}, "param_groups": []}}
    model = tiny_mlp()
    assert load_state_dict(model, ckpt).source == "checkpoint['model']"
    for key, value in saved.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key


def test_a_lightning_modules_other_attributes_are_left_out() -> None:
    net = tiny_mlp()
    sd = {f"model.{k}": v for k, v in net.state_dict().items()}
    sd["loss.weight"] = torch.ones(4)  # e.g. nn.CrossEntropyLoss(weight=...)
    result = load_state_dict(tiny_mlp(), {"state_dict": sd, "epoch": 1})
    assert result.complete and "prefix 'model.' removed" in result.source


def test_two_parts_that_fit_equally_are_an_error_naming_both() -> None:
    ckpt = {"a": tiny_mlp().state_dict(), "b": tiny_mlp().state_dict()}
    with pytest.raises(
        StateDictMismatchError,
        match=r"2 parts of the checkpoint fit the model equally well \(9 of its 9 keys each\): "
        r"checkpoint\['a'\], checkpoint\['b'\]; pass the one you mean, e\.g\. "
        r"load_state_dict\(model, checkpoint\['a'\]\)$",
    ):
        load_state_dict(tiny_mlp(), ckpt)


def test_a_tie_mentions_ema_only_when_there_is_an_ema_copy() -> None:
    ckpt = {"a": tiny_mlp().state_dict(), "b": tiny_mlp().state_dict()}
    ckpt["model_ema"] = tiny_mlp().state_dict()
    with pytest.raises(StateDictMismatchError, match=r"checkpoint\['b'\]; .*ema=True for the EMA"):
        load_state_dict(tiny_mlp(), ckpt)


@pytest.mark.parametrize(
    "copy",
    [lambda sd: sd, dict, lambda sd: {k: v.detach() for k, v in sd.items()}],
    ids=["same-dict", "same-tensors", "views"],
)
def test_the_same_weights_under_two_names_are_one_part(copy: Any, tmp_path: Path) -> None:
    sd = tiny_mlp().state_dict()
    torch.save({"model": sd, "state_dict": copy(sd), "epoch": 3}, tmp_path / "ckpt.pt")
    model = tiny_mlp()
    result = load_state_dict(model, load_checkpoint(tmp_path / "ckpt.pt"))
    assert result.complete and result.source == "checkpoint['model']"
    assert torch.equal(model.state_dict()["0.weight"], sd["0.weight"])


def test_equal_copies_in_other_memory_are_still_two_parts() -> None:
    sd = tiny_mlp().state_dict()
    ckpt = {"student": sd, "teacher": {k: v.clone() for k, v in sd.items()}}
    with pytest.raises(StateDictMismatchError, match=r"2 parts of the checkpoint fit"):
        load_state_dict(tiny_mlp(), ckpt)


def test_two_attributes_of_one_module_are_ambiguous_too() -> None:
    net = tiny_mlp()
    # Two copies (teacher = deepcopy(student)): equal values, other memory.
    sd = {
        f"{who}.{k}": v.clone()
        for who in ("student", "teacher")
        for k, v in net.state_dict().items()
    }
    with pytest.raises(
        StateDictMismatchError,
        match=r"checkpoint\['state_dict'\] \(prefix 'student\.' removed\), "
        r"checkpoint\['state_dict'\] \(prefix 'teacher\.' removed\).*"
        r"if k\.startswith\('student\.'\)",
    ) as caught:
        load_state_dict(tiny_mlp(), {"state_dict": sd})
    # The code the message suggests loads the one attribute, strictly.
    suggested = str(caught.value).split("e.g. ", 1)[1].split(", or ema=True")[0]
    model = tiny_mlp()
    eval(
        suggested,
        {"load_state_dict": load_state_dict, "model": model, "checkpoint": {"state_dict": sd}},
    )
    assert torch.equal(model.state_dict()["0.weight"], sd["student.0.weight"])


def test_an_ema_attribute_of_a_lightning_module_is_the_ema_copy() -> None:
    net, ema_net = tiny_mlp(), tiny_mlp()
    with torch.no_grad():
        for p in ema_net.parameters():
            p.add_(1.0)
    sd = {f"model.{k}": v for k, v in net.state_dict().items()}
    sd |= {f"model_ema.module.{k}": v for k, v in ema_net.state_dict().items()}
    regular, averaged = tiny_mlp(), tiny_mlp()
    assert "prefix 'model.'" in load_state_dict(regular, {"state_dict": sd}).source
    assert torch.equal(regular.state_dict()["0.weight"], net.state_dict()["0.weight"])
    result = load_state_dict(averaged, {"state_dict": sd}, ema=True)
    assert "model_ema.module." in result.source
    assert torch.equal(averaged.state_dict()["0.weight"], ema_net.state_dict()["0.weight"])


def test_ema_without_an_ema_copy_is_an_error() -> None:
    with pytest.raises(
        StateDictMismatchError,
        match=r"ema=True, but the checkpoint holds no EMA copy.*these fit: "
        r"checkpoint\['state_dict'\] \(prefix 'model\.' removed\) \(9 keys fit\).*ema=False",
    ):
        load_state_dict(tiny_mlp(), load_checkpoint(PEERS / "lightning" / "trainer.ckpt"), ema=True)
    with pytest.raises(StateDictMismatchError, match=r"ema=True, but"):
        load_state_dict(tiny_mlp(), tiny_mlp().state_dict(), ema=True)


def test_only_an_ema_copy_says_to_pass_ema() -> None:
    ckpt: dict[str, Any] = {"model_ema": tiny_mlp().state_dict(), "optimizer": {"state": {}}}
    with pytest.raises(
        StateDictMismatchError,
        match=r"only an EMA copy fits the model \(checkpoint\['model_ema'\].*pass ema=True",
    ):
        load_state_dict(tiny_mlp(), ckpt)
    assert load_state_dict(tiny_mlp(), ckpt, ema=True).source == "checkpoint['model_ema']"


def test_a_whole_checkpoint_where_nothing_fits_says_so() -> None:
    ckpt = {"model": {"head.w": torch.ones(1)}, "optimizer": {"state": {}}, "epoch": 1}
    with pytest.raises(
        StateDictMismatchError,
        match=r"looks like a whole checkpoint \(dicts under model, optimizer\), but no dict in "
        r"it fits the model by key and shape",
    ):
        load_state_dict(tiny_mlp(), ckpt, strict=False)


def test_ema_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match=r"ema must be one of \(False, True\), got 'yes'"):
        load_state_dict(tiny_mlp(), tiny_mlp().state_dict(), ema="yes")  # type: ignore[arg-type]


def test_averaged_model_state_dict_names_n_averaged() -> None:
    sd = load_checkpoint(PEERS / "averaged_model.pt")
    with pytest.raises(
        StateDictMismatchError,
        match=r"unexpected key\(s\).*n_averaged\n.*AveragedModel: load into AveragedModel\(model\)",
    ):
        load_state_dict(tiny_mlp(), sd)
    model = tiny_mlp()
    with pytest.warns(UserWarning, match=r"loaded 9 of 9 model keys: 1 unexpected \(n_averaged\)"):
        assert load_state_dict(model, sd, strict=False).unexpected == ("n_averaged",)
    assert_manifest(model.state_dict(), "averaged_model.pt", "<file>")  # n_averaged left out
