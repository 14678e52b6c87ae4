from __future__ import annotations

import sys
from pathlib import Path

import pytest

from trainperf._utils import imports as _imports


@pytest.fixture(autouse=True)
def _fresh_cache() -> None:
    _imports.is_available.cache_clear()


def test_installed_distribution_is_available() -> None:
    assert _imports.is_available("torch")
    assert _imports.is_available("numpy")


def test_stray_folder_without_distribution_is_not_available(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "strayfolderpkg").mkdir()
    (tmp_path / "strayfolderpkg" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert _imports.is_available("strayfolderpkg") is False
    assert "strayfolderpkg" not in sys.modules  # the check never imports it


def test_missing_parent_package_is_not_available() -> None:
    assert _imports.is_available("no_such_parent.child") is False


def test_require_names_the_feature_and_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_imports, "is_available", lambda name: False)
    with pytest.raises(
        ModuleNotFoundError,
        match=r"image_loader\(backend='dali'\) needs nvidia.dali: pip install 'trainperf\[dali\]'",
    ):
        _imports.require("nvidia.dali", "image_loader(backend='dali')")
    with pytest.raises(
        ModuleNotFoundError, match=r"plot\(\) needs matplotlib: pip install 'trainperf\[plot\]'"
    ):
        _imports.require("matplotlib", "plot()")


def test_require_passes_when_available() -> None:
    _imports.require("torch", "anything")
