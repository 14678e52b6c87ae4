"""Launcher environments the ddp tests feed to ``detect`` and ``launch``."""

from __future__ import annotations

__all__ = ["SLURM", "TORCHRUN"]

TORCHRUN = {
    "RANK": "3",
    "WORLD_SIZE": "4",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "10.1.2.3",
    "MASTER_PORT": "29500",
}
SLURM = {
    "SLURM_PROCID": "5",
    "SLURM_NTASKS": "8",
    "SLURM_LOCALID": "1",
    "SLURM_TASKS_PER_NODE": "4(x2)",
    "SLURM_JOB_NODELIST": "node[07-08],gpu3",
    "SLURM_JOB_ID": "4242",
}
