"""trainperf.pipelines._dali_feed: the files trainperf hands to DALI, and tracing errors back.

The feed is plain Python (DALI only calls it), so these tests run without DALI.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.pipelines._images import bomb_jpeg, write_tiff
from trainperf.pipelines._dali_feed import FedBatch, FileFeed, find_culprits
from trainperf.pipelines._header import MAX_IMAGE_PIXELS
from trainperf.pipelines._source import BadFile, epoch_batches, load_source, shard_plan

PIL = pytest.importorskip("PIL.Image")


def _plan(num_files: int, batch_size: int, rank: int = 0, world: int = 1) -> object:
    shard = shard_plan(num_files, batch_size, rank, world, "keep")

    def plan(epoch: int) -> list[list[int]]:
        return epoch_batches(
            num_files, shard, batch_size, shuffle=True, seed=3, epoch=epoch, last_batch="keep"
        )

    return plan


def test_feed_yields_each_epochs_batches_in_order_and_reads_the_bytes(folder: Path) -> None:
    files = load_source(folder, on_error="raise").files
    plan = _plan(len(files), 5, rank=1, world=2)
    feed = FileFeed(files, plan, max_pixels=MAX_IMAGE_PIXELS, threads=2)  # type: ignore[arg-type]
    try:
        for epoch in (0, 1):  # the feed runs on into the next epoch by itself
            for number, expected in enumerate(plan(epoch)):  # type: ignore[operator]
                datas, indices = feed()
                assert indices.dtype == np.int64 and indices.tolist() == expected
                for data, i in zip(datas, expected, strict=True):
                    assert data.tobytes() == Path(files[i]).read_bytes()
                assert feed.pending[-1] == FedBatch(epoch, number, tuple(expected))
        assert len(feed.pending) == 2 * 3  # 12 samples per rank: batches of 5, 5, 2
    finally:
        feed.close()


def test_training_feed_gives_each_image_the_crop_and_flip_every_backend_draws(
    folder: Path, tmp_path: Path
) -> None:
    from trainperf.pipelines._augment import train_params

    # A TIFF turned by its tag reaches DALI as PIL's upright decode: its crop is drawn from
    # that size (48 wide, 32 high, turned: 32 x 48), not the file's header's.
    turned = str(write_tiff(tmp_path / "turned.tif", "turned"))
    files = [*load_source(folder, on_error="raise").files[:5], turned]
    plan = _plan(len(files), 3)
    feed = FileFeed(files, plan, max_pixels=None, threads=2, augment_seed=7)  # type: ignore[arg-type]
    try:
        for epoch in (0, 1):
            for _ in plan(epoch):  # type: ignore[operator]
                _, indices, anchors, shapes, flips = feed()
                for k, i in enumerate(indices.tolist()):
                    with PIL.open(files[i]) as im:
                        width, height = im.size if i != 5 else (32, 48)
                    (top, left, h, w), flip = train_params(7, epoch, i, height, width)
                    assert anchors[k].tolist() == [top, left] and shapes[k].tolist() == [h, w]
                    assert flips[k] == flip
    finally:
        feed.close()


def test_training_feed_refuses_bytes_without_an_image_size(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import trainperf.pipelines._dali_feed as feed_module

    monkeypatch.setattr(feed_module, "read_for_dali", lambda path, limit: np.zeros(4, np.uint8))
    files = load_source(folder, on_error="raise").files[:2]
    feed = FileFeed(files, lambda epoch: [[0, 1]], max_pixels=None, threads=1, augment_seed=0)
    try:
        datas, _, _, shapes, _ = feed()
    finally:
        feed.close()
    assert [d.tolist() for d in datas] == [[0], [0]] and shapes.tolist() == [[1, 1], [1, 1]]
    assert feed.error is not None and feed.error.endswith("has no image size, so it is not decoded")


def test_starting_a_later_epoch_abandons_the_rest_of_this_one(folder: Path) -> None:
    files = load_source(folder, on_error="raise").files
    plan = _plan(len(files), 4)
    feed = FileFeed(files, plan, max_pixels=None, threads=2)  # type: ignore[arg-type]
    try:
        feed()
        feed.start(0)  # already there: nothing changes
        assert feed()[1].tolist() == plan(0)[1]  # type: ignore[operator]
        feed.start(1)
        assert feed()[1].tolist() == plan(1)[0]  # type: ignore[operator]
        assert [(b.epoch, b.batch) for b in feed.pending] == [(0, 0), (0, 1), (1, 0)]
    finally:
        feed.close()


def test_starting_an_earlier_epoch_or_one_begun_starts_it_afresh(folder: Path) -> None:
    files = load_source(folder, on_error="raise").files
    plan = _plan(len(files), 4)
    feed = FileFeed(files, plan, max_pixels=None, threads=2)  # type: ignore[arg-type]
    try:
        first = feed.start(0)
        feed(), feed()
        feed.pending.popleft()  # the loader took epoch 0's first batch: 0 is begun
        again = feed.start(0)
        assert again != first
        assert feed()[1].tolist() == plan(0)[0]  # type: ignore[operator]
        assert [(b.generation, b.epoch, b.batch) for b in feed.pending] == [
            (first, 0, 1),
            (again, 0, 0),
        ]
        feed.start(1)
        feed.start(0)  # backwards: afresh too
        assert feed()[1].tolist() == plan(0)[0]  # type: ignore[operator]
        assert feed.start(0) == feed.pending[-1].generation  # begun, not taken: goes on
    finally:
        feed.close()


def _passes_as_dali_runs_them(feed: FileFeed, passes: int, last: int) -> list[list[int]]:
    """Each pass's file indices, taken as ``DaliLoader`` takes them, while DALI keeps two
    batches queued ahead (``prefetch_queue_depth=2``); ``last`` is an epoch's last batch."""
    feed(), feed()
    orders: list[list[int]] = []
    for epoch in range(passes):
        generation = feed.start(epoch)
        order: list[int] = []
        while True:
            fed = feed.pending.popleft()
            feed()  # DALI asks for the batch after the two queued
            if (fed.generation, fed.epoch) != (generation, epoch):
                continue
            order += fed.indices
            if fed.batch == last:
                break
        orders.append(order)
    return orders


@pytest.mark.parametrize("batch_size", [64, 4, 2])
def test_feed_goes_on_when_dali_has_read_ahead_past_an_epoch_of_one_batch(
    folder: Path, monkeypatch: pytest.MonkeyPatch, batch_size: int
) -> None:
    # With one batch an epoch, DALI's two batches ahead took the feed into the next two
    # epochs before the loader's start(): each pass began a new generation and read its
    # epoch again (126 reads of 7 files in 6 passes, not 56).
    import trainperf.pipelines._dali_feed as feed_module

    reads: list[str] = []
    real = feed_module.read_for_dali

    def counting(path: str, max_pixels: int | None) -> Any:
        reads.append(path)
        return real(path, max_pixels)

    monkeypatch.setattr(feed_module, "read_for_dali", counting)
    files = load_source(folder, on_error="raise").files[:7]
    plan = _plan(len(files), batch_size)
    last = len(plan(0)) - 1  # type: ignore[operator]
    feed = FileFeed(files, plan, max_pixels=None, threads=2)  # type: ignore[arg-type]
    try:
        orders = _passes_as_dali_runs_them(feed, 6, last)
    finally:
        feed.close()
    expected = [[i for batch in plan(e) for i in batch] for e in range(6)]  # type: ignore[operator]
    assert orders == expected
    # Each epoch read once, and at most two epochs' files read ahead.
    assert len(reads) <= (6 + 2) * len(files), len(reads)
    assert feed.pending[0].generation == 0


def _refused(feed: FileFeed, bad: int) -> str:
    """Call the feed once; check that file ``bad`` was replaced by the placeholder byte."""
    datas, indices = feed()
    where = indices.tolist().index(bad)
    assert datas[where].tolist() == [0]  # one zero byte: DALI never gets the file
    problem = feed.pending[-1].problem
    assert problem is not None and feed.error == problem
    return problem


def test_feed_refuses_a_changed_file_before_dali_gets_it(fresh_folder: Path) -> None:
    files = load_source(fresh_folder, on_error="raise").files
    feed = FileFeed(files, _plan(len(files), 24), max_pixels=None, threads=2)  # type: ignore[arg-type]
    try:
        Path(files[5]).write_bytes(b"")
        assert "empty file, so it is not decoded: it changed after" in _refused(feed, 5)
    finally:
        feed.close()


def test_feed_refuses_a_bomb_that_replaced_a_file(fresh_folder: Path) -> None:
    files = load_source(fresh_folder, on_error="raise").files
    feed = FileFeed(files, _plan(len(files), 24), max_pixels=MAX_IMAGE_PIXELS, threads=2)  # type: ignore[arg-type]
    try:
        Path(files[7]).write_bytes(bomb_jpeg())
        assert "has 30000x30000 = 900,000,000 pixels" in _refused(feed, 7)
    finally:
        feed.close()


def test_feed_names_a_file_deleted_after_the_loader_was_built(fresh_folder: Path) -> None:
    files = load_source(fresh_folder, on_error="raise").files
    feed = FileFeed(files, _plan(len(files), 24), max_pixels=None, threads=2)  # type: ignore[arg-type]
    try:
        Path(files[2]).unlink()
        assert "02.jpg' cannot be read (No such file" in _refused(feed, 2)
    finally:
        feed.close()


def test_feed_names_a_file_whose_read_failed_otherwise(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import trainperf.pipelines._dali_feed as feed_module

    files = load_source(folder, on_error="raise").files
    real = feed_module.read_checked

    def failing(path: str, max_pixels: int | None) -> object:
        if path == files[4]:
            raise MemoryError("no memory for it")
        return real(path, max_pixels)

    monkeypatch.setattr(feed_module, "read_checked", failing)
    feed = FileFeed(files, _plan(len(files), 24), max_pixels=None, threads=2)  # type: ignore[arg-type]
    try:
        assert _refused(feed, 4).endswith("04.jpg' failed (MemoryError: no memory for it)")
    finally:
        feed.close()


def test_culprits_from_the_sample_dali_names(folder: Path, tmp_path: Path) -> None:
    good = load_source(folder, on_error="raise").files
    cut = tmp_path / "cut.jpg"
    cut.write_bytes(Path(good[0]).read_bytes()[:400])
    files = [*good[:3], str(cut)]
    pending = [FedBatch(0, 0, (0, 3)), FedBatch(0, 1, (1, 2))]
    bad, suspects = find_culprits("Failed to decode sample #1 : ", pending, files, None)
    assert suspects == [str(cut)] and [b.path for b in bad] == [str(cut)]
    assert bad[0].reason.startswith("cannot be decoded")
    # DALI names a sample PIL reads: still that file, and said so.
    bad, _ = find_culprits("Failed to decode sample #0 : ", pending, files, None)
    assert bad == [BadFile(good[0], "DALI's decoder refuses it (PIL reads it)")]


def test_culprits_without_a_sample_number_are_found_by_checking_every_pending_file(
    folder: Path, tmp_path: Path
) -> None:
    good = load_source(folder, on_error="raise").files
    cut = tmp_path / "cut.jpg"
    cut.write_bytes(Path(good[0]).read_bytes()[:400])
    files = [*good[:3], str(cut)]
    pending = [FedBatch(0, 0, (0, 1)), FedBatch(0, 1, (2, 3, 0))]
    bad, suspects = find_culprits("nvImageCodec failure: '#3'", pending, files, None)
    assert suspects == files  # each file once, oldest batch first
    assert [b.path for b in bad] == [str(cut)]
    bad, suspects = find_culprits("nvImageCodec failure: '#3'", pending[:1], files, None)
    assert bad == [] and suspects == list(good[:2])
    assert find_culprits("anything", [], files, None) == ([], [])


def test_feed_hands_over_a_tiff_dali_would_misread_as_pils_pixels(tmp_path: Path) -> None:
    import io

    turned = write_tiff(tmp_path / "turned.tif", "turned")
    plain = tmp_path / "plain.tif"
    PIL.new("RGB", (48, 32), (10, 20, 30)).save(plain)
    cut = tmp_path / "cut.tif"
    cut.write_bytes(turned.read_bytes()[:600])  # header intact, pixels cut short
    files = [str(turned), str(plain), str(cut)]
    feed = FileFeed(files, lambda epoch: [[0, 1], [2]], max_pixels=None, threads=2)
    try:
        (as_png, as_is), _ = feed()
        assert as_is.tobytes() == plain.read_bytes()  # DALI decodes it as PIL does
        with open(turned, "rb") as f, PIL.open(f) as im:  # as ImageFolder opens it
            expected = np.asarray(im.convert("RGB"))
        assert expected.shape == (48, 32, 3)  # turned by PIL: the file says 48 wide
        with PIL.open(io.BytesIO(as_png.tobytes())) as im:
            assert im.format == "PNG"
            assert np.array_equal(np.asarray(im), expected)
        assert "cut.tif' (OSError: image file is truncated" in _refused(feed, 2)
    finally:
        feed.close()
