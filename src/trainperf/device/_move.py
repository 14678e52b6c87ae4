"""Nested batches: :func:`to_device` moves them.

Exact dicts, lists, tuples and tensors are walked here, inline; every other type is walked
and rebuilt as :mod:`._containers` decides. One memo per call maps the ``id`` of every
tensor and container already moved to its result, so what the batch shares stays shared (a
tensor under two keys, tied weights, one list in two places) and a container that holds
itself is moved once.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import Any, TypeVar

import torch

from trainperf.device._containers import (
    ATOMS,
    HAS_TO,
    KEEP_ALIVE,
    KINDS,
    LEAF,
    MAPPING,
    PENDING,
    TENSOR,
    Memo,
    kind_of,
    move_tensor,
    rebuild,
)
from trainperf.device._resolve import resolve_device

T = TypeVar("T")

_FLOAT_DTYPES = sorted(
    {d for d in vars(torch).values() if isinstance(d, torch.dtype) and d.is_floating_point},
    key=str,
)
# Targets a copy never overlaps with the host for: the CPU itself (and a device-to-host copy
# read before it lands is the documented risk of non_blocking), MPS (a race, pytorch#83015,
# which is why Lightning never asks there either) and meta (no data moves).
_SYNC_TARGETS = frozenset({"cpu", "mps", "meta"})


def copies_async(source: torch.device, pinned: bool, target: torch.device) -> bool:
    """Whether :func:`to_device` asks for ``non_blocking=True`` for one tensor's copy.

    Only a pinned (page-locked) host tensor going to an accelerator (CUDA, XPU, ...): that
    is the one copy that overlaps with other work, and a device-to-host copy made
    asynchronously could be read before its data lands. The choice follows Lightning's
    ``move_data_to_device``, which never passes it for CPU or MPS targets.

    Args:
        source: the tensor's device.
        pinned: whether the tensor is in pinned memory (``tensor.is_pinned()``).
        target: where it goes.

    Returns:
        True to pass ``non_blocking=True`` (when the caller allowed it).

    Example:
        >>> cpu, cuda = torch.device("cpu"), torch.device("cuda")
        >>> copies_async(cpu, True, cuda), copies_async(cpu, False, cuda)
        (True, False)
        >>> copies_async(cuda, False, cpu), copies_async(cpu, True, cpu)
        (False, False)
    """
    return pinned and source.type == "cpu" and target.type not in _SYNC_TARGETS


_HOST = torch.device("cpu")


@functools.lru_cache(maxsize=64)
def _mover(
    dev: torch.device,
    non_blocking: bool,
    dtype: torch.dtype | None,
    skip: frozenset[Any],
    channels_last: bool = False,
) -> Callable[[Any, Memo], Any]:
    nb = non_blocking and copies_async(_HOST, True, dev)  # here, so once per device
    # ``nb`` is True only where a pinned host tensor would copy asynchronously to ``dev``
    # (copies_async); per tensor it then takes ``is_pinned()``, which only host tensors
    # can be, so ``nb and x.is_pinned()`` is copies_async(x.device, x.is_pinned(), dev).
    # dtype None: keep every dtype; else source dtype -> new dtype, None for ints and bools.
    cast = _keep_dtype if dtype is None else dict.fromkeys(_FLOAT_DTYPES, dtype).get
    layout = _channels_last_format if channels_last else _keep_format
    walk: list[Callable[[Any, Memo], Any]] = []

    def other(x: Any, cls: type, memo: Memo) -> Any:
        kind = KINDS.get(cls)
        if kind is None:
            kind = kind_of(cls)
        if kind == LEAF:
            return x
        key = id(x)
        if key in memo:
            done = memo[key]
            if done is PENDING:  # a reference cycle back to a dataclass being moved
                done = memo[key] = copy.copy(x)
            return done
        if kind == TENSOR:
            result = move_tensor(x, dev, cast(x.dtype), nb and x.is_pinned(), layout(x))
        else:
            result = rebuild(x, kind, walk[0], memo, dev, skip)
            if kind == HAS_TO and channels_last and isinstance(result, Mapping):
                # A mapping that moved itself (Hugging Face's BatchFeature) still holds its
                # images in their old layout: walk the moved copy as a mapping.
                memo.setdefault(KEEP_ALIVE, []).append(result)
                result = rebuild(result, MAPPING, walk[0], memo, dev, skip)
        # A tuple is built after its contents: a cycle through it may have built it first.
        return memo.setdefault(key, result)

    build = _walker if dtype is None else _casting_walker
    # With channels_last every tensor takes ``other``'s path, which sets its layout.
    inline = _NoTensor if channels_last else torch.Tensor
    walk.append(build(dev, nb, cast, not skip, other, inline))
    return walk[0]


def _keep_dtype(_: torch.dtype) -> None:
    return None


def _keep_format(_: torch.Tensor) -> torch.memory_format:
    return torch.preserve_format


def _channels_last_format(x: torch.Tensor) -> torch.memory_format:
    """channels_last for 4-D dense floating tensors (images); the others keep their layout."""
    if x.dim() == 4 and x.is_floating_point() and x.layout == torch.strided:
        return torch.channels_last
    return torch.preserve_format


class _NoTensor(torch.Tensor):
    """A tensor type never made: a walker given it moves no tensor inline."""


def _walker(
    dev: torch.device,
    nb: bool,
    cast: Callable[[torch.dtype], torch.dtype | None],
    plain_dicts: bool,
    other: Callable[[Any, type, Memo], Any],
    tensor: type[torch.Tensor],
) -> Callable[[Any, Memo], Any]:
    # Exact-type tests come first, so plain batches (dicts of lists of tensors) never reach
    # the kind table, and tensors inside containers move inline, without a Python call each:
    # such a call costs about as much as the rest of the traversal. Hence two walkers, this
    # one without a cast. With skip_keys, dicts take the slow path (``other``).
    # A list or dict goes into the memo before its items (it may hold itself), a tuple after.
    # A tensor goes in only when .to made a new one: one left where it is comes back as
    # itself wherever it appears, so it is shared already, at no cost. A tensor met again is
    # moved again and that copy dropped for the first: a look-up before each move would
    # cost every tensor of every batch for the rare one that appears twice.
    # ``tensor`` is torch.Tensor, or a type nothing has (every tensor then goes to ``other``).

    def move(x: Any, memo: Memo) -> Any:
        cls = type(x)
        if cls is tensor:
            return (
                r
                if (r := x.to(dev, non_blocking=nb and x.is_pinned())) is x
                else memo.setdefault(id(x), r)
            )
        if cls is list:
            key = id(x)
            if key in memo:
                return memo[key]
            memo[key] = out = []  # before the items: a list may hold itself
            out += [
                (
                    r
                    if (r := v.to(dev, non_blocking=nb and v.is_pinned())) is v
                    else memo.setdefault(id(v), r)
                )
                if type(v) is tensor
                else move(v, memo)
                for v in x
            ]
            return out
        if cls is dict and plain_dicts:
            key = id(x)
            if key in memo:
                return memo[key]
            memo[key] = new = {}
            new.update(
                {
                    k: (
                        r
                        if (r := v.to(dev, non_blocking=nb and v.is_pinned())) is v
                        else memo.setdefault(id(v), r)
                    )
                    if type(v) is tensor
                    else move(v, memo)
                    for k, v in x.items()
                }
            )
            return new
        if cls is tuple:
            moved = tuple(
                [
                    (
                        r
                        if (r := v.to(dev, non_blocking=nb and v.is_pinned())) is v
                        else memo.setdefault(id(v), r)
                    )
                    if type(v) is tensor
                    else move(v, memo)
                    for v in x
                ]
            )
            return memo.setdefault(id(x), moved)
        return x if cls in ATOMS else other(x, cls, memo)

    return move


def _casting_walker(
    dev: torch.device,
    nb: bool,
    cast: Callable[[torch.dtype], torch.dtype | None],
    plain_dicts: bool,
    other: Callable[[Any, type, Memo], Any],
    tensor: type[torch.Tensor],
) -> Callable[[Any, Memo], Any]:

    def move(x: Any, memo: Memo) -> Any:
        cls = type(x)
        if cls is tensor:
            return (
                r
                if (r := x.to(dev, cast(x.dtype), non_blocking=nb and x.is_pinned())) is x
                else memo.setdefault(id(x), r)
            )
        if cls is list:
            key = id(x)
            if key in memo:
                return memo[key]
            memo[key] = out = []  # before the items: a list may hold itself
            out += [
                (
                    r
                    if (r := v.to(dev, cast(v.dtype), non_blocking=nb and v.is_pinned())) is v
                    else memo.setdefault(id(v), r)
                )
                if type(v) is tensor
                else move(v, memo)
                for v in x
            ]
            return out
        if cls is dict and plain_dicts:
            key = id(x)
            if key in memo:
                return memo[key]
            memo[key] = new = {}
            new.update(
                {
                    k: (
                        r
                        if (r := v.to(dev, cast(v.dtype), non_blocking=nb and v.is_pinned())) is v
                        else memo.setdefault(id(v), r)
                    )
                    if type(v) is tensor
                    else move(v, memo)
                    for k, v in x.items()
                }
            )
            return new
        if cls is tuple:
            moved = tuple(
                [
                    (
                        r
                        if (r := v.to(dev, cast(v.dtype), non_blocking=nb and v.is_pinned())) is v
                        else memo.setdefault(id(v), r)
                    )
                    if type(v) is tensor
                    else move(v, memo)
                    for v in x
                ]
            )
            return memo.setdefault(id(x), moved)
        return x if cls in ATOMS else other(x, cls, memo)

    return move


def _skip_set(skip_keys: str | Iterable[Hashable] | None) -> frozenset[Any]:
    if skip_keys is None:
        return frozenset()
    if isinstance(skip_keys, str):
        return frozenset((skip_keys,))
    if isinstance(skip_keys, (bytes, bytearray)):
        raise _skip_keys_error(skip_keys, "bytes are not a list of keys")
    try:
        return frozenset(skip_keys)
    except TypeError as e:
        raise _skip_keys_error(skip_keys, str(e)) from e


def _skip_keys_error(skip_keys: object, why: str) -> TypeError:
    return TypeError(
        f"skip_keys must be a str or an iterable of hashable keys, such as ['labels'], "
        f"got {skip_keys!r} ({why})"
    )


def to_device(
    obj: T,
    device: str | int | torch.device,
    *,
    non_blocking: bool = True,
    dtype: torch.dtype | None = None,
    skip_keys: str | Iterable[Hashable] | None = None,
) -> T:
    """Move every tensor inside ``obj`` to ``device``, keeping the containers as they are.

    Walks dicts (``OrderedDict``, ``defaultdict`` and other mappings keep their type),
    lists, tuples, namedtuples, deques and other mutable sequences (``UserList``), sets,
    dataclasses (frozen ones too; their fields and the other attributes they hold) and
    ``SimpleNamespace``; calls ``.to(device)`` on a shallow copy (with its own dicts, lists
    and sets) of an object that has a ``.to`` method (custom batch classes, Hugging Face's
    ``BatchEncoding``, whose ``.to`` moves in place), keeping that copy if ``.to`` returns
    None, and on a module itself (``Module.to`` moves it in place, as torch does); leaves
    everything else (str, int, None, NumPy arrays…) untouched. A tensor already on
    ``device`` with the right dtype is returned as is, not copied; an ``nn.Parameter``
    comes back as a Parameter (a leaf, with its ``requires_grad``). ``obj`` itself is never
    changed (a module in it excepted): containers are copied, also a mapping that keeps its
    items in an attribute, and values of ``functools.cached_property`` are dropped from the
    copies (they were computed on the old device). A ``ChainMap`` has each of its maps
    moved. A container without a tensor to move that cannot be rebuilt from its items
    (``sys.version_info``) comes back as it is, and so does a struct sequence
    (``os.stat_result``, ``time.struct_time``: rebuilding one drops its extra fields).
    Keys are never moved: a tensor used as a dict key stays where it is.

    What ``obj`` holds twice comes back once: a tensor under two keys (tied weights) gives
    one moved tensor, a list in two places one new list, and a container that holds itself
    is no error. A view, though, is moved as a tensor of its own, as ``Tensor.to`` moves
    it: it no longer shares memory with its base after the move.

    ``non_blocking=True`` is passed on only where it helps and is safe: for a *pinned* CPU
    tensor (``pin_memory=True`` in the DataLoader) going to an accelerator such as CUDA.
    Copies to the CPU (device-to-host ones included) and to MPS stay synchronous, so their
    result can be read at once (as Lightning's ``move_data_to_device`` does).

    Args:
        obj: a tensor or any nesting of the containers above.
        device: ``"cuda:1"``, ``1`` (meaning ``cuda:1``) or a ``torch.device``. There is no
            default and None is refused (``TypeError``): a batch must go where its model is,
            which "the best device" need not be.
        non_blocking: allow asynchronous host-to-accelerator copies from pinned memory.
        dtype: cast floating-point tensors to this floating dtype on the way; integer and
            bool tensors (labels, indices, masks) keep theirs. Not passed to ``.to`` objects.
        skip_keys: a key, or several, whose values are left as they are in every mapping
            at any depth (Accelerate's ``send_to_device`` has the same option). Objects
            with their own ``.to`` (Hugging Face's ``BatchEncoding``) move themselves whole.

    Returns:
        A structure like ``obj`` with its tensors on ``device``.

    Raises:
        ValueError: ``device`` is not a valid device, or ``dtype`` is not floating-point.
        TypeError: ``device`` has the wrong type (None included), ``skip_keys`` is neither a
            str nor an iterable of hashable keys, or a container cannot be rebuilt.
        DeviceError: the device's backend (CUDA, MPS, XPU, ...) is not available here, or
            its index is beyond the visible devices (see
            :func:`trainperf.device.resolve_device`).

    Example:
        >>> batch = {"x": torch.ones(2), "y": [torch.tensor([1]), "id-7"]}
        >>> out = to_device(batch, "meta", dtype=torch.float16)
        >>> out["x"].device, out["x"].dtype, out["y"][0].dtype, out["y"][1]
        (device(type='meta'), torch.float16, torch.int64, 'id-7')
        >>> to_device(batch, "meta", skip_keys="y")["y"] is batch["y"]
        True
        >>> tied = to_device({"a": batch["x"], "b": batch["x"]}, "meta")
        >>> tied["a"] is tied["b"]
        True
    """
    dev = resolve_device(device, allowed=None, auto=False)
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(
            f"dtype casts floating-point tensors only, so it must be a floating dtype such as "
            f"torch.bfloat16, got {dtype!r}"
        )
    move = _mover(dev, bool(non_blocking), dtype, _skip_set(skip_keys))
    result: T = move(obj, {})
    return result


def to_device_channels_last(obj: T, device: str | int | torch.device) -> T:
    """:func:`to_device`, with every 4-D floating-point tensor also made channels_last.

    What :meth:`trainperf.MixedPrecision.prepare_batch` does for a channels_last model: the
    same walk as :func:`to_device` (containers keep their types, a Parameter stays one, what
    the batch shares stays shared, a container may hold itself), and each image changes
    device and layout in one copy. Other tensors (integer ones, other shapes) keep their
    layout. A mapping with its own ``.to`` (Hugging Face's ``BatchFeature``) moves itself,
    then its images are converted in a copy of it.

    Example:
        >>> batch = [torch.ones(2, 3, 4, 4), torch.ones(2, 3)]
        >>> images, rows = to_device_channels_last(batch, "cpu")
        >>> images.is_contiguous(memory_format=torch.channels_last), rows is batch[1]
        (True, True)
    """
    dev = resolve_device(device, allowed=None, auto=False)
    move = _mover(dev, True, None, frozenset(), True)
    result: T = move(obj, {})
    return result
