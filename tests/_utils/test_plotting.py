"""``checked_path`` and ``save_figure``: where a report's ``plot(path)`` writes."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainperf._utils.plotting import checked_path, save_figure


def test_a_file_path_in_a_folder_that_exists_comes_back_as_a_path(tmp_path: Path) -> None:
    assert checked_path(str(tmp_path / "x.png"), "R.plot", "x.png") == tmp_path / "x.png"


def test_a_missing_folder_names_the_method_the_folder_and_the_fix(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such"
    with pytest.raises(
        FileNotFoundError, match=r"^R\.plot\(.*folder .*no/such.* does not exist.*mkdir"
    ):
        checked_path(missing / "x.png", "R.plot", "x.png")


@pytest.mark.parametrize("path", ["", "."])
def test_a_folder_is_refused_with_a_file_path_in_it_as_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(IsADirectoryError, match=r"^R\.plot\(.*is a folder.*R\.plot\('x\.png'\)"):
        checked_path(path, "R.plot", "x.png")


@pytest.mark.slow  # matplotlib's import and one figure: about a second
def test_save_figure_without_a_suffix_writes_a_png_at_that_path(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    save_figure(Figure(), tmp_path / "chart")
    assert (tmp_path / "chart").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir()] == ["chart"]


@pytest.mark.slow  # matplotlib's import and one figure: about a second
def test_save_figure_with_an_unknown_suffix_names_the_supported_formats(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    # matplotlib's own message: "Format 'xyz' is not supported (supported formats: ..., png, ...)"
    with pytest.raises(
        ValueError, match=r"Format 'xyz' is not supported \(supported formats: .*png"
    ):
        save_figure(Figure(), tmp_path / "chart.xyz")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("inside", ["loader.png", "sub/loader.png"])
def test_a_file_where_the_folder_should_be_is_named_as_a_file(tmp_path: Path, inside: str) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(
        NotADirectoryError, match=r"^R\.plot\(.*notes\.txt' is a file, not a folder.*in a folder"
    ):
        checked_path(tmp_path / "notes.txt" / inside, "R.plot", "x.png")
