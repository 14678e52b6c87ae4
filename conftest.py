"""Fixtures that apply to every test and doctest in the repository.

- the environment is restored after each test (tests and doctests set CUDA_VISIBLE_DEVICES,
  RANK, MASTER_PORT, ...);
- a leaked default process group is destroyed;
- a test that leaves child processes alive fails (and the children are killed);
- doctests are collected from the module that defines each object, not its public path.
"""

from __future__ import annotations

import doctest
import inspect
import os
from collections.abc import Iterator
from typing import Any

import psutil
import pytest
import torch

_stock_from_module = doctest.DocTestFinder._from_module


def _defined_in(obj: object) -> str | None:
    """The module whose code defines ``obj`` (its globals), whatever ``__module__`` says."""
    if isinstance(obj, property):
        obj = obj.fget
    obj = getattr(obj, "__func__", obj)  # staticmethod / classmethod
    if inspect.isfunction(obj):
        return str(obj.__globals__.get("__name__"))
    if inspect.isclass(obj):
        for member in vars(obj).values():
            found = _defined_in(member) if not inspect.isclass(member) else None
            if found and found.startswith("trainperf"):
                return found
    return None


def _from_module(self: doctest.DocTestFinder, module: Any, obj: object) -> bool:
    # Public objects report their public path (``trainperf.TuningReport``), so doctest's own
    # rule would look for a re-exported class's examples in the package that re-exports it,
    # where the names its examples use are not defined. Collect each trainperf object where
    # its code is, as if ``__module__`` had never been rewritten.
    home = _defined_in(obj)
    if home is not None and home.startswith("trainperf"):
        return home == module.__name__
    return bool(_stock_from_module(self, module, obj))


doctest.DocTestFinder._from_module = _from_module  # type: ignore[method-assign]


def pytest_configure(config: pytest.Config) -> None:
    # multiprocessing starts one resource-tracker process lazily (spawn/forkserver, shared
    # memory) and keeps it for the life of the interpreter; starting it up front keeps it out
    # of the per-test leaked-children check below.
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    # Tests run on 2 cores: one torch thread pool per test process is plenty and avoids
    # oversubscription when tests spawn workers.
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "requires_cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _restore_environment() -> Iterator[None]:
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(autouse=True)
def _destroy_leaked_process_group() -> Iterator[None]:
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail("the test left a torch.distributed process group initialised")


@pytest.fixture(autouse=True)
def _no_leaked_children() -> Iterator[None]:
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    yield
    # Children get a moment to finish exiting after the test's own cleanup.
    leaked = [p for p in me.children(recursive=True) if p.pid not in before]
    _, alive = psutil.wait_procs(leaked, timeout=5)
    alive = [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
    if alive:
        for p in alive:
            p.kill()
        psutil.wait_procs(alive, timeout=5)
        pytest.fail(f"the test left child processes alive: {[p.pid for p in alive]}")
