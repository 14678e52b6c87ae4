"""The example scripts imported by path, so a test calls their ``main(argv)`` in-process."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load_example(name: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """``examples/<name>.py`` as a module, in ``sys.modules`` for the test."""
    module_name = f"example_{name}"
    spec = importlib.util.spec_from_file_location(module_name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, module_name, module)
    spec.loader.exec_module(module)
    return module


def refused(
    module: ModuleType,
    argv: list[str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> str:
    """What argparse printed when the script refused ``argv`` (exit status 2). The options go
    in through ``sys.argv``, as from a shell, since not every example's ``main`` takes argv."""
    monkeypatch.setattr(sys, "argv", [str(module.__file__), *argv])
    with pytest.raises(SystemExit) as exit_info:
        module.main()
    assert exit_info.value.code == 2, exit_info.value.code
    return capsys.readouterr().err
