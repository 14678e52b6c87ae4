"""Checkpoint directories: sharded weights with an index, Accelerate ``save_state``, DCP.

What other tools write as a directory, and what ``load_checkpoint(dir)`` makes of it:

- ``*.safetensors.index.json`` / ``pytorch_model.bin.index.json`` (Accelerate ``save_model``,
  transformers ``save_pretrained`` with shards): every shard its ``weight_map`` names, loaded
  as one state dict, each tensor from the shard the index names for it (the index decides:
  copies in other shards, and tensors it does not list, are left out); safetensors is
  preferred when both are there, as transformers does;
- ``model.safetensors``, ``pytorch_model.bin`` or ``pytorch_model_fsdp.bin`` (Accelerate
  ``save_state``, the last under FSDP with a full state dict; an unsharded
  ``save_pretrained``): that file; ``save_state``'s ``optimizer.bin``, ``scheduler.bin`` and
  ``random_states_*.pkl`` are not loaded, nor other weight files beside it
  (``ema.safetensors``); ``save_state`` with several models (``model_1.safetensors``,
  ``pytorch_model_1.bin``, ``pytorch_model_fsdp_1.bin``, ...) is an error asking for the file
  of one, and its files with no model weights an error saying so;
- a ``.metadata`` file (``torch.distributed.checkpoint``), or the DCP subdirectory
  ``pytorch_model_fsdp_0/`` of ``save_state`` under FSDP with a sharded state dict: an error
  naming the converter;
- ``pytorch_model_fsdp_rank{r}.bin`` (``save_state`` under FSDP with a local state dict): an
  error, as each is one rank's local shard; and one of the files above beside such files or a
  ``pytorch_model_fsdp_0/`` (the FSDP save type changed between saves) is loaded with a
  warning naming both.
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainperf._utils.stack import user_stacklevel
from trainperf.checkpoint._formats import read_error, read_failure, special_file
from trainperf.errors import CheckpointCorruptError, CheckpointNotFoundError, NotACheckpointError

# In the order they are preferred: safetensors first, as transformers and Accelerate do.
INDEX_SUFFIXES = (".safetensors.index.json", ".bin.index.json")
_SINGLE_FILES = ("model.safetensors", "pytorch_model.bin", "pytorch_model_fsdp.bin")
# save_state names the weights of its i-th model (i > 0) "model_{i}.safetensors",
# "pytorch_model_{i}.bin" or, under FSDP, "pytorch_model_fsdp_{i}.bin"; the rest of what it
# writes is training state, not weights.
_NUMBERED_MODEL = re.compile(r"(model_\d+\.safetensors|pytorch_model(_fsdp)?_\d+\.bin)")
# Under FSDP with a sharded state dict, save_state writes the i-th model (i >= 0, so the
# first is "_0") as a torch.distributed.checkpoint directory.
_FSDP_DCP_DIR = re.compile(r"pytorch_model_fsdp_\d+")
# Under FSDP with a local state dict, save_state writes each rank's own shard of the i-th
# model: "pytorch_model_fsdp_rank{r}.bin", or "pytorch_model_fsdp_{i}_rank{r}.bin" for i > 0.
_FSDP_RANK_FILE = re.compile(r"pytorch_model_fsdp(_\d+)?_rank\d+\.bin")
_SAVE_STATE = re.compile(
    r"(optimizer|scheduler|sampler|dl_state_dict)(_\d+)?\.bin"
    r"|(random_states|custom_checkpoint)_\d+\.pkl|scaler\.pt"
)
# What marks a directory as save_state's: the other names are common (scaler.pt,
# optimizer.bin), and save_state writes this one whatever was prepared.
_RNG_STATE = re.compile(r"random_states_\d+\.pkl")


def _listed(path: Path) -> list[Path]:
    """What the directory ``path`` holds, sorted.

    Raises:
        OSError: it cannot be listed (no permission, a disk error): as ``load_checkpoint``
            raises a file it cannot read, naming it and what to check.
    """
    try:
        return sorted(path.iterdir())
    except OSError as e:
        raise read_error(path, e) from e


def _index_file(path: Path) -> Path | None:
    inside = _listed(path)
    for suffix in INDEX_SUFFIXES:
        found = [p for p in inside if p.name.endswith(suffix)]
        if len(found) > 1:
            raise NotACheckpointError(
                f"{path} holds {len(found)} shard indexes ({', '.join(p.name for p in found)}); "
                "give the index file of the model you want: load_checkpoint("
                f"'{found[0]}')",
                path,
            )
        if found:
            return found[0]
    return None


def _shard_map(index: Path) -> dict[str, str]:
    try:
        _refuse_special(index)
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError(f"weight_map is a {type(weight_map).__name__}, not a dict")
    except FileNotFoundError as e:  # a dangling link, or removed since it was listed
        raise CheckpointNotFoundError(
            f"shard index {index} does not exist (a link to a missing file, or removed while "
            "loading): copy the directory again, its index included",
            index,
        ) from e
    except OSError as e:
        if read_failure(e) and not isinstance(e, IsADirectoryError):  # it may be fine
            raise read_error(index, e) from e
        raise _bad_index(index, e) from e
    except (ValueError, KeyError, TypeError) as e:
        raise _bad_index(index, e) from e
    return {str(k): str(v) for k, v in weight_map.items()}


def _refuse_special(index: Path) -> None:
    """Refuse the shard index ``index`` when it is a named pipe, socket or device: reading
    it would wait for a writer (a pipe) or read a device, as for a checkpoint file.

    Raises:
        NotACheckpointError: it is one (the message says which, and the fix).
        OSError: it cannot be looked at (as for reading it).
    """
    special = special_file(index.stat().st_mode)
    if special is not None:
        raise NotACheckpointError(
            f"shard index {index} is {special}, not a regular file: remove or rename it, "
            f"or give the checkpoint file inside {index.parent}",
            index,
        )


def _bad_index(index: Path, e: Exception) -> CheckpointCorruptError:
    return CheckpointCorruptError(
        f"shard index {index} is not a valid index ({type(e).__name__}: {e}); it should "
        'be JSON with a "weight_map" of tensor name -> shard file: re-copy the directory',
        index,
    )


def load_sharded(index: Path, load_file: Callable[[Path], Any]) -> dict[str, Any]:
    """Every shard ``index`` lists, merged into one state dict; each shard is read with
    ``load_file`` (so with ``weights_only`` and the CRC check); every tensor the index names
    must be in its shard, and is taken from that shard only: a stale copy in another shard
    (left by an earlier save), and tensors the index does not list, are left out.

    Raises:
        CheckpointCorruptError: the index is not valid JSON with a ``weight_map``, names a
            shard outside its directory, or lists tensors its shards lack.
        NotACheckpointError: the index is a named pipe, socket or device (never opened).
        CheckpointNotFoundError: a shard it lists is missing.
        OSError: the index could not be read (no permission, a disk error): it may be fine.
    """
    weight_map = _shard_map(index)
    keys_in: dict[str, list[str]] = {}
    for key, file in weight_map.items():
        keys_in.setdefault(file, []).append(key)
    merged: dict[str, Any] = {}
    for name, keys in keys_in.items():
        shard = index.parent / name
        if Path(name).name != name:
            raise CheckpointCorruptError(
                f"{index} names a shard outside its directory ({name!r}): an index lists "
                "file names beside it; check where this directory came from",
                index,
            )
        if not shard.is_file():
            raise CheckpointNotFoundError(
                f"shard {shard} listed in {index.name} does not exist: the directory was "
                "copied only in part; copy every shard the index lists",
                shard,
            )
        tensors = load_file(shard)
        merged.update((k, tensors[k]) for k in keys if k in tensors)
    absent = [k for k in weight_map if k not in merged]
    if absent:
        raise CheckpointCorruptError(
            f"{index} lists {len(absent)} tensor(s) that its shards do not hold "
            f"({', '.join(absent[:5])}{', ...' if len(absent) > 5 else ''}): the shards and "
            "the index come from different saves; re-copy the directory",
            index,
        )
    return merged


def directory_weights(path: Path) -> tuple[str, Path]:
    """``("index", file)`` or ``("file", file)``: what ``load_checkpoint(path)`` reads from
    the directory ``path``.

    Raises:
        NotACheckpointError: A ``torch.distributed.checkpoint`` directory (or an FSDP
            ``save_state``'s ``pytorch_model_fsdp_0/`` in it), several indexes, an Accelerate
            ``save_state`` with several models (``model_1.safetensors``), with per-rank FSDP
            files (``pytorch_model_fsdp_rank0.bin``) or with none, or no weights file
            trainperf recognises (the message lists what is there).
        OSError: the directory cannot be listed (no permission, a disk error): the message
            names it and what to check.
    """
    if (path / ".metadata").exists():
        raise _dcp_error(path)
    index = _index_file(path)
    if index is not None:
        return "index", index
    inside = [p.name for p in _listed(path)]
    _refuse_several_models(path, inside)
    for name in _SINGLE_FILES:
        if (path / name).is_file():
            _warn_other_fsdp_save(path, name, inside)
            return "file", path / name
    dcp_dirs = _fsdp_dcp_dirs(path, inside)
    if dcp_dirs:  # one: several were refused above
        raise _dcp_error(path / dcp_dirs[0])
    _refuse_fsdp_rank_files(path, inside)
    _refuse_state_without_model(path, inside)
    shown = ", ".join(inside[:8]) + (", ..." if len(inside) > 8 else "") if inside else "nothing"
    raise NotACheckpointError(
        f"{path} is a directory, not a checkpoint file, and holds no shard index "
        f"(*.safetensors.index.json, *.bin.index.json) nor {' or '.join(_SINGLE_FILES)}; it "
        f"holds {shown}: give the checkpoint file inside it",
        path,
    )


def _dcp_error(path: Path) -> NotACheckpointError:
    return NotACheckpointError(
        f"{path} is a torch.distributed.checkpoint (DCP) directory, which holds shards "
        "for a process group to load collectively; convert it to one file first: "
        "torch.distributed.checkpoint.format_utils.dcp_to_torch_save("
        f"'{path}', 'model.pt'), then load_checkpoint('model.pt') (or load it with "
        "torch.distributed.checkpoint.load on every rank)",
        path,
    )


def _fsdp_dcp_dirs(path: Path, inside: list[str]) -> list[str]:
    """The ``pytorch_model_fsdp_{i}`` DCP directories in ``path`` (``save_state`` under FSDP
    with a sharded state dict)."""
    return [n for n in inside if _FSDP_DCP_DIR.fullmatch(n) and (path / n).is_dir()]


def _fsdp_rank_files(inside: list[str]) -> list[str]:
    """The ``pytorch_model_fsdp[_{i}]_rank{r}.bin`` files in ``inside`` (``save_state`` under
    FSDP with a local state dict)."""
    return [n for n in inside if _FSDP_RANK_FILE.fullmatch(n)]


def _shown(names: list[str], most: int = 4) -> str:
    return ", ".join(names[:most]) + (", ..." if len(names) > most else "")


def _warn_other_fsdp_save(path: Path, chosen: str, inside: list[str]) -> None:
    """Warn that ``chosen`` is loaded from ``path`` although FSDP weights of another state
    dict type lie beside it (``pytorch_model_fsdp_0/``, ``pytorch_model_fsdp_rank0.bin``):
    the save type changed between two saves into the directory, so either may be stale."""
    others = [f"{n}/" for n in _fsdp_dcp_dirs(path, inside)] + _fsdp_rank_files(inside)
    if not others:
        return
    warnings.warn(
        f"{path} holds both {chosen} and {_shown(others)}, model weights of different FSDP "
        f"state dict types (the save type changed between saves into this directory); "
        f"loading {chosen}, which may be the older save: delete the stale weights, or give "
        f"the file you want by its path: load_checkpoint('{path / chosen}')",
        UserWarning,
        stacklevel=user_stacklevel(),
    )


def _refuse_fsdp_rank_files(path: Path, inside: list[str]) -> None:
    """Refuse an Accelerate ``save_state`` directory written under FSDP with
    ``LOCAL_STATE_DICT``: each file is one rank's shard, and returning one would pass a
    fraction of the model for the whole.

    Raises:
        NotACheckpointError: ``path`` holds ``pytorch_model_fsdp_rank{r}.bin`` or
            ``pytorch_model_fsdp_{i}_rank{r}.bin`` files (the message lists them, and the fix).
    """
    ranks = _fsdp_rank_files(inside)
    if not ranks:
        return
    raise NotACheckpointError(
        f"{path} holds FSDP LOCAL_STATE_DICT weights written by Accelerate save_state "
        f"({_shown(ranks)}): these are per-rank local shards of FSDP's flattened parameters, "
        "which load_checkpoint cannot merge into one state dict; load them per rank with "
        f"FSDP (accelerator.load_state('{path}') with the same world size and wrapping), or "
        "save with fsdp_state_dict_type FULL_STATE_DICT (one pytorch_model_fsdp.bin, which "
        "load_checkpoint reads) or SHARDED_STATE_DICT (a pytorch_model_fsdp_0/ directory "
        "to convert with dcp_to_torch_save)",
        path,
    )


def _refuse_several_models(path: Path, inside: list[str]) -> None:
    """Refuse an Accelerate ``save_state`` directory with the weights of several models:
    returning the first alone would pass for the whole checkpoint.

    Raises:
        NotACheckpointError: ``path`` holds ``model_1.safetensors``, ``pytorch_model_1.bin``
            or another numbered model file, or several ``pytorch_model_fsdp_{i}`` DCP
            directories (the message lists them, and how to load each).
    """
    dcp_dirs = _fsdp_dcp_dirs(path, inside)
    if not any(_NUMBERED_MODEL.fullmatch(name) for name in inside) and len(dcp_dirs) < 2:
        return
    models = [n for n in inside if n in _SINGLE_FILES or _NUMBERED_MODEL.fullmatch(n)]
    models += dcp_dirs
    models.sort(key=lambda n: (n.endswith(".bin"), len(n), n))  # model, model_1, ..., model_10
    each = ", ".join(f"load_checkpoint('{path / n}')" for n in models[:4])
    files = f"{len(models)} model weight file{'s' if len(models) > 1 else ''}"
    raise NotACheckpointError(
        f"{path} holds {files} written by Accelerate save_state, one per prepared model "
        f"({', '.join(models)}), and load_checkpoint(dir) returns one state dict: give the "
        f"file of the model you want: {each}",
        path,
    )


def _refuse_state_without_model(path: Path, inside: list[str]) -> None:
    """Refuse an Accelerate ``save_state`` directory that holds no model weights: one that
    holds ``save_state`` files only, ``random_states_*.pkl`` among them. Anything else there
    (a trainer's ``adapter_model.safetensors``, a ``unet/``, a ``best.pt`` beside a
    ``scaler.pt``) may be the weights: the generic error lists it.

    Raises:
        NotACheckpointError: ``path`` holds ``random_states_0.pkl`` and only other
            ``save_state`` files (``optimizer.bin``, ...), no model file (the message lists them).
    """
    state = [name for name in inside if _SAVE_STATE.fullmatch(name)]
    if len(state) < len(inside) or not any(_RNG_STATE.fullmatch(n) for n in state):
        return
    shown = ", ".join(state[:6]) + (", ..." if len(state) > 6 else "")
    raise NotACheckpointError(
        f"{path} holds Accelerate save_state files ({shown}) but no model weights "
        f"({', '.join(_SINGLE_FILES)} or a pytorch_model_fsdp_0 directory): save_state "
        "writes them only for models passed to accelerator.prepare, or they were not "
        "copied; these files are training state "
        f"(optimizer, scheduler, RNG), restored with accelerator.load_state('{path}')",
        path,
    )
