"""trainperf.pipelines._dali: the DALI backend, its graphs and CpuTrainFinish."""

from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.pipelines._images import _epoch, _indices, _loader, _pixels, needs_dali, write_tiff
from trainperf.pipelines._source import load_source

PIL = pytest.importorskip("PIL.Image")
torchvision = pytest.importorskip("torchvision")


@needs_dali
def test_dali_epoch_abandoned_part_way_is_finished_before_the_next(folder: Path) -> None:
    loader = _loader(folder, "dali", batch_size=5, last_batch="keep")
    it = loader.iter_with_indices()
    next(it)
    it.close()
    assert sorted(_indices(loader)) == list(range(24))
    assert len(_epoch(loader)) == len(loader)


@needs_dali
@pytest.mark.parametrize("train", [True, False])
def test_dali_cpu_batches_a_caller_keeps_stay_intact(folder: Path, train: bool) -> None:
    # On the CPU, eval batches are DALI's own buffers (dynamic executor, no copy) and train
    # batches reused ones (CpuTrainFinish): a batch that is kept must not be written over by
    # later batches, nor by writes into them.
    loader = _loader(folder, "dali", batch_size=5, last_batch="keep", train=train)
    kept = [(images, images.clone()) for images, _, _ in _epoch(loader)[:2]]
    for _ in range(2):
        for images, _, _ in _epoch(loader):
            images.mul_(0)
    for images, snapshot in kept:
        assert torch.equal(images, snapshot)
        assert snapshot.abs().sum() > 0


@needs_dali
def test_dali_after_a_decode_error_says_so_instead_of_hanging(truncated_folder: Path) -> None:
    from trainperf.pipelines._dali import _cause

    loader = _loader(truncated_folder, "dali", batch_size=25, train=False, last_batch="keep")
    with pytest.raises(RuntimeError, match="cannot continue after an error"):
        _epoch(loader)
    with pytest.raises(RuntimeError, match=r"failed earlier: DALI could not decode .*truncated"):
        _epoch(loader)
    message = (
        "Error in CPU operator\n  File x\nencountered:\n\nbad thing\n"
        "Current pipeline object is no longer valid."
    )
    assert _cause(message) == "bad thing"


def _reference_finish(
    crop: torch.Tensor, flip: bool, size: int, mean: list[float], std: list[float]
) -> torch.Tensor:
    """torchvision's tensor transforms: Resize (antialiased) on uint8, hflip, ToTensor-style
    scaling, Normalize."""
    import torchvision.transforms.functional as TF

    img = TF.resize(crop.permute(2, 0, 1).contiguous(), [size, size], antialias=True)
    if flip:
        img = TF.hflip(img)
    return TF.normalize(img.float() / 255, mean, std)


# 24 px: one row band; 128 px: two bands, the second shorter (see CpuTrainFinish).
@pytest.mark.parametrize("size", [24, 128])
def test_cpu_train_finish_matches_torchvision_resize_flip_normalize(size: int) -> None:
    from trainperf.pipelines._dali import CpuTrainFinish

    mean, std = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
    g = torch.Generator().manual_seed(0)
    # down, same size, up, and mixed
    shapes = [(2 * size + 3, 3 * size), (size, size), (size // 2, size // 3), (size * 4, 31)]
    crops = [torch.randint(0, 256, (h, w, 3), dtype=torch.uint8, generator=g) for h, w in shapes]
    flips = [True, False, True, False]
    batch = CpuTrainFinish(size, mean=mean, std=std)(crops, flips)
    assert batch.shape == (4, 3, size, size) and batch.dtype == torch.float32
    assert batch.is_contiguous()
    # torch's uint8 resize rounds in fixed point on channels_last input and in float on
    # contiguous input (torchvision's Resize here): results can differ by one 8-bit level.
    level = 1 / (255 * min(std)) + 1e-5
    for got, crop, flip in zip(batch, crops, flips, strict=True):
        expected = _reference_finish(crop, flip, size, mean, std)
        torch.testing.assert_close(got, expected, rtol=0, atol=level)
        assert (got - expected).abs().mean() < level / 4  # off by a level at a few pixels


def _solid(value: int) -> list[torch.Tensor]:
    return [torch.full((10, 10, 3), value, dtype=torch.uint8)] * 2


def test_cpu_train_finish_reuses_a_buffer_only_once_nothing_holds_it() -> None:
    from trainperf.pipelines._dali import CpuTrainFinish

    finish = CpuTrainFinish(8, mean=[0.0] * 3, std=[1.0] * 3, keep=3)
    no_flip = [False, False]
    first = finish(_solid(10), no_flip)
    first_ptr = first.data_ptr()
    del first
    assert finish(_solid(20), no_flip).data_ptr() == first_ptr  # dropped at once: reused

    # Each holder keeps its batch's buffer: the tensor, a view, a .numpy() array.
    kept = finish(_solid(30), no_flip)
    view = finish(_solid(40), no_flip)[1:]
    array = finish(_solid(50), no_flip).numpy()
    after = finish(_solid(60), no_flip)  # all three kept buffers in use: fresh memory
    again = finish(_solid(70), no_flip)
    pointers = {kept.data_ptr(), view.data_ptr() - view[0].nbytes, array.ctypes.data}
    assert len(pointers) == 3
    assert after.data_ptr() not in pointers and again.data_ptr() not in pointers
    for batch, value in ((kept, 30), (view, 40), (torch.from_numpy(array), 50), (after, 60)):
        torch.testing.assert_close(batch, torch.full_like(batch, value / 255))
    torch.testing.assert_close(again, torch.full_like(again, 70 / 255))

    kept_ptr = kept.data_ptr()
    del kept
    assert finish(_solid(80), no_flip).data_ptr() == kept_ptr  # let go: reused


# ------------------------------------------------------- every DALI failure names its file


def _cut(path: Path, keep: int = 300) -> None:
    """Cut a JPEG inside its headers: the frame header is kept (the size check passes), and
    DALI's decoder fails with "nvImageCodec failure: '#3'", naming no file."""
    path.write_bytes(path.read_bytes()[:keep])


@needs_dali
@pytest.mark.parametrize("train", [True, False])
def test_dali_cut_jpeg_is_named_not_just_nvimagecodec_failure_3(
    fresh_folder: Path, train: bool
) -> None:
    _cut(fresh_folder / "b_blue" / "04.jpg")
    loader = _loader(fresh_folder, "dali", batch_size=8, train=train, last_batch="keep")
    with pytest.raises(
        RuntimeError,
        match=r"^DALI could not decode '[^']*b_blue/04\.jpg': cannot be decoded .*\(rank 0, "
        r"epoch 0\); a DALI pipeline cannot continue after an error\. Fix or remove the file",
    ):
        _epoch(loader)
    with pytest.raises(RuntimeError, match=r"failed earlier: DALI could not decode .*04\.jpg"):
        _epoch(loader)


@needs_dali
def test_dali_skip_leaves_out_the_cut_jpeg_before_dali_sees_it(fresh_folder: Path) -> None:
    _cut(fresh_folder / "b_blue" / "04.jpg")
    with pytest.warns(UserWarning, match=r"04\.jpg"):
        loader = _loader(fresh_folder, "dali", batch_size=8, on_error="skip", last_batch="keep")
    assert [Path(b.path).name for b in loader.skipped] == ["04.jpg"]
    assert sorted(_indices(loader)) == list(range(23))


@needs_dali
@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_dali_on_a_file_pil_reads_advises_converting_it_not_skip(
    fresh_folder: Path, on_error: str
) -> None:
    # DALI's TIFF parser wants BitsPerSample, which Pillow leaves out of a 1-bit TIFF.
    PIL.new("1", (40, 30), 1).save(fresh_folder / "a_red" / "bilevel.tiff")
    loader = _loader(fresh_folder, "dali", batch_size=25, train=False, on_error=on_error)
    assert not loader.skipped  # PIL reads it, so skip keeps it
    with pytest.raises(
        RuntimeError,
        match=r"^DALI failed on one of .*, which PIL decodes .*a DALI pipeline cannot continue "
        r"after an error\. on_error='skip' would keep the file: .* Convert it to an image DALI "
        r"decodes .* or pass backend='torchvision', which decodes with PIL$",
    ):
        _epoch(loader)


def test_failure_fix_suggests_skip_only_for_a_file_pil_cannot_decode() -> None:
    from trainperf.pipelines._dali import failure_fix
    from trainperf.pipelines._dali_feed import DALI_REFUSES
    from trainperf.pipelines._source import BadFile

    refused, broken = BadFile("a.tiff", DALI_REFUSES), BadFile("b.jpg", "cannot be decoded")
    assert "on_error='skip', which decodes" in failure_fix([refused, broken], ["a.tiff", "b.jpg"])
    for pil_reads in ([], [refused]):  # PIL decodes the named file, or every suspect
        assert "on_error='skip' would keep the file" in failure_fix(pil_reads, ["a.tiff"])
        assert "backend='torchvision'" in failure_fix(pil_reads, ["a.tiff"])


def test_dali_failure_with_no_file_known_gives_both_fixes_and_claims_nothing() -> None:
    from trainperf.pipelines._dali import describe_failure, failure_fix

    # Nothing was pending: no file was named, none was checked with PIL.
    what = describe_failure("...encountered: nvImageCodec failure: '#3'", [], [])
    assert what == "DALI failed on a file it did not name (DALI said: nvImageCodec failure: '#3')"
    fix = failure_fix([], [])
    assert "PIL decodes this one" not in fix
    assert "Convert it" not in fix
    assert "on_error='skip'" in fix
    assert "backend='torchvision'" in fix


def _non_utf8(directory: Path, name: bytes, data: bytes) -> str:
    try:
        path = os.path.join(os.fsencode(directory), name)
        with open(path, "wb") as f:
            f.write(data)
    except (OSError, UnicodeError):
        pytest.skip("this file system takes only UTF-8 names")
    return os.fsdecode(path)


@needs_dali
@pytest.mark.parametrize("train", [True, False])
def test_dali_reads_file_names_that_are_not_utf8(fresh_folder: Path, train: bool) -> None:
    jpeg = (fresh_folder / "a_red" / "00.jpg").read_bytes()
    odd = _non_utf8(fresh_folder / "a_red", b"caf\xe9 \xff.jpg", jpeg)
    loader = _loader(fresh_folder, "dali", batch_size=5, train=train, last_batch="keep")
    assert odd in loader.files
    assert sorted(_indices(loader)) == list(range(25))


@needs_dali
def test_dali_error_on_a_non_utf8_name_shows_it_escaped(fresh_folder: Path) -> None:
    jpeg = (fresh_folder / "a_red" / "00.jpg").read_bytes()
    _non_utf8(fresh_folder / "a_red", b"caf\xe9.jpg", jpeg[:300])
    loader = _loader(fresh_folder, "dali", batch_size=25, train=False, last_batch="keep")
    with pytest.raises(RuntimeError, match=r"DALI could not decode '[^']*a_red/caf\\xe9\.jpg'"):
        _epoch(loader)


@needs_dali
@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("how", ["cut", "text"])
def test_dali_names_a_file_overwritten_after_the_loader_was_built(
    fresh_folder: Path, how: str, train: bool
) -> None:
    loader = _loader(fresh_folder, "dali", batch_size=8, train=train, last_batch="keep")
    victim = fresh_folder / "a_red" / "03.jpg"
    if how == "cut":  # the header still passes: DALI's decoder fails, the file is found
        _cut(victim)
        match = r"^DALI could not decode '[^']*a_red/03\.jpg': cannot be decoded"
    else:  # trainperf's feed refuses it before DALI has it
        victim.write_text("no longer an image")
        match = r"03\.jpg' not a supported image .*changed after the loader checked it"
    with pytest.raises(RuntimeError, match=match):
        _epoch(loader)


@needs_dali
@pytest.mark.parametrize("train", [True, False])
def test_dali_orders_files_as_the_other_backends(folder: Path, train: bool) -> None:
    kw: dict[str, Any] = {"batch_size": 4, "train": train, "shard": (1, 2), "seed": 2}
    dali, torchvision_ = _loader(folder, "dali", **kw), _loader(folder, "torchvision", **kw)
    for _ in range(2):
        assert _indices(dali) == _indices(torchvision_)


@needs_dali
def test_dali_reads_the_epoch_set_in_loader_epoch_even_an_earlier_one(folder: Path) -> None:
    # Resuming (or replaying) sets loader.epoch; the DALI feed only ever moved forward, so an
    # earlier epoch, or one left part-way, came out in another epoch's order, batches short.
    kw: dict[str, Any] = {"batch_size": 5, "seed": 4, "last_batch": "keep"}
    dali, torchvision_ = _loader(folder, "dali", **kw), _loader(folder, "torchvision", **kw)
    expected = [_indices(torchvision_) for _ in range(2)]
    assert [_indices(dali) for _ in range(2)] == expected
    dali.epoch = 0
    assert _indices(dali) == expected[0]
    it = dali.iter_with_indices()  # epoch 1, left after one batch
    next(it)
    it.close()
    dali.epoch = 1
    assert _indices(dali) == expected[1]


@needs_dali
def test_dali_epoch_left_part_way_costs_only_the_batches_read_ahead(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import trainperf.pipelines._dali_feed as feed_module

    reads: list[str] = []
    real = feed_module.read_checked

    def counting(path: str, max_pixels: int | None) -> Any:
        reads.append(path)
        return real(path, max_pixels)

    monkeypatch.setattr(feed_module, "read_checked", counting)
    loader = _loader(folder, "dali", batch_size=1, last_batch="keep")  # 24 batches an epoch
    it = loader.iter_with_indices()
    next(it)
    it.close()
    assert sorted(_indices(loader)) == list(range(24))
    # One batch taken and a few read ahead, then a whole epoch (and a few of the next): not
    # the 24 + 24 of a reader that must run the abandoned epoch to its end.
    assert len(reads) <= 1 + 4 + 24 + 4, len(reads)


@needs_dali
@pytest.mark.parametrize("batch_size", [64, 4, 2])
def test_dali_reads_each_epoch_once_when_an_epoch_is_one_batch(
    folder: Path, monkeypatch: pytest.MonkeyPatch, batch_size: int
) -> None:
    # DALI runs two batches ahead: with one batch an epoch, the feed was an epoch or two on
    # when each pass started, and started it afresh, reading every file again (126 reads of
    # 7 files in 6 passes, not 56).
    import trainperf.pipelines._dali_feed as feed_module

    reads: list[str] = []
    real = feed_module.read_for_dali

    def counting(path: str, max_pixels: int | None) -> Any:
        reads.append(path)
        return real(path, max_pixels)

    monkeypatch.setattr(feed_module, "read_for_dali", counting)
    source = load_source(folder, on_error="raise")
    seven = list(zip(source.files[::3], source.labels[::3], strict=True))[:7]  # both classes
    kw: dict[str, Any] = {"batch_size": batch_size, "seed": 5, "last_batch": "keep"}
    dali, torchvision_ = _loader(seven, "dali", **kw), _loader(seven, "torchvision", **kw)
    assert [_indices(dali) for _ in range(6)] == [_indices(torchvision_) for _ in range(6)]
    # Each epoch read once, and at most two epochs' files read ahead.
    assert len(reads) <= (6 + 2) * 7, len(reads)


@needs_dali
@pytest.mark.parametrize("failure", [None, "decoder", "feed"])
def test_dali_loader_is_freed_without_the_garbage_collector(
    fresh_folder: Path, failure: str | None
) -> None:
    # A loader only the collector frees may be destroyed in a forked DataLoader worker
    # (the collector runs there too), and destroying a DALI pipeline there segfaults.
    import gc
    import weakref

    loader = _loader(fresh_folder, "dali", batch_size=4, train=failure is None)
    if failure == "decoder":
        _cut(fresh_folder / "a_red" / "02.jpg")
    elif failure == "feed":
        (fresh_folder / "a_red" / "02.jpg").write_text("not an image any more")
    if failure is None:
        _epoch(loader)
    else:
        with pytest.raises(RuntimeError, match=r"02\.jpg"):
            _epoch(loader)
    gone = weakref.ref(loader)
    gc.disable()
    try:
        del loader
        assert gone() is None
    finally:
        gc.enable()


@needs_dali
def test_dali_never_hands_out_a_batch_whose_file_the_feed_replaced(folder: Path) -> None:
    # Should DALI ever decode the placeholder byte, the batch is still refused, with the
    # feed's reason.
    from trainperf.pipelines._dali_feed import FedBatch

    loader = _loader(folder, "dali", batch_size=4, train=False)
    loader._iterator = iter([[{"images": None, "indices": None}]])  # type: ignore[attr-defined]
    loader._feed.pending.append(FedBatch(0, 0, (0, 1, 2, 3), "image 'x.jpg' empty file"))  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match=r"^image 'x\.jpg' empty file \(rank 0, epoch -1\)"):
        loader._next()  # type: ignore[attr-defined]


@needs_dali
@pytest.mark.parametrize("kind", ["turned", "mirrored", "grey_alpha", "premultiplied", "lab"])
def test_dali_decodes_a_tiff_as_pil_and_the_other_backends_do(tmp_path: Path, kind: str) -> None:
    (tmp_path / "c").mkdir()
    write_tiff(tmp_path / "c" / "x.tif", kind)
    kw: dict[str, Any] = {"train": False, "batch_size": 1}
    dali = _epoch(_loader(tmp_path, "dali", **kw))[0][0]
    torchvision_ = _epoch(_loader(tmp_path, "torchvision", **kw))[0][0]
    # DALI resamples within one grey level of PIL; turned, mirrored or miscoloured, the image
    # was off by up to 200 levels.
    assert (_pixels(dali) - _pixels(torchvision_)).abs().max() <= 1.01 / 255


def _by_index(loader: Any) -> dict[int, torch.Tensor]:
    """One epoch's images, by file index."""
    epoch = _epoch(loader)
    return {i: img for images, _, idx in epoch for i, img in zip(idx.tolist(), images, strict=True)}


@needs_dali
def test_dali_replays_an_epochs_crops_and_flips_and_draws_new_ones_each_epoch(
    folder: Path,
) -> None:
    # DALI drew crops and flips from generators seeded once per pipeline: an epoch run again,
    # or resumed on a new loader, got other crops than the first time.
    kw: dict[str, Any] = {"batch_size": 4, "seed": 5, "num_threads": 2}
    dali = _loader(folder, "dali", **kw)
    first, second = _by_index(dali), _by_index(dali)
    dali.set_epoch(0)
    replayed = _by_index(dali)
    assert all(torch.equal(replayed[i], first[i]) for i in first)
    resumed = _loader(folder, "dali", **{**kw, "num_threads": 1})
    resumed.set_epoch(1)  # a new loader, another thread count: the same crops
    assert all(torch.equal(img, second[i]) for i, img in _by_index(resumed).items())
    both = first.keys() & second.keys()
    assert sum(torch.equal(first[i], second[i]) for i in both) == 0


@needs_dali
def test_dali_cuts_the_torchvision_backends_crops_and_flips(folder: Path) -> None:
    kw: dict[str, Any] = {"batch_size": 4, "seed": 3}
    dali, torchvision_ = _loader(folder, "dali", **kw), _loader(folder, "torchvision", **kw)
    for _ in range(2):
        ours, theirs = _by_index(dali), _by_index(torchvision_)
        assert ours.keys() == theirs.keys()
        for i, img in ours.items():  # other boxes or flips differ by tens of levels
            assert (_pixels(img[None]) - _pixels(theirs[i][None])).abs().mean() < 2 / 255


@needs_dali
@pytest.mark.timeout(60)
@pytest.mark.parametrize("train", [True, False])
def test_dali_pass_interrupted_by_another_raises_instead_of_hanging(
    folder: Path, train: bool
) -> None:
    # One DALI pipeline feeds one pass at a time. A second iter(loader) (interleaved loops,
    # nested loops) started the next epoch afresh, and the first pass then dropped every
    # batch as not its own, forever.
    loader = _loader(folder, "dali", batch_size=4, train=train, last_batch="keep")
    first, second = loader.iter_with_indices(), loader.iter_with_indices()
    next(first)
    next(second)
    with pytest.raises(RuntimeError, match=r"epoch 0 .*interrupted by .*epoch 1.* one pass at"):
        next(first)
    # The newer pass goes on, whole, and the loader still works afterwards.
    assert len([next(second) for _ in range(len(loader) - 1)]) == len(loader) - 1
    assert sorted(_indices(loader)) == list(range(24))


_OTHER_THREAD = r"interrupted by a newer pass .* from another thread: .*one loader per thread"


def _in_threads(*targets: Any) -> list[Any]:
    """Run each target in a thread of its own, started together; each one's result or
    exception."""

    barrier = threading.Barrier(len(targets))
    results: list[Any] = [None] * len(targets)

    def run(i: int) -> None:
        barrier.wait(timeout=30)
        try:
            results[i] = targets[i]()
        except Exception as e:  # handed back to the test's thread
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(targets))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads), "a thread hung"
    return results


@needs_dali
@pytest.mark.timeout(120)
@pytest.mark.parametrize("train", [True, False])
def test_dali_passes_from_two_threads_at_once_raise_the_one_loader_per_thread_fix(
    folder: Path, train: bool
) -> None:
    # DALI's iterator is not thread-safe: two threads in it at once got DALI's bare
    # "RuntimeError: generator raised StopIteration".
    loader = _loader(folder, "dali", batch_size=2, train=train, last_batch="keep")
    for _ in range(3):
        results = _in_threads(lambda: _indices(loader), lambda: _indices(loader))
        for result in results:
            if isinstance(result, Exception):
                assert isinstance(result, RuntimeError), repr(result)
                assert re.search(_OTHER_THREAD, str(result)), repr(result)
            else:
                assert sorted(result) == list(range(24))
    assert sorted(_indices(loader)) == list(range(24))  # and the loader still works


@needs_dali
@pytest.mark.timeout(60)
def test_dali_pass_interrupted_from_another_thread_names_the_fix(folder: Path) -> None:
    loader = _loader(folder, "dali", batch_size=4, train=False, last_batch="keep")
    first = loader.iter_with_indices()
    next(first)
    (newer,) = _in_threads(lambda: _indices(loader))  # a whole pass in another thread
    assert sorted(newer) == list(range(24))
    with pytest.raises(RuntimeError, match=_OTHER_THREAD):
        next(first)


@needs_dali
def test_dali_classes_and_labels_are_imagefolders_and_the_torchvision_backends(
    tmp_path: Path,
) -> None:
    # A label mismatch between backends would train silently wrong: the classes (case,
    # digits, non-ASCII, a subfolder) and each file's label must be ImageFolder's in both.
    from torchvision.datasets import ImageFolder

    for i, name in enumerate(["B", "a", "_x", "10", "9", "é"]):
        (tmp_path / name / "sub").mkdir(parents=True)
        PIL.new("RGB", (20 + i, 16)).save(tmp_path / name / f"{i}.jpg")
        PIL.new("RGB", (16, 20 + i)).save(tmp_path / name / "sub" / f"{i}.png")
    reference = ImageFolder(str(tmp_path))
    for backend in ("dali", "torchvision"):
        loader = _loader(tmp_path, backend, batch_size=5, train=False)
        assert {c: i for i, c in enumerate(loader.classes)} == reference.class_to_idx
        labels = {
            loader.files[i]: label
            for _, batch_labels, idx in _epoch(loader)
            for i, label in zip(idx.tolist(), batch_labels.tolist(), strict=True)
        }
        assert labels == dict(reference.samples)


@needs_dali
@pytest.mark.timeout(120)
@pytest.mark.parametrize("train", [True, False])
def test_a_dali_loader_closed_from_another_thread_says_it_was_closed(
    folder: Path, train: bool
) -> None:
    # close() let go of the feed under a pass in another thread's step: that pass then
    # failed with a bare KeyError: 'images', a CancelledError, or "DALI failed on ...
    # which PIL decodes", blaming good files.
    errors: list[BaseException] = []
    for trial in range(6):
        loader = _loader(folder, "dali", batch_size=1, train=train, last_batch="keep")

        def run(loader: Any = loader) -> None:
            try:
                for _ in range(1000):
                    for _batch in loader.iter_with_indices():
                        pass
            except BaseException as e:  # what the pass raised is the finding
                errors.append(e)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        time.sleep(0.05 + 0.01 * trial)
        loader.close()
        thread.join(30)
        assert not thread.is_alive()
    assert errors and all(str(e) == "this image loader was closed" for e in errors), errors
