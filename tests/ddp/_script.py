"""A training script the ddp tests run as a separate program (torchrun, SLURM, signals).

python _script.py all_reduce OUTDIR
    launch(main): each rank all-reduces rank+1 and writes OUTDIR/rank<R>.json.
python _script.py hang OUTDIR START_METHOD
    launch(main, nprocs=2): each rank starts 2 DataLoader workers, writes its pid and
    theirs to OUTDIR/pids<R>.json, then keeps iterating forever.
python _script.py destroys OUTDIR
    launch_all(main) whose main destroys the process group itself; prints every rank's value.
python _script.py destroys_on_rank0 OUTDIR
    the same, but main destroys the group on rank 0 only (timeout=30 s, so a hang is bounded).
python _script.py fails_on_rank1 OUTDIR
    launch_all(main) whose main raises on rank 1 only (timeout=60 s); prints each rank's error.
python _script.py hangs_on_rank1 OUTDIR
    the same, but main sleeps on rank 1 after rank 0 returned (hang_timeout=3 s).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import psutil
import torch
import torch.distributed as dist

import trainperf.ddp as ddp


def all_reduce_main(outdir: str) -> int:
    t = torch.tensor([float(ddp.rank() + 1)])
    dist.all_reduce(t)
    record = {
        "rank": ddp.rank(),
        "world_size": ddp.world_size(),
        "local_rank": ddp.local_rank(),
        "sum": t.item(),
        "pid": os.getpid(),
    }
    (Path(outdir) / f"rank{ddp.rank()}.json").write_text(json.dumps(record))
    return int(t.item())


class SlowDataset(torch.utils.data.Dataset[int]):
    def __len__(self) -> int:
        return 1_000_000

    def __getitem__(self, i: int) -> int:
        time.sleep(0.05)
        return i


def hang_main(outdir: str) -> None:
    loader = ddp.distributed_loader(SlowDataset(), batch_size=2, num_workers=2)
    batches = iter(loader)
    next(batches)
    me = psutil.Process()
    record = {"rank": os.getpid(), "loader": [c.pid for c in me.children(recursive=True)]}
    path = Path(outdir) / f"pids{ddp.rank()}.json"
    path.with_suffix(".tmp").write_text(json.dumps(record))
    path.with_suffix(".tmp").rename(path)
    for _ in batches:
        pass


def destroys_main() -> int:
    dist.all_reduce(torch.ones(1))
    dist.destroy_process_group()
    return ddp.rank() * 10


def destroys_on_rank0_main() -> int:
    dist.all_reduce(torch.ones(1))
    if ddp.rank() == 0:
        dist.destroy_process_group()
    return ddp.rank() * 10


def fails_on_rank1_main(mode: str) -> int:
    if ddp.rank() == 1 and mode == "fails_on_rank1":
        raise ValueError("rank 1's main broke")
    if ddp.rank() == 1:
        time.sleep(1000)
    return ddp.rank()


def exits_on_rank1_main() -> int:
    dist.all_reduce(torch.ones(1))
    if ddp.rank() == 1:
        sys.exit(0)  # counts as returning None, as under launch's own spawner
    return ddp.rank()


if __name__ == "__main__":
    mode, out = sys.argv[1], sys.argv[2]
    if mode == "all_reduce":
        print("result", ddp.launch(all_reduce_main, out, nprocs=2, backend="gloo"), flush=True)
    elif mode == "destroys":
        print(f"results {ddp.launch_all(destroys_main, backend='gloo')}\n", end="", flush=True)
    elif mode == "destroys_on_rank0":
        gathered = ddp.launch_all(
            destroys_on_rank0_main, backend="gloo", timeout=30, hang_timeout=None
        )
        print(f"results {gathered}\n", end="", flush=True)  # one write: ranks share a pipe
    elif mode == "exits_on_rank1":
        gathered = ddp.launch_all(exits_on_rank1_main, backend="gloo", timeout=30, hang_timeout=10)
        print(f"results {gathered}\n", end="", flush=True)
    elif mode in ("fails_on_rank1", "hangs_on_rank1"):
        try:
            ddp.launch_all(fails_on_rank1_main, mode, backend="gloo", timeout=60, hang_timeout=3)
        except Exception as e:
            print(f"error on rank {os.environ['SLURM_PROCID']}: {e}\n", end="", flush=True)
    elif mode == "hang":
        ddp.launch(hang_main, out, nprocs=2, backend="gloo", start_method=sys.argv[3])
    else:
        sys.exit(f"unknown mode {mode!r}")
