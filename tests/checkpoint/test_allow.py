"""trainperf.checkpoint._allow: data-only types load under weights_only=True (timm's args,
numpy values, paths); every other global is refused, and listed all at once."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import pathlib
import re
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.checkpoint._common import PEERS, assert_manifest, tiny_mlp
from trainperf.checkpoint import load_checkpoint, load_state_dict
from trainperf.errors import UnsafeCheckpointError


def safe_globals_now() -> set[Any]:
    return set(torch.serialization.get_safe_globals())


def test_timm_checkpoint_loads_with_default_settings() -> None:
    before = safe_globals_now()
    ckpt = load_checkpoint(PEERS / "timm" / "checkpoint-0.pth.tar")
    assert isinstance(ckpt["args"], argparse.Namespace)
    assert (ckpt["args"].model, ckpt["args"].lr, ckpt["args"].model_ema) == ("tiny_mlp", 0.1, True)
    assert_manifest(ckpt["state_dict"], "timm/checkpoint-0.pth.tar", "state_dict")
    assert_manifest(ckpt["state_dict_ema"], "timm/checkpoint-0.pth.tar", "state_dict_ema")
    assert safe_globals_now() == before  # nothing leaks into torch's allow-list


def test_research_file_with_numpy_and_paths_loads_with_default_settings() -> None:
    before = safe_globals_now()
    ckpt = load_checkpoint(PEERS / "research_numpy.pt")
    assert type(ckpt["best_acc"]) is np.float64 and ckpt["best_acc"] == 0.9
    assert ckpt["mean"].dtype == np.float32
    np.testing.assert_array_equal(ckpt["mean"], np.array([0.485, 0.456, 0.406], np.float32))
    assert ckpt["path"] == pathlib.PurePosixPath("x") and isinstance(ckpt["path"], pathlib.Path)
    assert_manifest(ckpt["model"], "research_numpy.pt", "model")
    assert load_state_dict(tiny_mlp(), ckpt).complete
    assert safe_globals_now() == before


def test_numpy_dtypes_scalars_and_dates_round_trip(tmp_path: Path) -> None:
    values = {
        "arrays": [np.array([0, 1, 1], dtype=d) for d in ("f2", "f8", "i8", "u1", "?", "c8")],
        "times": np.array(["2024-01-01"], dtype="datetime64[D]"),
        "objects": np.array([1, "a"], dtype=object),
        "scalars": [np.int32(7), np.bool_(True), np.float32(0.5)],
        "when": datetime.datetime(2024, 5, 1, 12, tzinfo=datetime.timezone.utc),
        "took": datetime.timedelta(seconds=3),
        "paths": [pathlib.PurePosixPath("a/b"), pathlib.PureWindowsPath("c:/d")],
    }
    torch.save(values, tmp_path / "v.pt")
    back = load_checkpoint(tmp_path / "v.pt")
    for a, b in zip(back["arrays"], values["arrays"], strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    assert back["times"][0] == np.datetime64("2024-01-01") and list(back["objects"]) == [1, "a"]
    assert back["scalars"] == values["scalars"]
    assert [type(s) for s in back["scalars"]] == [np.int32, np.bool_, np.float32]
    assert (back["when"], back["took"], back["paths"]) == (
        values["when"],
        values["took"],
        values["paths"],
    )


def test_a_global_the_user_allowed_stays_allowed(tmp_path: Path) -> None:
    # Leaving safe_globals removes what it added: allowing Namespace again must not take the
    # user's own entry away.
    with torch.serialization.safe_globals([argparse.Namespace]):
        load_checkpoint(PEERS / "timm" / "checkpoint-0.pth.tar")
        assert argparse.Namespace in safe_globals_now()


def test_overlapping_loads_in_threads_keep_the_types_allowed_until_the_last_ends() -> None:
    from trainperf.checkpoint._allow import allow_data_only

    assert argparse.Namespace not in safe_globals_now()
    first, second = allow_data_only(), allow_data_only()
    first.__enter__()  # one thread's load starts
    second.__enter__()  # another's, while the first is loading
    first.__exit__(None, None, None)  # the first ends: the second still loads
    assert argparse.Namespace in safe_globals_now()
    assert isinstance(load_checkpoint(PEERS / "timm" / "checkpoint-0.pth.tar"), dict)
    second.__exit__(None, None, None)
    assert argparse.Namespace not in safe_globals_now()  # the user's list as it was


class Odd(OrderedDict):  # type: ignore[type-arg]
    """An OrderedDict subclass: a class of the user's, so not data-only by default."""


class Config:
    def __init__(self, lr: float) -> None:
        self.lr = lr


@dataclasses.dataclass
class Stamp:
    step: int


class Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.marker}",))


def test_refusal_lists_every_blocked_global_at_once(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "mixed.pt"
    torch.save(
        {"odd": Odd(a=1), "cfg": Config(0.1), "x": Payload(marker), "w": torch.ones(1)}, path
    )
    before = safe_globals_now()
    with pytest.raises(
        UnsafeCheckpointError,
        match=r"3 global\(s\) not allowed: posix\.system, tests\.checkpoint\.test_allow\.Config, "
        r"tests\.checkpoint\.test_allow\.Odd.*`import posix, tests\.checkpoint\.test_allow; "
        r"torch\.serialization\.add_safe_globals\(\[posix\.system, ",
    ):
        load_checkpoint(path)
    assert not marker.exists()
    assert safe_globals_now() == before


def test_the_line_in_the_refusal_allows_the_file(tmp_path: Path) -> None:
    path = tmp_path / "mine.pt"
    torch.save({"cfg": Config(0.1), "when": Stamp(3)}, path)
    with pytest.raises(UnsafeCheckpointError, match=r"2 global\(s\) not allowed") as info:
        load_checkpoint(path)
    line = re.search(r"`(import [^`]*add_safe_globals\(\[.*?\]\))`", str(info.value))
    assert line is not None
    imports, listed = line.group(1).split("; torch.serialization.add_safe_globals(")
    scope: dict[str, Any] = {}
    exec(imports, scope)
    # The same list in a with-block, so the test leaves torch's allow-list as it was.
    with torch.serialization.safe_globals(eval(listed[:-1], scope)):
        ckpt = load_checkpoint(path)
    assert ckpt["cfg"].lr == 0.1 and ckpt["when"] == Stamp(3)


def test_whole_pickled_module_suggests_its_state_dict() -> None:
    with pytest.raises(
        UnsafeCheckpointError,
        match=r"torch\.nn\.modules\.container\.Sequential.*whole pickled model "
        r"\(torch\.save\(model\)\).*model\.state_dict\(\)",
    ):
        load_checkpoint(PEERS / "whole_module.pt")
