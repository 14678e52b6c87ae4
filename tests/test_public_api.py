"""The public API: `__all__` stays sorted and in sync, and `import trainperf` stays light."""

from __future__ import annotations

import ast
import copy
import functools
import importlib
import inspect
import json
import pickle
import pkgutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import trainperf
from trainperf._utils.public import set_public_module

INIT = Path(trainperf.__file__)


def test_all_is_sorted_and_unique() -> None:
    assert trainperf.__all__ == sorted(trainperf.__all__)
    assert len(set(trainperf.__all__)) == len(trainperf.__all__)


def _type_checking_imports() -> dict[str, str]:
    """The names ``trainperf/__init__.py`` imports under ``if TYPE_CHECKING:``, by module."""
    tree = ast.parse(INIT.read_text())
    (block,) = [
        node
        for node in tree.body
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
    ]
    return {
        alias.asname or alias.name: node.module
        for node in block.body
        if isinstance(node, ast.ImportFrom) and node.module
        for alias in node.names
    }


def test_all_matches_the_names_imported_for_type_checkers_and_loaded_lazily() -> None:
    imported = _type_checking_imports()
    assert set(imported) | {"__version__"} == set(trainperf.__all__)
    assert imported == trainperf._EXPORTS  # what mypy sees is what __getattr__ loads
    for name in trainperf.__all__:
        assert hasattr(trainperf, name), name


def test_public_callables_have_docstrings_with_examples() -> None:
    for name in trainperf.__all__:
        obj = getattr(trainperf, name)
        if callable(obj) and not isinstance(obj, type):
            doc = obj.__doc__ or ""
            assert ">>>" in doc, f"trainperf.{name} has no runnable example in its docstring"


@pytest.mark.slow
def test_import_is_light_and_never_initialises_cuda() -> None:
    # torch itself imports pynvml when it is installed, so what counts is what trainperf adds.
    code = (
        "import json, sys, torch\n"
        "heavy = ['pynvml', 'torchvision', 'nvidia.dali', 'matplotlib', 'safetensors']\n"
        "before = {m for m in heavy if m in sys.modules}\n"
        "import trainperf\n"
        "loaded = [getattr(trainperf, name) for name in trainperf.__all__]  # each subpackage\n"
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


def test_public_objects_report_their_public_module() -> None:
    # Every public object with a __module__ is checked, not only classes and functions:
    # trainperf.worker_init_fn, a callable object wrapping a function, said
    # trainperf.device._seed (in help() too) while this test skipped it.
    for name in trainperf.__all__:
        module = getattr(getattr(trainperf, name), "__module__", None)
        if name != "__version__":
            assert module == "trainperf", f"trainperf.{name}.__module__ = {module}"


def test_set_public_module_renames_a_callable_object_wrapping_a_function() -> None:
    def fn() -> None: ...

    class Wrapper:
        def __init__(self) -> None:
            functools.update_wrapper(self, fn)

        def __call__(self) -> None: ...

    wrapper, not_a_wrapper = Wrapper(), Wrapper()
    delattr(not_a_wrapper, "__wrapped__")
    fn.__module__ = "trainperf.x._private"
    for obj in (wrapper, not_a_wrapper):
        obj.__module__ = "trainperf.x._private"
    set_public_module({"w": wrapper, "n": not_a_wrapper}, ["w", "n"], "trainperf.x")
    assert (wrapper.__module__, not_a_wrapper.__module__) == ("trainperf.x", "trainperf.x._private")
    assert fn.__module__ == "trainperf.x._private"  # pickles by its defining module


def test_worker_init_fn_copies_report_the_public_module() -> None:
    # A spawned DataLoader worker unpickles a copy of worker_init_fn (carrying the rank).
    for copied in (
        pickle.loads(pickle.dumps(trainperf.worker_init_fn)),
        copy.deepcopy(trainperf.worker_init_fn),
    ):
        assert copied.__module__ == "trainperf"


def _all_modules() -> list[str]:
    return [m.name for m in pkgutil.walk_packages(trainperf.__path__, "trainperf.")]


def test_subpackage_exports_report_a_public_module() -> None:
    for module_name in _all_modules():
        if "._" in module_name:
            continue
        module = importlib.import_module(module_name)
        for name in getattr(module, "__all__", ()):
            obj = getattr(module, name)
            where = getattr(obj, "__module__", None) or ""  # callable objects too
            assert "._" not in where, f"{module_name}.{name}: {where}"


def test_no_module_is_shadowed_by_an_attribute() -> None:
    # `import trainperf.x` and `trainperf.x` must be the same thing, for every module.
    for module_name in _all_modules():
        module = importlib.import_module(module_name)
        parent_name, _, leaf = module_name.rpartition(".")
        parent = importlib.import_module(parent_name)
        assert getattr(parent, leaf) is module, f"{module_name} is shadowed by {parent_name}.{leaf}"


def test_no_private_module_sits_at_the_package_root() -> None:
    loose = [m for m in _all_modules() if m.count(".") == 1 and m.split(".")[1].startswith("_")]
    assert loose == ["trainperf.__main__", "trainperf._utils"], loose


def test_type_hints_of_public_classes_resolve() -> None:
    # __module__ is rewritten; the string annotations must still resolve (dataclass tools).
    import typing

    for module_name in ["trainperf", *[m for m in _all_modules() if "._" not in m]]:
        module = importlib.import_module(module_name)
        for name in getattr(module, "__all__", ()):
            obj = getattr(module, name)
            if inspect.isclass(obj) and obj.__module__.startswith("trainperf"):
                if not all(_hints_resolve(base) for base in obj.__mro__[1:]):
                    continue  # e.g. torch's DataLoader, whose own hints do not resolve
                typing.get_type_hints(obj)


def _hints_resolve(cls: type) -> bool:
    import typing

    try:
        typing.get_type_hints(cls)
    except NameError:
        return False
    return True


def _fresh_python(code: str) -> Any:
    """What ``code`` prints as its last line, as JSON, run in a new interpreter."""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_import_trainperf_imports_no_subpackage_and_not_torch() -> None:
    # Each name loads its subpackage on first use: `import trainperf.ddp` in every spawned
    # rank, and `trainperf --help`, pay only for what they use.
    result = _fresh_python(
        "import json, sys, trainperf\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('trainperf.'))\n"
        "version = trainperf.__version__\n"
        "print(json.dumps({'torch': 'torch' in sys.modules, 'loaded': loaded,\n"
        "                  'metadata_ok': isinstance(version, str)}))\n"
    )
    assert result == {
        "torch": False,
        "loaded": ["trainperf._utils", "trainperf._utils.exiting", "trainperf._utils.public"],
        "metadata_ok": True,
    }


@pytest.mark.slow
def test_public_module_does_not_depend_on_which_path_is_used_first() -> None:
    result = _fresh_python(
        "import json\n"
        "from trainperf.loader import TuningReport\n"
        "from trainperf.errors import HangError\n"
        "import trainperf\n"
        "print(json.dumps([TuningReport.__module__, HangError.__module__,\n"
        "                  trainperf.TuningReport is TuningReport]))\n"
    )
    assert result == ["trainperf", "trainperf", True]


def test_an_unknown_attribute_is_an_attribute_error_naming_it() -> None:
    with pytest.raises(AttributeError, match=r"^module 'trainperf' has no attribute 'nope'$"):
        trainperf.nope  # type: ignore[attr-defined]  # noqa: B018
    assert not hasattr(trainperf, "_private_nothing")


def test_dir_lists_every_public_name_and_subpackage() -> None:
    listed = dir(trainperf)
    assert set(trainperf.__all__) <= set(listed)
    assert {"ddp", "bench", "pipelines", "cli", "loader"} <= set(listed)


def test_every_public_subpackage_is_an_attribute_without_an_import() -> None:
    public = sorted(m.name for m in pkgutil.iter_modules(trainperf.__path__) if m.name[0] != "_")
    assert list(trainperf._SUBMODULES) == public
    for name in public:
        assert getattr(trainperf, name) is importlib.import_module(f"trainperf.{name}")
