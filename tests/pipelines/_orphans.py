"""A training process for ``test_torchvision.py``'s orphan test: run as a script.

``python _orphans.py <image folder> <pid folder>`` builds ``image_loader(backend="torchvision")``
with two DataLoader workers and starts an epoch. Each worker writes its pid, then stays busy in
the caller's ``worker_init_fn`` (as a worker decoding a huge batch would), where PyTorch's own
check for a dead parent never runs. The test SIGKILLs this process: only the parent-death
signal trainperf sets in every worker it starts can end them then.
"""

from __future__ import annotations

import os
import sys
import time


def busy_worker(worker_id: int) -> None:
    folder = os.environ["TRAINPERF_TEST_PIDS"]
    with open(os.path.join(folder, f"worker{worker_id}.tmp"), "w") as f:
        f.write(str(os.getpid()))
    os.replace(
        os.path.join(folder, f"worker{worker_id}.tmp"), os.path.join(folder, f"worker{worker_id}")
    )
    time.sleep(300)


def main(images: str, pids: str) -> None:
    from trainperf.pipelines import image_loader

    os.environ["TRAINPERF_TEST_PIDS"] = pids
    loader = image_loader(
        images,
        2,
        size=16,
        backend="torchvision",
        device="cpu",
        shard=None,
        loader_kwargs={"num_workers": 2, "worker_init_fn": busy_worker},
    )
    next(iter(loader))  # waits on the busy workers until this process is killed


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
