"""benchmarks/checkpoint_bench.py: a tiny CPU smoke test of the script (its numbers are not
checked: tests never assert on speed)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

# Starts a child process (the SIGTERM part) and two forked gloo ranks: seconds.
pytestmark = pytest.mark.slow

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "checkpoint_bench.py"


def load_bench(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    spec = importlib.util.spec_from_file_location("checkpoint_bench", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "checkpoint_bench", module)  # dataclasses look it up
    spec.loader.exec_module(module)
    return module


def test_checkpoint_bench_measures_every_part_on_a_tiny_state(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    bench = load_bench(monkeypatch)
    out_json = tmp_path / "ckpt.json"
    rc = bench.main(
        [
            *("--size-mb", "4", "--repeats", "1", "--seconds", "0.2", "--step-ms", "2"),
            *("--rate-rounds", "2"),
            *("--agree-steps", "20", "--dir", str(tmp_path / "d"), "--json", str(out_json)),
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    for label in (
        "torch.save",
        "save_checkpoint",
        "Checkpointer.save(blocking=False) [process]",
        "Checkpointer.save(blocking=False) [thread]",
        "during a process write",
        "during a thread write",
        "SIGTERM to exit with a 4 MB final save",
        "agreement on 2 gloo ranks",
    ):
        assert label in out, label
    result = json.loads(out_json.read_text())
    assert [r["what"] for r in result["blocked"]][:2] == ["torch.save", "save_checkpoint"]
    assert all(r["blocked_s"] > 0 for r in result["blocked"])
    assert result["sigterm"]["exit_code"] == 0 and "saved" in result["sigterm"]["child"]
    assert result["agreement"]["check_every"] >= 1
    assert result["settings"]["size_mb"] == 4
    for rate in result["rates"]:
        assert len(rate["ratios"]) == 2 and rate["ratio"] > 0
        for r in rate["rounds"]:
            assert r["windows"]["during"]["steps"] >= 0 and r["base_steps_per_s"] > 0
    process = next(r for r in result["rates"] if r["writer"] == "process")
    assert all(r["writer_cpu_s"] > 0 for r in process["rounds"])  # the reaped writer's CPU
    assert "where the loop's time went" in out


def test_the_training_step_trains_the_saved_model(monkeypatch: pytest.MonkeyPatch) -> None:
    bench = load_bench(monkeypatch)
    state = bench.make_state(1, torch.device("cpu"))
    step = bench.make_step(state, torch.device("cpu"), 1.0)
    params = [p.detach().clone() for p in state["model"].parameters()]
    steps_before = [s["step"].item() for s in state["optimizer"].state.values()]
    assert len(steps_before) == len(params)
    step()
    assert all(
        not torch.equal(a, b) for a, b in zip(params, state["model"].parameters(), strict=True)
    )
    steps_after = [s["step"].item() for s in state["optimizer"].state.values()]
    assert all(b > a for a, b in zip(steps_before, steps_after, strict=True))  # Adam stepped each


def test_bad_options_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    bench = load_bench(monkeypatch)
    with pytest.raises(SystemExit):
        bench.main(["--writers", "fork"])
    with pytest.raises(SystemExit):
        bench.main(["--rate-rounds", "0"])


def test_skip_names_its_parts_and_refuses_others(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    bench = load_bench(monkeypatch)
    monkeypatch.setattr(bench, "make_state", lambda *a: pytest.fail("ran before refusing"))
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--skip", "sigterm,agreement"])
    assert exit_info.value.code == 2
    assert "--skip takes sigterm, agree; got 'agreement'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--help"])
    assert exit_info.value.code == 0
    usage = " ".join(capsys.readouterr().out.split())
    assert "--skip PARTS parts not to run, comma-separated: sigterm, agree" in usage


def test_a_dry_run_of_the_cuda_plan_runs_on_the_cpu(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # What benchmarks/gpu_checks.sh runs on the GPU host, checked here without one: the CUDA
    # plan (staged buffers and a thread, the 2 % target) on a small CPU state.
    bench = load_bench(monkeypatch)
    out_json = tmp_path / "dry.json"
    argv = ["--device", "cuda", "--dry-run", "--skip", "agree", "--json", str(out_json)]
    assert bench.main([*argv, "--dir", str(tmp_path / "d")]) == 0
    out = capsys.readouterr().out
    assert "DRY RUN of the --device cuda plan" in out
    assert "Checkpointer.save(blocking=False) [thread]" in out and "[process]" not in out
    assert "blocked <= 2% of sync" in out and "SIGTERM to exit with a 4 MB final save" in out
    result = json.loads(out_json.read_text())
    assert result["device_type"] == "cuda" and result["dry_run"] and result["size_mb"] == 4
    assert [r["writer"] for r in result["rates"]] == ["thread"]
    assert not torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
