"""Random number generator states as plain data: Python's ``random``, NumPy's global
generator, torch's CPU generator and every initialised CUDA device's.

:class:`~trainperf.checkpoint.Checkpointer` puts them in every checkpoint and sets them on
restore, so dropout masks, augmentations drawn in the main process and the DataLoader's
shuffle continue as they would have. The values load with ``weights_only=True`` (tuples,
ints, floats and tensors only).
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from trainperf._utils.stack import user_stacklevel

__all__ = [
    "as_python_state",
    "attribute_generators",
    "generator_state",
    "is_generator",
    "numpy_state",
    "rng_state",
    "set_generator_state",
    "set_numpy_state",
    "set_rng_state",
]


def numpy_state() -> dict[str, Any]:
    kind, key, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    return {
        "kind": str(kind),
        # int64, not uint32: a plain tensor type that every loader reads.
        "key": torch.from_numpy(np.asarray(key, dtype=np.int64).copy()),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "gauss": float(gauss),
    }


def set_numpy_state(state: Mapping[str, Any]) -> None:
    key = np.asarray(state["key"].numpy(), dtype=np.uint32)
    np.random.set_state(
        (state["kind"], key, int(state["pos"]), int(state["has_gauss"]), float(state["gauss"]))
    )


def rng_state() -> dict[str, Any]:
    """This process's generator states, as plain data.

    CUDA states are read only where CUDA is already initialised (reading them would start
    it otherwise); a process that never used CUDA has drawn nothing from it.

    Example:
        >>> sorted(rng_state())
        ['cuda', 'numpy', 'python', 'torch']
    """
    cuda = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        cuda = [s.clone() for s in torch.cuda.get_rng_state_all()]
    return {
        "python": random.getstate(),
        "numpy": numpy_state(),
        "torch": torch.get_rng_state().clone(),
        "cuda": cuda,
    }


def as_python_state(value: Any) -> tuple[Any, ...]:
    # A checkpoint read back has lists where the state had tuples only if someone rewrote
    # it; random.setstate insists on tuples.
    version, internal, gauss = value
    return (int(version), tuple(int(x) for x in internal), gauss)


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Set every generator :func:`rng_state` recorded.

    CUDA states are set on the devices present (a warning says so when the checkpoint came
    from more devices than are visible here, or from a GPU run resumed without one).

    Raises:
        ValueError: ``state`` is not what :func:`rng_state` returns.

    Example:
        >>> saved = rng_state()
        >>> a = torch.rand(1)
        >>> set_rng_state(saved)
        >>> bool(torch.equal(a, torch.rand(1)))
        True
    """
    missing = {"python", "numpy", "torch", "cuda"} - set(state)
    if missing:
        raise ValueError(
            f"not a generator state from a trainperf checkpoint: {sorted(missing)} missing "
            f"(it has {sorted(state)}); the file was not written by Checkpointer.save"
        )
    random.setstate(as_python_state(state["python"]))
    set_numpy_state(state["numpy"])
    torch.set_rng_state(state["torch"].cpu())
    cuda = state["cuda"]
    if not cuda:
        return
    here = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for index, saved in enumerate(cuda[:here]):
        torch.cuda.set_rng_state(saved.cpu(), index)
    if len(cuda) > here:
        warnings.warn(
            f"the checkpoint holds the random states of {len(cuda)} CUDA device(s), but "
            f"{here} are visible here: those of the others are not restored, so GPU random "
            "numbers (dropout on those devices) will differ from the interrupted run",
            UserWarning,
            stacklevel=user_stacklevel(),
        )


_GENERATOR_TYPES = (torch.Generator, np.random.Generator, np.random.RandomState, random.Random)


def is_generator(value: Any) -> bool:
    """``value`` is a random generator object whose state :func:`generator_state` reads
    (``random.SystemRandom`` has none: it reads the operating system's entropy)."""
    return isinstance(value, _GENERATOR_TYPES) and not isinstance(value, random.SystemRandom)


def attribute_generators(obj: Any) -> dict[str, Any]:
    """``obj``'s attributes that hold generator objects (:func:`is_generator`), by name: a
    sampler a user wrote may shuffle with any of them."""
    attrs = getattr(obj, "__dict__", None)
    if not isinstance(attrs, dict):
        return {}
    return {k: v for k, v in attrs.items() if is_generator(v)}


def _plain_arrays(value: Any) -> Any:
    """A NumPy bit generator's state with its arrays as uint8 tensors of their bytes (a
    plain tensor type every loader reads; uint64 keys would not fit int64 otherwise)."""
    if isinstance(value, np.ndarray):
        raw = torch.from_numpy(np.frombuffer(value.tobytes(), dtype=np.uint8).copy())
        return {"ndarray": value.dtype.str, "shape": list(value.shape), "bytes": raw}
    if isinstance(value, dict):
        return {k: _plain_arrays(v) for k, v in value.items()}
    return value


def _numpy_arrays(value: Any) -> Any:
    """:func:`_plain_arrays` undone."""
    if isinstance(value, Mapping) and "ndarray" in value and "bytes" in value:
        data = value["bytes"].numpy().tobytes()
        return np.frombuffer(data, dtype=np.dtype(value["ndarray"])).reshape(value["shape"]).copy()
    if isinstance(value, Mapping):
        return {k: _numpy_arrays(v) for k, v in value.items()}
    return value


def generator_state(gen: Any) -> Any:
    """The state of a generator object (:func:`is_generator`) as plain data.

    Example:
        >>> g = np.random.default_rng(0)
        >>> saved = generator_state(g)
        >>> a = g.random()
        >>> set_generator_state(g, saved)
        >>> g.random() == a
        True
    """
    if isinstance(gen, torch.Generator):
        return gen.get_state()
    if isinstance(gen, np.random.Generator):
        return _plain_arrays(gen.bit_generator.state)
    if isinstance(gen, np.random.RandomState):
        return _plain_arrays(gen.get_state(legacy=False))
    return gen.getstate()


def set_generator_state(gen: Any, state: Any) -> None:
    """Put back what :func:`generator_state` read from ``gen``."""
    if isinstance(gen, torch.Generator):
        gen.set_state(state)
    elif isinstance(gen, np.random.Generator):
        gen.bit_generator.state = _numpy_arrays(state)
    elif isinstance(gen, np.random.RandomState):
        gen.set_state(_numpy_arrays(state))
    else:
        gen.setstate(as_python_state(state))
