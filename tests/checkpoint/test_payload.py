"""trainperf.checkpoint._payload: what a Checkpointer file holds, and plain values put back
into the live containers of the state in place."""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainperf import Checkpointer
from trainperf.checkpoint._payload import RESERVED, restore_into
from trainperf.checkpoint._rng import rng_state
from trainperf.errors import CheckpointError


def _saved(**entries: Any) -> dict[str, Any]:
    return {**entries, RESERVED: {"format": 1, "step": 1, "rng": rng_state()}}


def test_deques_are_restored_in_place_when_their_maxlen_matches() -> None:
    # A deque was replaced by the loaded one: the loop's `recent = state["recent"]` kept
    # filling a deque no later save would see.
    recent: collections.deque[int] = collections.deque([9], maxlen=3)
    window: collections.deque[int] = collections.deque(maxlen=2)
    nested: collections.deque[int] = collections.deque()
    state: dict[str, Any] = {"recent": recent, "window": window, "stats": {"q": nested}}
    saved = _saved(
        recent=collections.deque([1, 2, 3], maxlen=3),
        window=collections.deque([1, 2, 3], maxlen=4),
        stats={"q": collections.deque([5])},
    )
    restore_into(state, saved, None, "c.pt", 1)
    assert state["recent"] is recent and list(recent) == [1, 2, 3] and recent.maxlen == 3
    assert state["stats"]["q"] is nested and list(nested) == [5]
    # Another maxlen cannot be set on the live deque, and 2 would drop a saved item.
    assert state["window"] is not window and state["window"].maxlen == 4
    assert list(state["window"]) == [1, 2, 3]


def test_sets_are_restored_in_place_and_frozensets_replaced() -> None:
    seen = {"old"}
    state: dict[str, Any] = {"seen": seen, "tags": frozenset({"x"}), "by": {"ids": {0}}}
    ids = state["by"]["ids"]
    restore_into(state, _saved(seen={"a", "b"}, tags={"y"}, by={"ids": {1, 2}}), None, "c.pt", 1)
    assert state["seen"] is seen and seen == {"a", "b"}
    assert state["by"]["ids"] is ids and ids == {1, 2}
    assert state["tags"] == {"y"}


def test_a_set_is_filled_in_place_from_any_kind_of_set() -> None:
    import collections.abc

    class Frozen(collections.abc.Set):  # set.__ior__ returns NotImplemented for it
        def __init__(self, items: set[int]) -> None:
            self.items = items

        def __contains__(self, x: object) -> bool:
            return x in self.items

        def __iter__(self):  # type: ignore[no-untyped-def]
            return iter(self.items)

        def __len__(self) -> int:
            return len(self.items)

    live = {1, 2}
    state = {"seen": live}
    restore_into(state, _saved(seen=Frozen({3, 4})), None, "c.pt", 1)
    assert state["seen"] is live and live == {3, 4}


def _image_loader(tmp_path: Path) -> Any:
    pytest.importorskip("torchvision")
    from PIL import Image

    from trainperf.pipelines import image_loader

    for cls in ("cat", "dog"):
        (tmp_path / "imgs" / cls).mkdir(parents=True)
        for i in range(2):
            Image.new("RGB", (40, 30)).save(tmp_path / "imgs" / cls / f"{i}.jpg")
    return image_loader(tmp_path / "imgs", 2, size=16, backend="torchvision", device="cpu",
                        shard=None, loader_kwargs={"num_workers": 0})  # fmt: skip


@pytest.mark.parametrize("blocking", [True, False])
@pytest.mark.parametrize(
    ("place", "where"),
    [("top", r"\['loader'\]"), ("nested", r"\['loaders'\]\['train'\]")],
    ids=["top", "nested"],
)
def test_an_image_loader_in_state_is_refused_at_save_naming_it_and_the_fix(
    tmp_path: Path, blocking: bool, place: str, where: str
) -> None:
    # It failed with a raw pickling error (or, unstarted, with add_safe_globals advice), and
    # with blocking=False every save failed in the background.
    loader = _image_loader(tmp_path)
    entry = loader if place == "top" else {"train": loader}
    state = {"model": nn.Linear(2, 2), "loader" if place == "top" else "loaders": entry}
    ckpt = Checkpointer(tmp_path / "ck")
    assert ckpt.restore(state) == 0
    batches = iter(loader)
    next(batches)  # mid-epoch
    with pytest.raises(
        CheckpointError,
        match=rf"state{where} is a trainperf.pipelines image loader \(TorchvisionLoader\), "
        r"which a checkpoint cannot hold.*nothing was written\. Save the epoch number instead "
        r".*loader.epoch = state\['epoch'\].*mid-epoch resume is supported for torch DataLoaders",
    ):
        ckpt.save(state, step=3, blocking=blocking)
    ckpt.wait()
    assert ckpt.steps() == []
    batches.close()


@pytest.mark.parametrize("blocking", [True, False])
@pytest.mark.parametrize(
    ("entry", "where"),
    [
        (lambda dl: {"train": dl}, r"state\['loaders'\]\['train'\]"),
        (lambda dl: [dl], r"state\['loaders'\]\[0\]"),
    ],
    ids=["in-a-dict", "in-a-list"],
)
def test_a_dataloader_inside_another_entry_is_refused_saying_loaders_go_at_the_top(
    tmp_path: Path, blocking: bool, entry: Any, where: str
) -> None:
    # It was refused with advice to allow DataLoader with add_safe_globals (a background save
    # from the next wait), which would have pickled the loader, not its position.
    loader = DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=2, shuffle=True)
    state = {"model": nn.Linear(2, 2), "loaders": entry(loader)}
    ckpt = Checkpointer(tmp_path)
    with pytest.raises(
        CheckpointError,
        match=rf"{where} is a DataLoader inside another entry of state.*only as a top-level "
        r"entry of state: give it a key of its own",
    ):
        ckpt.save(state, step=1, blocking=blocking)
    ckpt.wait()
    assert ckpt.steps() == []
    top = {"model": nn.Linear(2, 2), "loader": loader}
    assert ckpt.restore(top) == 0
    ckpt.save(top, step=2)  # at the top it is saved
    assert ckpt.steps() == [2]


def test_a_file_without_generator_states_is_refused_before_anything_loads() -> None:
    # A file with the reserved entry but no "rng" (not one Checkpointer.save wrote) raised a
    # bare KeyError after the model had been loaded already.
    model = torch.nn.Linear(2, 2)
    before = model.weight.detach().clone()
    saved = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}
    saved["trainperf"] = {"step": 3}
    with pytest.raises(ValueError, match=r"c\.pt \(step 3\) has no random-generator states"):
        restore_into({"model": model}, saved, None, "c.pt", 3)
    assert torch.equal(model.weight, before)
