"""Fixtures of the pipelines tests: the image folder (see ``_images.py``) and damaged copies."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
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


@pytest.fixture()
def fifo_folder(folder: Path, tmp_path: Path) -> Iterator[Path]:
    """``folder`` plus a named pipe, ``a_red/pipe.jpg``, and a link to a real image.

    Opening a FIFO to read it blocks until a writer opens it. So that a regression fails
    instead of hanging the suite, a thread keeps letting such a reader go (it then reads an
    empty file), until the test ends.
    """
    import shutil

    root = Path(shutil.copytree(folder, tmp_path / "fifo"))
    pipe = root / "a_red" / "pipe.jpg"
    os.mkfifo(pipe)
    (root / "b_blue" / "link.jpg").symlink_to(root / "b_blue" / "00.jpg")
    done = threading.Event()
    thread = threading.Thread(target=_release_readers, args=(pipe, done), daemon=True)
    thread.start()
    yield root
    done.set()
    thread.join(timeout=10)


def _release_readers(pipe: Path, done: threading.Event) -> None:
    while not done.wait(0.2):
        try:  # succeeds only while something has the FIFO open to read (or waits to)
            fd = os.open(pipe, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            continue
        os.close(fd)
