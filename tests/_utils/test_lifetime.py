"""DieWithParent: workers tied to whichever process started them."""

from __future__ import annotations

import multiprocessing
import pickle
import sys

import pytest
from torch.utils.data import DataLoader

from trainperf import DieWithParent


def record(worker_id: int) -> None:
    """A caller's worker_init_fn (module level: picklable)."""


def test_wrapping_keeps_the_callers_function_once_and_pickles() -> None:
    twice = DieWithParent(DieWithParent(record))
    assert twice.user_fn is record
    assert pickle.loads(pickle.dumps(twice)).user_fn is record
    assert DieWithParent(None).user_fn is None


def _iterate(loader: DataLoader[int], queue: multiprocessing.Queue[list[int]]) -> None:
    queue.put(sorted(int(x) for batch in loader for x in batch))


@pytest.mark.slow  # about 1 s: a child process starts two workers
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork and prctl are Linux's")
def test_a_loader_built_here_and_iterated_in_a_child_keeps_its_workers() -> None:
    # The workers' parent is the child, not this process: they must not think it died.
    loader = DataLoader(range(8), batch_size=2, num_workers=2, worker_init_fn=DieWithParent(None))
    ctx = multiprocessing.get_context("fork")
    queue: multiprocessing.Queue[list[int]] = ctx.Queue()
    child = ctx.Process(target=_iterate, args=(loader, queue))
    child.start()
    try:
        assert queue.get(timeout=60) == list(range(8))
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
            child.join()
    assert child.exitcode == 0
