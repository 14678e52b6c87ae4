"""The progress bar names this tuner, on a terminal and off it."""

from __future__ import annotations

import io

from trainperf.batchsize._progress import BatchSizeBar


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_off_a_terminal_a_start_line_and_a_final_line_name_the_tuner() -> None:
    out = io.StringIO()
    bar = BatchSizeBar(30.0, stream=out)
    bar.update("batch 8: warming up", force=True)
    bar.update("batch 8: 1,000/s", force=True)
    bar.close()
    lines = out.getvalue().splitlines()
    assert lines[0] == "tune_batch_size: measuring batch sizes (budget 30 s)"
    assert len(lines) == 2 and lines[1].startswith("tune_batch_size [")
    assert lines[1].endswith("batch 8: 1,000/s") and "tune_loader" not in out.getvalue()


def test_on_a_terminal_the_line_is_redrawn_in_place() -> None:
    out = Tty()
    bar = BatchSizeBar(30.0, stream=out)
    bar.update("batch 8", force=True)
    bar.close()
    text = out.getvalue()
    assert text.startswith("\rtune_batch_size [") and text.endswith("\n")
    assert "measuring batch sizes" not in text


def test_a_disabled_bar_writes_nothing() -> None:
    out = io.StringIO()
    bar = BatchSizeBar(30.0, enabled=False, stream=out)
    bar.update("x", force=True)
    bar.close()
    assert out.getvalue() == ""
