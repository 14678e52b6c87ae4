"""The ``trainperf`` command: ``bench model|matmul|h2d``, ``doctor`` and ``gpus``.

A thin layer: :func:`build_parser` defines the arguments, each handler calls the library
(:mod:`trainperf.bench`, :mod:`trainperf.doctor`, :func:`trainperf.device.gpus`) and prints
either each result's ``str()`` (the report a person reads) on stdout or, with ``--json``, one
JSON document on stdout holding each result's ``to_dict()``.
Progress (warm-up, per-iteration lines in JSON mode) goes to stderr, so ``--json`` output
can be piped as it is.
"""

from trainperf._utils.public import set_public_module
from trainperf.cli._main import main
from trainperf.cli._parser import build_parser

__all__ = ["build_parser", "main"]

set_public_module(globals(), __all__, __name__)
