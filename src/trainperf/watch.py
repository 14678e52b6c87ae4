"""``trainperf.watch``: watch a real training loop and say what limits it.

::

    with trainperf.watch() as w:
        for batch in w.iter(loader):   # times the wait for each batch
            loss = step(batch)
            w.step()                   # marks the end of a training step
    print(w.report())

Per step the loop pays two ``time.perf_counter()`` stamps and, once the process uses CUDA,
two CUDA events (recorded, never waited for: they are read back lazily with
``Event.query()`` and one ``Event.synchronize()`` when the report is made). A background
thread samples GPU utilisation and memory (NVML) and process and host CPU (psutil) ten
times a second. :func:`analyse` (in ``_watch_analysis``, re-exported here) turns the
timeline into a verdict in the seed guide's terms: input-bound, compute-bound, host-bound,
GPU unused or periodic stalls.
"""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
from array import array
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import psutil
import torch

from trainperf._imports import is_available
from trainperf._watch_analysis import (
    Sample,
    StepRecord,
    Verdict,
    VerdictKind,
    WatchReport,
    analyse,
)
from trainperf.limits import usable_cpus

__all__ = [
    "Sample",
    "StepRecord",
    "Verdict",
    "VerdictKind",
    "Watch",
    "WatchReport",
    "analyse",
    "watch",
]

T = TypeVar("T")
_RESOLVE_EVERY = 32  # steps between non-blocking reads of finished CUDA events


def _child_pids() -> set[int]:
    """Direct children of this process (DataLoader workers), from /proc, cheaply."""
    pids: set[int] = set()
    try:
        for task in Path("/proc/self/task").iterdir():
            text = (task / "children").read_text()
            pids.update(int(p) for p in text.split())
    except OSError:
        # No /proc (macOS) or no CONFIG_PROC_CHILDREN: ask psutil, which scans every process.
        with contextlib.suppress(psutil.Error):
            pids = {c.pid for c in psutil.Process().children()}
    return pids


class _Sampler(threading.Thread):
    """Samples GPU utilisation and memory, process and host CPU, every ``interval`` s."""

    def __init__(self, interval: float, t0: float, gpu: bool) -> None:
        super().__init__(name="trainperf-watch-sampler", daemon=True)
        self.interval = interval
        self.t0 = t0
        self.gpu = gpu
        self.gpu_present = False
        self.device_index: int | None = None  # set by the watching thread once CUDA is in use
        self.samples: list[Sample] = []
        self.ready = threading.Event()
        self._stop_event = threading.Event()
        self._nvml: Any = None
        self._handle: Any = None
        self._handle_tried = False
        self._me = psutil.Process()
        self._children: dict[int, psutil.Process] = {}

    def stop(self) -> None:
        self._stop_event.set()
        # Bounded: a hung driver call must not hang the training script's exit with it.
        self.join(timeout=10)

    def run(self) -> None:
        try:
            self._me.cpu_percent(None)
            psutil.cpu_percent(None)
            if self.gpu:
                self._start_nvml()
        finally:
            self.ready.set()
        tick = 0
        try:
            while not self._stop_event.wait(self.interval):
                if tick % 20 == 0:  # workers come and go; /proc is read every ~2 s
                    self._refresh_children()
                tick += 1
                try:
                    self.samples.append(self._sample())
                except Exception:  # a failed sample is a gap in the plot, not a crash
                    continue
        finally:
            if self._nvml is not None:
                self._nvml.nvmlShutdown()

    def _start_nvml(self) -> None:
        from trainperf import device

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # "no NVML": the report says so
            try:
                self.gpu_present = bool(device.gpus())
            except Exception:  # a broken NVML must not break the training loop
                self.gpu_present = False
        if self.gpu_present and is_available("pynvml"):
            import pynvml

            try:
                pynvml.nvmlInit()
                self._nvml = pynvml
            except pynvml.NVMLError:
                self._nvml = None

    def _gpu_handle(self) -> Any:
        if self._handle is not None or self._handle_tried or self.device_index is None:
            return self._handle
        self._handle_tried = True
        nvml = self._nvml
        props: Any = torch.cuda.get_device_properties(self.device_index)  # stubs lack pci_*
        uuid = str(props.uuid)
        try:
            self._handle = nvml.nvmlDeviceGetHandleByUUID(
                uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"
            )
        except nvml.NVMLError:
            # Older drivers or MIG: fall back to the PCI address, where torch reports one.
            with contextlib.suppress(nvml.NVMLError, AttributeError):
                self._handle = nvml.nvmlDeviceGetHandleByPciBusId(
                    f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
                )
        return self._handle

    def _refresh_children(self) -> None:
        pids = _child_pids()
        for pid in list(self._children):
            if pid not in pids:
                del self._children[pid]
        for pid in pids - self._children.keys():
            try:
                child = psutil.Process(pid)
                child.cpu_percent(None)
                self._children[pid] = child
            except psutil.Error:
                continue

    def _sample(self) -> Sample:
        util: float | None = None
        used: int | None = None
        if self._nvml is not None:
            try:
                handle = self._gpu_handle()
                if handle is not None:
                    util = float(self._nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
                    used = int(self._nvml.nvmlDeviceGetMemoryInfo(handle).used)
            except Exception:  # NVML hiccups (MIG, a lost GPU) must not kill sampling
                util = used = None
        cpu = self._me.cpu_percent(None)
        for pid, child in list(self._children.items()):
            try:
                cpu += child.cpu_percent(None)
            except psutil.Error:
                del self._children[pid]
        return Sample(time.perf_counter() - self.t0, util, used, cpu, psutil.cpu_percent(None))


def _batch_size(batch: object, depth: int = 0) -> int | None:
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else None
    if depth >= 2:
        return None
    if isinstance(batch, (list, tuple)) and batch:
        return _batch_size(batch[0], depth + 1)
    if isinstance(batch, Mapping) and batch:
        return _batch_size(next(iter(batch.values())), depth + 1)
    return None


class Watch:
    """Times a training loop and samples GPU and CPU use; see :func:`watch`."""

    def __init__(
        self,
        *,
        device: str | torch.device | None = None,
        interval: float = 0.1,
        warmup_steps: int = 2,
    ) -> None:
        if not interval > 0:
            raise ValueError(f"interval must be > 0 seconds, got {interval!r}")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an int >= 0, got {warmup_steps!r}")
        dev = None
        if device is not None:
            try:
                dev = torch.device(device)
            except (RuntimeError, TypeError) as e:
                raise ValueError(
                    f"device must be 'cpu', 'cuda' or 'cuda:<i>', got {device!r}"
                ) from e
            if dev.type not in ("cpu", "cuda"):
                raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:<i>', got {device!r}")
        self._device = dev
        self._interval = interval
        self._warmup = warmup_steps
        self._state = "new"
        self._t0 = 0.0
        self._ends = array("d")
        self._waits = array("d")
        self._counts = array("q")
        self._pending_wait = 0.0
        self._pending_count = 0
        self._count_known = True
        self._sampler: _Sampler | None = None
        self._cpus = 1
        # CUDA events: (step index, event at the step's first batch, event at its end).
        self._cuda = False
        self._stream: Any = None
        self._step_start: Any = None
        self._pending: deque[tuple[int, Any, Any]] = deque()
        self._gpu_busy: dict[int, float] = {}

    def __enter__(self) -> Watch:
        if self._state != "new":
            raise RuntimeError("a Watch can be entered once; make a new one with trainperf.watch()")
        self._state = "running"
        self._cpus = usable_cpus()
        want_gpu = self._device is None or self._device.type == "cuda"
        self._sampler = _Sampler(self._interval, time.perf_counter(), gpu=want_gpu)
        self._sampler.start()
        self._sampler.ready.wait(timeout=10)
        self._maybe_start_cuda()
        # The clock starts once the sampler is up (NVML start-up is not the loop's time); the
        # sampler's first sample comes an interval later, so moving its origin is safe.
        self._t0 = self._sampler.t0 = time.perf_counter()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._state = "done"
        if self._sampler is not None:
            self._sampler.stop()

    def _maybe_start_cuda(self) -> None:
        # Never initialise CUDA ourselves: only follow a loop that already uses it.
        if self._device is not None and self._device.type == "cpu":
            return
        if not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            return
        index = self._device.index if self._device is not None else None
        if index is None:
            index = torch.cuda.current_device()
        self._stream = torch.cuda.current_stream(index)
        self._cuda = True
        if self._sampler is not None:
            self._sampler.device_index = index

    def iter(self, iterable: Iterable[T]) -> Iterator[T]:
        """Yield from ``iterable``, timing the wait for each item.

        Raises:
            RuntimeError: the watch is not running (use it inside ``with``).
        """
        if self._state != "running":
            raise RuntimeError(
                "w.iter() needs a running watch: use it inside `with trainperf.watch() as w:`"
            )
        return self._iterate(iter(iterable))

    def _iterate(self, it: Iterator[T]) -> Iterator[T]:
        clock = time.perf_counter
        while True:
            t = clock()
            try:
                item = next(it)
            except StopIteration:
                self._pending_wait += clock() - t
                return
            self._pending_wait += clock() - t
            n = _batch_size(item)
            if n is None:
                self._count_known = False
            else:
                self._pending_count += n
            if self._cuda and self._step_start is None:
                self._step_start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                self._step_start.record(self._stream)
            yield item

    def step(self, samples: int | None = None) -> None:
        """Mark the end of a training step.

        Args:
            samples: samples in this step, overriding what ``w.iter`` counted.

        Raises:
            RuntimeError: the watch is not running (use it inside ``with``).
            ValueError: ``samples`` is not an int >= 0.
        """
        now = time.perf_counter()
        if self._state != "running":
            raise RuntimeError(
                "w.step() needs a running watch: call it inside `with trainperf.watch() as w:`"
            )
        if samples is not None and (
            isinstance(samples, bool) or not isinstance(samples, int) or samples < 0
        ):
            raise ValueError(f"samples must be an int >= 0 or None, got {samples!r}")
        self._ends.append(now - self._t0)
        self._waits.append(self._pending_wait)
        if samples is not None:
            self._counts.append(samples)
        else:
            self._counts.append(self._pending_count if self._count_known else -1)
        self._pending_wait = 0.0
        self._pending_count = 0
        self._count_known = True
        if not self._cuda:
            self._maybe_start_cuda()
            if not self._cuda:
                return
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end.record(self._stream)
        self._pending.append((len(self._ends) - 1, self._step_start, end))
        self._step_start = None
        if len(self._ends) % _RESOLVE_EVERY == 0:
            self._resolve(block=False)

    def _resolve(self, *, block: bool) -> None:
        if block and self._pending:
            self._pending[-1][2].synchronize()
        while self._pending and self._pending[0][2].query():
            index, start, end = self._pending.popleft()
            if start is not None:
                self._gpu_busy[index] = start.elapsed_time(end) / 1e3

    def report(self) -> WatchReport:
        """The verdict so far (inside the ``with``) or on the whole loop (after it).

        Returns:
            A :class:`WatchReport`; ``print`` it, or ``.plot(path)`` for a timeline PNG.

        Raises:
            RuntimeError: the watch was never entered.
        """
        if self._state == "new":
            raise RuntimeError(
                "w.report() needs a watch that ran: use `with trainperf.watch() as w:`"
            )
        if self._cuda:
            self._resolve(block=True)
        timeline = []
        previous = 0.0
        steps = zip(self._ends, self._waits, self._counts, strict=True)
        for i, (end, wait_s, count) in enumerate(steps):
            duration = end - previous
            timeline.append(
                StepRecord(
                    index=i,
                    start=previous,
                    wait=min(wait_s, duration),
                    compute=max(0.0, duration - wait_s),
                    samples=None if count < 0 else count,
                    gpu_busy=self._gpu_busy.get(i),
                )
            )
            previous = end
        sampler = self._sampler
        if self._device is not None:
            device = str(self._device)
        else:
            device = (
                f"cuda:{sampler.device_index}"
                if sampler and sampler.device_index is not None
                else "auto"
            )
        return analyse(
            timeline,
            list(sampler.samples) if sampler else [],
            device=device,
            gpu_present=bool(sampler and sampler.gpu_present),
            cuda_used=self._cuda,
            cpus=self._cpus,
            warmup_steps=self._warmup,
        )


def watch(
    *,
    device: str | torch.device | None = None,
    interval: float = 0.1,
    warmup_steps: int = 2,
) -> Watch:
    """Watch a training loop and say what limits it: data, compute, the host, or stalls.

    Args:
        device: ``"cpu"`` for a CPU loop (no GPU is looked at), ``"cuda[:i]"`` for a GPU
            loop, or None to follow whatever the loop uses (CUDA once it is initialised).
            The watch never initialises CUDA itself.
        interval: seconds between background samples of GPU and CPU use.
        warmup_steps: leading steps left out of the verdict (loader start-up, autotuning).

    Returns:
        A :class:`Watch` to use as a context manager.

    Raises:
        ValueError: ``interval`` <= 0, ``warmup_steps`` < 0 or an invalid ``device``.

    Example:
        >>> import time
        >>> with watch(device="cpu") as w:
        ...     for batch in w.iter([torch.zeros(8, 3)] * 10):
        ...         time.sleep(0.002)
        ...         w.step()
        >>> r = w.report()
        >>> r.steps, r.verdict.kind in ("compute-bound", "input-bound", "periodic-stalls")
        (10, True)
    """
    return Watch(device=device, interval=interval, warmup_steps=warmup_steps)
