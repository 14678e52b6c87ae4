"""The `trainperf` command, run in-process (fast) and once as `python -m trainperf`."""

from __future__ import annotations

import errno
import io
import json
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from trainperf.cli import build_parser, main
from trainperf.cli._parser import _as_typed

ITERATION = re.compile(r"^Iteration \d+, \d+\.\d images/s in \d+\.\d{3} s\.$")
# One image of 32 px, one timed batch: each model run takes about a second on a CPU.
TINY = ["--device", "cpu", "--batch-size", "1", "--image-size", "32", "--warmup-batches", "1",
        "--iterations", "1"]  # fmt: skip


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    code, out, _ = run(capsys, *argv, "--json")
    assert code == 0
    document: dict[str, Any] = json.loads(out)
    return document


def test_bench_model_prints_the_seed_lines_and_a_summary(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = run(capsys, "bench", "model", *TINY[:-1], "2")
    assert code == 0
    lines = out.splitlines()
    assert [i for i, line in enumerate(lines) if ITERATION.match(line)] == [0, 1]
    assert lines[0].startswith("Iteration 0,") and lines[1].startswith("Iteration 1,")
    assert "resnet50 fp32 inference on cpu" in lines[2]
    assert "warming up" in err  # progress goes to stderr


@pytest.mark.slow
def test_bench_model_all_precisions_as_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "bench", "model", "--precision", "all", *TINY, "--json")
    assert code == 0
    document = json.loads(out)
    assert document["command"] == "bench model"
    results = document["results"]
    assert [r.get("precision", r.get("setting")) for r in results] == ["fp32", "fp16", "bf16"]
    for r in results:
        if "reason" in r:  # a precision this PyTorch cannot run on the CPU is a skipped record
            assert r["benchmark"] == "model"
            continue
        assert r["model"] == "resnet50" and r["device"] == "cpu"
        assert len(r["iteration_seconds"]) == 1 and r["images_per_s"] > 0
    # In JSON mode the iteration lines still show, on stderr.
    assert sum(bool(ITERATION.match(line)) for line in err.splitlines()) == sum(
        "reason" not in r for r in results
    )


@pytest.mark.slow
def test_bench_model_vit_json(capsys: pytest.CaptureFixture[str]) -> None:
    document = run_json(capsys, "bench", "model", "--model", "vit_b_16", "--precision", "bf16",
                        *TINY)  # fmt: skip
    (result,) = document["results"]
    assert (result["model"], result["precision"], result["image_size"]) == ("vit_b_16", "bf16", 32)


def test_bench_model_library_errors_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "bench", "model", "--model", "vit_b_16", "--image-size", "40",
                       "--device", "cpu")  # fmt: skip
    assert code == 1 and "trainperf: error: vit_b_16 takes 16-pixel patches" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_bench_model_on_missing_cuda_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "bench", "model", "--device", "cuda")
    assert code == 1 and "CUDA is not available" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_bench_matmul_on_missing_cuda_exits_1_instead_of_skipping_every_dtype(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = run(capsys, "bench", "matmul", "--device", "cuda", "--json")
    assert code == 1 and "CUDA is not available" in err
    assert json.loads(out)["error"]["type"] == "DeviceError"  # no results: the error instead


def test_bench_matmul_json_and_human(capsys: pytest.CaptureFixture[str]) -> None:
    document = run_json(capsys, "bench", "matmul", "--size", "32", "--iterations", "2",
                        "--device", "cpu")  # fmt: skip
    results = {r.get("dtype", r.get("setting")): r for r in document["results"]}
    assert list(results) == ["fp32", "tf32", "bf16", "fp16"]
    # In the command line's words: the user typed --dtype, not bench_matmul(dtype=...).
    assert results["tf32"]["reason"].startswith("--dtype tf32 needs a CUDA GPU")
    assert all(results[d]["tflops"] > 0 and results[d]["size"] == 32 for d in ("fp32", "fp16"))
    code, out, _ = run(capsys, "bench", "matmul", "--size", "32", "--dtype", "fp32", "fp32",
                       "--device", "cpu")  # fmt: skip
    assert code == 0 and out.count("TFLOP/s") == 1 and "fp32:" in out


@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_bench_h2d_on_a_gpu_that_is_not_there_exits_1_like_matmul(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, json_flag: list[str]
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a host with one GPU
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    code, out, err = run(capsys, "bench", "h2d", "--device", "cuda:3", "--size-mb", "1",
                         *json_flag)  # fmt: skip
    assert code == 1 and "device 'cuda:3' does not exist" in err
    assert (json.loads(out)["command"] == "bench h2d") if json_flag else out == ""


def test_bench_h2d_naming_cuda_on_a_cpu_only_host_exits_1_without_advising_the_cpu(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, out, err = run(capsys, "bench", "h2d", "--device", "cuda")
    assert code == 1 and out == "" and "CUDA is not available" in err
    assert "device='cpu'" not in err and "no CPU fallback" in err
    code, _, err = run(capsys, "bench", "h2d", "--device", "cpu")
    assert code == 1 and "device 'cpu' is not supported here" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_bench_h2d_without_cuda_says_so_and_succeeds(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "bench", "h2d")
    assert code == 0 and "bench h2d skipped" in out and "needs CUDA" in out
    document = run_json(capsys, "bench", "h2d")
    (skipped,) = document["results"]
    assert skipped["benchmark"] == "h2d" and "needs CUDA" in skipped["reason"]


@pytest.mark.requires_cuda
def test_bench_h2d_on_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    document = run_json(capsys, "bench", "h2d", "--size-mb", "16", "--iterations", "2")
    (result,) = document["results"]
    assert result["pinned_gb_per_s"] > 0 and result["size_bytes"] == 16 * 2**20


def test_doctor_human_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "doctor")
    assert out.splitlines()[0].split() == ["check", "verdict", "value"]
    assert "visible_devices" in out
    json_code, json_out, _ = run(capsys, "doctor", "--json")
    document = json.loads(json_out)
    assert document["command"] == "doctor"
    assert {c["name"] for c in document["checks"]} >= {"gpus", "cpus", "shm", "blas"}
    assert code == json_code == (1 if document["worst"] == "fail" else 0)


def test_gpus_lists_what_nvml_sees(capsys: pytest.CaptureFixture[str]) -> None:
    document = run_json(capsys, "gpus")
    code, out, _ = run(capsys, "gpus")
    assert code == 0
    if not document["gpus"]:
        assert "No NVIDIA GPU visible" in out
    for g in document["gpus"]:
        assert g["name"] in out and {"index", "uuid", "memory_total"} <= set(g)


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["bench"],
        ["bench", "model", "--precision", "fp8"],
        ["bench", "model", "--iterations", "0"],
        ["bench", "matmul", "--size", "x"],
        ["bench", "matmul", "--dtype", "int8"],
    ],
)
def test_usage_errors_exit_2_with_one_line(
    capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert re.fullmatch(r"trainperf: error: .+; see trainperf( \w+)* --help\n", err), err


@pytest.mark.parametrize(
    ("argv", "command", "message"),
    [
        (["bench", "matmul", "--size", "0"], "bench matmul",
         "argument --size: expected an integer >= 1, got '0'; see trainperf bench matmul --help"),
        (["bench", "matmul", "--size", "abc"], "bench matmul",
         "argument --size: expected an integer >= 1, got 'abc'; see trainperf bench matmul --help"),
        (["bench", "nope"], "bench", "argument BENCHMARK: invalid choice: 'nope'"),
        (["nope"], None, "argument COMMAND: invalid choice: 'nope'"),
        (["doctor", "--verbose"], "doctor",
         "unrecognized arguments: --verbose; see trainperf doctor --help"),
    ],
)  # fmt: skip
def test_a_usage_error_with_json_prints_the_error_document(
    capsys: pytest.CaptureFixture[str], argv: list[str], command: str | None, message: str
) -> None:
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--json"])
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    document = json.loads(out)
    assert document["command"] == command and document["error"]["type"] == "UsageError"
    assert document["error"]["message"].startswith(message)
    assert err == f"trainperf: error: {document['error']['message']}\n"


@pytest.mark.parametrize(
    ("argv", "prog"),
    [
        (["bench", "matmul", "--sise", "64"], "trainperf bench matmul"),
        (["bench", "--dry-run", "matmul"], "trainperf bench matmul"),
        (["gpus", "--all"], "trainperf gpus"),
    ],
)
def test_an_unknown_option_points_at_the_help_of_the_subcommand_given_it(
    capsys: pytest.CaptureFixture[str], argv: list[str], prog: str
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    unknown = " ".join(a for a in argv if a.startswith("-") or a.isdigit())
    assert exc.value.code == 2
    assert capsys.readouterr().err.endswith(
        f"error: unrecognized arguments: {unknown}; see {prog} --help\n"
    )


def test_a_usage_error_with_stderr_closed_writes_nothing_to_stdout(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "stderr", None)  # what Python sets when started with `2>&-`
    with pytest.raises(SystemExit) as exc:
        main(["bench", "matmul", "--size", "0"])
    assert exc.value.code == 2 and capsys.readouterr().out == ""


def test_build_parser_defaults() -> None:
    args = build_parser().parse_args(["bench", "model"])
    assert (args.model, args.precision, args.iterations, args.tf32, args.json) == (
        "resnet50", "fp32", None, None, False,
    )  # fmt: skip
    assert build_parser().parse_args(["bench", "model", "--no-tf32"]).tf32 is False


@pytest.mark.slow
def test_python_dash_m_trainperf() -> None:
    help_run = subprocess.run(
        [sys.executable, "-m", "trainperf", "--help"],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    assert "bench" in help_run.stdout and "doctor" in help_run.stdout
    doctor = subprocess.run(
        [sys.executable, "-m", "trainperf", "doctor", "--json"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    document = json.loads(doctor.stdout)
    assert doctor.returncode == (1 if document["worst"] == "fail" else 0)
    assert [c["name"] for c in document["checks"]][:2] == ["gpus", "torch"]


def test_bench_model_help_names_the_reference_table(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "model", "--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0
    assert "reference table" in " ".join(out.split()) and "seed" not in out


def test_gpus_table_formats_memory_like_the_other_reports(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from trainperf import device
    from trainperf.device import GpuInfo

    card = GpuInfo(0, 0, "GPU-1", "NVIDIA A100", 80 * 2**30, 2**29, 80 * 2**30 - 2**29, 3,
                   (8, 0), "00000000:01:00.0")  # fmt: skip
    monkeypatch.setattr(device, "gpus", lambda: [card])
    code, out, _ = run(capsys, "gpus")
    assert code == 0 and "512 MiB/80.0 GiB" in out


# --------------------------------------------------------------------------- --json is to_dict()


def _fixed_results() -> dict[str, Any]:
    """One result of each benchmark, made up, as the library would return them."""
    from trainperf.bench import BenchResult, H2DResult, MatmulResult, compare_to_reference

    comparison = compare_to_reference("NVIDIA A100-SXM4-80GB", "resnet50", "fp16", 1500.0)
    model = BenchResult(
        "resnet50", "fp16", "cuda:0", "NVIDIA A100-SXM4-80GB", 128, 224, 15, 15, False, False,
        False, True, False, torch.__version__, (1.2, 1.3), (1600.0, 1476.9), 1538.5,
        comparison, ("a note",),
    )  # fmt: skip
    matmul = MatmulResult(
        "fp16", 8192, "cuda:0", "NVIDIA A100-SXM4-80GB", 20, 0.004, 274.9, 312.0, 0.88, ()
    )
    h2d = H2DResult("cuda:0", "NVIDIA A100-SXM4-80GB", 16 * 2**20, 2, 9.1, 24.8, 24.8 / 9.1)
    return {"model": model, "matmul": matmul, "h2d": h2d}


@pytest.mark.parametrize(
    ("bench", "function", "argv"),
    [
        ("model", "bench_model", ["--precision", "fp16"]),
        ("matmul", "bench_matmul", ["--dtype", "fp16"]),
        ("h2d", "bench_h2d", ["--size-mb", "16"]),
    ],
)
def test_bench_json_prints_each_results_to_dict_and_human_mode_its_str(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    bench: str,
    function: str,
    argv: list[str],
) -> None:
    import trainperf.bench

    result = _fixed_results()[bench]
    monkeypatch.setattr(trainperf.bench, function, lambda *args, **kwargs: result)
    device = [] if bench == "h2d" else ["--device", "cpu"]
    document = run_json(capsys, "bench", bench, *argv, *device)
    assert document == {"command": f"bench {bench}", "results": [result.to_dict()]}
    code, out, _ = run(capsys, "bench", bench, *argv, *device)
    assert code == 0 and out == f"{result}\n"


def test_bench_json_prints_a_skipped_records_to_dict(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import trainperf.bench
    from trainperf.bench import Skipped
    from trainperf.errors import DeviceError

    def bench_matmul(dtype: str, **kwargs: Any) -> Any:
        raise DeviceError(f"bench_matmul(dtype={dtype!r}) needs what this GPU lacks")

    monkeypatch.setattr(trainperf.bench, "bench_matmul", bench_matmul)
    document = run_json(capsys, "bench", "matmul", "--dtype", "bf16", "--device", "cpu")
    skipped = Skipped("matmul", "bf16", "--dtype bf16 needs what this GPU lacks")
    assert document == {"command": "bench matmul", "results": [skipped.to_dict()]}
    code, out, _ = run(capsys, "bench", "matmul", "--dtype", "bf16", "--device", "cpu")
    assert code == 0 and out == "bf16: skipped: --dtype bf16 needs what this GPU lacks\n"


def test_a_setting_that_runs_out_of_memory_is_skipped_the_others_run_and_the_exit_is_1(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import trainperf.bench

    fp32 = _fixed_results()["matmul"]
    devices: list[object] = []

    def bench_matmul(dtype: str, **kwargs: Any) -> Any:
        devices.append(kwargs["device"])
        if dtype == "bf16":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return fp32

    monkeypatch.setattr(trainperf.bench, "bench_matmul", bench_matmul)
    code, out, err = run(capsys, "bench", "matmul", "--dtype", "bf16", "fp32")
    assert code == 1 and "Traceback" not in err
    assert "bf16: skipped: out of memory (CUDA out of memory. Tried" in out
    assert "try a smaller --size" in out and f"{fp32}" in out
    assert devices == ["cpu", "cpu"]  # resolved once, the same device for every dtype


def test_a_cpu_allocation_failure_is_out_of_memory_and_other_errors_exit_1_without_a_traceback(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import trainperf.bench

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried 4 TB")

    monkeypatch.setattr(trainperf.bench, "bench_model", refuse)
    document = json.loads(run(capsys, "bench", "model", *TINY, "--json")[1])
    assert document["results"][0]["reason"].startswith("out of memory (DefaultCPUAllocator")
    assert "--batch-size or --image-size" in document["results"][0]["reason"]

    def python_refuses(*args: Any, **kwargs: Any) -> Any:
        raise MemoryError  # Python's own (before: not caught, an unexpected error)

    monkeypatch.setattr(trainperf.bench, "bench_model", python_refuses)
    document = json.loads(run(capsys, "bench", "model", *TINY, "--json")[1])
    assert document["results"][0]["reason"].startswith("out of memory (MemoryError)")

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    monkeypatch.setattr(trainperf.bench, "bench_model", broken)
    code, out, err = run(capsys, "bench", "model", *TINY)
    last = err.splitlines()[-1]
    assert code == 1 and out == "" and "Traceback" not in err
    assert last.startswith("trainperf: error: unexpected RuntimeError: mat1 and mat2 shapes "
                           "cannot be multiplied (raised at ")  # fmt: skip
    code, out, _ = run(capsys, "bench", "model", *TINY, "--json")
    assert code == 1 and json.loads(out) == {
        "command": "bench model",
        "error": {"type": "RuntimeError", "message": last.removeprefix("trainperf: error: ")},
    }


def _host_memory(monkeypatch: pytest.MonkeyPatch, available: int) -> None:
    import dataclasses
    import importlib

    common = importlib.import_module("trainperf.bench._common")
    limits = dataclasses.replace(common.host_limits(), memory_available=available)
    monkeypatch.setattr(common, "host_limits", lambda: limits)


def test_a_cpu_matmul_past_the_free_host_memory_is_skipped_in_the_options_words(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before: the matrices were filled until the kernel killed the process, with no message.
    _host_memory(monkeypatch, 8 * 2**20)
    code, out, err = run(capsys, "bench", "matmul", "--dtype", "fp32", "--size", "1024",
                         "--device", "cpu")  # fmt: skip
    reason = (
        "out of memory: --size 1024: three 1024x1024 fp32 matrices need 12 MiB of host memory, "
        "and 8 MiB is available (it would swap, or the kernel would kill the process): use a "
        "smaller size"
    )
    assert code == 1 and "Traceback" not in err and out == f"fp32: skipped: {reason}\n"


def test_h2d_copies_past_the_free_host_memory_are_skipped_in_the_options_words(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import trainperf.bench

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(trainperf.bench, "bench_h2d", lambda **kwargs: pytest.fail("ran"))
    _host_memory(monkeypatch, 3 * 2**20)
    code, out, err = run(capsys, "bench", "h2d", "--size-mb", "2", "--json")
    assert code == 1 and "Traceback" not in err
    (skipped,) = json.loads(out)["results"]
    assert skipped["reason"] == (
        "out of memory: --size-mb 2: a pageable and a pinned copy need 4 MiB of host memory, "
        "and 3 MiB is available (it would swap, or the kernel would kill the process): use a "
        "smaller --size-mb"
    )


def test_every_setting_of_a_command_runs_on_the_one_emptiest_gpu(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import trainperf.bench
    import trainperf.bench._common as common

    picks = iter(["cuda:2", "cuda:0", "cuda:1"])  # the emptiest GPU changes as each one runs
    monkeypatch.setattr(
        common, "resolve_device", lambda device, allowed=(): torch.device(next(picks))
    )
    seen: list[object] = []

    def bench_model(model: str, precision: str, **kwargs: Any) -> Any:
        seen.append(kwargs["device"])
        return _fixed_results()["model"]

    monkeypatch.setattr(trainperf.bench, "bench_model", bench_model)
    assert run(capsys, "bench", "model", "--precision", "all")[0] == 0
    assert seen == ["cuda:2", "cuda:2", "cuda:2"]


def test_doctor_json_prints_the_reports_to_dict(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import trainperf.doctor
    from trainperf.doctor import Check, DoctorReport

    report = DoctorReport((Check("shm", "warn", "64 MiB", "enlarge /dev/shm"),))
    monkeypatch.setattr(trainperf.doctor, "diagnose", lambda: report)
    document = run_json(capsys, "doctor")
    assert document.pop("command") == "doctor"
    assert document == report.to_dict()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_bench_model_on_a_missing_gpu_fails_before_building_anything(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = run(capsys, "bench", "model", "--device", "cuda")
    assert code != 0 and "needs CUDA" in err
    assert "building and warming up" not in out + err


def test_doctor_dist_asks_for_the_multi_process_checks(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import trainperf.doctor
    from trainperf.doctor import AllReduceSweep, Check, DoctorReport, SweepRow

    calls: list[dict[str, object]] = []
    sweep = AllReduceSweep("gloo", 2, "cpu", (SweepRow(2**26, 3, 0.1, 0.671, 0.671),))
    report = DoctorReport(
        (Check("ifname", "fail", "NCCL_SOCKET_IFNAME='bogus0'", "fix"),), (sweep,)
    )

    def diagnose(**kwargs: object) -> DoctorReport:
        calls.append(kwargs)
        return report

    monkeypatch.setattr(trainperf.doctor, "diagnose", diagnose)
    assert build_parser().parse_args(["doctor"]).dist is False
    code, out, err = run(capsys, "doctor", "--dist", "--json")
    assert calls == [{"dist": True}] and code == 1  # a failed check: exit status 1
    document = json.loads(out)
    assert document["all_reduce"][0]["peak_busbw_gb_per_s"] == 0.671
    assert "starting ranks" in err  # progress on stderr, the document alone on stdout
    code, out, _ = run(capsys, "doctor", "--dist")
    assert "all_reduce sweep: gloo, 2 ranks on cpu" in out and "bogus0" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "matmul", "--size", "3000000000"], "--size 3000000000: a "),
        (["bench", "matmul", "--size", "99999999999999999999"], "more than a tensor can address"),
        (["bench", "model", "--image-size", "4000000000"], "--image-size 4000000000: its input"),
        (["bench", "model", "--batch-size", "99999999999999999999"], "use a smaller --batch-size"),
    ],
)
def test_sizes_past_what_a_tensor_can_address_are_errors_not_tracebacks(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    code, out, err = run(capsys, *argv, "--device", "cpu", "--json")
    assert code == 1 and "Traceback" not in err
    assert err.splitlines()[-1].startswith("trainperf: error: ") and message in err
    document = json.loads(out)
    assert document["command"] == " ".join(argv[:2]) and document["error"]["type"] == "ValueError"
    assert message in document["error"]["message"]


@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_bench_h2d_past_what_a_tensor_can_address_names_the_value_and_option_given(
    capsys: pytest.CaptureFixture[str], json_flag: list[str]
) -> None:
    code, out, err = run(capsys, "bench", "h2d", "--size-mb", str(2**43), *json_flag)
    message = (
        f"--size-mb {2**43}: one copy is 9.2e+18 bytes, more than a tensor can address "
        "(2**63 - 1): use a smaller --size-mb"
    )
    assert code == 1 and err == f"trainperf: error: {message}\n"
    if json_flag:
        assert json.loads(out)["error"]["message"] == message


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


def test_a_closed_stdout_is_an_error_before_any_work(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import trainperf.doctor

    monkeypatch.setattr(trainperf.doctor, "diagnose", lambda: pytest.fail("ran with no stdout"))
    monkeypatch.setattr(sys, "stdout", None)  # what Python sets when started with `>&-`
    code = main(["doctor", "--json"])
    err = capsys.readouterr().err
    assert code == 1 and err.startswith("trainperf: error: stdout is closed")


@pytest.mark.slow
def test_the_command_on_a_full_disk_or_a_closed_stdout_exits_1_with_one_line() -> None:
    for redirect in ("> /dev/full", ">&-"):
        shell = f"{shlex.quote(sys.executable)} -m trainperf gpus --json {redirect}"
        done = subprocess.run(shell, shell=True, capture_output=False, stderr=subprocess.PIPE,
                              text=True, timeout=120)  # fmt: skip
        assert done.returncode == 1, (redirect, done.stderr)
        assert done.stderr.startswith("trainperf: error: ") and done.stderr.count("\n") == 1


@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_ctrl_c_mid_run_is_one_line_and_exit_130_not_a_traceback(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, json_flag: list[str]
) -> None:
    import trainperf.bench

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        raise KeyboardInterrupt  # what Python raises where Ctrl-C lands, deep inside torch

    monkeypatch.setattr(trainperf.bench, "bench_model", interrupted)
    message = "interrupted (Ctrl-C) before the command finished"
    try:
        code, out, err = run(capsys, "bench", "model", *TINY, *json_flag)
    except KeyboardInterrupt:  # would stop pytest itself
        pytest.fail("Ctrl-C escaped main(): Python prints its traceback")
    assert code == 130 and "Traceback" not in err
    assert err.splitlines()[-1] == f"trainperf: error: {message}"
    if json_flag:
        assert json.loads(out) == {
            "command": "bench model",
            "error": {"type": "KeyboardInterrupt", "message": message},
        }
    else:
        assert out == ""


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


# ------------------------------------------------ strict JSON; errors in the command line's words


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


def test_a_missing_cuda_device_is_refused_in_the_options_words(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, out, err = run(capsys, "bench", "matmul", "--device", "cuda", "--json")
    assert code == 1 and "CUDA is not available" in err
    assert err.endswith("; use --device cpu or --device auto instead\n")
    assert "device=" not in err and "device=" not in json.loads(out)["error"]["message"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--train", "--batch-size", "1"],
            "training needs --batch-size >= 2 (BatchNorm cannot normalise one image), got 1",
        ),
        (["--image-size", "8"], "resnet50 needs --image-size >= 32, got 8"),
        (
            ["--batch-size", "3000000000", "--image-size", "3000000"],
            "--batch-size 3000000000 --image-size 3000000: its input batch (3000000000 x 3 x "
            "3000000 x 3000000 fp32) is 3.2e+23 bytes, more than a tensor can address "
            "(2**63 - 1): use a smaller --batch-size or --image-size (the reference uses 128 "
            "at 224 px)",
        ),
    ],
)
def test_bench_model_errors_name_the_options_not_the_parameters(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    code, _, err = run(capsys, "bench", "model", *argv, "--device", "cpu")
    assert code == 1 and err.splitlines()[-1] == f"trainperf: error: {message}"


def test_a_device_value_naming_a_parameter_is_quoted_as_typed(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, _, err = run(capsys, "bench", "model", "--device", "cpu:batch_size")
    assert code == 1 and "invalid device 'cpu:batch_size'" in err


@pytest.mark.parametrize(
    ("bench", "message", "typed"),
    [
        # The user's own values, paths and dotted names keep their words.
        ("model", "invalid device 'cpu:batch_size'", "invalid device 'cpu:batch_size'"),
        ("model", 'invalid device "cpu:batch_size"', 'invalid device "cpu:batch_size"'),
        ("model", "could not open /data/batch_size/img.jpg", None),
        ("model", "could not open batch_size/img.jpg", None),
        ("model", "could not open batch_size.pt", None),
        ("model", "memory_format=torch.channels_last", None),
        ("model", "use torch.channels_last", None),
        # A flag is an option without a value: True is the flag given, False is left alone.
        ("model", "channels_last=True", "--channels-last"),
        ("model", "channels_last=False", None),
        (
            "model",
            "bench_model(channels_last=True, batch_size=3)",
            "--channels-last --batch-size 3",
        ),
        # A call with an argument the command has no option for is left whole.
        ("matmul", "bench_matmul(size=64, dtypes=['fp16', 'bf16'])", None),
        # What the command line gave stays in its options' words.
        ("model", "use device='cpu'", "use --device cpu"),
        ("model", "bench_model(batch_size=3, image_size=4)", "--batch-size 3 --image-size 4"),
        ("model", "batch_size too large.", "--batch-size too large."),
        (
            "model",
            "use a smaller batch_size or image_size",
            "use a smaller --batch-size or --image-size",
        ),
    ],
)
def test_library_errors_name_options_only_where_the_library_names_a_parameter(
    bench: str, message: str, typed: str | None
) -> None:
    args = build_parser().parse_args(["bench", bench])
    assert _as_typed(message, args) == (message if typed is None else typed)


def test_a_skipped_precision_and_a_results_notes_name_the_options_typed(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import dataclasses

    import trainperf.bench
    from trainperf.errors import DeviceError

    fp16 = dataclasses.replace(
        _fixed_results()["model"],
        notes=("channels_last is faster than the reference's default layout",),
    )

    def bench_model(model: str, precision: str, **kwargs: Any) -> Any:
        if precision == "bf16":
            raise DeviceError("bench_model(precision='bf16') on cpu: no bf16 kernels")
        return fp16

    monkeypatch.setattr(trainperf.bench, "bench_model", bench_model)
    code, out, _ = run(capsys, "bench", "model", "--precision", "all", "--channels-last", *TINY)
    assert code == 0
    assert "Skipped bf16: --precision bf16 on cpu: no bf16 kernels" in out.splitlines()
    assert "Note: --channels-last is faster than the reference's default layout" in out
    assert "bench_model(" not in out and "channels_last" not in out
    document = run_json(capsys, "bench", "model", "--precision", "bf16", *TINY)
    assert document["results"][0]["reason"] == "--precision bf16 on cpu: no bf16 kernels"


def test_a_results_tf32_note_names_the_option_in_text_and_in_json(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The library's note says tf32=True (bench_model's parameter); the command's, --tf32.
    import dataclasses

    import trainperf.bench
    from trainperf.bench import compare_to_reference

    comparison = compare_to_reference(
        "NVIDIA A100-SXM4-80GB", "vit_b_16", "fp32", 100.0,
        compute_capability=(8, 0), tf32_matmul=False,
    )  # fmt: skip
    result = dataclasses.replace(
        _fixed_results()["model"], precision="fp32", comparison=comparison, notes=("tf32=True",)
    )
    monkeypatch.setattr(trainperf.bench, "bench_model", lambda *args, **kwargs: result)
    code, out, _ = run(capsys, "bench", "model", "--device", "cpu", "--no-tf32")
    assert code == 0 and "tf32=True" not in out
    assert "reference did not: run with --tf32 for a like-for-like comparison" in out
    document = run_json(capsys, "bench", "model", "--device", "cpu", "--no-tf32")
    (typed,) = document["results"]
    assert typed["notes"] == ["--tf32"]
    assert any("run with --tf32 for a like" in n for n in typed["comparison"]["notes"])
    assert typed["comparison"]["column"] == "vit_base_patch16_224_fp32"  # not a note: as it is


def test_tf32_on_the_cpu_is_noted_in_the_options_words(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before: `bench model --device cpu --tf32` was taken without a word (matmul's tf32 is
    # skipped on the CPU with its reason).
    import importlib

    model_module = importlib.import_module("trainperf.bench._model")
    monkeypatch.setattr(model_module, "_build", lambda model, size: torch.nn.Conv2d(3, 1, 1))
    note = (
        "--tf32 has no effect on cpu: TF32 is a tensor-core mode of CUDA GPUs (compute "
        "capability 8.0, Ampere, and newer)"
    )
    code, out, _ = run(capsys, "bench", "model", *TINY, "--tf32")
    assert code == 0 and f"Note: {note}" in out.splitlines()
    document = run_json(capsys, "bench", "model", *TINY, "--tf32")
    assert note in document["results"][0]["notes"]
    code, out, _ = run(capsys, "bench", "model", *TINY, "--no-tf32")
    assert code == 0 and "TF32" not in out


# ---------------------------------------------- starting light; Ctrl-C and a reader that went away


def test_help_imports_no_torch() -> None:
    # A fresh interpreter: `trainperf --help` and each command's --help parse and print
    # without the seconds of `import torch` (that waits for a command that runs).
    code = (
        "import contextlib, io, json, sys\n"
        "from trainperf.cli import main\n"
        "for argv in (['--help'], ['bench', '--help'], ['bench', 'model', '--help'],\n"
        "             ['bench', 'matmul', '--help'], ['bench', 'h2d', '--help'],\n"
        "             ['doctor', '--help'], ['gpus', '--help'], ['bench', 'matmul', '-h']):\n"
        "    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "        main(argv)\n"
        "print(json.dumps('torch' in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True)  # fmt: skip
    assert json.loads(done.stdout) is False, done.stderr


@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_ctrl_c_before_the_command_runs_is_one_line_and_exit_130(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, json_flag: list[str]
) -> None:
    import trainperf.cli._main

    def interrupted(argv: list[str]) -> Any:
        raise KeyboardInterrupt  # Ctrl-C while the command line is read

    monkeypatch.setattr(trainperf.cli._main, "_parse", interrupted)
    try:
        code, out, err = run(capsys, "gpus", *json_flag)
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C escaped main(): Python prints its traceback")
    message = "interrupted (Ctrl-C) before the command finished"
    assert code == 130 and err == f"trainperf: error: {message}\n"
    if json_flag:
        assert json.loads(out) == {
            "command": None,
            "error": {"type": "KeyboardInterrupt", "message": message},
        }
    else:
        assert out == ""


def test_ctrl_c_while_a_command_imports_torch_exits_130_without_a_traceback(
    tmp_path: Path,
) -> None:
    # A stand-in torch whose import waits, so Ctrl-C lands inside it, as it would in the
    # seconds the real one takes.
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text(
        "import sys, time\nprint('importing torch', file=sys.stderr, flush=True)\ntime.sleep(60)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    argv = [sys.executable, "-m", "trainperf", "bench", "matmul", "--device", "cpu", "--json"]
    with subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as process:  # fmt: skip
        try:
            assert process.stderr is not None
            first = process.stderr.readline()
            assert first == "importing torch\n", first + process.stderr.read()
            process.send_signal(signal.SIGINT)
            out, err = process.communicate(timeout=60)
        finally:
            process.kill()
    message = "interrupted (Ctrl-C) before the command finished"
    assert process.returncode == 130 and err == f"trainperf: error: {message}\n"
    assert json.loads(out)["error"] == {"type": "KeyboardInterrupt", "message": message}


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


def test_dtype_given_twice_runs_both_lists(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import trainperf.bench

    ran: list[str] = []

    def bench_matmul(dtype: str, **kwargs: Any) -> Any:
        ran.append(dtype)
        return _fixed_results()["matmul"]

    monkeypatch.setattr(trainperf.bench, "bench_matmul", bench_matmul)
    code, _, _ = run(capsys, "bench", "matmul", "--dtype", "fp32", "--dtype", "fp16", "fp32",
                     "--device", "cpu")  # fmt: skip
    assert code == 0 and ran == ["fp32", "fp16"]  # not only the last --dtype's
    ran.clear()
    run(capsys, "bench", "matmul", "--device", "cpu")
    assert ran == ["fp32", "tf32", "bf16", "fp16"]  # none given: all of them


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
