"""trainperf.cli._parser: usage errors, defaults, help, and errors in the options' words."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tests.cli._run import run
from trainperf.cli import build_parser, main
from trainperf.cli._parser import _as_typed


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


def test_bench_model_help_names_the_reference_table(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "model", "--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0
    assert "reference table" in " ".join(out.split()) and "seed" not in out


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


@pytest.mark.parametrize(
    ("argv", "suggestion"),
    [
        (["doctr"], "'doctor'"),
        (["gpu"], "'gpus'"),
        (["bench", "modle"], "'model'"),
        (["bench", "model", "--precision", "FP16"], "'fp16'"),
        (["bench", "matmul", "--dtype", "fp32", "bf61"], "'bf16'"),
        (["bench", "model", "--model", "resnet"], "'resnet50'"),  # no digits typed: any
    ],
)
def test_an_invalid_choice_suggests_the_closest_one(
    capsys: pytest.CaptureFixture[str], argv: list[str], suggestion: str
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1
    assert f"; did you mean {suggestion}?; see trainperf" in err, err


def test_an_invalid_choice_far_from_every_one_suggests_nothing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["xyzzy"])
    assert "did you mean" not in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        # fp32 and tf32 are as close as each other: difflib picked one, here 'tf32'.
        ["bench", "matmul", "--dtype", "f32"],
        # fp64 is no misspelt fp16: a choice whose digits differ is never suggested.
        ["bench", "matmul", "--dtype", "fp64"],
        ["bench", "model", "--precision", "fp64"],
    ],
)
def test_an_invalid_choice_with_no_one_likely_choice_suggests_nothing(
    capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    # Before: "did you mean 'tf32'?" for f32, and "did you mean 'fp16'?" for fp64.
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "invalid choice" in err
    assert "did you mean" not in err, err


@pytest.mark.parametrize("typed", ["tf32", "TF32"])
def test_bench_model_precision_tf32_points_at_the_tf32_flag(
    capsys: pytest.CaptureFixture[str], typed: str
) -> None:
    # Before: "did you mean 'fp32'?", which runs fp32 with TF32 as PyTorch has it; TF32 is
    # `--precision fp32 --tf32`.
    with pytest.raises(SystemExit) as exc:
        main(["bench", "model", "--precision", typed])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1
    assert "; did you mean '--precision fp32 --tf32'?; see trainperf" in err, err
    # The flag it names exists, and runs fp32 with TF32 allowed.
    args = build_parser().parse_args(["bench", "model", "--precision", "fp32", "--tf32"])
    assert (args.precision, args.tf32) == ("fp32", True)


def test_version_prints_the_installed_version_and_exits_0(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Before: "unrecognized arguments: --version", exit 2.
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"trainperf {version('trainperf')}\n"


def test_bench_matmul_iterations_has_help_with_its_defaults(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "matmul", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--iterations ITERATIONS timed products (20 on a GPU, 10 on the CPU)" in out
