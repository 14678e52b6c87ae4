"""trainperf.checkpoint._writer: the memory rule, staging into reused buffers, and the
handle that reports a background write (its failure raised once)."""

from __future__ import annotations

import collections
import errno
from pathlib import Path

import pytest
import torch

from trainperf.checkpoint._writer import SaveHandle, Staging, staging_fits, tensor_bytes
from trainperf.errors import CheckpointError

GiB = 1 << 30


def test_staging_fits_keeps_a_margin_free() -> None:
    # The margin is max(512 MiB, 5 % of total).
    assert staging_fits(GiB, 2 * GiB, 8 * GiB)
    assert not staging_fits(GiB, GiB + (511 << 20), 8 * GiB)
    assert staging_fits(GiB, GiB + (512 << 20), 8 * GiB)
    assert not staging_fits(GiB, GiB + (600 << 20), 100 * GiB)  # 5 GiB margin on 100 GiB
    assert staging_fits(0, 0, 0) is False  # nothing free at all: the margin cannot be kept


def test_tensor_bytes_counts_each_storage_once() -> None:
    w = torch.zeros(1000)
    payload = {"model": {"w": w, "tied": w, "view": w[:10]}, "opt": [torch.zeros(3, 2)]}
    assert tensor_bytes(payload) == (4000 + 24, True)


def test_staging_copies_and_reuses_its_buffers() -> None:
    staging = Staging()
    sd = collections.OrderedDict(w=torch.arange(6.0), b=torch.ones(2))
    sd._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    payload = {"model": sd, "step": 3, "pair": (torch.zeros(1), "x"), "tied": sd["w"]}
    assert staging.needed_bytes(payload) == (6 + 2 + 1) * 4  # the tied tensor once
    first = staging.stage(payload)
    sd["w"].add_(100)  # the training step changes the live tensor: the copy does not move
    assert first["model"]["w"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert first["model"]._metadata == {"": {"version": 1}} and first["pair"][1] == "x"
    assert type(first["model"]) is collections.OrderedDict and first["step"] == 3
    assert staging.needed_bytes(payload) == 0  # the buffers are there now
    second = staging.stage(payload)
    assert second["model"]["w"].data_ptr() == first["model"]["w"].data_ptr()  # reused
    assert second["tied"] is second["model"]["w"]  # one buffer for the tied tensor
    assert second["model"]["w"].tolist() == [100.0, 101.0, 102.0, 103.0, 104.0, 105.0]


def test_a_failure_is_raised_once_chained_with_the_path(tmp_path: Path) -> None:
    handle = SaveHandle(7, tmp_path / "step-000000007.pt", "process")
    assert not handle.done() and handle.wait(timeout=0.01) is False
    cause = OSError(errno.ENOSPC, "No space left on device")
    handle._finish(("could not save checkpoint x: No space left on device", cause), [])
    with pytest.raises(CheckpointError, match=r"background save of step 7 failed: could not") as e:
        handle.wait()
    assert e.value.__cause__ is cause and e.value.path == tmp_path / "step-000000007.pt"
    assert handle.wait() is True  # raised once; the Checkpointer's next call does not repeat it
    assert "failed" in repr(handle)
