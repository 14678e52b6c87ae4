"""trainperf.errors: the tree its docstring draws is the real one, and the docs list every
exception type the package raises."""

from __future__ import annotations

import builtins
import inspect
import re
from pathlib import Path

import pytest

import trainperf.errors as errors
from trainperf.checkpoint import load_checkpoint
from trainperf.errors import CheckpointNotFoundError, TrainperfError

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "trainperf"
DOCS = ROOT / "docs" / "errors.md"
TESTS = ROOT / "tests"

# Raised inside the package and always caught there: never reaches a caller.
INTERNAL = {
    "DeadlineReached": "loader's measuring loop: the time budget ran out",
    "Interrupted": "ddp's signal guard: turned into KeyboardInterrupt / SystemExit by launch",
    # Reaches a caller, but as the ValueError it subclasses (documented as one): the class is
    # for trainperf.cli to tell a run-time refusal apart from a bad argument.
    "RunTimeLimitExceeded": "bench's refusal of a run past max_seconds: a ValueError",
}
_TREE_LINE = re.compile(r"^(?P<indent>[│├└─ ]*)(?P<name>[A-Z]\w+)(?P<note>.*)$")


def own_classes() -> dict[str, type[BaseException]]:
    return {name: getattr(errors, name) for name in errors.__all__}


def tree_lines(text: str) -> list[str]:
    """The lines of the first drawing that starts with ``TrainperfError``."""
    lines = [line.strip("\n") for line in text.splitlines()]
    start = next(i for i, line in enumerate(lines) if line.strip() == "TrainperfError")
    width = len(lines[start]) - len(lines[start].lstrip())
    out = []
    for line in lines[start:]:
        if not line.strip() or line.strip().startswith("```"):
            break
        out.append(line[width:].rstrip())
    return out


def parse_tree(lines: list[str]) -> dict[str, tuple[str | None, str]]:
    """``{class: (parent, note)}`` from a drawing where each level indents by 4."""
    parents: list[str] = []
    out: dict[str, tuple[str | None, str]] = {}
    for line in lines:
        match = _TREE_LINE.match(line)
        assert match, f"not a tree line: {line!r}"
        depth = len(match["indent"]) // 4
        del parents[depth:]
        out[match["name"]] = (parents[-1] if parents else None, match["note"].strip())
        parents.append(match["name"])
    return out


def raised_types() -> set[str]:
    """Every exception class named after ``raise`` (or returned by an ``*_error`` helper)."""
    found: set[str] = set()
    pattern = re.compile(r"\b(?:raise|return) ([A-Z]\w*)\b")
    for path in SRC.rglob("*.py"):
        for name in pattern.findall(path.read_text()):
            cls = getattr(builtins, name, None) or getattr(errors, name, None)
            is_exception = inspect.isclass(cls) and issubclass(cls, BaseException)
            if is_exception or name in INTERNAL or name.endswith(("Error", "Exception")):
                found.add(name)
    return found


def test_the_docstring_tree_is_the_class_tree() -> None:
    assert errors.__doc__ is not None
    tree = parse_tree(tree_lines(errors.__doc__))
    assert set(tree) == set(errors.__all__)
    for name, (parent, note) in tree.items():
        cls = own_classes()[name]
        own_bases = [b.__name__ for b in cls.__bases__ if b in own_classes().values()]
        assert own_bases == ([parent] if parent else []), name
        for also in re.findall(r"\(also (\w+)\)", note):
            assert issubclass(cls, getattr(builtins, also)), f"{name} is not a {also}"
        for base in cls.__bases__:
            if base.__module__ == "builtins" and base is not Exception:
                assert f"(also {base.__name__})" in note, f"say that {name} is a {base.__name__}"


def test_the_docs_draw_the_same_tree_and_list_every_class() -> None:
    docs = DOCS.read_text()
    assert errors.__doc__ is not None
    assert tree_lines(docs) == tree_lines(errors.__doc__)
    for name in errors.__all__:
        assert f"| `{name}` |" in docs or name == "TrainperfError", f"{name} has no row"


def test_every_exception_type_the_package_raises_is_listed() -> None:
    docs = DOCS.read_text()
    assert errors.__doc__ is not None
    unknown = []
    for name in sorted(raised_types()):
        if name in INTERNAL or name in errors.__all__:  # own classes: the tests above
            continue
        if name == "StopIteration":  # an iterator's end (w.iter()), not an error to catch
            continue
        if f"`{name}`" not in docs or f"``{name}``" not in errors.__doc__:
            unknown.append(name)
    assert not unknown, f"document these in errors.py and docs/errors.md: {unknown}"
    # Internal ones must stay internal: not public, not documented as something to catch.
    for name in INTERNAL:
        assert name not in errors.__all__


def test_every_own_class_is_raised_and_matched_in_the_tests() -> None:
    text = "\n".join(p.read_text() for p in TESTS.rglob("*.py"))
    missing = []
    for name in errors.__all__:
        call = re.compile(rf"pytest\.raises\(\s*(?:errors\.)?{name}\b[^()]*match=")
        if not call.search(text):
            missing.append(name)
    assert not missing, f"no pytest.raises(..., match=...) for {missing}"


def test_every_trainperf_error_is_a_trainperf_error(tmp_path: Path) -> None:
    with pytest.raises(TrainperfError, match=r"checkpoint .*missing\.pt does not exist") as info:
        load_checkpoint(tmp_path / "missing.pt")
    assert isinstance(info.value, CheckpointNotFoundError)
    assert isinstance(info.value, FileNotFoundError)
