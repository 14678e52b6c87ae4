"""trainperf.bench._common: the Skipped record and the JSON form every result shares."""

from __future__ import annotations

import json
from dataclasses import dataclass

from trainperf.bench import Skipped
from trainperf.bench._common import result_dict


def test_skipped_to_dict_is_json_safe_and_its_str_says_why() -> None:
    s = Skipped("matmul", "tf32", "bench_matmul(dtype='tf32') needs a CUDA GPU")
    data = s.to_dict()
    assert json.loads(json.dumps(data)) == data
    assert data == {"benchmark": "matmul", "setting": "tf32", "reason": s.reason}
    assert str(s) == "bench matmul tf32 skipped: bench_matmul(dtype='tf32') needs a CUDA GPU"


@dataclass(frozen=True)
class _Nested:
    pair: tuple[str, float] | None
    items: tuple[Skipped, ...]
    table: dict[str, tuple[int, ...]]


def test_result_dict_turns_tuples_into_lists_at_every_depth() -> None:
    data = result_dict(_Nested(("A100", 1.5), (Skipped("h2d", "x", "y"),), {"k": (1, 2)}))
    assert data == {
        "pair": ["A100", 1.5],
        "items": [{"benchmark": "h2d", "setting": "x", "reason": "y"}],
        "table": {"k": [1, 2]},
    }
    assert json.loads(json.dumps(data)) == data
