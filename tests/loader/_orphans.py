"""A process that starts DataLoader workers the way trainperf.loader does, for the test that
SIGKILLs it (tests/loader/test_autotune.py): ``python _orphans.py MODE DIR``.

Each worker writes its pid to ``DIR`` once it is loading (after ``worker_init_fn`` ran),
then sleeps far longer than the test waits, so only the parent-death signal can end it
in time.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

SLEEP_S = 120.0


def _loading(where: str) -> None:
    if get_worker_info() is not None:
        (Path(where) / str(os.getpid())).touch()
        time.sleep(SLEEP_S)


class Sleeper(Dataset[torch.Tensor]):
    def __init__(self, where: str) -> None:
        self.where = where

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        _loading(self.where)
        return torch.zeros(2)


class SleepingStream(IterableDataset[torch.Tensor]):
    def __init__(self, where: str) -> None:
        self.where = where

    def __iter__(self) -> Iterator[torch.Tensor]:
        _loading(self.where)
        yield from (torch.full((2,), float(i)) for i in range(64))


def main(mode: str, where: str) -> None:
    if mode == "tuned":  # the loader autotune_loader returns
        from trainperf.loader import TunedDataLoader

        next(iter(TunedDataLoader(Sleeper(where), batch_size=1, num_workers=2)))
    elif mode == "measure":  # a candidate the tuner measures
        from trainperf.loader import measure

        measure(
            Sleeper(where),
            1,
            {},
            num_workers=2,
            prefetch_factor=2,
            pin_memory=False,
            deadline=time.perf_counter() + 2 * SLEEP_S,
            hang_timeout_s=2 * SLEEP_S,
        )
    elif mode == "sharding":  # the IterableDataset check
        from trainperf.loader._iterable import check_sharding

        check_sharding(SleepingStream(where), {}, time.perf_counter() + 2 * SLEEP_S)
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
