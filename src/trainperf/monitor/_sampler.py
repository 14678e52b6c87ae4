"""The background sampler of ``trainperf.watch``: GPU use (NVML) and CPU use (psutil).

One daemon thread per watch keeps one NVML session open and samples every ``interval``
seconds; it keeps the most recent ``max_samples`` samples and counts the ones it dropped.
The process CPU it samples is the whole process's: a sampler started while another runs
warns, and marks both ``shared`` (their reports say the CPU figures cover both loops).
"""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
import weakref
from collections import deque
from pathlib import Path
from typing import Any

import psutil
import torch

from trainperf._utils.stack import user_stacklevel
from trainperf._utils.steal import StealMeter
from trainperf.errors import DeviceError
from trainperf.monitor._records import Sample

__all__ = ["MAX_RECORDS"]

MAX_RECORDS = 100_000  # steps, and background samples, a watch keeps by default
# Samples between reads of this process's children: DataLoader workers start when the loop
# first iterates, and their CPU (the predictions' per-worker cost) counts from the next read.
_REFRESH_EVERY = 5
SHARED_CPU = (
    "two trainperf.watch() run at once in this process, and the process CPU each samples "
    "(psutil's, for the whole process) covers both loops: a CPU-based verdict (host-bound) "
    "may be the other loop's doing; watch one loop at a time for CPU figures of its own"
)
_running: weakref.WeakSet[_Sampler] = weakref.WeakSet()  # samplers started, not stopped
_running_lock = threading.Lock()


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

    def __init__(
        self, interval: float, t0: float, gpu: bool, max_samples: int = MAX_RECORDS
    ) -> None:
        super().__init__(name="trainperf-watch-sampler", daemon=True)
        self.interval = interval
        self.t0 = t0
        self.gpu = gpu
        self.gpu_present = False
        self.device_index: int | None = None  # set by the watching thread once CUDA is in use
        # The most recent samples only; the watching thread copies them under the lock.
        self.samples: deque[Sample] = deque(maxlen=max_samples)
        self.dropped = 0
        self.shared = False  # another sampler ran in this process meanwhile (see start)
        self._lock = threading.Lock()
        self.ready = threading.Event()
        # Set once the watch has moved t0 to after start-up: no sample is timed from the
        # old origin (a sample from before would look later than the ones after it).
        self.go = threading.Event()
        self._stop_event = threading.Event()
        self._nvml: Any = None
        self._handle: Any = None
        self._handle_tried = False
        self._me = psutil.Process()
        self._steal: StealMeter | None = None
        self._children: dict[int, psutil.Process] = {}

    def start(self) -> None:
        """Start sampling; with another sampler running in this process, warn and mark both
        ``shared``: each one's process CPU then includes the other loop's."""
        with _running_lock:
            others = [s for s in _running if not s._stop_event.is_set()]
            _running.add(self)
            for sampler in [*others, self] if others else []:
                sampler.shared = True
        if others:
            warnings.warn(SHARED_CPU, RuntimeWarning, stacklevel=user_stacklevel())
        super().start()

    def request_stop(self) -> None:
        """Ask the thread to end, without waiting for it (a dropped watch's finaliser)."""
        self._stop_event.set()
        self.go.set()

    def stop(self) -> None:
        """Ask the thread to end and wait for it (10 s at most); a thread that never
        started (``start()`` failed: the OS had no thread to give) has nothing to wait for."""
        self.request_stop()
        if self.ident is None:  # joining it would raise a second RuntimeError over the first
            return
        # Bounded: a hung driver call must not hang the training script's exit with it.
        self.join(timeout=10)

    def snapshot(self) -> tuple[list[Sample], int]:
        """The samples kept, and how many older ones were dropped."""
        with self._lock:
            return list(self.samples), self.dropped

    def run(self) -> None:
        # The NVML session stays open while the thread samples: one init, cheap queries.
        with contextlib.ExitStack() as stack:
            try:
                self._me.cpu_percent(None)
                psutil.cpu_percent(None)
                self._steal = StealMeter()
                if self.gpu:
                    self._start_nvml(stack)
            finally:
                self.ready.set()
            self.go.wait(timeout=10)
            tick = 0
            while not self._stop_event.wait(self.interval):
                if tick % _REFRESH_EVERY == 0:  # workers come and go: /proc is read again
                    self._refresh_children()
                tick += 1
                try:
                    sample = self._sample()
                except Exception:  # a failed sample is a gap in the plot, not a crash
                    continue
                with self._lock:
                    if len(self.samples) == self.samples.maxlen:
                        self.dropped += 1
                    self.samples.append(sample)

    def _start_nvml(self, stack: contextlib.ExitStack) -> None:
        from trainperf.device import _inventory

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # "no NVML": the report says so
            try:
                self.gpu_present = bool(_inventory.gpus())
            except Exception:  # a broken NVML must not break the training loop
                self.gpu_present = False
        if self.gpu_present:
            try:
                self._nvml = stack.enter_context(_inventory.nvml_session("sampling GPU use"))
            except DeviceError:
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
        # Clamped at 0: a PID reused since the last read has psutil subtract the old
        # process's CPU times from the newcomer's, and a negative figure is no one's use.
        own = max(0.0, self._me.cpu_percent(None))
        workers = 0.0
        for pid, child in list(self._children.items()):
            try:
                workers += max(0.0, child.cpu_percent(None))
            except psutil.Error:
                del self._children[pid]
        stolen = None if self._steal is None else self._steal.share()
        return Sample(
            time.perf_counter() - self.t0, util, used, own + workers, psutil.cpu_percent(None),
            workers, None if stolen is None else 100 * stolen,
        )  # fmt: skip
