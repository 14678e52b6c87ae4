"""The states a DataLoader pass's sampler draws from, read and put back (for
:mod:`._loader_state`): torch's, NumPy's and Python's global generators, every generator and
``epoch`` along the sampler chain (``BatchSampler.sampler``, ``DistributedSampler.epoch``,
a custom sampler's ``self.rng``) and the loader's ``generator`` (:class:`SamplerStates`), and
the context managers that let a pass's start be replayed without moving them
(:func:`sandbox`, :func:`replaying`).
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from trainperf.checkpoint._rng import (
    as_python_state,
    attribute_generators,
    generator_state,
    numpy_state,
    set_generator_state,
    set_numpy_state,
)

__all__ = [
    "SamplerStates",
    "chain_generators",
    "chain_others",
    "replaying",
    "sampler_chain",
    "sandbox",
]

_CHAIN_DEPTH = 4  # loader -> BatchSampler -> sampler -> a sampler it wraps


def sampler_chain(index_sampler: Any) -> list[Any]:
    """The index sampler and the samplers it wraps (``.sampler``), outermost first."""
    out = [index_sampler]
    while len(out) < _CHAIN_DEPTH and getattr(out[-1], "sampler", None) is not None:
        out.append(out[-1].sampler)
    return out


def chain_generators(chain: list[Any]) -> list[torch.Generator | None]:
    return [
        g if isinstance(g := getattr(s, "generator", None), torch.Generator) else None
        for s in chain
    ]


def chain_others(chain: list[Any]) -> list[dict[str, Any]]:
    """The generators each sampler keeps under other names (a sampler a user wrote:
    ``self.rng = np.random.default_rng(seed)``), by attribute; its torch ``generator`` is
    :func:`chain_generators`'."""
    return [
        {
            k: g
            for k, g in attribute_generators(s).items()
            if not (k == "generator" and isinstance(g, torch.Generator))
        }
        for s in chain
    ]


def _epochs(chain: list[Any]) -> list[int | None]:
    return [e if isinstance(e := getattr(s, "epoch", None), int) else None for s in chain]


@dataclass
class SamplerStates:
    """The generator states and epochs a pass's sampler draws from: torch's, NumPy's and
    Python's global generators (a custom sampler may shuffle with any of them), the
    sampler chain's own generators and epochs, and the loader's ``generator``."""

    torch_state: torch.Tensor
    generators: list[torch.Tensor | None]
    epochs: list[int | None]
    loader_generator: torch.Tensor | None = None
    numpy_state: dict[str, Any] | None = None  # None: a checkpoint from before they were kept
    python_state: Any = None
    others: list[dict[str, Any]] | None = None  # None: a checkpoint from before they were kept

    @classmethod
    def read(cls, chain: list[Any], loader_gen: torch.Generator | None) -> SamplerStates:
        return cls(
            torch.get_rng_state(),
            [None if g is None else g.get_state() for g in chain_generators(chain)],
            _epochs(chain),
            None if loader_gen is None else loader_gen.get_state(),
            numpy_state(),
            random.getstate(),
            [{k: generator_state(g) for k, g in d.items()} for d in chain_others(chain)],
        )

    def apply_globals(self) -> None:
        """torch's, NumPy's and Python's global generators."""
        torch.set_rng_state(self.torch_state)
        if self.numpy_state is not None:
            set_numpy_state(self.numpy_state)
        if self.python_state is not None:
            random.setstate(as_python_state(self.python_state))

    def apply(self, chain: list[Any], loader_gen: torch.Generator | None) -> None:
        self.apply_globals()
        for g, state in zip(chain_generators(chain), self.generators, strict=False):
            if g is not None and state is not None:
                g.set_state(state)
        for gens, states in zip(chain_others(chain), self.others or [], strict=False):
            for name, g in gens.items():
                if name in states:
                    set_generator_state(g, states[name])
        for sampler, epoch in zip(chain, self.epochs, strict=False):
            if epoch is not None and isinstance(getattr(sampler, "epoch", None), int):
                sampler.epoch = epoch
        if loader_gen is not None and self.loader_generator is not None:
            loader_gen.set_state(self.loader_generator)

    def to_dict(self) -> dict[str, Any]:
        return {
            "torch": self.torch_state,
            "generators": self.generators,
            "epochs": self.epochs,
            "loader_generator": self.loader_generator,
            "numpy": self.numpy_state,
            "python": self.python_state,
            "others": self.others,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SamplerStates:
        return cls(
            d["torch"],
            list(d["generators"]),
            list(d["epochs"]),
            d["loader_generator"],
            d.get("numpy"),
            d.get("python"),
            d.get("others"),
        )


@contextlib.contextmanager
def sandbox(chain: list[Any], loader_gen: torch.Generator | None) -> Iterator[None]:
    """Whatever is drawn inside leaves every generator (and epoch) as it found them."""
    before = SamplerStates.read(chain, loader_gen)
    try:
        yield
    finally:
        before.apply(chain, loader_gen)


@contextlib.contextmanager
def replaying(chain: list[Any], loader_gen: torch.Generator | None) -> Iterator[None]:
    """Like :func:`sandbox`, but the sampler chain's generators stay where the replay left
    them: a sampler that draws lazily from one (``RandomSampler(replacement=True)``, 32
    indices at a time) goes on from there. torch's global generator, the epochs and a loader
    ``generator`` the samplers do not draw from are put back (and NumPy's and Python's global
    generators: a custom sampler that shuffles with them replays its order, and the loop's
    own draws from them go on from the checkpoint's states)."""
    before = SamplerStates.read(chain, loader_gen)
    try:
        yield
    finally:
        before.apply_globals()
        for sampler, epoch in zip(chain, before.epochs, strict=False):
            if epoch is not None and isinstance(getattr(sampler, "epoch", None), int):
                sampler.epoch = epoch
        drawn = any(g is loader_gen for g in chain_generators(chain)) or any(
            g is loader_gen for gens in chain_others(chain) for g in gens.values()
        )
        if loader_gen is not None and before.loader_generator is not None and not drawn:
            loader_gen.set_state(before.loader_generator)
