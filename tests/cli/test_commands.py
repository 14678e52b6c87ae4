"""trainperf.cli._commands: bench model|matmul|h2d, doctor and gpus, run in-process."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.cli._run import ITERATION, TINY, run, run_json
from trainperf.cli import build_parser


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
    assert code == 1 and "--device cpu" in err and "needs a CUDA device" in err


@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_bench_h2d_device_auto_without_cuda_is_skipped_as_with_no_device(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, json_flag: list[str]
) -> None:
    # bench_h2d(device="auto") is bench_h2d(device=None); before, --device auto on a host
    # without CUDA was an error (exit 1) where no --device was a skipped record (exit 0).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, out, err = run(capsys, "bench", "h2d", "--device", "auto", *json_flag)
    assert code == 0 and run(capsys, "bench", "h2d", *json_flag) == (code, out, err)
    assert "needs CUDA" in out


@pytest.mark.parametrize("device", ["cpu", "mps", "meta"])
def test_bench_h2d_on_a_device_other_than_cuda_says_it_copies_to_a_gpu(
    capsys: pytest.CaptureFixture[str], device: str
) -> None:
    # Before: "device 'cpu' is not supported here: expected 'auto', 'cuda' or 'cuda:<i>'",
    # without saying why (the Python API's own error does).
    code, out, err = run(capsys, "bench", "h2d", "--device", device)
    assert (code, out) == (1, "")
    assert err == (
        f"trainperf: error: bench h2d measures host-to-GPU copies, so it needs a CUDA device "
        f"(--device cuda or --device cuda:<i>, or no --device for the best one), got --device "
        f"{device}\n"
    )


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
        "smaller size (e.g. --size 512)"  # before: "a smaller size", not the option to set
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


def test_a_missing_cuda_device_is_refused_in_the_options_words(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, out, err = run(capsys, "bench", "matmul", "--device", "cuda", "--json")
    assert code == 1 and "CUDA is not available" in err
    assert err.endswith("; use --device cpu or --device auto instead\n")
    assert "device=" not in err and "device=" not in json.loads(out)["error"]["message"]


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


def _per_dtype_rates(monkeypatch: pytest.MonkeyPatch, rates: dict[str, float]) -> list[int]:
    """Matmul products take ``2 * n**3 / rates[dtype]`` seconds, and none runs; returns the
    sizes timed."""
    import importlib

    matmul = importlib.import_module("trainperf.bench._matmul")
    timed: list[int] = []

    def product_timer(dtype: str, size: int, device: object) -> Callable[[int, int], float]:
        def seconds_per_product(iterations: int, warmup: int) -> float:
            timed.append(size)
            return 2 * size**3 / rates[dtype]

        return seconds_per_product

    monkeypatch.setattr(matmul, "_product_timer", product_timer)
    return timed


@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_a_matmul_run_of_hours_is_refused_up_front_in_the_options_words(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, json_flag: list[str]
) -> None:
    # Before: `bench matmul --device cpu --size 50000` ran for hours with no word. Here fp32
    # would take 2 s and fp16 4 h: neither runs, not even fp32 first.
    timed = _per_dtype_rates(monkeypatch, {"fp32": 1e13, "fp16": 1e9})
    code, out, err = run(capsys, "bench", "matmul", "--device", "cpu", "--size", "8192",
                         "--dtype", "fp32", "fp16", *json_flag)  # fmt: skip
    message = (
        "--size 8192: 13 fp16 products (3 warm-up, 10 timed) would take about 4.0 h on cpu "
        "(1 GFLOP/s measured on a 512x512 product), more than --max-seconds 300: use a smaller "
        "size (e.g. --size 2048) or a larger --max-seconds (e.g. --max-seconds 18000)"
    )
    assert code == 1 and err.splitlines()[-1] == f"trainperf: error: {message}"
    assert timed.count(8192) <= 3  # fp32's probe (3 products) at most: no run
    if json_flag:
        assert json.loads(out)["error"] == {"type": "ValueError", "message": message}
    else:
        assert out == ""
    code, out, _ = run(capsys, "bench", "matmul", "--device", "cpu", "--size", "8192",
                       "--dtype", "fp32", "fp16", "--max-seconds", "15000")  # fmt: skip
    assert code == 0 and out.count("TFLOP/s") == 2


@pytest.mark.parametrize("value", ["0", "-5", "nan", "abc"])
def test_max_seconds_must_be_a_positive_number(
    capsys: pytest.CaptureFixture[str], value: str
) -> None:
    with pytest.raises(SystemExit) as caught:
        run(capsys, "bench", "matmul", "--max-seconds", value)
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --max-seconds: expected a number of seconds > 0, got {value!r}" in err


@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_a_model_run_of_hours_is_refused_in_the_options_words(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, json_flag: list[str]
) -> None:
    # Before: `bench model --device cpu --batch-size 256 --image-size 224` printed nothing
    # for 45+ s, and larger settings ran for hours. Here a batch takes 10 s: 17 min.
    from tests.bench._fakes import FakeBatches

    fake = FakeBatches(monkeypatch, 10.0)
    argv = ["bench", "model", "--device", "cpu", "--batch-size", "256", "--image-size", "224",
            "--iterations", "100"]  # fmt: skip
    code, out, err = run(capsys, *argv, *json_flag)
    message = (
        "--batch-size 256 --image-size 224 --iterations 100: 102 resnet50 fp32 inference "
        "batches (2 warm-up, 100 timed in 100 iterations) would take about 17 min on cpu "
        "(25.6 images/s, 10 s per "
        "batch, measured on the second warm-up batch), more than --max-seconds 300: use a "
        "smaller --batch-size (e.g. --batch-size 32), a smaller --image-size, fewer "
        "iterations (e.g. --iterations 22) or a larger --max-seconds (e.g. --max-seconds "
        "1300)"
    )
    assert code == 1 and err.splitlines()[-1] == f"trainperf: error: {message}"
    assert fake.ran == 2
    if json_flag:
        assert json.loads(out)["error"] == {"type": "ValueError", "message": message}
    else:
        assert out == ""
    code, out, _ = run(capsys, *argv, "--max-seconds", "1300")
    assert code == 0 and out.count("Iteration ") == 100


@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_an_h2d_run_of_hours_is_refused_in_the_options_words(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, json_flag: list[str]
) -> None:
    # Before: `bench h2d --iterations 1000000` ran for hours with no word.
    import importlib

    from tests.bench._fakes import FakeCopies

    fake = FakeCopies(monkeypatch, importlib.import_module("trainperf.bench._h2d"), 0.1, 0.01)
    argv = ["bench", "h2d", "--size-mb", "2", "--iterations", "1000000"]
    code, out, err = run(capsys, *argv, *json_flag)
    message = (
        "--iterations 1000000: 2000002 copies of 2 MiB (1 warm-up and 1000000 timed, pageable "
        "and pinned) would take about 30.6 h on cuda:0 (0.021 GB/s pageable, 0.21 GB/s "
        "pinned, from the first timed copy of each), more than --max-seconds 300: use fewer "
        "iterations (e.g. --iterations 2180) or a larger --max-seconds (e.g. --max-seconds "
        "140000)"
    )
    assert code == 1 and err.splitlines()[-1] == f"trainperf: error: {message}"
    assert len(fake.copies) == 4
    if json_flag:
        assert json.loads(out)["error"] == {"type": "ValueError", "message": message}
    code, out, _ = run(capsys, "bench", "h2d", "--size-mb", "2", "--iterations", "3000",
                       "--max-seconds", "400")  # fmt: skip
    assert code == 0 and "pinned:" in out


@pytest.mark.parametrize("bench", ["model", "h2d"])
def test_model_and_h2d_take_max_seconds_as_matmul_does(
    capsys: pytest.CaptureFixture[str], bench: str
) -> None:
    assert build_parser().parse_args(["bench", bench]).max_seconds == 300.0
    with pytest.raises(SystemExit) as caught:
        run(capsys, "bench", bench, "--max-seconds", "nan")
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert "argument --max-seconds: expected a number of seconds > 0, got 'nan'" in err


@pytest.mark.parametrize("bench", ["model", "matmul", "h2d"])
def test_max_seconds_defaults_to_the_librarys_limit(bench: str) -> None:
    # The parser writes the default out (importing trainperf.bench would import torch while
    # parsing): it must stay the library's, in the value and in the help.
    from trainperf.bench._common import DEFAULT_MAX_SECONDS
    from trainperf.cli._parser import _options

    args = build_parser().parse_args(["bench", bench])
    assert args.max_seconds == DEFAULT_MAX_SECONDS
    assert str(_options(args)["max_seconds"].help).endswith(f" ({DEFAULT_MAX_SECONDS:g})")


def _precision_batches(monkeypatch: pytest.MonkeyPatch, seconds: dict[str, float]) -> Any:
    """``bench_model``'s batches faked (:class:`~tests.bench._fakes.FakeBatches`), a batch of
    each precision taking ``seconds[precision]``."""
    import importlib

    from tests.bench._fakes import FakeBatches

    fake = FakeBatches(monkeypatch, 1.0)

    def runner(model: str, precision: str, *args: object, **kwargs: object) -> Any:
        def batch() -> None:
            fake.now += seconds[precision]
            fake.events.append("b")

        return batch

    monkeypatch.setattr(importlib.import_module("trainperf.bench._model"), "_batch_runner", runner)
    return fake


@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_a_precision_refused_for_its_run_time_is_skipped_and_the_others_kept(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, json_flag: list[str]
) -> None:
    # With --precision all, fp16 refused past --max-seconds (emulated on a CPU, 100x slower)
    # does not end the command with an error: fp32's finished result is kept with --json, and
    # bf16 still runs.
    _precision_batches(monkeypatch, {"fp32": 1.0, "fp16": 100.0, "bf16": 1.0})
    code, out, err = run(capsys, "bench", "model", "--device", "cpu", "--precision", "all",
                         "--batch-size", "8", "--image-size", "64", "--iterations", "20",
                         *json_flag)  # fmt: skip
    assert code == 1  # a precision did not run
    refusal = (
        "--batch-size 8 --image-size 64: 22 resnet50 fp16 inference batches (2 warm-up, 20 "
        "timed in 20 iterations) would take about 37 min on cpu"
    )
    if json_flag:
        results = json.loads(out)["results"]
        assert [r.get("precision", r.get("setting")) for r in results] == ["fp32", "fp16", "bf16"]
        assert results[0]["images_per_s"] == results[2]["images_per_s"] == 8.0
        assert results[1]["benchmark"] == "model" and results[1]["reason"].startswith(refusal)
        assert "--max-seconds 300: use " in results[1]["reason"]
    else:
        assert f"Skipped fp16: {refusal}" in out
        assert "resnet50 fp32 inference" in out and "resnet50 bf16 inference" in out
    assert "trainperf: error" not in err


def test_a_lone_precision_refused_for_its_run_time_is_still_the_commands_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _precision_batches(monkeypatch, {"fp32": 1.0, "fp16": 100.0, "bf16": 1.0})
    code, out, err = run(capsys, "bench", "model", "--device", "cpu", "--precision", "fp16",
                         "--batch-size", "8", "--image-size", "64", "--iterations", "20",
                         "--json")  # fmt: skip
    assert code == 1 and json.loads(out)["error"]["type"] == "ValueError"
    assert "trainperf: error: --batch-size 8 --image-size 64: 22 resnet50 fp16" in err


def test_a_bad_argument_with_every_precision_is_the_commands_error_not_a_skip(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = run(capsys, "bench", "model", "--model", "vit_b_16", "--image-size", "40",
                         "--device", "cpu", "--precision", "all")  # fmt: skip
    assert code == 1 and "Skipped" not in out
    assert "trainperf: error: vit_b_16 takes 16-pixel patches" in err


def test_h2d_copies_too_long_each_are_told_the_size_mb_that_fits(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The fix names the option and a value. Three rounds of 64 MiB copies at 300 s a round;
    # 16 MiB ones fit.
    import importlib

    from tests.bench._fakes import FakeCopies

    FakeCopies(monkeypatch, importlib.import_module("trainperf.bench._h2d"), 200.0, 100.0)
    code, _, err = run(capsys, "bench", "h2d", "--size-mb", "64", "--iterations", "2")
    assert code == 1
    assert err.splitlines()[-1].endswith(
        "more than --max-seconds 300: use a smaller --size-mb (e.g. --size-mb 16) or a larger "
        "--max-seconds (e.g. --max-seconds 1100)"
    )


@pytest.mark.parametrize(("bench", "each"), [("model", "precision"), ("matmul", "dtype")])
def test_max_seconds_help_says_the_limit_is_per_setting(bench: str, each: str) -> None:
    # Each precision (dtype) of --precision all (several --dtype) has a limit of its own.
    from trainperf.cli._parser import _options

    option = _options(build_parser().parse_args(["bench", bench]))["max_seconds"]
    assert f"the limit per {each}" in str(option.help)


def test_a_host_memory_refusal_keeps_its_fix_in_the_skipped_reason(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before, the reason was cut at 200 characters, mid-word: "use a smaller size (e.g. si".
    import trainperf.bench

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise MemoryError(
            "bench_matmul(size=100000): three 100000x100000 fp32 matrices need 111.8 GiB of "
            "host memory, and 21.2 GiB is available (it would swap, or the kernel would kill "
            "the process): use a smaller size (e.g. size=32768)"
        )

    monkeypatch.setattr(trainperf.bench, "bench_matmul", refuse)
    argv = ["bench", "matmul", "--size", "32", "--dtype", "fp32", "--device", "cpu"]
    code, out, _ = run(capsys, *argv, "--json")
    (skipped,) = json.loads(out)["results"]
    assert code == 1 and skipped["reason"].startswith("out of memory: --size 100000: three")
    assert skipped["reason"].endswith("use a smaller size (e.g. --size 32768)")
    code, out, _ = run(capsys, *argv)
    assert code == 1 and out.endswith("use a smaller size (e.g. --size 32768)\n")
