"""trainperf._utils.qualname: names that key the tuners' caches."""

from __future__ import annotations

import functools
import os

from trainperf._utils.qualname import code_digest, qualname


def _top_level(batch: object) -> None:
    pass


def test_classes_functions_and_instances_are_named_by_module_and_qualname() -> None:
    assert qualname(dict) == "builtins.dict"
    assert qualname({}) == "builtins.dict"  # an instance counts by its type
    assert qualname(_top_level).split("#")[0] == f"{__name__}._top_level"


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
    assert (
        qualname(functools.partial(_top_level, 1)) == f"functools.partial({qualname(_top_level)})"
    )


def test_a_function_s_name_changes_with_its_body() -> None:
    # Before: a module-level step was named only by module and qualname, so editing it (a
    # bigger model built inside, another loss) kept the old cached batch size.
    source = "def step(batch):\n    return batch{}\n"
    first, edited, same = ({"__name__": "train"} for _ in range(3))
    exec(source.format(" + 1"), first)
    exec(source.format(" * 2"), edited)
    exec(source.format(" + 1"), same)
    assert qualname(first["step"]) != qualname(edited["step"])
    assert qualname(first["step"]) == qualname(same["step"])
    assert qualname(first["step"]).startswith("train.step#")


def step_names(source: str, build: str = "Step()") -> tuple[str, str, str]:
    """The qualnames of the step ``build`` makes from ``source`` with its body ending
    ``+ 1``, ``* 2`` (edited) and ``+ 1`` again (the same code run anew)."""
    names = []
    for end in (" + 1", " * 2", " + 1"):
        scope: dict[str, object] = {"__name__": "train"}
        exec(source.format(end), scope)
        names.append(qualname(eval(build, scope)))
    return names[0], names[1], names[2]


def test_a_step_object_s_name_changes_with_its_call_method() -> None:
    # Before: an instance with __call__ counted by its class's name alone, so editing
    # __call__ kept the old cached batch size.
    first, edited, same = step_names(
        "class Step:\n    def __call__(self, batch):\n        return batch{}\n"
    )
    assert first != edited and first == same and first.startswith("train.Step#")
    assert qualname({}) == "builtins.dict"  # not callable: the type's name alone


MODULE_STEP = (
    "import torch\n"
    "class Step(torch.nn.Module):\n"
    "    def forward(self, batch):\n"
    "        return batch{}\n"
)


def test_a_module_used_as_the_step_counts_by_its_forward() -> None:
    # Before: its class's __call__ is torch's Module.__call__, the same for every module,
    # so editing forward kept the old cached batch size.
    first, edited, same = step_names(MODULE_STEP)
    assert first != edited and first == same and first.startswith("train.Step#")


def test_a_decorated_step_counts_by_the_body_it_wraps() -> None:
    # Before: functools.wraps copies the name but the digest was the wrapper's body, the
    # same whatever it wraps, so editing the step kept the old cached batch size.
    first, edited, same = step_names(
        "import functools\n"
        "def deco(f):\n"
        "    @functools.wraps(f)\n"
        "    def wrapper(*args):\n"
        "        return f(*args)\n"
        "    return wrapper\n"
        "@deco\n"
        "def step(batch):\n"
        "    return batch{}\n",
        build="step",
    )
    assert first != edited and first == same and first.startswith("train.step#")


def test_a_module_whose_forward_is_decorated_counts_by_the_forward_it_wraps() -> None:
    # Before: the digest was the decorator's body (torch.no_grad's), the same for every
    # decorated forward, so editing it kept the old cached batch size.
    first, edited, same = step_names(
        "import torch\n"
        "class Step(torch.nn.Module):\n"
        "    @torch.no_grad()\n"
        "    def forward(self, batch):\n"
        "        return batch{}\n"
    )
    assert first != edited and first == same and first.startswith("train.Step#")


def test_a_compiled_function_counts_by_the_body_it_compiled() -> None:
    first, edited, same = step_names(
        "def step(batch):\n    return batch{}\n", build="__import__('torch').compile(step)"
    )
    assert first != edited and first == same and first.startswith("train.step#")
    plain, _, _ = step_names("def step(batch):\n    return batch{}\n", build="step")
    assert first != plain  # compiled or not: another answer


def test_a_compiled_module_names_the_module_it_compiled() -> None:
    # Before: every compiled module was "torch._dynamo.eval_frame.OptimizedModule", one
    # cache entry for all of them whatever their forward.
    first, edited, same = step_names(MODULE_STEP, build="torch.compile(Step())")
    assert first != edited and first == same
    assert first.startswith("torch.compile(train.Step#")


def test_nested_functions_count_in_their_outer_function_s_digest() -> None:
    def outer_a() -> object:
        return lambda: 1

    def outer_b() -> object:
        return lambda: 2

    assert code_digest(outer_a.__code__) != code_digest(outer_b.__code__)
    assert code_digest(outer_a.__code__) == code_digest(outer_a.__code__)


def test_a_function_s_name_is_the_same_in_every_process() -> None:
    # Before: a set literal's constant (a frozenset of strings) was hashed by its repr,
    # whose order follows PYTHONHASHSEED: every run (every DDP rank) keyed its own entry.
    import subprocess
    import sys

    code = (
        "from trainperf._utils.qualname import qualname\n"
        "def step(batch):\n    return [k for k in batch if k in {'image', 'label', 'mask', 'x'}]\n"
        "print(qualname(step))\n"
    )

    def name_in_a_process(seed: int) -> str:
        env = {**os.environ, "PYTHONHASHSEED": str(seed)}
        run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True)
        return run.stdout.decode()

    names = {name_in_a_process(seed) for seed in (1, 2, 3, 4)}
    assert len(names) == 1, names
