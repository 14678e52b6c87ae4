"""trainperf.loader._progress: the progress bar on a terminal, in a log, disabled."""

from __future__ import annotations

import io

from trainperf.loader._progress import ProgressBar


def test_progress_bar_disabled_writes_nothing() -> None:
    out = io.StringIO()
    bar = ProgressBar(1.0, enabled=False, stream=out)
    bar.update("x", force=True)
    bar.close()
    assert out.getvalue() == ""


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_redraws_in_place_on_a_terminal() -> None:
    out = Terminal()
    bar = ProgressBar(10.0, stream=out, width=10)
    for n in range(3):
        bar.update(f"workers={n}", force=True)
    bar.close()
    text = out.getvalue()
    assert text.count("\r") == 4  # three updates and the final redraw
    assert text.endswith("workers=2\n") and text.count("\n") == 1


def test_progress_bar_writes_a_start_and_a_final_line_elsewhere() -> None:
    out = io.StringIO()  # a CI log or a SLURM .err file: not a terminal
    bar = ProgressBar(10.0, stream=out, width=10)
    for n in range(50):
        bar.update(f"workers={n}", force=True)
    bar.close()
    text = out.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert len(lines) == 2 and text.endswith("\n")
    assert lines[0] == "tune_loader: measuring DataLoader settings (budget 10 s)"
    assert lines[1].startswith("tune_loader [") and lines[1].endswith("workers=49")


def test_progress_bar_on_a_stream_without_isatty() -> None:
    class Sink:
        def __init__(self) -> None:
            self.parts: list[str] = []

        def write(self, s: str) -> int:
            self.parts.append(s)
            return len(s)

        def flush(self) -> None:
            pass

    sink = Sink()
    bar = ProgressBar(5.0, stream=sink, width=4)  # type: ignore[arg-type]
    bar.close()  # no update: only the final line
    assert len(sink.parts) == 1 and sink.parts[0].startswith("tune_loader [")
