"""What a watched loop ran with, besides its timeline: :class:`LoopSetup`.

The predictions of ``trainperf.watch()`` (``_predict``) need a few facts the step timeline
cannot give: the DataLoader's settings (and what the tuner measured, when the loader came
from :func:`trainperf.autotune_loader`), torch's thread count, the host's CPUs, and the
GPU. :class:`~trainperf.monitor.Watch` reads them once, when the report is made
(``_probe``); :func:`~trainperf.monitor.analyse` takes them as one value so a recorded
timeline can be re-analysed with the setup it ran with.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

__all__ = ["LoopSetup"]


@dataclass(frozen=True)
class LoopSetup:
    """The settings a watched loop ran with; every field None where it is not known.

    Attributes:
        num_workers: the DataLoader's ``num_workers`` (0: batches are loaded in the loop's
            own thread); None when ``w.iter()`` was given something other than a
            ``torch.utils.data.DataLoader``, or never called.
        prefetch_factor: the DataLoader's ``prefetch_factor`` (None without workers).
        batch_size: the DataLoader's ``batch_size``.
        tuned_num_workers: the ``num_workers`` :func:`trainperf.autotune_loader` chose,
            None unless the loader came from it.
        tuned_worker_cpus: the cores the tuner left for workers (``TuningReport.worker_cpus``).
        tuned_max_workers: the largest ``num_workers`` the tuner considered.
        tuned_samples_per_s: the throughput the tuner measured for its choice.
        torch_threads: ``torch.get_num_threads()`` in the loop's process.
        host_cpus: logical CPUs of the whole host (``os.cpu_count()``).
        gpu_name: the CUDA device's name, None without CUDA.
        gpu_capability: its compute capability, e.g. ``(9, 0)``.
        cpu_native_bf16: whether the CPU computes bf16 natively (what
            :class:`trainperf.amp.MixedPrecision` decides on for a CPU loop).
        batches_per_step: batches ``w.iter()`` yielded per step (1 in most loops; more
            with gradient accumulation inside a step).
        handover_receive_s: CPU seconds the loop's thread would spend taking one batch from a
            DataLoader worker, measured by a one-worker probe of this loop's batch layout
            when the loop loads in its own thread (``_handover``); None otherwise.
        handover_produce_s: the extra CPU seconds a worker would spend on one batch
            (collating into shared memory, pickling), from the same probe.
        fewer_threads: the torch threads the usable CPUs hold beside the workers, where the
            loop's threads crowd them on the CPU (``_crowding``); None otherwise.
        fewer_threads_speedup: how much faster a parallel torch workload ran with
            ``fewer_threads`` threads than with ``torch_threads``, beside processes as busy
            as the workers (measured once, when the report is made); None otherwise.
        cpu_bf16_speedup: how much faster a small MLP training step ran under bf16
            autocast than in fp32 on this CPU (``_cpu_bf16``), for a CPU loop without
            MixedPrecision on a CPU with native bf16; None otherwise.
        save_block_s: seconds ``Checkpointer.save(..., blocking=False)`` of a CPU state
            blocked this process for (``_save_cost``: its fork and bookkeeping), what it
            still adds to the step that saves, for a CPU loop with periodic stalls; None
            otherwise.
        background_saves: the background checkpoint writes
            (``Checkpointer.save(..., blocking=False)``) the loop started while watched.
        prefetch_thread: the name of the thread that iterated ``w.iter()`` while another
            stepped the watch (a prefetch thread feeding the loop through a queue): the
            data wait was then not measured; None otherwise.
        steps_per_epoch: the steps one pass over the loader that fed the loop took (its
            longest pass that ended: exhausted, or left for a new pass), None before one
            ended. Stalls that recur once every this many steps come between epochs (a
            validation pass as likely as a save).

    Example:
        >>> LoopSetup(num_workers=0, torch_threads=4).to_dict()["num_workers"]
        0
    """

    num_workers: int | None = None
    prefetch_factor: int | None = None
    batch_size: int | None = None
    tuned_num_workers: int | None = None
    tuned_worker_cpus: int | None = None
    tuned_max_workers: int | None = None
    tuned_samples_per_s: float | None = None
    torch_threads: int | None = None
    host_cpus: int | None = None
    gpu_name: str | None = None
    gpu_capability: tuple[int, int] | None = None
    cpu_native_bf16: bool | None = None
    batches_per_step: float | None = None
    handover_receive_s: float | None = None
    handover_produce_s: float | None = None
    fewer_threads: int | None = None
    fewer_threads_speedup: float | None = None
    cpu_bf16_speedup: float | None = None
    save_block_s: float | None = None
    background_saves: int = 0
    prefetch_thread: str | None = None
    steps_per_epoch: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """Every field by name, JSON-safe (the capability as a list)."""
        data = dataclasses.asdict(self)
        if self.gpu_capability is not None:
            data["gpu_capability"] = list(self.gpu_capability)
        return data
