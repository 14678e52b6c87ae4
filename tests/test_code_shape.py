"""House rules that keep the source readable: short functions, no loose private modules."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "trainperf"
MAX_CODE_LINES = 60  # per function, docstring, comments and blank lines excluded


def code_lines(node: ast.FunctionDef | ast.AsyncFunctionDef, lines: list[str]) -> int:
    """Lines of a function's body that hold code (a nested function counts for both)."""
    body = node.body
    first = body[0]
    if (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    ):
        body = body[1:]
    counted: set[int] = set()
    for stmt in body:
        for n in range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1):
            text = lines[n - 1].strip()
            if text and not text.startswith("#"):
                counted.add(n)
    return len(counted)


def long_functions(source: str, limit: int = MAX_CODE_LINES) -> list[tuple[str, int]]:
    """``(name, code lines)`` of every function in ``source`` longer than ``limit``."""
    lines = source.splitlines()
    return [
        (node.name, n)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and (n := code_lines(node, lines)) > limit
    ]


def test_the_counter_skips_docstrings_comments_and_blank_lines() -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(61))
    source = f'def f():\n    """Doc.\n\n    More.\n    """\n    # why\n\n{body}\n'
    assert long_functions(source) == [("f", 61)]
    assert long_functions(source, limit=61) == []


def test_no_function_is_longer_than_sixty_code_lines() -> None:
    too_long = [
        f"{path.relative_to(SRC)}: {name} has {n} code lines"
        for path in sorted(SRC.rglob("*.py"))
        for name, n in long_functions(path.read_text())
    ]
    assert not too_long, "split these (limit 60):\n" + "\n".join(too_long)


def stray_docstrings(source: str) -> list[int]:
    """Lines of module-level strings that follow neither an assignment nor the module's start:
    an attribute docstring separated from its name (a constant inserted in between)."""
    body = ast.parse(source).body
    return [
        after.lineno
        for before, after in itertools.pairwise(body)
        if isinstance(after, ast.Expr)
        and isinstance(after.value, ast.Constant)
        and isinstance(after.value.value, str)
        and not isinstance(before, (ast.Assign, ast.AnnAssign))
    ]


def test_the_stray_docstring_finder_sees_a_docstring_cut_from_its_name() -> None:
    kept = '"""Module."""\nA = 1\n"""About A."""\nB = 2\n"""About B."""\n'
    cut = '"""Module."""\nA = 1\nB = 2\n"""About B."""\n"""About A."""\n'
    assert stray_docstrings(kept) == []
    assert stray_docstrings(cut) == [5]


def test_every_module_constants_docstring_sits_under_it() -> None:
    stray = [
        f"{path.relative_to(SRC)}:{line}"
        for path in sorted(SRC.rglob("*.py"))
        for line in stray_docstrings(path.read_text())
    ]
    assert not stray, "put these docstrings under the name they describe:\n" + "\n".join(stray)


def redefined(source: str) -> list[str]:
    """Top-level functions and classes ``source`` defines more than once (the later one
    silently replaces the earlier for every caller after it)."""
    seen: set[str] = set()
    again: list[str] = []
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name in seen:
                again.append(node.name)
            seen.add(node.name)
    return again


def test_redefined_finds_a_second_definition() -> None:
    assert redefined("def a(): pass\ndef b(): pass\ndef a(x): pass\n") == ["a"]
    assert redefined("def a(): pass\nclass B: pass\n") == []


def test_no_module_defines_a_top_level_name_twice() -> None:
    # A test file once defined a helper `_spec` twice: the second, with another signature,
    # replaced the first and broke an earlier test's calls (ruff's F811 passes a redefinition
    # of a name already used).
    tests = Path(__file__).resolve().parent
    found = {
        str(path.relative_to(tests.parent)): names
        for path in sorted([*SRC.rglob("*.py"), *tests.rglob("*.py")])
        if (names := redefined(path.read_text()))
    }
    assert found == {}
