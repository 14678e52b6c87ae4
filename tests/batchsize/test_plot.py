"""Where :meth:`BatchSizeReport.plot` writes (``batchsize/_plot.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainperf.batchsize import BatchSizeCandidate, BatchSizeReport


def _small_report() -> BatchSizeReport:
    c = BatchSizeCandidate(8, "ok", samples_per_s=10.0, peak_memory=2**20)
    return BatchSizeReport(8, 1, 10.0, 2**20, 2**30, (c,), 1.0, 5.0, 0.1, "cpu")


def test_plot_into_a_missing_folder_names_the_folder_and_the_fix(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such"
    with pytest.raises(
        FileNotFoundError,
        match=r"BatchSizeReport\.plot\(.*folder .*no/such.* does not exist.*mkdir",
    ):
        _small_report().plot(missing / "batch_size.png")
    assert not missing.exists()


def test_plot_to_a_folder_is_refused_not_written_beside_it(tmp_path: Path) -> None:
    # matplotlib would write "<folder>.png" beside it and the call return the folder.
    with pytest.raises(IsADirectoryError, match=r"is a folder.*pass a file path"):
        _small_report().plot(tmp_path)
    assert list(tmp_path.iterdir()) == []
    assert not (tmp_path.parent / f"{tmp_path.name}.png").exists()


@pytest.mark.slow  # matplotlib's import and one figure: about a second
def test_plot_to_a_path_without_a_suffix_writes_a_png_at_that_path(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = _small_report().plot(tmp_path / "batch_size")
    assert out == tmp_path / "batch_size"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir()] == ["batch_size"]
