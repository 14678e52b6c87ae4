"""trainperf.pipelines._torchvision: the DataLoader backend, its workers and the autotuner."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.pipelines._images import SIZE, _epoch, _indices, _loader, _reference_eval, requires_cuda
from trainperf.pipelines._source import load_source

PIL = pytest.importorskip("PIL.Image")
torchvision = pytest.importorskip("torchvision")


def test_torchvision_persistent_workers_end_with_close(folder: Path) -> None:
    import psutil

    def children() -> set[psutil.Process]:
        return set(psutil.Process().children(recursive=True))

    # Earlier tests may have started long-lived helpers (multiprocessing's resource tracker).
    before = children()
    loader = _loader(
        folder,
        "torchvision",
        batch_size=12,
        loader_kwargs={"num_workers": 1, "persistent_workers": True},
    )
    assert sorted(_indices(loader)) == list(range(24))
    workers = children() - before
    assert workers  # the worker outlives the epoch...
    loader.close()
    assert psutil.wait_procs(list(workers), timeout=10)[1] == []  # ...not close()


def test_file_dataset_takes_a_plain_index_as_epoch_zero(folder: Path) -> None:
    from trainperf.pipelines._torchvision import FileDataset

    files = load_source(folder, on_error="raise").files
    dataset = FileDataset(files, train=True, size=SIZE, seed=0)
    image, index = dataset[3]
    assert index == 3 and image.shape == (SIZE, SIZE, 3) and image.dtype == torch.uint8
    assert torch.equal(image, dataset[(3, 0)][0]) and not torch.equal(image, dataset[(3, 1)][0])


def test_torchvision_results_do_not_depend_on_the_worker_count(folder: Path) -> None:
    inline = _loader(folder, "torchvision", batch_size=12, seed=5)
    workers = _loader(
        folder, "torchvision", batch_size=12, seed=5, loader_kwargs={"num_workers": 2}
    )
    for (a, la, ia), (b, lb, ib) in zip(_epoch(inline), _epoch(workers), strict=True):
        assert torch.equal(ia, ib) and torch.equal(la, lb) and torch.equal(a, b)


@pytest.mark.slow
def test_torchvision_backend_builds_its_dataloader_with_the_autotuner(folder: Path) -> None:
    loader = _loader(
        folder,
        "torchvision",
        batch_size=6,
        loader_kwargs={"budget_s": 10, "cache": False, "progress": False, "max_workers": 1},
    )
    report = loader.dataloader.tuning_report  # type: ignore[attr-defined]
    assert report.num_workers in (0, 1)
    assert sorted(_indices(loader)) == list(range(24))


@pytest.mark.slow
def test_autotuned_torchvision_backend_shows_no_progress_bar_unless_asked(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import trainperf.loader

    seen: list[dict[str, Any]] = []
    real = trainperf.loader.autotune_loader

    def autotune_loader(dataset: Any, batch_size: int, **kw: Any) -> Any:
        seen.append(kw)
        return real(dataset, batch_size, **{**kw, "max_workers": 0, "budget_s": 5})

    monkeypatch.setattr(trainperf.loader, "autotune_loader", autotune_loader)
    _loader(folder, "torchvision", loader_kwargs={"cache": False})
    _loader(folder, "torchvision", loader_kwargs={"cache": False, "progress": True})
    assert [kw["progress"] for kw in seen] == [False, True]
    assert all(kw["cache"] is False for kw in seen)


@requires_cuda
def test_torchvision_backend_on_cuda_normalises_there_exactly(folder: Path) -> None:
    loader = _loader(
        folder, "torchvision", device="cuda", train=False, batch_size=8, last_batch="keep"
    )
    for images, labels, indices in loader.iter_with_indices():
        assert images.device.type == labels.device.type == "cuda" and images.is_contiguous()
        for image, index in zip(images.cpu(), indices.tolist(), strict=True):
            expected = _reference_eval(loader.files[index], SIZE)
            torch.testing.assert_close(image, expected, atol=1e-5, rtol=0)


def test_plain_dataloader_workers_are_tied_to_their_parent(folder: Path) -> None:
    from trainperf import DieWithParent

    def mine(worker_id: int) -> None:
        pass

    loader = _loader(
        folder, "torchvision", loader_kwargs={"num_workers": 2, "worker_init_fn": mine}
    )
    init = loader.dataloader.worker_init_fn  # type: ignore[attr-defined]
    assert isinstance(init, DieWithParent) and init.user_fn is mine
    plain = _loader(folder, "torchvision", loader_kwargs={"num_workers": 1})
    assert isinstance(plain.dataloader.worker_init_fn, DieWithParent)  # type: ignore[attr-defined]


@pytest.mark.slow  # about 2 s: two workers start, twice
@pytest.mark.parametrize("persistent", [False, True])
def test_closed_mid_epoch_it_says_so_and_its_workers_are_gone(
    folder: Path, persistent: bool
) -> None:
    import psutil

    kwargs = {"num_workers": 2, "persistent_workers": persistent}
    loader = _loader(folder, "torchvision", batch_size=2, loader_kwargs=kwargs)
    before = {p.pid for p in psutil.Process().children()}
    it = loader.iter_with_indices()
    next(it)
    workers = [p for p in psutil.Process().children() if p.pid not in before]
    assert len(workers) == 2
    loader.close()  # it went on yielding the workers' batches, and left them running
    with pytest.raises(RuntimeError, match=r"^this image loader was closed$"):
        next(it)
    assert _alive([w.pid for w in workers]) == []


def _alive(pids: list[int]) -> list[int]:
    import psutil

    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's"
)
def test_workers_die_with_a_sigkilled_training_process(folder: Path, tmp_path: Path) -> None:
    script = Path(__file__).parent / "_orphans.py"
    root = Path(__file__).parents[2]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["PYTHONPATH"] = os.pathsep.join([str(root / "src"), str(root), env.get("PYTHONPATH", "")])
    proc = subprocess.Popen(
        [sys.executable, str(script), str(folder), str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 120
        files = [tmp_path / "worker0", tmp_path / "worker1"]
        while not all(f.exists() for f in files):
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"the workers never started:\n{proc.communicate()[0]}")
            time.sleep(0.1)
        pids = [int(f.read_text()) for f in files]
        assert len(_alive(pids)) == 2
        proc.kill()  # SIGKILL: no clean-up code runs in the training process
        proc.wait(timeout=30)
        # Busy in worker_init_fn, PyTorch's own parent check (every 5 s, between batches)
        # never runs: without the parent-death signal they would sleep on for 300 s.
        deadline = time.monotonic() + 10
        while _alive(pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _alive(pids) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in _alive(pids):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
def test_pillows_own_limit_is_named_with_its_fix_when_a_worker_decodes(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trainperf.pipelines._torchvision import FileDataset

    files = load_source(folder, on_error="raise").files
    dataset = FileDataset(files, train=False, size=SIZE, seed=0, max_pixels=None)
    monkeypatch.setattr(PIL, "MAX_IMAGE_PIXELS", 100)  # every test image is over twice this
    with pytest.raises(
        RuntimeError,
        match=r"could not decode image .*DecompressionBombError.*PIL\.Image\.MAX_IMAGE_PIXELS "
        r"\(now 100\): raise it along with max_pixels",
    ):
        dataset[0]


def test_a_file_gone_since_the_check_is_named_as_changed(fresh_folder: Path) -> None:
    from trainperf.pipelines._torchvision import FileDataset

    files = load_source(fresh_folder, on_error="raise").files
    dataset = FileDataset(files, train=False, size=SIZE, seed=0)
    Path(files[2]).unlink()
    with pytest.raises(
        RuntimeError,
        match=r"image '[^']*' cannot be read \(No such file or directory\), so it is not "
        r"decoded: it changed after the loader checked it",
    ):
        dataset[2]


def test_a_file_that_became_a_fifo_is_not_opened_by_a_worker(fifo_folder: Path) -> None:
    from trainperf.pipelines._torchvision import FileDataset

    dataset = FileDataset([str(fifo_folder / "a_red" / "pipe.jpg")], train=False, size=SIZE, seed=0)
    with pytest.raises(RuntimeError, match=r"pipe\.jpg' not a regular file \(a FIFO\), so it"):
        dataset[0]


@pytest.mark.slow  # about 2 s: two workers start
def test_an_epoch_ended_by_a_decode_error_ends_its_workers(truncated_folder: Path) -> None:
    import psutil

    before = {p.pid for p in psutil.Process().children()}
    loader = _loader(
        truncated_folder, "torchvision", train=False, batch_size=5, loader_kwargs={"num_workers": 2}
    )
    epoch = iter(loader)
    next(epoch)
    workers = [p.pid for p in psutil.Process().children() if p.pid not in before]
    assert len(workers) == 2
    with pytest.raises(RuntimeError, match=r"could not decode image .*truncated\.jpg"):
        for _ in epoch:
            pass
    assert _gone(workers) == []  # the traceback kept the epoch's DataLoader iterator alive
    loader.close()


def _gone(pids: list[int], timeout: float = 10) -> list[int]:
    """The pids still alive (not zombies) after up to ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return _alive(pids)


def test_sampler_set_epoch_as_lightning_calls_it_sets_the_loaders_epoch(folder: Path) -> None:
    # Lightning (and scripts written for a DataLoader) call loader.sampler.set_epoch(e) at
    # each epoch's start, with e the epoch resumed from a checkpoint.
    loader = _loader(folder, "torchvision", batch_size=6, seed=5)
    reference = _loader(folder, "torchvision", batch_size=6, seed=5)
    orders = [_indices(reference) for _ in range(4)]
    loader.sampler.set_epoch(3)  # type: ignore[attr-defined]
    assert loader.epoch == 3 and _indices(loader) == orders[3]
    loader.dataloader.sampler.set_epoch(1)  # type: ignore[attr-defined]
    assert _indices(loader) == orders[1] and loader.epoch == 2
    with pytest.raises(ValueError, match=r"epoch must be an int >= 0, got -1"):
        loader.sampler.set_epoch(-1)  # type: ignore[attr-defined]


def _orders(folder: Path, epochs: int) -> list[list[int]]:
    """The first ``epochs`` passes' file indices of a fresh loader built as ``_seeded``."""
    reference = _seeded(folder)
    return [_indices(reference) for _ in range(epochs)]


def _seeded(folder: Path, **kw: Any) -> Any:
    return _loader(folder, "torchvision", batch_size=6, seed=5, **kw)


def test_loader_survives_a_pickle_round_trip(folder: Path) -> None:
    # The sampler held a weak reference to its loader, which pickle refuses: a loader could
    # not be passed to a spawned process (trainperf.ddp.launch).
    import pickle

    orders = _orders(folder, 4)
    loader = _seeded(folder)
    restored = pickle.loads(pickle.dumps(loader))
    assert [_indices(restored) for _ in range(2)] == orders[:2]
    restored.sampler.set_epoch(3)
    assert restored.epoch == 3 and _indices(restored) == orders[3]
    assert loader.epoch == 0 and _indices(loader) == orders[0]


def test_a_deep_copy_sets_its_own_epoch_not_the_originals(folder: Path) -> None:
    # The copy's sampler kept the original's weak reference: its set_epoch set the original.
    import copy

    orders = _orders(folder, 4)
    loader = _seeded(folder)
    twin = copy.deepcopy(loader)
    twin.sampler.set_epoch(3)
    assert (loader.epoch, twin.epoch) == (0, 3)
    assert _indices(twin) == orders[3] and _indices(loader) == orders[0]


def test_iterating_the_dataloader_itself_draws_the_epoch_the_sampler_was_set_to(
    folder: Path,
) -> None:
    # sampler.set_epoch(e) set the loader's epoch but not the sampler's own, so a loop over
    # loader.dataloader drew the same order every epoch.
    orders = _orders(folder, 4)
    loader = _seeded(folder)
    dataloader = loader.dataloader
    for epoch in (2, 3, 2):
        loader.sampler.set_epoch(epoch)
        drawn = [i for _, indices in dataloader for i in indices.tolist()]
        assert drawn == orders[epoch]
    assert loader.epoch == 2 and _indices(loader) == orders[2]


@pytest.mark.parametrize("workers", [0, 2])
def test_each_pass_draws_its_own_epoch_and_sampler_set_epoch_sets_the_next(
    folder: Path, workers: int
) -> None:
    orders = _orders(folder, 6)
    loader = _seeded(folder, loader_kwargs={"num_workers": workers})
    sampler: Any = loader.sampler
    first, second = loader.iter_with_indices(), loader.iter_with_indices()
    assert loader.epoch == sampler.epoch == 2
    assert [i for _, _, idx in second for i in idx.tolist()] == orders[1]
    batches = iter(first)  # begun after a later pass: still epoch 0's order
    order = next(batches)[2].tolist()
    sampler.set_epoch(5)  # during a pass: the next one's
    order += [i for _, _, idx in batches for i in idx.tolist()]
    assert order == orders[0] and _indices(loader) == orders[5]
    sampler.set_epoch(5)  # an epoch read already: read again
    assert _indices(loader) == orders[5] and loader.epoch == 6


def test_a_pass_begun_in_another_thread_while_one_draws_reads_the_next_epoch(
    folder: Path,
) -> None:
    # A pass set the sampler's epoch to the one it draws until its first batch came: a pass
    # begun meanwhile in another thread read that epoch too (the same order and crops twice)
    # and the loader's epoch was counted once for the two.
    import threading

    orders = _orders(folder, 2)
    loader = _seeded(folder, loader_kwargs={"num_workers": 0})
    dataset: Any = loader.dataset  # type: ignore[attr-defined]
    decode, other, calls = dataset._decode, [], [0]

    def decode_and_start_a_pass_once(path: str) -> Any:
        calls[0] += 1
        if calls[0] == 1:  # inside the first pass's draw of its first batch
            thread = threading.Thread(target=lambda: other.extend(_indices(loader)))
            thread.start()
            thread.join()
        return decode(path)

    dataset._decode = decode_and_start_a_pass_once
    first = [i for _, _, idx in loader.iter_with_indices() for i in idx.tolist()]
    assert (first, other) == (orders[0], orders[1])
    assert loader.epoch == 2


def test_a_pass_begun_inside_another_over_persistent_workers_leaves_it_whole(
    folder: Path,
) -> None:
    # Persistent workers are one DataLoader iterator, which iter() resets: a peek inside a
    # pass (next(iter(loader))) restarted that pass's epoch under its loop, repeating batches.
    orders = _orders(folder, 2)
    loader = _seeded(folder, loader_kwargs={"num_workers": 1, "persistent_workers": True})
    try:
        order, peeked = [], []
        for i, (_, _, idx) in enumerate(loader.iter_with_indices()):
            order += idx.tolist()
            if i == 0:
                peeked = next(loader.iter_with_indices())[2].tolist()
        assert order == orders[0] and peeked == orders[1][: len(peeked)]
        kept = loader.dataloader._iterator
        assert _indices(loader) == _orders(folder, 3)[2] and loader.dataloader._iterator is kept
    finally:
        loader.close()


def test_passes_over_a_tuned_persistent_pool_reuse_it(folder: Path) -> None:
    # Before: the pass held the pool's iterator in a local while it called iter(), which a
    # tuned DataLoader (the tuner's choice of persistent workers, the default path) read as
    # a pass in progress: every pass after the first started a new pool beside the idle one.
    from types import SimpleNamespace

    from trainperf.loader._autotune import _tuned

    loader = _seeded(folder, loader_kwargs={"num_workers": 0})
    plain = loader.dataloader
    chosen = {
        "batch_size": 6,
        "sampler": loader.sampler,
        "drop_last": plain.drop_last,
        "num_workers": 1,
        "persistent_workers": True,
        "collate_fn": plain.collate_fn,
    }
    tuned = _tuned(loader.dataset, SimpleNamespace(best_kwargs=chosen), asked=None)  # type: ignore[arg-type]
    loader.dataloader = tuned
    started = []
    make = tuned._get_iterator

    def counted() -> Any:
        started.append(1)
        return make()

    tuned._get_iterator = counted  # type: ignore[method-assign]
    try:
        assert [_indices(loader) for _ in range(3)] == _orders(folder, 3)
        assert len(started) == 1
    finally:
        loader.close()
