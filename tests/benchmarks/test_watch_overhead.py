"""benchmarks/watch_overhead.py: its options (the overhead figures are not checked)."""

from __future__ import annotations

import sys

import pytest
import torch

from tests.benchmarks._scripts import load_script


def run_main(monkeypatch: pytest.MonkeyPatch, *argv: str) -> None:
    bench = load_script("watch_overhead", monkeypatch)
    monkeypatch.setattr(sys, "argv", ["watch_overhead.py", *argv])
    bench.main()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--configs", "typical,shrot"], "unknown configs ['shrot']; choose from typical, short"),
        (["--steps", "0"], "--steps and --rounds must be >= 1, got 0 and 1"),
        (["--rounds", "0"], "--steps and --rounds must be >= 1, got 1 and 0"),
    ],
)
def test_bad_options_are_refused_before_anything_runs(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    message: str,
) -> None:
    # Before, an unknown config ran the CPU's token model under that name (a KeyError on
    # CUDA, after the others), and 0 steps or rounds ended in a ZeroDivisionError or
    # StatisticsError after the timing.
    options = {"--steps": "1", "--rounds": "1", "--device": "cpu"}
    options.update(zip(argv[::2], argv[1::2], strict=True))
    with pytest.raises(SystemExit) as exc:
        run_main(monkeypatch, *(item for pair in options.items() for item in pair))
    out, err = capsys.readouterr()
    assert exc.value.code == 2 and out == ""
    assert err.splitlines()[-1] == f"watch_overhead.py: error: {message}"


@pytest.mark.slow  # a few one-step rounds on the CPU
def test_device_cpu_on_a_cuda_host_names_the_cpu(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before, the header asked torch.cuda for the name of the CPU device whenever CUDA was
    # there, and torch refuses: "Expected a cuda device, but got: cpu".
    def device_name(device: torch.device) -> str:
        if torch.device(device).type != "cuda":
            raise ValueError(f"Expected a cuda device, but got: {device}")
        return "NVIDIA H100"

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", device_name)
    run_main(monkeypatch, "--device", "cpu", "--steps", "1", "--rounds", "1", "--configs",
             "typical")  # fmt: skip
    out = capsys.readouterr().out
    assert out.startswith("trainperf.watch overhead on CPU: 1 steps x 1 rounds\n")
    assert "typical-step overhead" in out
