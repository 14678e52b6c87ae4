"""The ``trainperf`` command's arguments: :func:`build_parser`, and the parser ``main`` uses,
whose usage errors raise instead of printing argparse's usage.
"""

from __future__ import annotations

import argparse
import difflib
import re
from collections.abc import Sequence
from typing import Any, NoReturn

from trainperf._utils.validate import positive_int, positive_number

_MiB = 2**20
_DEVICE_HELP = "cpu, cuda or cuda:<i> (default: the best available)"


def _positive(text: str) -> int:
    # argparse's type=int accepts 0 and negatives; a count below 1 is an argument error, by
    # the library's own rule (trainperf._utils.validate.positive_int).
    try:
        return positive_int("count", int(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from e


def _positive_seconds(text: str) -> float:
    # float() takes "nan", "inf" and 0: a limit is a finite number > 0, by the library's own
    # rule (trainperf._utils.validate.positive_number).
    try:
        return positive_number("seconds", float(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}") from e


def _add_max_seconds(
    parser: argparse.ArgumentParser, what: str, source: str, each: str | None = None
) -> None:
    # With --precision all (several --dtype) each setting has the limit to itself.
    per = f", the limit per {each}" if each else ""
    # trainperf.bench's DEFAULT_MAX_SECONDS, written out: importing it would import torch
    # while parsing (tests/cli/test_commands.py checks they agree).
    parser.add_argument(
        "--max-seconds",
        type=_positive_seconds,
        default=300.0,
        help=f"refuse {what} estimated ({source}) to take longer than this{per} (300)",
    )


def _add_json(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json", action="store_true", help="print one JSON document on stdout instead"
    )


def _add_model_parser(benches: Any) -> None:
    model = benches.add_parser(
        "model",
        help="ResNet-50 / ViT-B/16 throughput on synthetic data, vs the reference GPUs",
        description="The reference table's benchmark (a GPU cloud provider's published "
        "figures, PyTorch 1.9): a torchvision model with random weights, "
        "synthetic input on the device, weights cast to the precision. Defaults: batch 128 at "
        "224 px and 15 batches per iteration on a GPU; batch 2 at 64 px on the CPU.",
    )
    model.add_argument("--model", choices=["resnet50", "vit_b_16"], default="resnet50")
    model.add_argument(
        "--precision", choices=["fp32", "fp16", "bf16", "all"], default="fp32", help="or all"
    )
    model.add_argument("--batch-size", type=_positive)
    model.add_argument("--image-size", type=_positive)
    model.add_argument("--iterations", type=_positive, help="timed iterations (GPU 5, CPU 2)")
    model.add_argument("--batches-per-iteration", type=_positive)
    model.add_argument("--warmup-batches", type=_positive, help="untimed batches first")
    model.add_argument("--train", action="store_true", help="time forward+backward+SGD step")
    model.add_argument("--channels-last", action="store_true")
    model.add_argument(
        "--tf32",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="allow TF32 for fp32 (default: PyTorch's current setting)",
    )
    _add_max_seconds(model, "a run", "from its second warm-up batch", "precision")
    model.add_argument("--device", help=_DEVICE_HELP)
    _add_json(model)


def _add_matmul_parser(benches: Any) -> None:
    matmul = benches.add_parser(
        "matmul",
        help="matrix-product TFLOP/s per dtype, vs the datasheet",
        description="Square matrix products on random data: fp32 (TF32 off), tf32, bf16, fp16.",
    )
    matmul.add_argument("--size", type=_positive, help="matrix side (8192 on a GPU, 256 on CPU)")
    matmul.add_argument(
        "--dtype",
        nargs="+",
        action="extend",  # `--dtype fp32 --dtype fp16` runs both, not only the last
        choices=["fp32", "tf32", "bf16", "fp16", "all"],
        help="one or more (default: all)",
    )
    matmul.add_argument(
        "--iterations", type=_positive, help="timed products (20 on a GPU, 10 on the CPU)"
    )
    _add_max_seconds(matmul, "a dtype whose run is", "by a quick probe", "dtype")
    matmul.add_argument("--device", help=_DEVICE_HELP)
    _add_json(matmul)


def _add_h2d_parser(benches: Any) -> None:
    h2d = benches.add_parser(
        "h2d", help="host-to-device GB/s, pageable vs pinned memory (needs CUDA)"
    )
    h2d.add_argument("--size-mb", type=_positive, default=512, help="MiB per copy (512)")
    h2d.add_argument("--iterations", type=_positive, default=5)
    _add_max_seconds(h2d, "a run", "from its first timed copies")
    h2d.add_argument("--device", help="cuda or cuda:<i> (default: the best available)")
    _add_json(h2d)


class _UsageError(Exception):
    """A command line that does not parse: ``prog`` is the (sub)command that refused it."""

    def __init__(self, prog: str, message: str) -> None:
        super().__init__(message)
        self.prog = prog
        self.message = message


class _Parser(argparse.ArgumentParser):
    """The parser :func:`main` uses: a usage error is raised as :class:`_UsageError`, for
    main to report in one line (and as JSON with ``--json``), where argparse would print the
    usage text, to stdout when stderr is closed, and exit."""

    def error(self, message: str) -> NoReturn:
        raise _UsageError(self.prog, message)

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        # argparse lists the choices; a typo (`doctr`, `FP16`) also gets the one it meant.
        try:
            super()._check_value(action, value)
        except argparse.ArgumentError as e:
            meant = self._meant(action, value)
            if meant is None:
                raise
            raise argparse.ArgumentError(action, f"{e.message}; did you mean {meant!r}?") from e

    def _meant(self, action: argparse.Action, value: Any) -> str | None:
        # TF32 is no precision of bench model's but fp32 with its --tf32 flag: 'fp32' alone
        # would run with TF32 as PyTorch has it.
        tf32 = isinstance(value, str) and value.lower() == "tf32"
        if tf32 and action.dest == "precision" and "--tf32" in self._option_string_actions:
            return f"{action.option_strings[0]} fp32 --tf32"
        return _closest(value, action.choices)


def _closest(value: Any, choices: Any) -> str | None:
    """The choice ``value`` most likely misspells (case aside), or None if none is close, or
    two are as close (``f32``: ``fp32`` or ``tf32``). A choice whose digits differ from
    ``value``'s (``fp64``, ``fp16``) is never it; the same digits reordered (``bf61``) are.

    Example:
        >>> _closest("doctr", ["bench", "doctor", "gpus"]), _closest("xyzzy", ["gpus"])
        ('doctor', None)
        >>> _closest("f32", ["fp32", "tf32"]), _closest("fp64", ["fp16"])
        (None, None)
    """
    if not isinstance(value, str) or choices is None:
        return None
    typed = value.lower()
    by_lower = {str(choice).lower(): str(choice) for choice in choices}
    scores = [
        (difflib.SequenceMatcher(None, choice, typed).ratio(), choice)
        for choice in by_lower
        if not _digits(typed) or _digits(choice) == _digits(typed)  # "resnet": resnet50
    ]
    close = sorted((pair for pair in scores if pair[0] >= 0.6), reverse=True)  # difflib's cutoff
    if not close or (len(close) > 1 and close[0][0] == close[1][0]):
        return None
    return by_lower[close[0][1]]


def _digits(text: str) -> list[str]:
    """``text``'s digits, in order of value (a transposition keeps them)."""
    return sorted(c for c in text if c.isdigit())


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    """``argv`` parsed by :func:`main`'s parser; an option no parser knows is a usage error of
    the (sub)command it was given to, whose ``--help`` lists what that one takes (argparse
    would blame, and point at the help of, the top-level ``trainperf``)."""
    args, unknown = _build_parser(_Parser).parse_known_args(argv)
    if unknown:
        names = (args.command, getattr(args, "bench", None))
        prog = " ".join(["trainperf", *(name for name in names if name)])
        raise _UsageError(prog, f"unrecognized arguments: {' '.join(unknown)}")
    return args


def build_parser() -> argparse.ArgumentParser:
    """The ``trainperf`` argument parser.

    Example:
        >>> args = build_parser().parse_args(["bench", "matmul", "--size", "64", "--json"])
        >>> args.command, args.bench, args.size, args.json
        ('bench', 'matmul', 64, True)
    """
    return _build_parser(argparse.ArgumentParser)


def _version() -> str:
    """The installed trainperf's version (``importlib.metadata``, read once per process)."""
    import trainperf

    return trainperf.__version__


def _build_parser(parser_class: type[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    # Subparsers are made of the same class (argparse's default parser_class).
    parser = parser_class(
        prog="trainperf",
        description="Say why PyTorch training is slow: benchmark the GPU, check the "
        "environment, list GPUs.",
    )
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {_version()}", help="print the version"
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    bench = commands.add_parser("bench", help="benchmark the GPU (model, matmul, h2d)")
    benches = bench.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    _add_model_parser(benches)
    _add_matmul_parser(benches)
    _add_h2d_parser(benches)
    doctor = commands.add_parser(
        "doctor",
        help="check GPUs, drivers, CPUs, memory, /dev/shm, BLAS, threads; exit 1 on a fail",
    )
    doctor.add_argument(
        "--dist",
        action="store_true",
        help="also the multi-process pre-flight (5-30 s): start one rank per GPU (2 CPU "
        "ranks with gloo without 2 GPUs), time an all_reduce sweep against the link, check "
        "/dev/shm for NCCL, NCCL_*/GLOO_* variables, interfaces, IOMMU/ACS, P2P on vs off",
    )
    _add_json(doctor)
    gpus = commands.add_parser("gpus", help="list the GPUs this process can see (NVML)")
    _add_json(gpus)
    return parser


# The library's words for an argument, in its error messages: `bench_model(batch_size=1, ...)`
# (a call), `device='cpu'` (a keyword) and `batch_size` (a name); never inside a quoted value,
# a path, a dotted name or `a:b` (`'cpu:batch_size'`, `/data/batch_size/`, `torch.channels_last`),
# which are the user's or PyTorch's words.
_START = r"(?<![\w./:'\"-])"
_QUOTES = "'\""  # around a string value, as repr() writes it
_QUOTED = r"(?<!\w)(?:'[^']*'|\"[^\"]*\")(?!\w)"  # not an apostrophe: PyTorch's
_CALL = rf"{_START}[a-z_]\w*\([^()]*\)"
_KEYWORD = re.compile(rf"{_START}([a-z_]\w*)=('[^']*'|\"[^\"]*\"|[^\s,()]+)")
_NAME = rf"{_START}[a-z]\w*_\w+\b(?!/|\.\w)"
# One scan, so that what one term matched (a quoted span, a call left whole, a keyword's
# value) is never rewritten by another.
_TERM = re.compile(
    rf"(?P<quoted>{_QUOTED})|(?P<call>{_CALL})|(?P<keyword>{_KEYWORD.pattern})|(?P<name>{_NAME})"
)


def _options(args: argparse.Namespace) -> dict[str, argparse.Action]:
    """The options of the (sub)command ``args`` ran, by parameter name: ``{"batch_size":
    <--batch-size>, ...}`` (each option's dest is the library parameter it is passed to)."""
    parser: argparse.ArgumentParser = build_parser()
    for name in (args.command, getattr(args, "bench", None)):
        subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if name is None or not subparsers:
            break
        parser = subparsers[0].choices[name]
    return {a.dest: a for a in parser._actions if a.option_strings}


def _as_typed(message: str, args: argparse.Namespace) -> str:
    """A library error ``message`` in the words of the command line ``args`` came from: the
    parameters the command exposes named by their options, ``device='cpu'`` as ``--device
    cpu``, ``channels_last=True`` as ``--channels-last``, a parameter in another unit as its
    option (``size_bytes=2097152`` as ``--size-mb 2``; a value not in whole MiB is left
    alone), and a call ``bench_model(batch_size=1, image_size=8)`` as the options that gave
    it, ``--batch-size 1 --image-size 8``. Other words (English "size"), quoted values,
    paths, dotted names, a flag set to False or None, and a call with an argument the command
    has no option for are left alone.

    Example:
        >>> args = build_parser().parse_args(["bench", "model"])
        >>> _as_typed("bench_model(image_size=8): image_size too small; use device='cpu'", args)
        '--image-size 8: --image-size too small; use --device cpu'
        >>> _as_typed("invalid device 'cpu:batch_size'", args)
        "invalid device 'cpu:batch_size'"
        >>> h2d = build_parser().parse_args(["bench", "h2d"])
        >>> _as_typed("use a smaller size_bytes (e.g. size_bytes=16777216)", h2d)
        'use a smaller --size-mb (e.g. --size-mb 16)'
    """
    options = _options(args)

    def term(match: re.Match[str]) -> str:
        text = match.group()
        if match.lastgroup == "call":
            return _call_as_typed(text, options)
        if match.lastgroup == "keyword":
            return _keyword_as_typed(text, options) or text
        option = _option_for(text, options) if match.lastgroup == "name" else None
        return option.option_strings[0] if option else text

    return _TERM.sub(term, message)


def _keyword_as_typed(text: str, options: dict[str, argparse.Action]) -> str | None:
    """``name=value`` as the option that gives it (``--device cpu``, a flag ``--train`` for
    True); None where no option gives it (a flag False or None, or no such option)."""
    match = _KEYWORD.fullmatch(text)
    option = _option_for(match.group(1), options) if match else None
    if match is None or option is None:
        return None
    name, value = match.groups()
    if name not in options and name in _SCALED:  # size_bytes=2097152 is --size-mb 2
        scale = _SCALED[name][1]
        if not value.isdigit() or int(value) % scale:
            return None
        return f"{option.option_strings[0]} {int(value) // scale}"
    if option.nargs == 0:  # a flag: True is the flag given; False and None are no option
        return option.option_strings[0] if value == "True" else None
    if value in ("True", "False", "None"):
        return None
    return f"{option.option_strings[0]} {value.strip(_QUOTES)}"


# Library parameters a command takes in another unit: bench_h2d's size_bytes is bench h2d's
# --size-mb (its name alone is the option; a value in whole MiB is the option's value).
_SCALED = {"size_bytes": ("size_mb", _MiB)}


def _option_for(name: str, options: dict[str, argparse.Action]) -> argparse.Action | None:
    """The option that gives the library parameter ``name``, if the command has one."""
    option = options.get(name)
    if option is None and name in _SCALED:
        option = options.get(_SCALED[name][0])
    return option


def _call_as_typed(text: str, options: dict[str, argparse.Action]) -> str:
    """A call ``f(a=1, b=2)`` as the options that gave its arguments, or left whole where one
    has no option."""
    arguments = text[text.index("(") + 1 : -1].split(", ")
    typed = [_keyword_as_typed(argument, options) for argument in arguments]
    return text if None in typed else " ".join(t for t in typed if t)
