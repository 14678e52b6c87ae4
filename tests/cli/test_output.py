"""trainperf.cli._output: strict JSON, full disks, odd encodings and readers that went away."""

from __future__ import annotations

import errno
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.cli._run import TINY, run
from trainperf.cli import main


class _FullDisk(io.StringIO):
    """A stdout on a full disk (`> /dev/full`), whose file descriptor is a scratch file."""

    def __init__(self, fd: int) -> None:
        super().__init__()
        self.fd = fd

    def write(self, text: str) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    def flush(self) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    def fileno(self) -> int:
        return self.fd


def test_doctor_json_to_a_full_disk_says_so_without_a_traceback(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import trainperf.doctor
    from trainperf.doctor import Check, DoctorReport

    report = DoctorReport((Check("shm", "ok", "64 GiB"),))
    monkeypatch.setattr(trainperf.doctor, "diagnose", lambda: report)
    with open(tmp_path / "stdout", "w") as scratch:
        monkeypatch.setattr(sys, "stdout", _FullDisk(scratch.fileno()))
        code = main(["doctor", "--json"])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert err == (
        "trainperf: error: could not write the output to stdout: No space left on device; "
        "free space there, or redirect stdout elsewhere\n"
    )
    assert isinstance(sys.stdout, _FullDisk)  # main's own stdout wrapper is gone again


def test_doctor_prints_what_stdouts_encoding_lacks_escaped(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import trainperf.doctor
    from trainperf.doctor import Check, DoctorReport

    report = DoctorReport((Check("threads", "warn", "OMP_NUM_THREADS=4\u00e9"),))
    monkeypatch.setattr(trainperf.doctor, "diagnose", lambda: report)
    ascii_out = io.TextIOWrapper(io.BytesIO(), encoding="ascii")  # PYTHONIOENCODING=ascii
    monkeypatch.setattr(sys, "stdout", ascii_out)
    code = main(["doctor"])
    ascii_out.flush()
    out = ascii_out.buffer.getvalue().decode("ascii")  # type: ignore[attr-defined]
    assert code == 0 and capsys.readouterr().err == ""
    assert "OMP_NUM_THREADS=4\\xe9" in out and out.splitlines()[0].split()[0] == "check"


def test_a_closed_stderr_keeps_progress_and_errors_out_of_the_json_on_stdout(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "stderr", None)  # what Python sets when started with `2>&-`
    code, out, _ = run(capsys, "bench", "matmul", "--size", "16", "--dtype", "fp32",
                       "--iterations", "1", "--device", "cpu", "--json")  # fmt: skip
    assert code == 0 and json.loads(out)["results"][0]["dtype"] == "fp32"
    code, out, _ = run(capsys, "bench", "model", *TINY, "--json")
    assert code == 0 and json.loads(out)["results"][0]["model"] == "resnet50"
    code, out, _ = run(capsys, "bench", "matmul", "--device", "tpu", "--json")
    assert code == 1 and json.loads(out)["error"]["type"] == "ValueError"


class _GoneReader(io.StringIO):
    """A stderr whose reader went away (`2>&1 | head -1`), its file descriptor a scratch file."""

    def __init__(self, fd: int) -> None:
        super().__init__()
        self.fd = fd

    def write(self, text: str) -> int:
        raise BrokenPipeError(errno.EPIPE, "Broken pipe")

    def flush(self) -> None:
        raise BrokenPipeError(errno.EPIPE, "Broken pipe")

    def fileno(self) -> int:
        return self.fd


def test_a_stderr_whose_reader_went_away_loses_progress_not_the_results(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    with open(tmp_path / "stderr", "w") as scratch:
        monkeypatch.setattr(sys, "stderr", _GoneReader(scratch.fileno()))
        code, out, _ = run(capsys, "bench", "model", *TINY, "--json")
        assert code == 0 and json.loads(out)["results"][0]["model"] == "resnet50"
        code, out, _ = run(capsys, "bench", "matmul", "--size", "16", "--dtype", "fp32",
                           "--iterations", "1", "--device", "cpu")  # fmt: skip
    assert code == 0 and out.startswith("fp32: ")


def test_a_stderr_whose_reader_went_away_keeps_the_error_document_and_status(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    with open(tmp_path / "stderr", "w") as scratch:
        monkeypatch.setattr(sys, "stderr", _GoneReader(scratch.fileno()))
        with pytest.raises(SystemExit) as usage:
            main(["bench", "matmul", "--size", "0", "--json"])
        assert usage.value.code == 2
        assert json.loads(capsys.readouterr().out)["error"]["type"] == "UsageError"
        code, out, _ = run(capsys, "bench", "matmul", "--device", "tpu", "--json")
    assert code == 1 and json.loads(out)["error"]["type"] == "ValueError"


@pytest.mark.slow
def test_the_command_with_its_stderr_reader_gone_exits_with_its_own_status() -> None:
    # Python's exit code is 120 where flushing stderr fails at exit: what failed to go to
    # stderr must not stay in its buffer.
    command = [sys.executable, "-m", "trainperf", "bench", "matmul", "--size", "16",
               "--dtype", "fp32", "--iterations", "1", "--device", "cpu", "--json"]  # fmt: skip
    for argv, status in ((command, 0), ([*command[:5], "--size", "0", "--json"], 2)):
        read_end, write_end = os.pipe()
        os.close(read_end)  # the reader of stderr is gone before the first line
        done = subprocess.run(argv, stdout=subprocess.PIPE, stderr=write_end, text=True,
                              timeout=120)  # fmt: skip
        os.close(write_end)
        assert done.returncode == status, argv
        assert json.loads(done.stdout)["command"] == "bench matmul"


def _strict_loads(text: str) -> Any:
    """``json.loads`` as a strict parser (jq, JavaScript) reads it: NaN and Infinity refused."""

    def refuse(constant: str) -> Any:
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


class _Measured:
    """A result whose ``to_dict()`` holds values no measurement should give, but might."""

    def to_dict(self) -> dict[str, Any]:
        nan, inf = float("nan"), float("inf")
        return {"tflops": nan, "ratio": inf, "seconds": [1.0, -inf], "nested": {"x": (nan,)}}


def test_json_writes_a_non_finite_number_as_null(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import trainperf.bench

    monkeypatch.setattr(trainperf.bench, "bench_matmul", lambda *a, **k: _Measured())
    code, out, _ = run(capsys, "bench", "matmul", "--dtype", "fp32", "--device", "cpu", "--json")
    assert code == 0
    (result,) = _strict_loads(out)["results"]
    assert result == {
        "tflops": None,
        "ratio": None,
        "seconds": [1.0, None],
        "nested": {"x": [None]},
    }


class _Broken:
    def to_dict(self) -> dict[str, Any]:
        raise ValueError("to_dict failed half-way")


def test_a_to_dict_that_fails_mid_document_leaves_only_the_error_document(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from trainperf import device
    from trainperf.device import GpuInfo

    card = GpuInfo(0, 0, "GPU-1", "NVIDIA A100", 80 * 2**30, 2**29, 80 * 2**30 - 2**29, 3,
                   (8, 0), "00000000:01:00.0")  # fmt: skip
    # The first GPU is written fine; the second fails once the document is under way.
    monkeypatch.setattr(device, "gpus", lambda: [card, _Broken()])
    code, out, err = run(capsys, "gpus", "--json")
    assert code == 1 and err == "trainperf: error: to_dict failed half-way\n"
    assert _strict_loads(out) == {
        "command": "gpus",
        "error": {"type": "ValueError", "message": "to_dict failed half-way"},
    }


@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_stdouts_reader_gone_exits_141_quietly(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    json_flag: list[str],
) -> None:
    import trainperf.doctor
    from trainperf.doctor import Check, DoctorReport

    report = DoctorReport((Check("shm", "fail", "64 MiB"),))  # a failing check: still 141
    monkeypatch.setattr(trainperf.doctor, "diagnose", lambda: report)
    with open(tmp_path / "stdout", "w") as scratch:
        monkeypatch.setattr(sys, "stdout", _GoneReader(scratch.fileno()))  # `| head -0`
        code = main(["doctor", *json_flag])
    assert code == 141 and capsys.readouterr().err == ""


@pytest.mark.slow
def test_the_command_with_its_stdout_reader_gone_exits_141_with_nothing_on_stderr() -> None:
    read_end, write_end = os.pipe()
    os.close(read_end)  # `trainperf gpus | head -0`: the reader is gone before the output
    done = subprocess.run([sys.executable, "-m", "trainperf", "gpus"], stdout=write_end,
                          stderr=subprocess.PIPE, text=True, timeout=120)  # fmt: skip
    os.close(write_end)
    assert (done.returncode, done.stderr) == (141, "")


class _GoneReaderWithoutFd(io.StringIO):
    """A stdout object (a notebook's, a test's) whose reader went away and that has no
    file descriptor to point elsewhere."""

    def write(self, text: str) -> int:
        raise BrokenPipeError(errno.EPIPE, "Broken pipe")


def test_a_gone_reader_without_a_file_descriptor_still_exits_141(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "stdout", _GoneReaderWithoutFd())
    code = main(["bench", "matmul", "--size", "8", "--dtype", "fp32", "--iterations", "1",
                 "--device", "cpu"])  # fmt: skip
    assert code == 141 and "Traceback" not in capsys.readouterr().err
