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

__all__ = ["as_python_state", "numpy_state", "rng_state", "set_numpy_state", "set_rng_state"]


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
