"""trainperf.checkpoint._dirs: load_checkpoint(dir) for sharded checkpoints with an index
(Accelerate save_model, transformers save_pretrained), Accelerate save_state, and DCP."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.checkpoint._common import PEERS, assert_manifest, tiny_mlp
from trainperf.checkpoint import load_checkpoint, load_state_dict
from trainperf.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    NotACheckpointError,
    UnsafeCheckpointError,
)


@pytest.mark.parametrize(
    ("fixture", "name", "needs_safetensors"),
    [
        ("accelerate/save_model_bin", "merged shards", False),
        ("accelerate/save_model_safetensors", "merged shards", True),
        ("accelerate/save_state", "model.safetensors", True),
        ("transformers/bert_tiny", "merged shards", True),
    ],
    ids=["accelerate-bin-shards", "accelerate-safetensors-shards", "save-state", "transformers"],
)
def test_directory_loads_as_one_state_dict(
    fixture: str, name: str, needs_safetensors: bool
) -> None:
    if needs_safetensors:
        pytest.importorskip("safetensors")
    sd = load_checkpoint(PEERS / fixture)
    assert_manifest(sd, fixture, name)
    if not fixture.startswith("transformers"):
        model = tiny_mlp()
        assert load_state_dict(model, sd).complete
        assert_manifest(model.state_dict(), fixture, name)


def test_save_state_with_bin_weights_loads_pytorch_model_bin(tmp_path: Path) -> None:
    sd = tiny_mlp().state_dict()
    torch.save(sd, tmp_path / "pytorch_model.bin")
    torch.save({"state": {}, "param_groups": []}, tmp_path / "optimizer.bin")
    loaded = load_checkpoint(tmp_path)
    assert list(loaded) == list(sd) and all(torch.equal(loaded[k], sd[k]) for k in sd)


def bin_shards(directory: Path, shards: dict[str, dict[str, Any]]) -> Path:
    weight_map = {}
    for file, tensors in shards.items():
        torch.save(tensors, directory / file)
        weight_map.update(dict.fromkeys(tensors, file))
    index = directory / "pytorch_model.bin.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return index


class Payload:
    def __reduce__(self) -> Any:
        return (os.system, ("true",))


def test_shards_are_loaded_with_weights_only(tmp_path: Path) -> None:
    bin_shards(tmp_path, {"a.bin": {"w": torch.ones(1)}, "b.bin": {"v": Payload()}})
    with pytest.raises(UnsafeCheckpointError, match=r"b\.bin contains objects.*posix\.system"):
        load_checkpoint(tmp_path)


def test_a_missing_shard_is_named(tmp_path: Path) -> None:
    bin_shards(tmp_path, {"a.bin": {"w": torch.ones(1)}, "b.bin": {"v": torch.ones(1)}})
    (tmp_path / "b.bin").unlink()
    with pytest.raises(CheckpointNotFoundError, match=r"shard .*b\.bin listed in .*does not exist"):
        load_checkpoint(tmp_path)


def test_an_index_naming_absent_tensors_is_corrupt(tmp_path: Path) -> None:
    index = bin_shards(tmp_path, {"a.bin": {"w": torch.ones(1)}})
    index.write_text(json.dumps({"weight_map": {"w": "a.bin", "gone": "a.bin"}}))
    with pytest.raises(CheckpointCorruptError, match=r"lists 1 tensor\(s\) that its shards do not"):
        load_checkpoint(tmp_path)
    index.write_text("{not json")
    with pytest.raises(CheckpointCorruptError, match=r"is not a valid index.*weight_map"):
        load_checkpoint(tmp_path)
    index.write_text(json.dumps({"weight_map": ["w"]}))
    with pytest.raises(CheckpointCorruptError, match=r"weight_map is a list"):
        load_checkpoint(tmp_path)


def _refused(monkeypatch: pytest.MonkeyPatch, method: str, refused: Path) -> None:
    """``Path.<method>`` of ``refused`` fails with EACCES (no permission), as under a mode
    root would ignore."""
    real = getattr(Path, method)

    def failing(self: Path, *args: Any, **kwargs: Any) -> Any:
        if self == refused:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, method, failing)


def test_a_directory_that_cannot_be_listed_is_a_read_error_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # os.scandir's bare PermissionError, naming neither load_checkpoint nor what to check.
    bin_shards(tmp_path, {"a.bin": {"w": torch.ones(1)}})
    _refused(monkeypatch, "iterdir", tmp_path)
    with pytest.raises(
        PermissionError,
        match=rf"cannot read checkpoint {tmp_path}: Permission denied\. .*check its permissions",
    ):
        load_checkpoint(tmp_path)


def test_an_index_that_cannot_be_read_is_a_read_error_not_corrupt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # It was "not a valid index ... re-copy the directory": the file may be fine.
    index = bin_shards(tmp_path, {"a.bin": {"w": torch.ones(1)}})
    _refused(monkeypatch, "read_text", index)
    with pytest.raises(
        PermissionError, match=r"cannot read checkpoint .*index\.json: Permission denied\. "
    ) as info:
        load_checkpoint(tmp_path)
    assert not isinstance(info.value, CheckpointCorruptError)


@pytest.mark.timeout(20)
def test_a_named_pipe_named_as_an_index_is_refused_not_waited_on(tmp_path: Path) -> None:
    # Reading it opened it, which waits for a writer: load_checkpoint(dir) hung for good.
    os.mkfifo(tmp_path / "pytorch_model.bin.index.json")
    with pytest.raises(
        NotACheckpointError,
        match=r"shard index .*pytorch_model\.bin\.index\.json is a named pipe \(FIFO\), not a "
        r"regular file: remove or rename it",
    ):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize("name", ["model.safetensors.index.json", "pytorch_model.bin.index.json"])
@pytest.mark.parametrize("link", [False, True], ids=["missing", "dangling-link"])
def test_a_missing_index_file_is_not_found_not_corrupt(
    tmp_path: Path, name: str, link: bool
) -> None:
    # It was CheckpointCorruptError "not a valid index ... re-copy the directory".
    index = tmp_path / name
    if link:
        index.symlink_to(tmp_path / "gone.json")
    with pytest.raises(CheckpointNotFoundError, match=rf"{re.escape(str(index))} does not exist"):
        load_checkpoint(index)


def test_a_dangling_index_link_in_a_directory_is_not_found_not_corrupt(tmp_path: Path) -> None:
    (tmp_path / "pytorch_model.bin.index.json").symlink_to(tmp_path / "gone.json")
    with pytest.raises(
        CheckpointNotFoundError,
        match=r"shard index .*pytorch_model\.bin\.index\.json does not exist",
    ):
        load_checkpoint(tmp_path)


def test_two_indexes_ask_which(tmp_path: Path) -> None:
    bin_shards(tmp_path, {"a.bin": {"w": torch.ones(1)}})
    shutil.copy(tmp_path / "pytorch_model.bin.index.json", tmp_path / "other.bin.index.json")
    with pytest.raises(NotACheckpointError, match=r"holds 2 shard indexes.*give the index file"):
        load_checkpoint(tmp_path)


def test_an_index_file_loads_its_directorys_shards(tmp_path: Path) -> None:
    # Refused as "JSON text", where the "several indexes" error advises passing it.
    index = bin_shards(tmp_path, {"a.bin": {"w": torch.ones(1)}})
    assert load_checkpoint(index).keys() == load_checkpoint(index.parent).keys() == {"w"}


def test_dcp_directory_names_the_converter() -> None:
    with pytest.raises(
        NotACheckpointError,
        match=r"torch\.distributed\.checkpoint \(DCP\) directory.*"
        r"torch\.distributed\.checkpoint\.format_utils\.dcp_to_torch_save\(",
    ):
        load_checkpoint(PEERS / "dcp")


@pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")
def test_dcp_converted_as_the_error_says_loads(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(PEERS / "dcp", tmp_path / "model.pt")
    model = tiny_mlp()
    assert load_state_dict(model, load_checkpoint(tmp_path / "model.pt")).complete
    assert_manifest(model.state_dict(), "dcp", "model")


def test_a_directory_without_weights_lists_what_it_holds(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(
        NotACheckpointError,
        match=r"is a directory, not a checkpoint file, and holds no shard index.*"
        r"it holds notes\.txt: give the checkpoint file inside it",
    ):
        load_checkpoint(tmp_path)


def test_an_index_naming_a_shard_outside_its_directory_is_refused(tmp_path: Path) -> None:
    outside = tmp_path / "outside.bin"
    torch.save({"w": torch.ones(1)}, outside)
    inner = tmp_path / "ckpt"
    inner.mkdir()
    index = bin_shards(inner, {"a.bin": {"v": torch.ones(1)}})
    index.write_text(json.dumps({"weight_map": {"v": "a.bin", "w": "../outside.bin"}}))
    with pytest.raises(CheckpointCorruptError, match=r"names a shard outside its directory"):
        load_checkpoint(inner)


def test_each_tensor_comes_from_the_shard_the_index_names(tmp_path: Path) -> None:
    # a.bin still holds a stale copy of "b" from an earlier save; the index says b.bin has it.
    torch.save({"a": torch.zeros(2), "b": torch.full((2,), 9.0)}, tmp_path / "a.bin")
    torch.save({"b": torch.ones(2)}, tmp_path / "b.bin")
    torch.save({"a": torch.full((2,), 9.0)}, tmp_path / "stray.bin")  # named by no index
    (tmp_path / "pytorch_model.bin.index.json").write_text(
        json.dumps({"weight_map": {"b": "b.bin", "a": "a.bin"}})
    )
    sd = load_checkpoint(tmp_path)
    assert sorted(sd) == ["a", "b"]
    assert torch.equal(sd["a"], torch.zeros(2)) and torch.equal(sd["b"], torch.ones(2))


def test_tensors_a_shard_holds_but_the_index_does_not_list_are_left_out(tmp_path: Path) -> None:
    torch.save({"w": torch.ones(1), "old_head": torch.ones(1)}, tmp_path / "a.bin")
    (tmp_path / "pytorch_model.bin.index.json").write_text(
        json.dumps({"weight_map": {"w": "a.bin"}})
    )
    assert list(load_checkpoint(tmp_path)) == ["w"]


def _save_state_models(directory: Path, names: list[str]) -> list[dict[str, Any]]:
    """What Accelerate ``save_state`` writes for ``len(names)`` prepared models: one weights
    file each (``model.safetensors``, ``model_1.safetensors``, ...), plus optimizer and RNG."""
    states = []
    for i, name in enumerate(names):
        sd = {"w": torch.full((2,), float(i))}
        if name.endswith(".safetensors"):
            from safetensors.torch import save_file

            save_file(sd, directory / name)
        else:
            torch.save(sd, directory / name)
        states.append(sd)
    torch.save({"state": {}, "param_groups": []}, directory / "optimizer.bin")
    torch.save({"random_state": 0}, directory / "random_states_0.pkl")
    return states


@pytest.mark.parametrize(
    "names",
    [
        ["model.safetensors", "model_1.safetensors"],
        ["pytorch_model.bin", "pytorch_model_1.bin", "pytorch_model_2.bin"],
        ["pytorch_model_fsdp.bin", "pytorch_model_fsdp_1.bin"],
    ],
    ids=["safetensors", "bin", "fsdp-full-state"],
)
def test_save_state_with_several_models_asks_which(tmp_path: Path, names: list[str]) -> None:
    # It returned the first model's weights alone, saying nothing of the others.
    if names[0].endswith(".safetensors"):
        pytest.importorskip("safetensors")
    _save_state_models(tmp_path, names)
    shown = r", ".join(re.escape(n) for n in names)
    with pytest.raises(
        NotACheckpointError,
        match=rf"holds {len(names)} model weight files written by Accelerate save_state, one per "
        rf"prepared model \({shown}\).*load_checkpoint\('{re.escape(str(tmp_path / names[1]))}'\)",
    ):
        load_checkpoint(tmp_path)


def test_each_of_several_save_state_models_loads_by_its_file(tmp_path: Path) -> None:
    states = _save_state_models(tmp_path, ["pytorch_model.bin", "pytorch_model_1.bin"])
    for name, sd in zip(["pytorch_model.bin", "pytorch_model_1.bin"], states, strict=True):
        assert torch.equal(load_checkpoint(tmp_path / name)["w"], sd["w"])


def test_a_numbered_save_state_model_alone_is_not_taken_for_the_whole(tmp_path: Path) -> None:
    # model.safetensors went missing in a copy: model_1 is not "the" model either.
    _save_state_models(tmp_path, ["pytorch_model.bin", "pytorch_model_1.bin"])
    (tmp_path / "pytorch_model.bin").unlink()
    with pytest.raises(
        NotACheckpointError, match=r"holds 1 model weight file written .*\(pytorch_model_1\.bin\)"
    ):
        load_checkpoint(tmp_path)


def test_a_save_state_directory_without_a_model_says_so(tmp_path: Path) -> None:
    # It said "give the checkpoint file inside it", pointing at optimizer.bin as if weights.
    torch.save({"state": {}, "param_groups": []}, tmp_path / "optimizer.bin")
    torch.save({"random_state": 0}, tmp_path / "random_states_0.pkl")
    with pytest.raises(
        NotACheckpointError,
        match=r"holds Accelerate save_state files \(optimizer\.bin, random_states_0\.pkl\) but "
        r"no model weights \(model\.safetensors, pytorch_model\.bin, pytorch_model_fsdp\.bin or a "
        r"pytorch_model_fsdp_0 directory\).*"
        rf"accelerator\.load_state\('{re.escape(str(tmp_path))}'\)",
    ):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize(
    ("files", "dirs", "shown"),
    [
        (
            [
                "adapter_model.safetensors",
                "optimizer.pt",
                "rng_state.pth",
                "scaler.pt",
                "scheduler.pt",
                "trainer_state.json",
            ],
            [],
            "adapter_model.safetensors, optimizer.pt, rng_state.pth, scaler.pt, scheduler.pt, "
            "trainer_state.json",
        ),
        (
            ["optimizer.bin", "random_states_0.pkl", "scaler.pt", "scheduler.bin"],
            ["unet"],
            "optimizer.bin, random_states_0.pkl, scaler.pt, scheduler.bin, unet",
        ),
        (["best.pt", "scaler.pt"], [], "best.pt, scaler.pt"),
        (["scaler.pt"], [], "scaler.pt"),
    ],
    ids=["peft-trainer-checkpoint", "diffusers-save-state", "best-pt", "scaler-alone"],
)
def test_other_files_beside_save_state_names_are_not_called_save_state(
    tmp_path: Path, files: list[str], dirs: list[str], shown: str
) -> None:
    # One stray scaler.pt or optimizer.bin made it "Accelerate save_state files ... but no
    # model weights", hiding adapter_model.safetensors, unet/ or best.pt from the message.
    for name in files:
        (tmp_path / name).write_bytes(b"x")
    for name in dirs:
        (tmp_path / name).mkdir()
    with pytest.raises(
        NotACheckpointError,
        match=rf"it holds {re.escape(shown)}: give the checkpoint file inside it",
    ):
        load_checkpoint(tmp_path)


def test_other_weight_files_beside_model_safetensors_are_not_read(tmp_path: Path) -> None:
    # Documented: model.safetensors is the model; an EMA copy beside it is given by its path.
    pytest.importorskip("safetensors")
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, tmp_path / "model.safetensors")
    save_file({"w": torch.ones(2)}, tmp_path / "ema.safetensors")
    assert torch.equal(load_checkpoint(tmp_path)["w"], torch.zeros(2))
    assert torch.equal(load_checkpoint(tmp_path / "ema.safetensors")["w"], torch.ones(2))


def test_fsdp_full_state_dict_save_state_loads_pytorch_model_fsdp_bin(tmp_path: Path) -> None:
    # Accelerate save_state under FSDP (FULL_STATE_DICT) names the model pytorch_model_fsdp.bin;
    # it was refused as "save_state files but no model weights".
    (state,) = _save_state_models(tmp_path, ["pytorch_model_fsdp.bin"])
    assert torch.equal(load_checkpoint(tmp_path)["w"], state["w"])


def _fsdp_sharded_save_state(directory: Path, models: int) -> list[Path]:
    """What Accelerate ``save_state`` writes under FSDP with ``SHARDED_STATE_DICT``: a DCP
    directory per model (``pytorch_model_fsdp_0/``, ...) and per optimizer (``optimizer_0/``)."""
    subdirs = [directory / f"pytorch_model_fsdp_{i}" for i in range(models)]
    for subdir in [*subdirs, directory / "optimizer_0"]:
        shutil.copytree(PEERS / "dcp", subdir)
    torch.save({"random_state": 0}, directory / "random_states_0.pkl")
    return subdirs


def test_fsdp_sharded_save_state_names_the_dcp_converter_for_its_subdirectory(
    tmp_path: Path,
) -> None:
    # It said the model weights were missing; they are in the DCP subdirectory.
    (subdir,) = _fsdp_sharded_save_state(tmp_path, 1)
    with pytest.raises(
        NotACheckpointError,
        match=rf"{re.escape(str(subdir))} is a torch\.distributed\.checkpoint \(DCP\) directory.*"
        rf"dcp_to_torch_save\('{re.escape(str(subdir))}', 'model\.pt'\)",
    ):
        load_checkpoint(tmp_path)


def test_several_fsdp_sharded_save_state_models_ask_which(tmp_path: Path) -> None:
    subdirs = _fsdp_sharded_save_state(tmp_path, 2)
    with pytest.raises(
        NotACheckpointError,
        match=r"holds 2 model weight files written by Accelerate save_state.*"
        r"\(pytorch_model_fsdp_0, pytorch_model_fsdp_1\).*"
        rf"load_checkpoint\('{re.escape(str(subdirs[1]))}'\)",
    ):
        load_checkpoint(tmp_path)
    with pytest.raises(NotACheckpointError, match=r"\(DCP\) directory"):
        load_checkpoint(subdirs[1])


def _fsdp_local_save_state(directory: Path, models: int, ranks: int) -> list[str]:
    """What Accelerate ``save_state`` writes under FSDP with ``LOCAL_STATE_DICT``: one file
    per model and rank (``pytorch_model_fsdp_rank0.bin``, ``pytorch_model_fsdp_1_rank0.bin``),
    plus the optimizer's DCP directory and RNG."""
    names = [
        f"pytorch_model_fsdp{'' if i == 0 else f'_{i}'}_rank{r}.bin"
        for i in range(models)
        for r in range(ranks)
    ]
    for name in names:
        torch.save({"w": torch.zeros(2)}, directory / name)
    shutil.copytree(PEERS / "dcp", directory / "optimizer_0")
    torch.save({"random_state": 0}, directory / "random_states_0.pkl")
    return names


@pytest.mark.parametrize(("models", "ranks"), [(1, 2), (2, 2)], ids=["one-model", "two-models"])
def test_fsdp_local_state_dict_save_state_is_refused_as_per_rank_shards(
    tmp_path: Path, models: int, ranks: int
) -> None:
    # It said "save_state files but no model weights": the weights are there, one file a rank.
    names = _fsdp_local_save_state(tmp_path, models, ranks)
    with pytest.raises(
        NotACheckpointError,
        match=rf"{re.escape(str(tmp_path))} holds FSDP LOCAL_STATE_DICT weights.*"
        rf"{re.escape(names[0])}.*per-rank local shards.*cannot merge.*"
        r"FSDP.*FULL_STATE_DICT.*SHARDED_STATE_DICT",
    ):
        load_checkpoint(tmp_path)


def test_fsdp_local_rank_files_without_other_save_state_files_are_refused_alike(
    tmp_path: Path,
) -> None:
    torch.save({"w": torch.zeros(2)}, tmp_path / "pytorch_model_fsdp_rank0.bin")
    with pytest.raises(NotACheckpointError, match=r"per-rank local shards"):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize(
    "other",
    ["pytorch_model_fsdp_0", "pytorch_model_fsdp_rank0.bin"],
    ids=["sharded-dir", "local-rank-file"],
)
def test_a_full_state_dict_file_beside_another_fsdp_save_type_warns_naming_both(
    tmp_path: Path, other: str
) -> None:
    # The FSDP state dict type changed between saves: the file was loaded silently.
    (state,) = _save_state_models(tmp_path, ["pytorch_model_fsdp.bin"])
    if other.endswith(".bin"):
        torch.save({"w": torch.zeros(2)}, tmp_path / other)
    else:
        shutil.copytree(PEERS / "dcp", tmp_path / other)
    with pytest.warns(
        UserWarning,
        match=rf"holds both pytorch_model_fsdp\.bin and {re.escape(other)}.*"
        r"loading pytorch_model_fsdp\.bin",
    ):
        sd = load_checkpoint(tmp_path)
    assert torch.equal(sd["w"], state["w"])


def test_a_full_state_dict_file_alone_loads_without_a_warning(tmp_path: Path) -> None:
    (saved,) = _save_state_models(tmp_path, ["pytorch_model_fsdp.bin"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded = load_checkpoint(tmp_path)
    assert loaded.keys() == saved.keys() and torch.equal(loaded["w"], saved["w"])
