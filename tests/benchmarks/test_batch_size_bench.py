"""benchmarks/batch_size_bench.py: a CPU smoke test of the script (its numbers are not checked)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.batchsize._fakes import QUICK
from trainperf.batchsize import _tune

# Each test here runs a script: seconds each.
pytestmark = pytest.mark.slow

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "batch_size_bench.py"


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def load_bench(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    spec = importlib.util.spec_from_file_location("batch_size_bench", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "batch_size_bench", module)  # dataclasses look it up
    spec.loader.exec_module(module)
    return module


def test_the_sweep_is_the_powers_of_two_and_their_midpoints(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bench = load_bench(monkeypatch)
    assert bench.sweep_sizes(48) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48]


def test_the_mlp_sweep_and_the_tuner_run_and_are_compared(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    bench = load_bench(monkeypatch)
    monkeypatch.setattr(_tune, "DEFAULT_PROBE", QUICK)  # short windows: both sides alike
    out_json = tmp_path / "bs.json"
    rc = bench.main(
        ["--quick", "--models", "mlp", "--budget", "5", "--threads", "1", "--sweeps", "2",
         "--score-rounds", "2", "--json", str(out_json)]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0
    rows = [line for line in out.splitlines() if line.startswith("mlp ")]
    assert len(rows) == 1 and "1..16" in rows[0]
    (r,) = json.loads(out_json.read_text())["results"]
    assert [c["batch_size"] for c in r["sweep"]] == [1, 2, 3, 4, 6, 8, 12, 16]
    assert 1 <= r["tuned"] <= 16 and r["tuned_samples_per_s"] > 0
    assert r["sweep_best_samples_per_s"] > 0 and r["time_fraction"] > 0
    # The tuner's choice alternated with the sweep's best (no rounds when they are one size).
    assert r["ratio_to_sweep_best"] > 0
    assert (r["score_rounds"] is None) == (r["tuned"] == r["sweep_best"])
    if r["score_rounds"] is not None:
        assert len(r["score_rounds"]) == 2 and all(len(x) == 2 for x in r["score_rounds"])
    assert len(r["repeat_sweeps"]) == 2 and "repeated sweeps" in out
    assert "[mlp] tuner report:" in out and "targets: vs best >= 97 %" in out


def test_the_lightning_mode_reads_a_saved_sweep(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    pytest.importorskip("lightning.pytorch")  # only in the benchmark's own environment
    bench = load_bench(monkeypatch)
    sweep = [{"batch_size": n, "status": "ok", "samples_per_s": 10.0 * n} for n in (1, 2, 4)]
    saved = {"results": [{"model": "mlp", "sweep": sweep, "tuned": 4,
                          "tuned_samples_per_s": 40.0, "tuner_s": 1.0, "sweep_best": 4,
                          "sweep_best_samples_per_s": 40.0,
                          "ratio_to_sweep_best": 1.0}]}  # fmt: skip
    path = tmp_path / "bs.json"
    path.write_text(json.dumps(saved))
    assert bench.main(["--lightning", str(path), "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[:3] == ["model", "trainperf", "samples/s"]
    (row,) = [line for line in out.splitlines() if line.startswith("mlp ")]
    assert row.split()[:4] == ["mlp", "4", "40.0", "100.0%"]


def test_an_unknown_model_is_refused_before_any_runs(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before, each model was built when its turn came: `mlp,resnet` swept mlp, then ended
    # in a ValueError traceback that lost its results.
    bench = load_bench(monkeypatch)
    ran: list[str] = []
    monkeypatch.setattr(bench, "run_one", lambda name, *a: ran.append(name) or {})
    with pytest.raises(SystemExit) as exc:
        bench.main(["--models", "mlp,resnet", "--device", "cpu"])
    assert exc.value.code == 2 and ran == []
    assert (
        capsys.readouterr()
        .err.splitlines()[-1]
        .endswith(
            "error: unknown models ['resnet']; choose from resnet18, mlp, encoder, resnet50, "
            "vit_b_16, gpt2"
        )
    )
