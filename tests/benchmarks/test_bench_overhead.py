"""benchmarks/bench_overhead.py: counts below one are refused before the warm-up runs."""

from __future__ import annotations

import sys

import pytest

from tests.benchmarks._scripts import load_script

COUNTS = ["--batch-size", "--image-size", "--iterations", "--batches-per-iteration", "--rounds"]


def _refused(argv: list[str] | None, monkeypatch: pytest.MonkeyPatch) -> int | str | None:
    bench = load_script("bench_overhead", monkeypatch)
    monkeypatch.setattr(bench, "bench_model", lambda *a, **k: pytest.fail("warm-up ran"))
    monkeypatch.setattr(bench, "bare_loop", lambda *a, **k: pytest.fail("warm-up ran"))
    with pytest.raises(SystemExit) as exit_info:
        bench.main() if argv is None else bench.main(argv)
    return exit_info.value.code


def test_zero_rounds_are_refused_from_the_command_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "argv", ["bench_overhead.py", "--rounds", "0"])
    assert _refused(None, monkeypatch) == 2
    assert "argument --rounds: must be >= 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("option", COUNTS)
def test_counts_below_one_are_refused(
    option: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _refused([option, "-1"], monkeypatch) == 2
    assert f"argument {option}: must be >= 1, got -1" in capsys.readouterr().err
