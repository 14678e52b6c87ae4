"""benchmarks/autotune_bench.py: a CPU smoke test of the script (its numbers are not checked)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.benchmarks._scripts import load_script

# Each test here runs a script or builds the site: seconds each.
pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def load_bench(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return load_script("autotune_bench", monkeypatch)


@pytest.mark.slow  # a few seconds: a 3-configuration grid and two tuner runs
def test_autotune_bench_compares_both_tuner_modes_with_the_grid(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    bench = load_bench(monkeypatch)
    out_json = tmp_path / "autotune.json"
    rc = bench.main(
        ["--quick", "--datasets", "light", "--budget", "5", "--device", "cpu",
         "--json", str(out_json)]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0
    rows = [line for line in out.splitlines() if line.startswith("light ")]
    assert len(rows) == 2 and "default" in rows[0] and "loader alone" in rows[1]
    results = json.loads(out_json.read_text())["results"]
    assert [r["mode"] for r in results] == ["default", "loader alone"]
    for r in results:
        assert r["grid_configs"] == 3  # --quick: 0, 1 and 2 workers at one prefetch factor
        assert r["tuned_samples_per_s"] > 0 and r["grid_best_samples_per_s"] > 0
        assert 0 < r["ratio_to_grid_best"] <= 1.0  # the grid best is the grid's maximum
    assert results[0]["main_cores"] == 1.0  # no step_fn: one core kept
    assert results[1]["main_cores"] < 0.5  # an idle step_fn: the main process only takes batches


@pytest.mark.slow  # the warmup scenario, shortened: about 6 s
def test_autotune_bench_adapt_runs_the_adaptive_scenarios(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    bench = load_bench(monkeypatch)
    monkeypatch.setitem(sys.modules, "adapt_bench", None)  # replaced by the one it loads
    short = ["--workers", "0,2", "--duration", "2.5", "--tail", "1.5", "--warm", "0.3"]
    rc = bench.main(["--adapt", "--scenarios", "warmup", *short, "--measure", "0.8"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "warmup   as started" in out and "[warmup] tuning_history" in out
    assert "cpus " not in out  # only the scenario asked for


def test_an_unknown_dataset_is_refused_before_any_runs(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before, each dataset was built when its turn came: `light,jpg` ran light's grid and
    # tuner, then ended in a ValueError traceback that lost its results.
    bench = load_bench(monkeypatch)
    ran: list[str] = []
    monkeypatch.setattr(bench, "run_one", lambda name, *a: ran.append(name) or [])
    with pytest.raises(SystemExit) as exc:
        bench.main(["--datasets", "light,jpg", "--device", "cpu"])
    assert exc.value.code == 2 and ran == []
    assert (
        capsys.readouterr()
        .err.splitlines()[-1]
        .endswith("error: unknown datasets ['jpg']; choose from jpeg, light, io, memory")
    )
