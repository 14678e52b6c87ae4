"""Fixtures of the pipelines tests: the image folder (see ``_images.py``) and damaged copies."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.pipelines._images import _write_folder, big_image, bomb_jpeg


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """24 images: 12 per class, the odd formats included."""
    root = _write_folder(tmp_path_factory.mktemp("images") / "data", per_class=10)
    (root / "b_blue" / "10.jpg").write_bytes((root / "b_blue" / "00.jpg").read_bytes())
    return root


@pytest.fixture()
def bad_folder(folder: Path, tmp_path: Path) -> Path:
    import shutil

    root = shutil.copytree(folder, tmp_path / "bad")
    (root / "a_red" / "notes.jpg").write_text("a text file with an image suffix")
    (root / "b_blue" / "empty.jpg").write_bytes(b"")
    return Path(root)


@pytest.fixture()
def truncated_folder(folder: Path, tmp_path: Path) -> Path:
    import shutil

    root = Path(shutil.copytree(folder, tmp_path / "truncated"))
    data = (root / "a_red" / "00.jpg").read_bytes()
    (root / "a_red" / "truncated.jpg").write_bytes(data[: len(data) // 2])
    return root


@pytest.fixture()
def bomb_folder(folder: Path, tmp_path: Path) -> Path:
    """``folder`` plus a header-only 30000 x 30000 JPEG bomb and a real 300 x 200 PNG."""
    import shutil

    root = Path(shutil.copytree(folder, tmp_path / "bombs"))
    (root / "a_red" / "bomb.jpg").write_bytes(bomb_jpeg())
    big_image(root / "b_blue" / "big.png")
    return root


@pytest.fixture()
def fresh_folder(folder: Path, tmp_path: Path) -> Path:
    """A copy of ``folder`` that a test may change after building a loader on it."""
    import shutil

    return Path(shutil.copytree(folder, tmp_path / "fresh"))
