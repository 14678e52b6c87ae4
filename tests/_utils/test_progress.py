"""trainperf._utils.progress: the bar each tuner names, on a terminal and elsewhere."""

from __future__ import annotations

import io

from trainperf._utils.progress import ProgressBar


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_off_a_terminal_the_start_and_final_lines_carry_the_name() -> None:
    out = io.StringIO()
    bar = ProgressBar(20.0, name="tune_x", what="things", stream=out, width=4)
    for n in range(5):
        bar.update(f"n={n}", force=True)
    bar.close()
    lines = out.getvalue().splitlines()
    assert lines == [lines[0], lines[1]] and "\r" not in out.getvalue()
    assert lines[0] == "tune_x: measuring things (budget 20 s)"
    assert lines[1].startswith("tune_x [....] ") and lines[1].endswith("/20 s  n=4")


def test_on_a_terminal_the_line_is_redrawn_in_place() -> None:
    out = Terminal()
    bar = ProgressBar(20.0, name="tune_x", what="things", stream=out, width=4)
    bar.update("a long text", force=True)
    bar.update("short", force=True)
    bar.close()
    text = out.getvalue()
    assert text.count("\r") == 3 and text.endswith("\n") and "measuring" not in text
    assert text.startswith("\rtune_x [")


def test_a_disabled_bar_writes_nothing() -> None:
    out = io.StringIO()
    bar = ProgressBar(20.0, name="tune_x", what="things", enabled=False, stream=out)
    bar.update("x", force=True)
    bar.close()
    assert out.getvalue() == ""
