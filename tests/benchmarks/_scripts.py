"""The benchmark scripts imported by path, for their smoke tests."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _module(name: str, module_name: str) -> tuple[ModuleType, importlib.machinery.ModuleSpec]:
    spec = importlib.util.spec_from_file_location(module_name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    return importlib.util.module_from_spec(spec), spec


def load_script(name: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """``benchmarks/<name>.py`` as a module, in ``sys.modules`` for the test (dataclasses
    look their module up there)."""
    module, spec = _module(name, name)
    monkeypatch.setitem(sys.modules, name, module)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def script_module(name: str, module_name: str | None = None) -> Iterator[ModuleType]:
    """The same for a module-scoped fixture: in ``sys.modules`` (as ``module_name``) while
    the block runs."""
    module, spec = _module(name, module_name or name)
    sys.modules[spec.name] = module
    try:
        assert spec.loader is not None
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]
