"""trainperf._utils.qualname: names that key the tuners' caches."""

from __future__ import annotations

import functools

from trainperf._utils.qualname import qualname


def _top_level(batch: object) -> None:
    pass


def test_classes_functions_and_instances_are_named_by_module_and_qualname() -> None:
    assert qualname(dict) == "builtins.dict"
    assert qualname({}) == "builtins.dict"  # an instance counts by its type
    assert qualname(_top_level) == f"{__name__}._top_level"


def test_nested_functions_and_lambdas_add_where_they_are_defined() -> None:
    def make() -> object:
        def inner(batch: object) -> None:
            pass

        return inner

    f, g = (lambda b: None), (lambda b: b)
    assert qualname(f) != qualname(g)
    assert "<locals>" in qualname(make()) and "@" in qualname(make())
    assert qualname(make()) == qualname(make())  # the same code: the same name
    assert "@" not in qualname(_top_level)


def test_a_partial_names_its_function() -> None:
    assert qualname(functools.partial(_top_level, 1)) == f"functools.partial({__name__}._top_level)"
