"""What the tests of the `trainperf` command share: running it in-process, and tiny runs."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from trainperf.cli import main

ITERATION = re.compile(r"^Iteration \d+, \d+\.\d images/s in \d+\.\d{3} s\.$")


# One image of 32 px, one timed batch: each model run takes about a second on a CPU.
TINY = ["--device", "cpu", "--batch-size", "1", "--image-size", "32", "--warmup-batches", "1",
        "--iterations", "1"]  # fmt: skip


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    code, out, _ = run(capsys, *argv, "--json")
    assert code == 0
    document: dict[str, Any] = json.loads(out)
    return document
