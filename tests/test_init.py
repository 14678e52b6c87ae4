"""The public API: `__all__` stays sorted and in sync, and `import trainperf` stays light."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import trainperf

INIT = Path(trainperf.__file__)


def test_all_is_sorted_and_unique() -> None:
    assert trainperf.__all__ == sorted(trainperf.__all__)
    assert len(set(trainperf.__all__)) == len(trainperf.__all__)


def test_all_matches_the_names_imported_in_init() -> None:
    tree = ast.parse(INIT.read_text())
    imported = {
        alias.asname or alias.name
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("trainperf")
        for alias in node.names
    }
    assert imported | {"__version__"} == set(trainperf.__all__)
    for name in trainperf.__all__:
        assert hasattr(trainperf, name), name


def test_public_callables_have_docstrings_with_examples() -> None:
    for name in trainperf.__all__:
        obj = getattr(trainperf, name)
        if callable(obj) and not isinstance(obj, type):
            doc = obj.__doc__ or ""
            assert ">>>" in doc, f"trainperf.{name} has no runnable example in its docstring"


def test_import_is_light_and_never_initialises_cuda() -> None:
    # torch itself imports pynvml when it is installed, so what counts is what trainperf adds.
    code = (
        "import json, sys, torch\n"
        "heavy = ['pynvml', 'torchvision', 'nvidia.dali', 'matplotlib', 'safetensors']\n"
        "before = {m for m in heavy if m in sys.modules}\n"
        "import trainperf\n"
        "added = [m for m in heavy if m in sys.modules and m not in before]\n"
        "print(json.dumps({'added': added, 'cuda_initialised': torch.cuda.is_initialized()}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"added": [], "cuda_initialised": False}


def test_version_is_a_string() -> None:
    assert isinstance(trainperf.__version__, str) and trainperf.__version__
