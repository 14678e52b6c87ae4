"""trainperf.loader._picklable: batches that workers could not send back.

A worker sends each batch to the main process pickled; a ``collate_fn`` that returns a
generator (or anything else that cannot be pickled) makes every worker pool hang. The
tuner sees it on the first batch it loads with ``num_workers=0`` and tries no pool.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.queues
import pickle
import threading
from collections.abc import Iterator, Mapping
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np
import pytest
import torch
from torch._utils import ExceptionWrapper
from torch.utils.data import TensorDataset

from tests.loader._fakes import quick
from trainperf.loader import AdaptiveDataLoader, TunedDataLoader, autotune_loader, tune_loader
from trainperf.loader._faults import classify_fault
from trainperf.loader._picklable import (
    FirstBatch,
    _pickle_error,
    _send_unpicklable,
    pickle_refusal,
    unpicklable_part,
)


def as_generator(samples: list[Any]) -> Iterator[Any]:
    """A collate_fn whose batches cannot be pickled (module level: the function itself can)."""
    return (s for s in samples)


def tiny() -> TensorDataset:
    return TensorDataset(torch.zeros(16, 2))


def test_a_batch_that_cannot_be_pickled_skips_workers_with_the_reason() -> None:
    with pytest.warns(RuntimeWarning, match="generator") as caught:
        r = tune_loader(tiny(), 4, **quick(max_workers=2, budget_s=4.0, collate_fn=as_generator))
    assert caught[0].filename == __file__
    assert r.num_workers == 0
    workers = [c for c in r.candidates if c.num_workers > 0]
    assert workers and all(c.fault == "pickle" for c in workers), r
    # No pool was started: nothing waited for a batch that could never arrive.
    assert all(c.startup_s is None and c.elapsed_s == 0.0 for c in workers), r
    reason = workers[0].reason or ""
    assert "generator" in reason and "num_workers=0" in reason and "collate_fn" in reason
    assert not any(c.fault == "hang" for c in r.candidates)


def test_autotune_loader_without_adapt_keeps_no_workers_for_such_a_batch() -> None:
    with pytest.warns(RuntimeWarning, match="cannot be pickled"):
        loader = autotune_loader(
            tiny(), 4, adapt=False, **quick(max_workers=2, budget_s=4.0, collate_fn=as_generator)
        )
    assert loader.num_workers == 0


def test_the_callers_own_workers_are_skipped_for_the_same_reason() -> None:
    with pytest.warns(RuntimeWarning, match="generator"):
        r = tune_loader(
            tiny(), 4, **quick(max_workers=2, budget_s=4.0, collate_fn=as_generator, num_workers=2)
        )
    mine = [c for c in r.candidates if (c.num_workers, c.prefetch_factor) == (2, 2)]
    assert mine and mine[0].status == "skipped" and mine[0].fault == "pickle", r


def test_tensors_and_plain_values_pickle() -> None:
    batch = {"x": torch.zeros(4, 3), "ids": [1, 2], "names": ("a", "b"), "a": np.zeros(2)}
    assert unpicklable_part(batch) is None
    assert unpicklable_part(torch.zeros(2)) is None


def test_tensors_are_left_out_of_the_check() -> None:
    # A tensor is never pickled by the check (workers send tensors through shared memory).
    class Refuses(torch.Tensor):
        def __reduce_ex__(self, protocol: Any) -> Any:
            raise AssertionError("the check pickled a tensor")

    assert unpicklable_part([torch.zeros(2).as_subclass(Refuses), 3]) is None


def test_the_part_that_cannot_be_pickled_is_named_with_where_it_is() -> None:
    found = unpicklable_part(x for x in range(3))
    assert found is not None and found[0] == "the batch" and found[1] == "generator"
    found = unpicklable_part([torch.zeros(2), {"ids": [1, threading.Lock()]}])
    assert found is not None
    assert found[0] == "batch[1]['ids'][1]" and found[1].endswith("lock"), found


def test_a_refusal_says_what_and_how_to_fix() -> None:
    batch = (torch.zeros(2), (x for x in range(2)))
    r = pickle_refusal(unpicklable_part(batch), max_workers=4, pin=False)
    assert r is not None and (r.num_workers, r.status, r.fault) == (1, "failed", "pickle")
    assert r.reason is not None
    assert "batch[1] is a generator" in r.reason
    assert "fix: return tensors, numbers, strings, lists, tuples or dicts" in r.reason
    assert pickle_refusal(None, max_workers=4, pin=False) is None
    assert pickle_refusal(unpicklable_part(batch), max_workers=0, pin=False) is None


def test_first_batch_keeps_only_the_finding() -> None:
    check = FirstBatch()
    assert check.found is None
    check([torch.zeros(2), (x for x in range(2))])
    assert check.found is not None and check.found[1] == "generator"
    check([torch.zeros(2)])  # only the first batch counts
    assert check.found is not None


def _nested(depth: int) -> list[Any]:
    batch: list[Any] = []
    for _ in range(depth):
        batch = [batch]
    return batch


def _pickles_in_a_thread(batch: Any) -> bool:
    """Whether ``batch`` pickles on a fresh thread's shallow stack, as a worker's feeder
    thread pickles it."""
    ok: list[bool] = []

    def dump() -> None:
        try:
            ForkingPickler.dumps(batch)
            ok.append(True)
        except RecursionError:
            ok.append(False)

    thread = threading.Thread(target=dump)
    thread.start()
    thread.join()
    return ok[0]


def test_a_batch_too_deep_for_the_checks_stack_is_not_refused() -> None:
    # The check pickles on the caller's (deep) stack, the workers on a shallow one: a batch
    # near the recursion limit pickled there but was refused here, with the wrong fix.
    low, high = 1, 10_000  # the deepest nesting that pickles in a thread, by bisection
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if _pickles_in_a_thread(_nested(mid)) else (low, mid - 1)
    batch = _nested(low)

    def from_deeper(frames: int) -> Any:
        if frames:
            return from_deeper(frames - 1)
        return _pickle_error(batch), unpicklable_part(batch)

    error, found = from_deeper(100)
    if error is None:
        # The premise fails where pickle counts its depth apart from the caller's Python
        # stack (CPython >= 3.12): the batch pickles here too, and the test would pass
        # without the check ever meeting a RecursionError.
        pytest.skip("pickling here does not reach the recursion limit sooner on a deep stack")
    assert isinstance(error, RecursionError), error  # the check's own pickling hit the limit
    assert found is None  # RecursionError: the check cannot tell, so no refusal


class _Unsayable(TypeError):
    def __str__(self) -> str:
        raise ValueError("no str")


class _RefusesPickling:
    def __reduce__(self) -> Any:
        raise _Unsayable()


class _Unrepresentable:
    def __repr__(self) -> str:
        raise ValueError("no repr")


def test_an_error_or_key_that_cannot_be_shown_is_named_by_its_type() -> None:
    found = unpicklable_part({_Unrepresentable(): _RefusesPickling()})
    assert found is not None
    assert found[0] == "batch[_Unrepresentable]" and found[2] == "_Unsayable", found


def test_the_check_never_breaks_tuning() -> None:
    class Broken(Mapping[str, Any]):  # local: cannot be pickled; fails when looked into
        def __getitem__(self, key: str) -> Any:
            raise KeyError(key)

        def __iter__(self) -> Iterator[str]:
            raise RuntimeError("cannot iterate")

        def __len__(self) -> int:
            return 1

    check = FirstBatch()
    check(Broken())
    assert check.checked and check.found is None


def refuses_pickling(samples: list[Any]) -> dict[str, Any]:
    """A collate_fn whose batch cannot be pickled, with an error whose str() raises."""
    return {"x": torch.stack([s[0] for s in samples]), "meta": _RefusesPickling()}


def test_tune_loader_survives_an_error_that_cannot_be_shown() -> None:
    with pytest.warns(RuntimeWarning, match="_RefusesPickling"):
        r = tune_loader(
            tiny(), 4, **quick(max_workers=2, budget_s=4.0, collate_fn=refuses_pickling)
        )
    assert r.num_workers == 0
    assert all(c.fault == "pickle" for c in r.candidates if c.num_workers > 0), r


class LockAt(torch.utils.data.Dataset[Any]):
    """Sample ``bad`` holds a lock (it cannot be pickled); the others are plain."""

    def __init__(self, n: int = 100, bad: int = 40) -> None:
        self.n, self.bad = n, bad

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return {"x": torch.zeros(2), "lock": threading.Lock() if i == self.bad else 0}


def as_list(samples: list[Any]) -> list[Any]:
    """A collate_fn that keeps the samples as they are (default_collate refuses a lock)."""
    return samples


def _first_error(loader: Any) -> tuple[int, BaseException]:
    """The batches ``loader`` yields before it raises, and the error (its workers stopped)."""
    it = iter(loader)
    seen = 0
    try:
        for _ in it:
            seen += 1
    except Exception as e:
        return seen, e
    finally:
        if isinstance(loader, AdaptiveDataLoader):
            loader.close()
        else:
            it._shutdown_workers()
    raise AssertionError(f"no error after {seen} batches")


def test_a_later_batch_that_cannot_be_pickled_raises_in_the_loop_at_once() -> None:
    # Sample 40 is in batch 10: torch's worker drops it (a traceback on stderr) and a
    # DataLoader without timeout waits for it for ever; the loader's workers send an error.
    loader = TunedDataLoader(LockAt(), batch_size=4, num_workers=2, collate_fn=as_list, timeout=20)
    seen, error = _first_error(loader)
    assert seen == 10
    assert isinstance(error, pickle.PicklingError), error
    text = str(error)
    assert "batch 10 " in text and "batch[0]['lock'] is a _thread.lock" in text, text
    assert "num_workers=0" in text and "timed out" not in text


def test_the_adaptive_loaders_workers_send_the_error_too() -> None:
    loader = AdaptiveDataLoader(
        LockAt(), batch_size=4, num_workers=2, collate_fn=as_list, timeout=20, max_workers=2
    )
    seen, error = _first_error(loader)
    assert seen == 10 and isinstance(error, pickle.PicklingError), error
    assert "_thread.lock" in str(error)


def test_the_tuner_marks_workers_that_meet_such_a_batch_as_pickle_faults() -> None:
    with pytest.warns(RuntimeWarning, match="cannot be pickled"):
        r = tune_loader(LockAt(), 4, **quick(max_workers=2, budget_s=6.0, collate_fn=as_list))
    assert r.num_workers == 0
    workers = [c for c in r.candidates if c.num_workers > 0 and c.status == "failed"]
    assert workers and workers[0].fault == "pickle", r
    assert "lock" in (workers[0].reason or "") and "num_workers=0" in (workers[0].reason or "")
    assert not any(c.fault in ("hang", "budget") for c in r.candidates), r


def test_an_error_queued_by_the_worker_is_left_as_it_is() -> None:
    # Anything but a batch (a 2-tuple of an int and a value) goes to the original handler.
    calls: list[Any] = []
    queue = type("Q", (), {"put": lambda self, obj: calls.append(obj)})()
    _send_unpicklable(queue, TypeError("x"), "not a batch")  # printed, not queued
    assert calls == []


def test_an_item_a_closed_queue_refuses_is_printed_not_raised(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The handler runs in the queue's feeder thread: an error raised there (put on a queue
    # torch closed at shutdown) killed the thread, and that worker sent nothing more.
    def closed(obj: object) -> None:
        raise ValueError("Queue is closed")

    queue = type("Q", (), {"put": lambda self, obj: closed(obj)})()
    try:  # the feeder thread calls the handler while it handles the pickling error
        raise TypeError("cannot pickle lock")
    except TypeError as e:
        _send_unpicklable(queue, e, (3, [threading.Lock()]))
    assert "cannot pickle lock" in capsys.readouterr().err  # Python's handler printed it


class _Queued:
    """A queue that keeps what is put in it."""

    def __init__(self) -> None:
        self.items: list[Any] = []

    def put(self, obj: Any) -> None:
        self.items.append(obj)


def _sent(error: BaseException, obj: Any) -> BaseException:
    """What the main process raises for ``obj`` that the worker's queue could not pickle."""
    queue = _Queued()
    _send_unpicklable(queue, error, obj)
    assert len(queue.items) == 1, queue.items
    index, wrapper = pickle.loads(ForkingPickler.dumps(queue.items[0]))  # as it travels
    assert index == obj[0]
    with pytest.raises(Exception) as caught:
        wrapper.reraise()
    return caught.value


_SHM_FULL = "unable to write to file </torch_1_2_3>: No space left on device (28)"


def test_a_full_dev_shm_keeps_its_type_and_gets_the_shared_memory_fix() -> None:
    # Tensors go through /dev/shm: when it is full, the batch is not at fault and the pickle
    # fix ("return tensors, numbers, ...") is the wrong advice.
    error = _sent(RuntimeError(_SHM_FULL), (7, [torch.zeros(2)]))
    assert type(error) is RuntimeError, error
    text = str(error)
    assert "batch 7 " in text and "No space left on device" in text, text
    assert "--shm-size" in text and "emptyDir" in text and "prefetch_factor" in text, text
    assert "return tensors" not in text and "cannot be pickled" not in text, text
    kind, reason = classify_fault(error, start_method="fork", timeout_s=10)
    assert kind == "shm"
    # The worker's fix was in the reason a second time, after torch's "Original " prefix.
    assert reason.count("fix:") == 1 and "Original " not in reason, reason


def test_too_many_open_files_keeps_its_type_and_gets_the_file_limit_fix() -> None:
    error = _sent(OSError(24, "Too many open files"), (0, [torch.zeros(2)]))
    assert isinstance(error, OSError), error
    text = str(error)
    assert "Too many open files" in text and "ulimit -n" in text, text
    assert "file_system" in text and "return tensors" not in text, text


def test_a_tensor_that_requires_grad_keeps_torchs_own_error() -> None:
    batch = [torch.zeros(2, requires_grad=True) * 2]  # not a leaf: torch refuses to send it
    try:
        ForkingPickler.dumps(batch)
    except RuntimeError as e:
        error = _sent(e, (2, batch))
    else:
        pytest.skip("this torch pickles a non-leaf tensor that requires grad")
    assert type(error) is RuntimeError, error
    assert "batch 2 " in str(error) and "detach" in str(error), error
    assert "return tensors" not in str(error), error


class _TwoArgs(Exception):
    def __init__(self, a: str, b: str) -> None:
        super().__init__(a, b)


def test_an_error_whose_type_cannot_be_rebuilt_comes_back_as_runtime_error() -> None:
    class Local(Exception):  # cannot be pickled
        pass

    for original in (_TwoArgs("a", "b"), Local("disk on fire")):
        error = _sent(original, (1, [torch.zeros(2)]))
        assert type(error) is RuntimeError, error
        assert "batch 1 " in str(error) and type(original).__name__ in str(error), error


def test_a_full_dev_shm_in_a_worker_is_raised_as_it_is() -> None:
    loader = TunedDataLoader(
        tiny(), batch_size=4, num_workers=1, worker_init_fn=_shm_full, timeout=20
    )
    seen, error = _first_error(loader)
    assert seen == 0 and type(error) is RuntimeError, error
    assert "No space left on device" in str(error) and "--shm-size" in str(error), error


def _no_space(storage: Any) -> Any:
    raise RuntimeError(_SHM_FULL)


def _shm_full(worker_id: int) -> None:
    """A worker_init_fn whose worker cannot put any tensor in shared memory (/dev/shm full)."""
    for storage in (torch.UntypedStorage, torch.storage.TypedStorage):
        ForkingPickler.register(storage, _no_space)


def _local_error() -> type[Exception]:
    class NoSuchKey(Exception):  # like botocore's per-client exception classes
        pass

    return NoSuchKey


_NoSuchKey = _local_error()


class _RaisesAt(torch.utils.data.Dataset[Any]):
    """Sample 5 raises an exception whose class cannot be pickled."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> Any:
        if i == 5:
            raise _NoSuchKey(f"s3://bucket/{i}")
        return torch.zeros(2)


def test_a_worker_error_whose_class_cannot_be_pickled_is_queued() -> None:
    try:
        raise _NoSuchKey("s3://bucket/5")
    except _NoSuchKey:
        wrapper = ExceptionWrapper(where="in DataLoader worker process 1")  # type: ignore[no-untyped-call]
    try:
        ForkingPickler.dumps((5, wrapper))
    except Exception as e:
        error = _sent(e, (5, wrapper))
    else:
        raise AssertionError("the wrapper pickled")
    assert type(error) is RuntimeError, error
    text = str(error)
    assert "in DataLoader worker process 1" in text and "s3://bucket/5" in text, text
    assert "its class " in text and "NoSuchKey cannot be pickled" in text, text
    assert "define it at module level" in text, text


def test_a_worker_error_whose_class_cannot_be_pickled_raises_in_the_loop() -> None:
    # torch's worker queues the error wrapped with its class; the queue could not pickle it
    # and dropped it, and the loop waited until the timeout.
    loader = TunedDataLoader(_RaisesAt(), batch_size=2, num_workers=2, timeout=10)
    seen, error = _first_error(loader)
    assert seen == 2, seen
    assert "timed out" not in str(error) and "s3://bucket/5" in str(error), error
    assert "define it at module level" in str(error), error


_PYTHONS_HANDLER = multiprocessing.queues.Queue._on_queue_feeder_error  # type: ignore[attr-defined]


class _SideChannel(torch.utils.data.Dataset[Any]):
    """Tells, from the worker, whether the user's own queue keeps Python's handler for what
    it cannot pickle (it drops it); with torch's handled on the class, ``(i, lambda)`` put
    on it arrived as a torch ExceptionWrapper."""

    def __init__(self, queue: Any) -> None:
        self.queue = queue

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> Any:
        self.queue.put(i)  # its feeder thread starts, and reads the handler
        return self.queue._on_queue_feeder_error is _PYTHONS_HANDLER


def test_the_users_own_queues_in_a_worker_keep_pythons_handler() -> None:
    queue = multiprocessing.get_context("fork").Queue()
    loader = TunedDataLoader(
        _SideChannel(queue), batch_size=2, num_workers=1, multiprocessing_context="fork"
    )
    assert [b.tolist() for b in loader] == [[True, True], [True, True]]
