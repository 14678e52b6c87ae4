"""examples/resume_after_preemption.py: stop steps in order, and a rerun into the same --out."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.examples._scripts import EXAMPLES, load_example, refused


@pytest.mark.parametrize(
    "stops",
    [
        ("--term-at", "20", "--kill-at", "20"),
        ("--term-at", "30", "--kill-at", "20"),
        ("--term-at", "0", "--kill-at", "20"),
        ("--steps", "40", "--term-at", "15", "--kill-at", "41"),
    ],
)
def test_stops_out_of_order_are_refused_before_any_training(
    stops: tuple[str, ...],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    example = load_example("resume_after_preemption", monkeypatch)
    monkeypatch.setattr(example, "train", lambda *a, **k: pytest.fail("trained"))
    err = refused(example, [*stops, "--out", str(tmp_path)], monkeypatch, capsys)
    assert "need 1 <= --term-at < --kill-at <= --steps, got" in err
    assert not any(tmp_path.iterdir())


class Stopped(Exception):
    """Raised by the stand-in for ``train``: the test ends the script there."""


def stop_in_train(directory: Path, steps: int, hold_at: int = -1) -> dict[str, object]:
    directory.mkdir(parents=True)  # FileExistsError if the last run's was not cleared
    (directory / "checkpoint").write_text("the script's")
    raise Stopped


def run_once(example: ModuleType, out: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", [str(example.__file__), "--out", str(out)])
    with pytest.raises(Stopped):
        example.main()


def test_a_users_run_folder_beside_the_scripts_survives_reruns(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Before: the first run marked --out as the script's, and a rerun removed any run/ or
    # reference/ in it (with --out ~, a user's own ~/run/ made later).
    example = load_example("resume_after_preemption", monkeypatch)
    monkeypatch.setattr(example, "train", stop_in_train)
    run_once(example, tmp_path, monkeypatch)
    for name in ("run", "reference"):
        (tmp_path / name).mkdir(exist_ok=True)
        (tmp_path / name / "notes.txt").write_text("the user's")
    run_once(example, tmp_path, monkeypatch)  # its own reference/ cleared, or this fails
    run_once(example, tmp_path, monkeypatch)
    assert (tmp_path / "run" / "notes.txt").read_text() == "the user's"
    assert (tmp_path / "reference" / "notes.txt").read_text() == "the user's"
    own = tmp_path / "resume_after_preemption"
    assert (own / "reference" / "checkpoint").read_text() == "the script's"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "reference",
        "resume_after_preemption",
        "run",
    ]


def test_a_folder_of_its_name_it_did_not_make_is_refused_and_kept(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    example = load_example("resume_after_preemption", monkeypatch)
    monkeypatch.setattr(example, "train", lambda *a, **k: pytest.fail("trained"))
    mine = tmp_path / "resume_after_preemption" / "run" / "notes.txt"
    mine.parent.mkdir(parents=True)
    mine.write_text("the user's")
    err = refused(example, ["--out", str(tmp_path)], monkeypatch, capsys)
    assert f"--out {tmp_path} already holds resume_after_preemption/, which this script" in err
    assert mine.read_text() == "the user's"


@pytest.mark.slow  # two whole demos: reference run, SIGTERM, SIGKILL, resume
def test_a_rerun_into_the_same_out_starts_afresh(tmp_path: Path) -> None:
    (tmp_path / "theirs.txt").write_text("kept")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "theirs.txt").write_text("kept")
    argv = [sys.executable, str(EXAMPLES / "resume_after_preemption.py")]
    argv += ["--steps", "24", "--term-at", "5", "--kill-at", "12", "--out", str(tmp_path)]
    for _ in range(2):
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "SIGTERM: saved step 5" in proc.stdout
        assert "starting at step 5" in proc.stdout and "starting at step 10" in proc.stdout
        assert "identical to the uninterrupted run: True" in proc.stdout
    assert (tmp_path / "theirs.txt").read_text() == "kept"
    assert (tmp_path / "run" / "theirs.txt").read_text() == "kept"
