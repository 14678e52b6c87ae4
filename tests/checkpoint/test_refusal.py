"""trainperf.checkpoint._refusal: what would not load back with weights_only=True, or not
pickle at all, found before anything is written."""

from __future__ import annotations

import collections
import http
from typing import Any

import numpy as np
import pytest
import torch

from trainperf.checkpoint._refusal import save_refusal, weights_only_refusal

Pair = collections.namedtuple("Pair", "a b")


@pytest.mark.parametrize(
    ("value", "refused"),
    [
        ({"w": torch.ones(2), "a": np.ones(3), "n": 3, "o": collections.OrderedDict(x=1)}, None),
        ({"w": torch.ones(2), "pair": Pair(torch.ones(1), 2)}, "Pair"),
        ({"counts": collections.defaultdict(int, a=torch.ones(1))}, "defaultdict"),
        ([torch.ones(2), {"status": http.HTTPStatus.OK}], "HTTPStatus"),
    ],
)
def test_weights_only_refusal_checks_what_surrounds_tensors_as_the_load_will_see_it(
    value: Any, refused: str | None
) -> None:
    got = weights_only_refusal(value)
    assert got is None if refused is None else refused in str(got), got


class NeedsItsTensors(dict):  # type: ignore[type-arg]
    """Pickles only with its tensors in it (the check's skeleton has None there)."""

    def __reduce__(self) -> Any:
        return NeedsItsTensors, ({k: v.clone() for k, v in self.items()},)


def test_save_refusal_does_not_call_unpicklable_what_pickles_with_its_tensors() -> None:
    refusal = save_refusal(NeedsItsTensors(w=torch.ones(2)))
    assert refusal is not None and not refusal.unpicklable, refusal
    assert "NeedsItsTensors" in refusal.reason
    locked = save_refusal({"w": torch.ones(2), "fn": lambda: 1})
    assert locked is not None and locked.unpicklable and "lambda" in locked.reason
