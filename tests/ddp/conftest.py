"""Every ddp test starts outside any launcher: no torchrun or SLURM variables are inherited."""

from __future__ import annotations

import os

import pytest

# torch.compile, the first optimizer step, DistributedDataParallel and
# use_deterministic_algorithms each import torch._dynamo (about 2 s here) the first time.
# Importing it while collecting keeps that one-time cost out of whichever test happens to run
# first, so --durations (and the slow marker) measure the tests themselves.
import torch._dynamo  # noqa: F401

from trainperf.ddp import _env


def _clear_launcher_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name in _env.TORCHRUN_VARS or name.startswith("SLURM_") or name == "LOCAL_WORLD_SIZE":
            monkeypatch.delenv(name)


@pytest.fixture(autouse=True)
def _no_launcher_env(monkeypatch: pytest.MonkeyPatch) -> None:
    _clear_launcher_env(monkeypatch)
