"""The states of the random generators a DataLoader's dataset owns, saved and put back (for
:mod:`._loader_state`).

The generators are found as the tuner finds them (``self.rng``, and those of the datasets a
``Subset`` or ``ConcatDataset`` wraps: :func:`trainperf._utils.rng.dataset_generators`) and
saved as they are at the checkpoint (:func:`dataset_states`), so augmentation drawn from them
in this process goes on as it would have (:func:`restore_dataset_generators`). One the
sampler or the loader draws from too (:func:`shared_with_sampler`) is put back again once
the resumed pass's replay has drawn its order (:func:`put_back`).
"""

from __future__ import annotations

import warnings
from typing import Any

from torch.utils.data import DataLoader

from trainperf._utils.rng import dataset_generators
from trainperf._utils.stack import user_stacklevel
from trainperf.checkpoint._rng import generator_state, set_generator_state
from trainperf.checkpoint._sampler_states import chain_generators, chain_others

__all__ = ["dataset_states", "put_back", "restore_dataset_generators", "shared_with_sampler"]


def dataset_states(loader: DataLoader[Any]) -> list[Any]:
    """The states of the generators ``loader``'s dataset owns, as plain data.

    Example:
        >>> import torch
        >>> class Noisy(torch.utils.data.Dataset):
        ...     def __init__(self):
        ...         self.rng = torch.Generator().manual_seed(0)
        ...     def __len__(self):
        ...         return 4
        ...     def __getitem__(self, i):
        ...         return torch.rand(1, generator=self.rng)
        >>> loader = DataLoader(Noisy())
        >>> saved = dataset_states(loader)
        >>> a = next(iter(loader))
        >>> restored = restore_dataset_generators(loader, saved, "train")
        >>> bool(torch.equal(a, next(iter(loader)))), len(restored)
        (True, 1)
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as caught:  # a foreign file's entry
        ...     warnings.simplefilter("always")
        ...     restore_dataset_generators(loader, 5, "train")
        []
        >>> "the checkpoint no list of them" in str(caught[0].message)
        True
    """
    return [generator_state(g) for g in dataset_generators(loader.dataset)]


def restore_dataset_generators(
    loader: DataLoader[Any], saved: Any, key: str
) -> list[tuple[Any, Any]]:
    """Put back the generators ``loader``'s dataset owns, as :func:`dataset_states` saved
    them (None: a file from before they were kept); a warning, and every one left as it
    was, when the dataset owns other generators than were saved.

    Returns:
        Each generator put back, with its saved state (none when none was).
    """
    if saved is None:
        return []
    gens = dataset_generators(loader.dataset)
    before = [generator_state(g) for g in gens]
    try:
        if len(gens) != len(saved):
            raise ValueError("another number of generators")
        for g, state in zip(gens, saved, strict=True):
            set_generator_state(g, state)
    except (TypeError, ValueError, KeyError, IndexError, RuntimeError):
        for g, state in zip(gens, before, strict=True):
            set_generator_state(g, state)
        warnings.warn(
            f"loader {key!r}: its dataset owns {len(gens)} random generators, the checkpoint "
            f"{len(saved) if isinstance(saved, list) else 'no list of them'} (or of other "
            "kinds), so none is restored and augmentation drawn "
            "from them differs from the interrupted run's; give restore the dataset the "
            "checkpoint was saved with",
            UserWarning,
            stacklevel=user_stacklevel(),
        )
        return []
    return list(zip(gens, saved, strict=True))


def shared_with_sampler(
    loader: DataLoader[Any], chain: list[Any], restored: list[tuple[Any, Any]]
) -> list[tuple[Any, Any]]:
    """Those of the ``restored`` dataset generators the sampler chain or the loader draws
    from too. Their saved state is theirs at the save, the sampler's draws and the
    dataset's together, so the pass's replay puts it back once it has replayed the batches
    the interrupted run took. Only a loader that loads in this process (``num_workers=0``)
    draws from its dataset's generators here: with workers, the replay's state is the saved
    one."""
    if loader.num_workers:
        return []
    drawn = [g for g in chain_generators(chain) if g is not None]
    drawn += [g for gens in chain_others(chain) for g in gens.values()]
    if loader.generator is not None:
        drawn.append(loader.generator)
    ids = {id(g) for g in drawn}
    return [(g, state) for g, state in restored if id(g) in ids]


def put_back(shared: list[tuple[Any, Any]]) -> None:
    """Set each generator in ``shared`` to the state paired with it."""
    for g, state in shared:
        set_generator_state(g, state)
