"""user_stacklevel: a warning raised however deep inside trainperf names the caller's line."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import trainperf
from trainperf import Checkpointer
from trainperf._utils.stack import user_stacklevel

_INSIDE = os.path.join(os.path.dirname(trainperf.__file__), "_fake_module.py")
_CODE = """
import warnings
from trainperf._utils.stack import user_stacklevel

def deep():
    return deeper()

def deeper():
    warnings.warn("from inside", UserWarning, stacklevel=user_stacklevel())
"""


def test_a_warning_from_two_levels_inside_names_this_file() -> None:
    namespace: dict[str, object] = {}
    exec(compile(_CODE, _INSIDE, "exec"), namespace)  # functions that live "in" trainperf
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        namespace["deep"]()  # type: ignore[operator]
    assert [(w.filename, str(w.message)) for w in caught] == [(__file__, "from inside")]
    assert user_stacklevel() == 1  # called from outside: the line itself


def test_a_checkpoint_warning_names_the_callers_save(tmp_path: Path) -> None:
    Checkpointer(tmp_path).save({"step": 5}, step=5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Checkpointer(tmp_path).save({"step": 1}, step=1)  # below step 5: warns
    assert [w.filename for w in caught] == [__file__]
