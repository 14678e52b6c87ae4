"""Shared set-up of the device tests."""

from __future__ import annotations

# torch.compile, the first optimizer step, DistributedDataParallel and
# use_deterministic_algorithms each import torch._dynamo (about 2 s here) the first time.
# Importing it while collecting keeps that one-time cost out of whichever test happens to run
# first, so --durations (and the slow marker) measure the tests themselves.
import torch._dynamo  # noqa: F401
