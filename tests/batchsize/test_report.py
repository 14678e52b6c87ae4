"""The report protocol: the table, a JSON-safe dict, a plot; and the pipeline's memory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainperf.batchsize import BatchSizeCandidate, BatchSizeReport, PipelineMemory

GiB = 2**30


def report(**kw: object) -> BatchSizeReport:
    cands = (
        BatchSizeCandidate(32, "ok", samples_per_s=900.0, spread=0.02, peak_memory=2 * GiB,
                           accumulation_steps=8),
        BatchSizeCandidate(64, "ok", samples_per_s=1000.0, spread=0.01, peak_memory=3 * GiB,
                           accumulation_steps=4),
        BatchSizeCandidate(128, "oom", peak_memory=9 * GiB, accumulation_steps=2,
                           reason="CUDA out of memory"),
        BatchSizeCandidate(96, "over-headroom", samples_per_s=990.0, peak_memory=8 * GiB,
                           reason="peak past the 7.2 GiB usable"),
    )  # fmt: skip
    fields: dict[str, object] = {
        "batch_size": 64,
        "accumulation_steps": 4,
        "samples_per_s": 1000.0,
        "peak_memory": 3 * GiB,
        "memory_limit": 8 * GiB,
        "candidates": cands,
        "elapsed_s": 12.5,
        "budget_s": 60.0,
        "headroom": 0.1,
        "device": "cuda:0",
        "world_size": 1,
        "global_batch": 256,
        "memory_kind": "cuda",
        "pipeline": PipelineMemory.of(2**20 * 64, 4, 2, 16 * GiB, GiB),
        "notes": ("growth stopped at 128: oom (CUDA out of memory)",),
    }
    fields.update(kw)
    return BatchSizeReport(**fields)  # type: ignore[arg-type]


def test_the_table_shows_every_size_the_choice_and_the_pipeline() -> None:
    text = str(report())
    lines = text.splitlines()
    assert lines[0] == "Batch size tuning: device cuda:0, 1 rank, global batch 256, 12.5 s of 60 s"
    assert "limit 8.0 GiB, headroom 10 % -> 7.2 GiB usable" in lines[1]
    assert "caching allocator" in lines[1]
    assert lines[2].split() == ["batch", "accum", "samples/s", "spread", "peak", "status"]
    assert lines[4].endswith("ok <- chosen") and lines[4].split()[:2] == ["64", "4"]
    assert "oom: CUDA out of memory" in lines[5]
    assert "over-headroom: peak past the 7.2 GiB usable" in lines[6]
    assert "chosen: batch_size=64, accumulation_steps=4 (64 x 4 x 1 = 256 samples" in text
    assert "peak 3.0 GiB of 7.2 GiB usable" in text
    assert "num_workers=4 x prefetch_factor=2 + 1 holds 9 batches: 576 MiB" in text
    assert text.endswith("note: growth stopped at 128: oom (CUDA out of memory)")


def test_a_cached_unmeasured_report_says_so() -> None:
    text = str(report(from_cache=True, memory_limit=None, memory_kind="unmeasured", pipeline=None))
    assert "from cache" in text.splitlines()[0]
    assert "memory: peak memory not measured on this device" in text
    assert "input pipeline" not in text


def test_a_choice_without_a_measured_rate_says_samples_per_s_not_measured() -> None:
    text = str(report(samples_per_s=None, from_cache=True))
    chosen = next(line for line in text.splitlines() if line.startswith("chosen:"))
    assert chosen.endswith(
        "samples per update): samples/s not measured, peak 3.0 GiB of 7.2 GiB usable"
    )
    assert "not measured samples/s" not in text


def test_to_dict_is_json_safe_and_complete() -> None:
    r = report()
    data = json.loads(json.dumps(r.to_dict()))
    assert data["effective_batch"] == 256 and data["usable_memory"] == int(0.9 * 8 * GiB)
    assert data["candidates"][2]["status"] == "oom"
    assert BatchSizeCandidate(**data["candidates"][0]) == r.candidates[0]
    assert data["pipeline"]["fits"] is True and data["notes"] == list(r.notes)


def test_the_pipeline_figure_counts_the_batches_in_flight_against_shm() -> None:
    fits = PipelineMemory.of(100 * 2**20, 0, None, GiB, 10)  # no workers: shm not used
    assert (fits.batches_in_flight, fits.fits) == (1, True)
    shm = PipelineMemory.of(100 * 2**20, 8, 2, 16 * GiB, GiB)  # 17 x 100 MiB > 1 GiB
    assert not shm.fits and "does NOT fit" in str(shm) and "/dev/shm 1.0 GiB free" in str(shm)
    assert not PipelineMemory.of(GiB, 0, None, GiB // 2, None).fits
    r = report()
    other = r.input_pipeline(8, 4)
    assert other is not None and other.batches_in_flight == 33
    assert other.total_bytes == 33 * 64 * 2**20 and not other.fits  # past the 1 GiB /dev/shm
    assert report(pipeline=None).input_pipeline(2) is None


def test_chosen_is_the_measured_candidate_of_the_chosen_size() -> None:
    r = report()
    assert r.chosen() is r.candidates[1]
    assert report(batch_size=96).chosen() is None  # over the headroom: not a valid choice


@pytest.mark.slow  # importing matplotlib: seconds on a busy host
def test_plot_draws_throughput_memory_and_the_choice(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = report().plot(tmp_path / "bs.svg")
    svg = out.read_text()
    assert "chosen: 64" in svg and "peak memory" in svg and "usable" in svg


@pytest.mark.slow  # importing matplotlib: seconds on a busy host
@pytest.mark.parametrize(
    "candidates",
    [(), (BatchSizeCandidate(128, "skipped", reason="no time left in the budget"),)],
    ids=["none", "skipped"],
)
def test_plot_of_a_report_with_nothing_measured_draws_empty_axes(
    tmp_path: Path, candidates: tuple[BatchSizeCandidate, ...]
) -> None:
    # Before: a log-scaled axis without data raised "Data cannot be log-scaled" (a report
    # read from a cache entry with no candidates, say).
    pytest.importorskip("matplotlib")
    r = report(candidates=candidates, samples_per_s=None, peak_memory=None)
    assert "Batch size on cuda:0" in r.plot(tmp_path / "bs.svg").read_text()
