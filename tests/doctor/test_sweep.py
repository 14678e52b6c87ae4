"""The all_reduce sweep (``doctor/_sweep.py``): bus bandwidth, the result, the gloo ranks."""

from __future__ import annotations

import importlib
import json
import math
import os
import sys
import threading
import warnings
from pathlib import Path

import pytest

from trainperf.doctor import AllReduceSweep, SweepRow, all_reduce_sweep, bus_bandwidth
from trainperf.doctor._sweep import environment, start_method_for

sweep_module = importlib.import_module("trainperf.doctor._sweep")

ROWS = (SweepRow(2**20, 40, 0.002, 0.524, 0.524), SweepRow(2**26, 4, 0.05, 1.342, 1.342))


def test_bus_bandwidth_is_algbw_times_2_n_minus_1_over_n() -> None:
    assert bus_bandwidth(10.0, 2) == 10.0
    assert bus_bandwidth(10.0, 4) == 15.0
    assert bus_bandwidth(8.0, 8) == 14.0


def test_a_row_from_the_slowest_ranks_time() -> None:
    row = SweepRow.from_timing(64 * 2**20, 5, 0.01, ranks=4)
    assert row.algbw_gb_per_s == pytest.approx(6.711, abs=1e-3)
    assert row.busbw_gb_per_s == pytest.approx(6.711 * 1.5, abs=1e-3)
    assert (row.size_bytes, row.iterations, row.seconds_per_call) == (64 * 2**20, 5, 0.01)


def test_sweep_report_protocol() -> None:
    sweep = AllReduceSweep("gloo", 2, "cpu", ROWS, start_method="fork", seconds=1.5)
    assert sweep.peak == ROWS[1]
    text = str(sweep)
    assert text.splitlines()[0].startswith("all_reduce sweep: gloo, 2 ranks on cpu")
    assert "64 MiB" in text and "1.34" in text and "50.00 ms" in text
    data = json.loads(json.dumps(sweep.to_dict()))
    assert data["peak_busbw_gb_per_s"] == 1.342 and len(data["rows"]) == 2
    assert data["setting"] == "as configured" and data["backend"] == "gloo"
    assert AllReduceSweep("gloo", 2, "cpu", ()).to_dict()["peak_busbw_gb_per_s"] is None


@pytest.mark.slow  # the first matplotlib import takes seconds
def test_sweep_plot_writes_an_image(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = AllReduceSweep("gloo", 2, "cpu", ROWS).plot(tmp_path / "sweep.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sweep_plot_into_a_missing_folder_names_the_folder_and_the_fix(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such"
    with pytest.raises(
        FileNotFoundError, match=r"AllReduceSweep\.plot\(.*folder .*no/such.* does not exist.*mkdir"
    ):
        AllReduceSweep("gloo", 2, "cpu", ROWS).plot(missing / "all_reduce.png")
    assert not missing.exists()


def test_sweep_plot_to_a_folder_is_refused_not_written_beside_it(tmp_path: Path) -> None:
    # matplotlib would write "<folder>.png" beside it and the call return the folder.
    with pytest.raises(IsADirectoryError, match=r"is a folder.*pass a file path"):
        AllReduceSweep("gloo", 2, "cpu", ROWS).plot(tmp_path)
    assert list(tmp_path.iterdir()) == []
    assert not (tmp_path.parent / f"{tmp_path.name}.png").exists()


@pytest.mark.slow  # matplotlib's import and one figure: about a second
def test_sweep_plot_to_a_path_without_a_suffix_writes_a_png_at_that_path(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = AllReduceSweep("gloo", 2, "cpu", ROWS).plot(tmp_path / "all_reduce")
    assert out == tmp_path / "all_reduce"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir()] == ["all_reduce"]


def test_environment_sets_removes_and_restores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NCCL_P2P_LEVEL", "NVL")
    monkeypatch.delenv("NCCL_P2P_DISABLE", raising=False)
    with environment({"NCCL_P2P_DISABLE": "1", "NCCL_P2P_LEVEL": None}):
        assert os.environ["NCCL_P2P_DISABLE"] == "1" and "NCCL_P2P_LEVEL" not in os.environ
    assert "NCCL_P2P_DISABLE" not in os.environ and os.environ["NCCL_P2P_LEVEL"] == "NVL"
    with pytest.raises(RuntimeError, match="inside"), environment({"NCCL_P2P_DISABLE": "1"}):
        raise RuntimeError("inside")
    assert "NCCL_P2P_DISABLE" not in os.environ


def test_start_method_forks_only_where_safe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clean = tmp_path / "maps"
    clean.write_text("7f00-7f80 r-xp 0 08:01 1 /usr/lib/libcudart.so.13\n")  # runtime only
    cuda = tmp_path / "cuda-maps"
    cuda.write_text("7f00-7f80 r-xp 0 08:01 1 /usr/lib/libcuda.so.1\n")
    assert start_method_for("nccl", clean) == "spawn"
    assert start_method_for("gloo", cuda) == "spawn"
    assert start_method_for("gloo", tmp_path / "missing") == "spawn"
    with monkeypatch.context() as alone:
        # One thread, whatever an earlier test left winding down (under load, a thread
        # still exiting made this flaky).
        alone.setattr(threading, "active_count", lambda: 1)
        assert start_method_for("gloo", clean) == ("fork" if sys.platform == "linux" else "spawn")
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:
        assert start_method_for("gloo", clean) == "spawn"  # fork with a second thread
    finally:
        stop.set()
        other.join()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"nprocs": 1}, "nprocs >= 2"),
        ({"nprocs": 0}, "nprocs must be an int >= 1, got 0"),
        ({"sizes": []}, "at least one message size"),
        # Before: "sizes[] must be ...", which did not say which of the sizes was wrong.
        ({"sizes": [2**20, 0]}, r"sizes\[1\] must be an int >= 1, got 0"),
        ({"backend": "mpi"}, "backend must be one of"),
        ({"timeout": math.nan}, "timeout"),
        # Accepted before, then refused by ddp.launch as a hang_timeout never passed.
        ({"timeout": 1.5}, r"timeout=1.5\) is under 2 s: half of it bounds a hang"),
        ({"target_seconds": 0}, "target_seconds"),
    ],
)
def test_all_reduce_sweep_refuses_bad_options_before_starting_ranks(
    kwargs: dict[str, object], message: str
) -> None:
    options: dict[str, object] = {"backend": "gloo", **kwargs}
    with pytest.raises(ValueError, match=message):
        all_reduce_sweep(**options)  # type: ignore[arg-type]


@pytest.mark.slow
def test_gloo_sweep_end_to_end_with_an_environment_override() -> None:
    sweep = all_reduce_sweep(
        backend="gloo", nprocs=2, sizes=[2**16, 2**20], env={"TRAINPERF_SWEEP_TEST": "1"},
        target_seconds=0.02,
    )  # fmt: skip
    assert (sweep.backend, sweep.world_size, sweep.device) == ("gloo", 2, "cpu")
    assert [r.size_bytes for r in sweep.rows] == [2**16, 2**20]
    assert all(r.iterations >= 3 and r.busbw_gb_per_s > 0 for r in sweep.rows)
    assert sweep.setting == "TRAINPERF_SWEEP_TEST=1"
    assert "TRAINPERF_SWEEP_TEST" not in os.environ


@pytest.mark.requires_cuda
@pytest.mark.slow
def test_nccl_sweep_one_rank_per_gpu() -> None:
    import trainperf

    gpus = len(trainperf.gpus())  # NVML: CUDA stays uninitialised in this process
    if gpus < 2:
        pytest.skip(f"an NCCL all_reduce needs 2+ GPUs, this host has {gpus}")
    sweep = all_reduce_sweep(backend="nccl", sizes=[2**20, 2**26], target_seconds=0.05)
    assert (sweep.backend, sweep.world_size, sweep.device) == ("nccl", gpus, "cuda")
    assert sweep.start_method == "spawn" and all(r.busbw_gb_per_s > 0 for r in sweep.rows)


def test_sweep_hang_timeout_is_below_its_timeout_so_launch_does_not_warn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import trainperf.ddp._launch as launch_module

    seen: dict[str, object] = {}

    def fake_spawn(*args: object, **kwargs: object) -> dict[int, object]:
        seen.update(kwargs)
        return {0: [(2**16, 3, 0.001)]}

    monkeypatch.setattr(launch_module, "_spawn", fake_spawn)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sweep = all_reduce_sweep(backend="gloo", sizes=[2**16], timeout=20.0)
    assert seen["hang_timeout"] == 10.0 and len(sweep.rows) == 1


@pytest.mark.parametrize("ranks", [0, -2, 2.0, True, "8"])
def test_bus_bandwidth_refuses_a_rank_count_that_is_not_a_positive_int(ranks: object) -> None:
    # Before: ranks=0 raised ZeroDivisionError, and -2 gave a bandwidth of 3x algbw.
    with pytest.raises(ValueError, match=r"ranks must be an int >= 1, got "):
        bus_bandwidth(1.0, ranks)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"ranks must be an int >= 1, got "):
        SweepRow.from_timing(2**20, 3, 0.01, ranks)  # type: ignore[arg-type]


@pytest.mark.parametrize("algbw", [float("nan"), float("inf"), -1.0, "100", None, True])
def test_bus_bandwidth_refuses_an_algbw_that_is_no_measurement(algbw: object) -> None:
    # Before: NaN came back as NaN, "100" raised a bare TypeError, -1.0 gave a negative figure.
    with pytest.raises(ValueError, match=r"algbw must be a finite number >= 0, got "):
        bus_bandwidth(algbw, 8)  # type: ignore[arg-type]


@pytest.mark.parametrize("seconds", [0, -0.5, float("nan"), float("inf")])
def test_a_row_refuses_a_time_per_call_that_is_no_time(seconds: float) -> None:
    # Before: seconds=0 raised ZeroDivisionError, and NaN or inf made NaN/0 bandwidths.
    message = rf"seconds must be a positive number of seconds per call, got {seconds}"
    with pytest.raises(ValueError, match=message):
        SweepRow.from_timing(2**20, 5, seconds, ranks=2)


@pytest.mark.parametrize(("field", "value"), [("size", 0), ("iterations", 2.0)])
def test_a_row_refuses_a_size_or_count_below_one(field: str, value: object) -> None:
    args: dict[str, object] = {"size": 2**20, "iterations": 5, field: value}
    with pytest.raises(ValueError, match=rf"{field} must be an int >= 1, got {value!r}"):
        SweepRow.from_timing(seconds=0.01, ranks=2, **args)  # type: ignore[arg-type]


def test_a_row_from_numpy_figures_is_json_safe() -> None:
    np = pytest.importorskip("numpy")
    # Before: the row kept the NumPy size and count, which json.dumps refuses.
    row = SweepRow.from_timing(np.int64(2**20), np.int64(5), np.float64(0.01), np.int64(2))
    assert row == SweepRow.from_timing(2**20, 5, 0.01, ranks=2)
    data = AllReduceSweep("gloo", 2, "cpu", (row,)).to_dict()
    assert json.loads(json.dumps(data)) == data


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sizes": 2**20}, r"sizes must be a sequence of message sizes in bytes, got 1048576"),
        ({"sizes": "1048576"}, r"sizes must be a sequence of message sizes in bytes, got '1"),
        ({"env": {"NCCL_P2P_DISABLE": 1}}, r"env\['NCCL_P2P_DISABLE'\] must be a str or None"),
        ({"env": {"A=B": "1"}}, r"env key must be a variable name"),
        ({"env": ["NCCL_P2P_DISABLE"]}, r"env must be a mapping"),
    ],
)
def test_all_reduce_sweep_names_a_malformed_sizes_or_env(
    kwargs: dict[str, object], message: str
) -> None:
    # Before: TypeError("'int' object is not iterable"), "sizes[] ... got '1'" for a string,
    # and os.environ's own "str expected, not int" from inside the environment block.
    with pytest.raises(ValueError, match=message):
        all_reduce_sweep(backend="gloo", **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("visible", [0, 1])
def test_all_reduce_sweep_with_nccl_on_too_few_gpus_names_the_gpus_not_nprocs(
    monkeypatch: pytest.MonkeyPatch, visible: int
) -> None:
    # Before: "nprocs must be an int >= 1, got 0" (or "nprocs >= 2 ..., got 1") for an nprocs
    # the caller never passed.
    monkeypatch.setattr(sweep_module, "_visible_gpus", lambda: visible)
    message = rf"backend='nccl' runs one rank per GPU and needs 2\+ visible GPUs, found {visible}"
    with pytest.raises(ValueError, match=message):
        all_reduce_sweep(backend="nccl")


def test_start_method_reads_maps_that_are_not_utf8(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A mapped file whose path is not UTF-8 made the sweep fail with UnicodeDecodeError.
    # One thread, or a second one alive would answer "spawn" without reading maps at all.
    monkeypatch.setattr(threading, "active_count", lambda: 1)
    maps = tmp_path / "maps"
    maps.write_bytes(b"7f00-7f80 r-xp 0 08:01 1 /data/caf\xe9/libcuda.so.1\n")
    assert start_method_for("gloo", maps) == "spawn"
    maps.write_bytes(b"7f00-7f80 r-xp 0 08:01 1 /data/caf\xe9/libx.so\n")
    assert start_method_for("gloo", maps) == ("fork" if sys.platform == "linux" else "spawn")
