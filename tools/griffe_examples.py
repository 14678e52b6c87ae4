"""Griffe extension for the API reference: read trainperf's docstrings as the house style means.

- ``Example:`` (singular, used throughout ``src/trainperf``) is a doctest section, but Griffe's
  Google parser only knows ``Examples:`` and renders anything else as an admonition of plain
  Markdown, where ``>>> table["3090"]["fp16"]`` becomes a broken reference link. It is renamed
  before parsing, so the examples render as ``pycon`` code blocks.
- Sphinx roles (``:func:`launch```, ``:class:`GpuInfo```) mean nothing to Markdown; they are
  reduced to code spans.

Loaded by ``mkdocs.yml`` (``plugins.mkdocstrings.handlers.python.options.extensions``).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_EXAMPLE_HEADING = re.compile(r"^([ \t]*)Example:[ \t]*$", re.MULTILINE)
_SPHINX_ROLE = re.compile(r":(?:func|class|mod|meth|attr|data|exc|obj):`~?([^`]+)`")


def rewrite(text: str) -> str:
    """Return ``text`` with ``Example:`` headings renamed and Sphinx roles made code spans."""
    text = _EXAMPLE_HEADING.sub(r"\1Examples:", text)
    return _SPHINX_ROLE.sub(r"`\1`", text)


class HouseDocstrings(griffe.Extension):
    """Rewrites every docstring as it is loaded (see the module docstring)."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = rewrite(obj.docstring.value)
