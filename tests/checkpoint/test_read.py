"""trainperf.checkpoint._read: reading one checkpoint by its first bytes (files that are not
checkpoints, or are damaged, named as such)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.checkpoint._common import PEERS
from trainperf.checkpoint import load_checkpoint, save_checkpoint
from trainperf.errors import CheckpointCorruptError, NotACheckpointError


@pytest.mark.parametrize("name", ["__0_0.distcp", ".metadata"])
def test_a_file_of_a_dcp_directory_names_the_converter(tmp_path: Path, name: str) -> None:
    shutil.copytree(PEERS / "dcp", tmp_path / "dcp")
    with pytest.raises(
        NotACheckpointError,
        match=rf"{name}.*torch\.distributed\.checkpoint.*dcp_to_torch_save\(.*dcp'",
    ):
        load_checkpoint(tmp_path / "dcp" / name)


@pytest.mark.parametrize("size", [64, 100_000])
def test_a_file_of_zero_bytes_is_damaged_not_text(tmp_path: Path, size: int) -> None:
    # What a power loss after a plain torch.save can leave on ext4/XFS: the size, no data.
    (tmp_path / "c.pt").write_bytes(bytes(size))
    with pytest.raises(CheckpointCorruptError, match=r"c\.pt starts with zero bytes.*earlier"):
        load_checkpoint(tmp_path / "c.pt")


def test_a_torch_file_with_zeroed_start_is_damaged(tmp_path: Path) -> None:
    save_checkpoint({"w": torch.ones(4)}, tmp_path / "c.pt")
    data = bytearray((tmp_path / "c.pt").read_bytes())
    data[:4096] = bytes(4096)
    (tmp_path / "c.pt").write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError, match=r"c\.pt starts with"):
        load_checkpoint(tmp_path / "c.pt")
