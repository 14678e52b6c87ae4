"""TF32 for fp32 matmuls and cuDNN convolutions: read, switch and restore it safely.

torch keeps TF32 as process-wide state behind two APIs: the legacy one
(``torch.set_float32_matmul_precision``, ``torch.backends.cuda.matmul.allow_tf32``,
``torch.backends.cudnn.allow_tf32``) and, from torch 2.9, a tree of ``fp32_precision``
settings: ``torch.backends`` at the root, a backend's (``torch.backends.cudnn``, oneDNN's) below
it, each operation's (``torch.backends.cuda.matmul``, ``torch.backends.cudnn.conv``) at the
leaves; a setting at "none" follows its parent. The legacy getters raise ``RuntimeError`` ("mix
of the legacy and new APIs") where the two disagree.

:func:`tf32` switches both APIs together, so that inside the block every getter answers and
agrees, and puts back on exit what each setting held itself (also "none", so a setting that
followed its parent follows it again) and the legacy flags' own values, read without tripping
over a mix. One thing cannot be put back: in a fresh process cuDNN's conv and rnn settings hold
an internal start value (TF32, unless a parent setting says otherwise) that no API can set;
:func:`tf32` leaves it alone where it can (``tf32(True)`` when cuDNN already agrees), and
otherwise sets back the value it read. The settings exist without CUDA, so all of this works,
and is tested, on a CPU-only build.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import NamedTuple

import torch

from trainperf._utils.validate import flag

__all__ = ["TF32State", "enable_tf32", "tf32", "tf32_decision", "tf32_state"]


@dataclass(frozen=True)
class TF32State:
    """Whether TF32 is allowed, as torch would apply it now.

    Attributes:
        matmul: fp32 matmuls (cuBLAS) may use TF32 tensor cores.
        cudnn: cuDNN convolutions may use TF32 tensor cores.
    """

    matmul: bool
    cudnn: bool


# ----------------------------------------------------------------------- the fp32_precision tree

Node = tuple[str, str]  # (backend, op), as torch._C names them
_ROOT: Node = ("generic", "all")
_PARENTS: tuple[Node, ...] = (("cuda", "all"), ("mkldnn", "all"))
_LEAVES: tuple[Node, ...] = tuple((b, op) for b, _ in _PARENTS for op in ("matmul", "conv", "rnn"))
_CUDNN: tuple[Node, ...] = (("cuda", "conv"), ("cuda", "rnn"))
# cuDNN's conv and rnn start at an internal value no API can set (see the module docstring).
_START = "start"


def _has_tree() -> bool:
    """Whether this torch has the fp32_precision settings (torch >= 2.9)."""
    try:  # private accessors: a torch whose signatures differ falls back to the legacy API
        torch.backends.cudnn.conv.fp32_precision  # type: ignore[attr-defined]  # noqa: B018
        _read(_ROOT)
        _read(_CUDNN[0])
    except (AttributeError, TypeError, RuntimeError):
        return False
    return True


def _read(node: Node) -> str:
    """What ``node`` reads (after following "none" to its parents), as its public getter says.

    Through torch._C: the public ``torch.backends.mkldnn.fp32_precision`` setter writes the root.
    """
    return str(torch._C._get_fp32_precision_getter(*node))


def _write(node: Node, value: str) -> None:
    torch._C._set_fp32_precision_setter(*node, value)


def _ancestors(node: Node, own: Mapping[Node, str]) -> dict[Node, str]:
    """``node``'s parent settings (none for the root), with the value each holds itself."""
    if node == _ROOT:
        return {}
    if node[1] == "all":
        return {_ROOT: own[_ROOT]}
    return {(node[0], "all"): own[(node[0], "all")], _ROOT: own[_ROOT]}


def _reads_with(node: Node, ancestors: Mapping[Node, str], value: str) -> str:
    """What ``node`` reads with every ancestor set to ``value``; the ancestors are put back."""
    for ancestor in ancestors:
        _write(ancestor, value)
    try:
        return _read(node)
    finally:
        for ancestor, own in ancestors.items():
            _write(ancestor, own)


def _own_value(node: Node, ancestors: Mapping[Node, str]) -> str:
    """What ``node`` holds itself: a precision, "none" (follows its parent) or ``_START``.

    torch's getter answers with the inherited value, so this asks again with the ancestors set
    to something else (does it follow?) and to "none" (where "none" reads "none" and cuDNN's
    start value reads TF32).
    """
    seen = _read(node)
    probe = "tf32" if seen == "ieee" else "ieee"
    if _reads_with(node, ancestors, probe) != probe:
        return seen
    return "none" if _reads_with(node, ancestors, "none") == "none" else _START


class _Setting(NamedTuple):
    node: Node
    own: str  # what the setting holds itself
    seen: str  # what it read: set back where ``own`` is the start value and was overwritten


def _own_settings() -> tuple[_Setting, ...]:
    own = {_ROOT: _read(_ROOT)}  # the root follows nothing: it reads what it holds
    for node in (*_PARENTS, *_LEAVES):  # parents first: their leaves' probes put them back
        own[node] = _own_value(node, _ancestors(node, own))
    return tuple(_Setting(node, value, _read(node)) for node, value in own.items())


def _write_settings(settings: Iterable[_Setting]) -> None:
    for s in settings:
        _write(s.node, s.seen if s.own == _START else s.own)


def _starts_kept(settings: tuple[_Setting, ...]) -> set[Node]:
    """The settings saved at cuDNN's start value that still hold it (the parents must be
    back as saved)."""
    own = {s.node: s.own for s in settings}
    return {
        s.node
        for s in settings
        if s.own == _START and _own_value(s.node, _ancestors(s.node, own)) == _START
    }


# ----------------------------------------------------------------------- the legacy flags


def _legacy_matmul() -> str:
    """The legacy matmul precision's own value. Its getter raises where the matmul leaves
    disagree with it; with both at "ieee" nothing disagrees. Leaves them at "ieee"."""
    _write(("cuda", "matmul"), "ieee")
    _write(("mkldnn", "matmul"), "ieee")
    return torch.get_float32_matmul_precision()


def _legacy_cudnn(settings: tuple[_Setting, ...]) -> bool:
    """The legacy cuDNN flag's own value. Its getter answers only where conv and rnn agree with
    it: with both at "tf32", exactly when it is True. May leave conv and rnn at "tf32"."""
    if any(s.own == _START for s in settings if s.node in _CUDNN):
        return True  # the flag's own setter overwrites the start value: never set, so True
    for node in _CUDNN:
        _write(node, "tf32")
    try:
        return bool(torch.backends.cudnn.allow_tf32)
    except RuntimeError:
        return False


# ----------------------------------------------------------------------- snapshot and restore


@dataclass(frozen=True)
class _Saved:
    matmul: str  # the legacy matmul precision's own value
    cudnn: bool  # the legacy cuDNN flag's own value
    settings: tuple[_Setting, ...]  # the fp32_precision tree; () before torch 2.9


def _legacy_flags() -> tuple[str, bool]:
    """The legacy matmul precision and cuDNN flag, never raising: where a legacy getter
    refuses a mix of the two APIs (a torch whose private accessors this module cannot use),
    the public ``fp32_precision`` attributes say it instead."""
    try:
        matmul = torch.get_float32_matmul_precision()
    except RuntimeError:
        matmul = "high" if _public(torch.backends.cuda.matmul) == "tf32" else "highest"
    try:
        cudnn = bool(torch.backends.cudnn.allow_tf32)
    except RuntimeError:
        cudnn = _public(getattr(torch.backends.cudnn, "conv", None)) == "tf32"
    return matmul, cudnn


def _public(backend: object) -> str | None:
    """A backend's public ``fp32_precision``, None where it has none or cannot say."""
    try:
        return str(backend.fp32_precision)  # type: ignore[attr-defined]
    except Exception:
        return None


def _snapshot() -> _Saved:
    if not _has_tree():
        return _Saved(*_legacy_flags(), ())
    settings = _own_settings()
    try:
        return _Saved(_legacy_matmul(), _legacy_cudnn(settings), settings)
    finally:
        _write_settings(s for s in settings if s.own != _START)  # what the reads changed


def _restore(saved: _Saved) -> None:
    # Legacy setters first: they write leaves, which are then written back as they were.
    torch.set_float32_matmul_precision(saved.matmul)
    if not saved.settings:
        torch.backends.cudnn.allow_tf32 = saved.cudnn
        return
    _write_settings(s for s in saved.settings if s.node[1] == "all")
    kept = _starts_kept(saved.settings)
    if not kept:  # a kept start value means the cuDNN flag was never set: it is as saved
        torch.backends.cudnn.allow_tf32 = saved.cudnn
    _write_settings(s for s in saved.settings if s.node[1] != "all" and s.node not in kept)


def _cudnn_agrees(enabled: bool) -> bool:
    """Whether the legacy cuDNN flag reads ``enabled`` (it raises unless conv and rnn agree)."""
    try:
        return bool(torch.backends.cudnn.allow_tf32) is enabled
    except RuntimeError:
        return False


def _switch(enabled: bool) -> None:
    """Set TF32 through both APIs so that every getter answers and agrees."""
    # Both matmul leaves are set explicitly, as the legacy getter expects.
    torch.set_float32_matmul_precision("high" if enabled else "highest")
    if _cudnn_agrees(enabled):
        return  # nothing to do; and cuDNN's start value stays as it is
    torch.backends.cudnn.allow_tf32 = enabled
    if not enabled and _has_tree():
        # The legacy setter leaves conv and rnn at "none", which would follow a "tf32" set on
        # torch.backends or torch.backends.cudnn.
        for node in _CUDNN:
            _write(node, "ieee")


# ----------------------------------------------------------------------- the public functions


def tf32_state() -> TF32State:
    """Whether TF32 is on for fp32 matmuls and cuDNN convolutions, never raising.

    Read from the fp32_precision settings where torch has them (they are what it applies;
    the legacy getters can raise, or answer for a setting that was overridden since), else
    from the legacy flags.

    Returns:
        A :class:`TF32State`.

    Example:
        >>> with tf32(False):
        ...     tf32_state()
        TF32State(matmul=False, cudnn=False)
    """
    if _has_tree():
        return TF32State(
            matmul=_read(("cuda", "matmul")) == "tf32", cudnn=_read(("cuda", "conv")) == "tf32"
        )
    matmul, cudnn = _legacy_flags()
    return TF32State(matmul=matmul != "highest", cudnn=cudnn)


@contextlib.contextmanager
def tf32(enabled: bool) -> Iterator[TF32State]:
    """Switch TF32 on or off for fp32 matmuls and cuDNN convolutions, then restore it.

    Inside the block both APIs agree: the legacy getters answer (``"high"``/``"highest"``,
    ``allow_tf32``) and the matmul, conv and rnn ``fp32_precision`` settings say the same
    (oneDNN's matmul setting follows the legacy matmul precision, as torch's own setter makes
    it). On exit, also after an error, every setting is put back as it was, read through
    either API; see the module docstring for the one value torch cannot take back.

    Args:
        enabled: allow TF32 (True) or force full fp32 (False) inside the block.

    Yields:
        The :class:`TF32State` in effect inside the block.

    Raises:
        TypeError: ``enabled`` is not a bool.

    Example:
        >>> before = tf32_state()
        >>> with tf32(True) as state:
        ...     state.matmul, tf32_state().cudnn, torch.backends.cudnn.allow_tf32
        (True, True, True)
        >>> tf32_state() == before
        True
    """
    flag("enabled", enabled)
    saved = _snapshot()
    try:
        _switch(enabled)
        yield tf32_state()
    finally:
        _restore(saved)


def enable_tf32() -> None:
    """Allow TF32 for fp32 matmuls and cuDNN convolutions, process-wide (not restored).

    What :class:`trainperf.amp.MixedPrecision` does on compute capability >= 8.0. Safe after
    either TF32 API was used, and leaves both readable and in agreement.

    Example:
        >>> with tf32(False):  # only to leave this process's settings as they were
        ...     enable_tf32()
        ...     tf32_state()
        TF32State(matmul=True, cudnn=True)
    """
    _switch(True)


def tf32_decision(setting: bool, capability: tuple[int, int] | None) -> tuple[bool, str]:
    """Whether :meth:`trainperf.MixedPrecision.prepare` enables TF32, and why (pure: reads
    no device): ``tf32=True`` (``setting``) on CUDA compute capability >= 8.0
    (``capability``; None: not CUDA).

    Example:
        >>> tf32_decision(True, (8, 0))
        (True, 'TF32: enabled process-wide')
        >>> tf32_decision(True, None)[1]
        'TF32: not applicable (needs CUDA compute capability >= 8.0)'
    """
    if not setting:
        return False, "TF32: off (tf32=False)"
    if (capability or (0, 0)) < (8, 0):
        return False, "TF32: not applicable (needs CUDA compute capability >= 8.0)"
    return True, "TF32: enabled process-wide"
