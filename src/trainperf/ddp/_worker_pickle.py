"""How ``main``, its arguments and the launcher's file descriptors travel to a spawned worker.

``main``, ``args`` and ``kwargs`` travel as one blob that the worker unpickles inside its
own error handling (:meth:`~trainperf.ddp._worker.WorkerSpec.load`), each value labelled
so that a failure names the one being unpickled; tensors are copied into each rank, as a
forked or torchrun rank has its own. A descriptor (the launcher's stderr) travels as
:class:`InheritedFd`.
"""

from __future__ import annotations

import copyreg
import functools
import io
import multiprocessing
import os
import pickle
import sys
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from types import TracebackType
from typing import Any

__all__ = [
    "InheritedFd",
    "UnpicklableArgument",
    "UnsendableResult",
    "called_function",
    "pickling_code_only",
]

_MAIN = "main"
# The labels of what this worker has unpickled so far, in order: the first one missing after
# a failure is the one that failed.
_unpickled: list[str] = []


class _Labelled:
    """One of ``main``, its arguments, on the way to a worker: unpickled, it is the value
    itself, and its label is recorded once the value is built."""

    def __init__(self, label: str, value: Any) -> None:
        self.label = label
        self.value = value

    def __reduce__(self) -> tuple[Any, ...]:
        return (_arrived, (self.label, self.value))


def _labelled(
    main: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], tuple[str, ...]]:
    """``(main, args, kwargs)`` with each value labelled, and the labels in unpickling order."""
    positional = [f"args[{i}] ({_class_name(type(a))})" for i, a in enumerate(args)]
    keyword = {k: f"kwargs[{k!r}] ({_class_name(type(v))})" for k, v in kwargs.items()}
    call = (
        _Labelled(_MAIN, main),
        tuple(_Labelled(label, a) for label, a in zip(positional, args, strict=True)),
        {k: _Labelled(keyword[k], v) for k, v in kwargs.items()},
    )
    return call, (*positional, *keyword.values())


def _arrived(label: str, value: Any) -> Any:
    _unpickled.append(label)
    return value


def _class_name(cls: type) -> str:
    """``pkg.mod.Name`` as the user wrote it (``Name`` for builtins; a spawned rank imports
    the script as ``__mp_main__``: the user wrote ``__main__``)."""
    module = "__main__" if cls.__module__ == "__mp_main__" else cls.__module__
    return cls.__qualname__ if module == "builtins" else f"{module}.{cls.__qualname__}"


class UnpicklableArgument(pickle.PicklingError):
    """Packing ``(main, args, kwargs)`` failed on the value ``label`` names (``"main"``,
    ``"args[1] (pkg.Cls)"``); the pickler's own error is its ``__cause__``."""

    def __init__(self, label: str, error: BaseException) -> None:
        super().__init__(f"{label}: {type(error).__name__}: {error}")
        self.label = label


class UnsendableResult(TypeError):
    """``main`` returned a value that cannot be pickled back to the launcher: the message
    names its type and the fix. Reported as a ``TypeError``, without a traceback when the
    pickling error's own shows only trainperf's and pickle's frames (:func:`pickling_code_only`);
    with that traceback when the value's own code (its ``__getstate__``, ``__reduce__``) raised.

    Example:
        >>> print(UnsendableResult(lambda: 0, TypeError("cannot pickle it")))  # doctest: +ELLIPSIS
        main returned a value that cannot be pickled ... its type is function; return plain ...
    """

    def __init__(self, payload: Any, error: BaseException) -> None:
        # One line: the launcher's summary of a failure is the message's first line.
        # The fix comes before pickle's own words, which a long summary cuts off.
        super().__init__(
            "main returned a value that cannot be pickled to send it back to the launcher: "
            f"its type is {_class_name(type(payload))}; return plain data (numbers, tensors, "
            "dicts/lists of them) instead, or save it to a file in main and return the path "
            f"({type(error).__name__}: {error})"
        )


# Where pickling runs without the pickled value's own code: trainperf, pickle, copyreg and
# multiprocessing (a frame's file compared as a path, a package's as a folder).
_PICKLING_FILES = (pickle.__file__, copyreg.__file__)
_PICKLING_FOLDERS = (
    os.path.dirname(multiprocessing.__file__) + os.sep,
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,  # trainperf/
)


def pickling_code_only(tb: TracebackType | None) -> bool:
    """Whether every frame of ``tb`` is in trainperf, pickle, copyreg or multiprocessing: a
    pickling error raised there says all in its message, its traceback adds nothing.

    Example:
        >>> try:
        ...     pickle.dumps(lambda: 0)
        ... except Exception as e:
        ...     error = e
        >>> pickling_code_only(error.__traceback__)  # the doctest's own frame
        False
        >>> pickling_code_only(None)
        True
    """
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        if filename not in _PICKLING_FILES and not filename.startswith(_PICKLING_FOLDERS):
            return False
        tb = tb.tb_next
    return True


class _CopyingPickler(ForkingPickler):
    """multiprocessing's pickler (queues, pipes and locks travel as under spawn), except
    that tensors are copied into each rank, as a forked rank or a torchrun rank has its own:
    torch's reducers would move every tensor of ``args`` into shared memory, so a model passed
    to ``main`` had one set of parameters for every rank (and the launcher), each rank's
    optimizer step applied to it. A CPU tensor already in shared memory
    (``tensor.share_memory_()``, ``model.share_memory()``) stays shared: that was asked for."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # One storage object per storage, so pickle's memo writes it once and views of one
        # buffer (parameters carved out of a flat one) stay views of one copy in the rank.
        self._storages: dict[tuple[int, Any], Any] = {}
        # The label of the value being pickled: pickling is depth first, so the last one
        # reached when pickling fails is the one that failed.
        self.label = _MAIN

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, _Labelled):
            self.label = obj.label
            return NotImplemented
        torch = sys.modules.get("torch")  # not imported: there is no tensor to pickle
        if torch is None:
            return NotImplemented
        if isinstance(obj, torch.Tensor):
            try:
                storage = obj.untyped_storage()
            except (NotImplementedError, RuntimeError):  # sparse and such: no one storage
                return obj.__reduce_ex__(2)
        elif isinstance(obj, torch.TypedStorage):  # what a tensor's reduction holds
            storage = obj._untyped_storage
        elif isinstance(obj, torch.UntypedStorage):
            storage = obj
        else:
            return NotImplemented
        if storage.device.type == "cpu" and storage.is_shared():
            return NotImplemented  # torch's reducer: shared, as the user made it
        if not isinstance(obj, torch.Tensor):
            return obj.__reduce__()  # a storage by value (torch.save into bytes)
        reduced = obj.__reduce_ex__(2)  # by value; its storage comes back here
        args = reduced[1]
        if args and isinstance(args[0], torch.TypedStorage):
            key = (args[0]._untyped_storage._cdata, args[0].dtype)
            same = self._storages.setdefault(key, args[0])
            reduced = (reduced[0], (same, *args[1:]), *reduced[2:])
        return reduced


def _pack(call: tuple[Any, ...]) -> bytes:
    """``call`` (from :func:`_labelled`) pickled; a value that cannot be pickled raises
    :class:`UnpicklableArgument` naming it.

    Example:
        >>> import threading
        >>> call, _ = _labelled(print, (1, threading.Lock()), {})
        >>> try:
        ...     _pack(call)
        ... except UnpicklableArgument as e:
        ...     print(e.label)
        args[1] (_thread.lock)
    """
    buf = io.BytesIO()
    pickler = _CopyingPickler(buf, pickle.HIGHEST_PROTOCOL)
    try:
        pickler.dump(call)
    except (pickle.PicklingError, AttributeError, TypeError) as e:
        raise UnpicklableArgument(pickler.label, e) from e
    return buf.getvalue()


class InheritedFd:
    """A file descriptor of the launcher handed to a spawned worker under the same number.

    Pickled only while multiprocessing starts the worker (which passes the descriptor
    along); a forked worker inherits every descriptor and needs none of this.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, ...]:
        from multiprocessing import reduction

        return (_rebuild_fd, (reduction.DupFd(self.fd),))


def _rebuild_fd(dup: Any) -> InheritedFd:
    return InheritedFd(dup.detach())


def called_function(main: Callable[..., Any]) -> Callable[..., Any]:
    """The function ``main`` calls: itself, or what a ``functools.partial`` wraps.

    Example:
        >>> import functools, operator
        >>> called_function(functools.partial(functools.partial(operator.add, 1), 2))
        <built-in function add>
    """
    while isinstance(main, functools.partial):
        main = main.func
    return main
