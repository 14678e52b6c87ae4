"""trainperf.watch (``monitor/_watch.py`` and its ``_watch_*`` modules): the Watch class on
synthetic and GPU loops."""

from __future__ import annotations

import gc
import importlib
import itertools
import math
import os
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from tests.monitor._fakes import burn, cpu_work, sampler_threads, sleepy_loader
from trainperf.errors import DeviceError
from trainperf.monitor import Watch, WatchReport, watch

# --------------------------------------------------------------------------- synthetic loops


def test_a_loader_that_sleeps_is_input_bound() -> None:
    with watch(device="cpu") as w:
        for _ in w.iter(sleepy_loader(30, 0.015)):
            burn(0.002)
            w.step()
    report = w.report()
    assert report.verdict.kind == "input-bound", report
    assert report.wait_fraction is not None and report.wait_fraction > 0.5
    assert "autotune_loader" in report.verdict.fix
    assert report.steps == 30 and report.warmup_steps == 2
    assert report.samples_per_s is not None and report.samples_per_s > 0
    # Loading in the loop's thread: the hand-over to workers was measured for the prediction.
    assert report.setup.batches_per_step == 1.0
    if os.path.exists("/proc/self/schedstat"):
        assert report.setup.handover_receive_s is not None
        assert "measured by a one-worker probe" in report.verdict.fixes[0].basis


def test_a_report_inside_the_loop_does_not_run_the_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    # The probe takes about a second: inside the loop it would land in the loop's step.
    from trainperf.monitor import _handover

    monkeypatch.setattr(_handover, "_CACHE", {})
    probed: list[float] = []
    real = _handover._probe

    def spy(layout: tuple[int, ...], batch: int, pause_s: float = 0.0) -> object:
        probed.append(pause_s)
        return real(layout, batch, pause_s)

    monkeypatch.setattr(_handover, "_probe", spy)
    with watch(device="cpu") as w:
        for i, _ in enumerate(w.iter(sleepy_loader(12, 0.01))):
            burn(0.002)
            w.step()
            if i == 8:
                inside = w.report()
    assert inside.setup.handover_receive_s is None and not probed
    after = w.report()
    assert len(probed) == (1 if _handover._can_fork_a_worker() else 0)
    assert (after.setup.handover_receive_s is not None) == bool(probed)
    if probed:  # it paused before each receive for the loop's own 2 ms between batches
        assert 0.0015 <= probed[0] <= 0.01


def test_a_step_that_burns_cpu_is_compute_bound() -> None:
    batches = [torch.zeros(8, 4)] * 30  # ready at once: no wait
    with watch(device="cpu") as w:
        for _ in w.iter(batches):
            burn(0.01)
            w.step()
    report = w.report()
    assert report.wait_fraction is not None and report.wait_fraction < 0.1
    if _held_by_others(report):  # other jobs on this machine: that, not compute, is the verdict
        return
    assert report.verdict.kind == "compute-bound", report
    assert "MixedPrecision" in report.verdict.fix
    assert "on the CPU" in report.verdict.summary
    assert "data arrives in time" in report.verdict.summary  # measured, so it may say so


def _held_by_others(report: WatchReport) -> bool:
    """The verdict is that other processes hold the CPUs, and the samples show it."""
    if not report.verdict.summary.startswith("other processes hold the host's CPUs"):
        return False
    assert report.host_cpu_mean is not None and report.host_cpu_mean >= 90, report
    return True


def test_a_data_wait_outside_w_iter_is_not_called_data_arriving_in_time() -> None:
    # 80 % of each step waits for data, but before w.step() and without w.iter(): the watch
    # cannot see the wait, and must say so rather than call the loop compute-bound.
    with watch(device="cpu") as w:
        for _ in range(30):
            time.sleep(0.008)  # the data wait
            burn(0.002)  # the step
            w.step(samples=16)
    report = w.report()
    assert report.wait_fraction is None
    assert "data arrives in time" not in report.verdict.summary, report
    assert report.verdict.kind in ("compute-bound", "host-bound"), report
    text = str(report)
    assert "data wait not measured (wrap the loader: w.iter(loader))" in text
    if not _held_by_others(report):
        assert "data waiting was not measured" in report.verdict.summary
        assert report.verdict.fix.startswith("measure the data wait first")


@dataclass
class _StandInPrecision:
    """What watch reads of a live ``trainperf.amp.MixedPrecision``: its dtype and reason."""

    dtype: torch.dtype
    reason: str


def _compute_bound_loop() -> WatchReport:
    with watch(device="cpu") as w:
        for _ in w.iter([torch.zeros(8, 4)] * 20):
            burn(0.005)
            w.step()
    return w.report()


def test_watch_does_not_advise_the_mixed_precision_already_in_use(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from trainperf.monitor._watch_report import _precision_in_use

    amp = sys.modules["trainperf.amp._mixed"]
    why = "auto: the CPU has no native bf16 (emulated bf16 is slower) -> fp32"
    # The registry amp keeps of its live MixedPrecision objects (a WeakSet): a stand-in.
    monkeypatch.setattr(amp, "LIVE", [_StandInPrecision(torch.float32, why)])
    assert _precision_in_use() == ("fp32", why)
    report = _compute_bound_loop()
    if not _held_by_others(report):
        assert report.verdict.kind == "compute-bound", report
        assert f"MixedPrecision is in use and chose fp32 ({why})" in report.verdict.fix
        assert "autocast" not in report.verdict.fix
    both = [_StandInPrecision(torch.float32, why), _StandInPrecision(torch.bfloat16, "bf16!")]
    monkeypatch.setattr(amp, "LIVE", both)
    assert _precision_in_use() == ("bf16", "bf16!")
    report = _compute_bound_loop()
    if not _held_by_others(report):
        assert "already runs in bf16 (trainperf.amp.MixedPrecision: bf16!)" in report.verdict.fix
    monkeypatch.setattr(amp, "LIVE", [object()])  # not a MixedPrecision: ignored
    assert _precision_in_use() is None
    report = _compute_bound_loop()
    if not _held_by_others(report):
        assert "bf16/fp16 autocast (trainperf.amp.MixedPrecision)" in report.verdict.fix


def test_watch_sees_a_real_mixed_precision() -> None:
    from trainperf.amp import _mixed
    from trainperf.monitor._watch_report import _precision_in_use

    mp = _mixed.MixedPrecision("cpu", precision="fp32")
    # What the report hands to the rules, whatever else the host is doing.
    assert _precision_in_use() == ("fp32", mp.reason)
    report = _compute_bound_loop()
    if not _held_by_others(report):
        assert f"chose fp32 ({mp.reason})" in report.verdict.fix, report


@pytest.mark.slow
def test_a_stall_every_tenth_step_is_found_with_its_period(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # On the watch's own clock, and with no CPU samples (an interval longer than the loop):
    # on a busy host, real sleeps overran and other processes' load made the verdict theirs.
    import trainperf.monitor._watch as watch_module
    import trainperf.monitor._watch_iter as iter_module
    import trainperf.monitor._watch_steps as steps_module

    clock = [1000.0]
    for module in (watch_module, iter_module, steps_module):
        monkeypatch.setattr(module, "time", _clock_module(lambda: clock[0]))
    with watch(device="cpu", interval=3600) as w:
        for i, _ in enumerate(w.iter([torch.zeros(4)] * 50)):
            clock[0] += 0.08 if i % 10 == 9 else 0.005
            w.step()
    report = w.report()
    assert report.samples == ()
    assert report.verdict.kind == "periodic-stalls", report
    assert report.stall_period == 10
    assert report.stall_steps == (9, 19, 29, 39, 49)
    assert "save_checkpoint" in report.verdict.fix
    assert "every 10 steps" in report.verdict.summary


def test_watch_does_not_initialise_cuda() -> None:
    was = torch.cuda.is_initialized()
    with watch() as w:
        for _ in w.iter([torch.zeros(2)] * 6):
            w.step()
    assert torch.cuda.is_initialized() == was
    if not was:
        assert w.report().device == "auto"


def test_samples_are_counted_from_batches_or_given() -> None:
    batches = [{"x": torch.zeros(5, 2), "y": torch.zeros(5)}, (torch.zeros(3), 1), "opaque"]
    with watch(device="cpu") as w:
        for _ in w.iter(batches):
            w.step()
        w.step(samples=7)
        with pytest.raises(ValueError, match="samples must be an int >= 0"):
            w.step(samples=-1)
    counts = [s.samples for s in w.report().timeline]
    assert counts == [5, 3, None, 7]


def test_per_sample_numpy_batches_are_counted_by_their_samples() -> None:
    # Before: 224 each, the images' height. collate_fn=list, then detection's collate.
    per_sample = [(np.zeros((224, 224, 3), np.uint8), 1) for _ in range(8)]
    with watch(device="cpu") as w:
        for _ in w.iter([per_sample, tuple(zip(*per_sample, strict=True))]):
            w.step()
    assert [s.samples for s in w.report().timeline] == [8, 8]


@pytest.mark.parametrize(
    ("count", "match"),
    [
        (32.5, r"samples must be an int >= 0, got 32\.5$"),
        (True, r"samples must be an int >= 0, got True$"),
        (32.0, r"got 32\.0 \(pass int\(samples\)\)"),
        (torch.tensor(32), r"got tensor\(32\) \(pass int\(samples\)\)"),
    ],
    ids=["fraction", "bool", "float", "tensor"],
)
def test_a_sample_count_that_is_no_int_is_refused_with_the_fix(count: object, match: str) -> None:
    # A tensor is not read for the caller: .item() on a CUDA one would wait for the GPU
    # inside the loop being timed.
    with watch(device="cpu") as w:
        with pytest.raises(ValueError, match=match):
            w.step(samples=count)  # type: ignore[arg-type]
        w.step(samples=3)
    assert [(s.samples, type(s.samples)) for s in w.report().timeline] == [(3, int)]


class _Items(torch.utils.data.Dataset[torch.Tensor]):
    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, n: int) -> None:
        self.item, self.n = torch.zeros(shape, dtype=dtype), n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.item


@pytest.mark.parametrize(
    ("shape", "dtype", "per_batch"),
    [((224, 224, 3), torch.uint8, 8), ((3, 16, 16), torch.float32, 8), ((512,), torch.long, 4)],
    ids=["hwc-images", "chw-images", "token-ids"],
)
def test_a_loaders_list_of_per_sample_tensors_is_counted_by_its_samples(
    shape: tuple[int, ...], dtype: torch.dtype, per_batch: int
) -> None:
    # Before: 224, 3 and 512 a batch, the tensors' shared leading size, read as fields.
    loader = DataLoader(_Items(shape, dtype, 2 * per_batch), batch_size=per_batch, collate_fn=list)
    with watch(device="cpu") as w:
        for _ in w.iter(loader):
            w.step()
    assert [s.samples for s in w.report().timeline] == [per_batch, per_batch]


@pytest.mark.parametrize(
    ("shape", "dtype", "per_batch"),
    [((224, 224, 3), torch.uint8, 8), ((3, 16, 16), torch.float32, 8), ((512,), torch.long, 4)],
    ids=["hwc-images", "chw-images", "token-ids"],
)
def test_a_short_last_batch_of_per_sample_tensors_is_counted_by_its_samples(
    shape: tuple[int, ...], dtype: torch.dtype, per_batch: int
) -> None:
    # Before: the last batch read as its tensors' shared leading size (224, 3, 512), as
    # if they were the batch's fields, though the full batches before it were per-sample.
    last = per_batch - 1
    items = _Items(shape, dtype, 2 * per_batch + last)
    loader = DataLoader(items, batch_size=per_batch, collate_fn=list)
    with watch(device="cpu") as w:
        for _ in range(2):  # a second epoch reads its last batch the same way
            for _ in w.iter(loader):
                w.step()
    assert [s.samples for s in w.report().timeline] == [per_batch, per_batch, last] * 2


def test_a_sample_count_too_large_to_record_is_refused_and_the_log_stays_whole() -> None:
    with watch(device="cpu") as w:
        w.step(samples=2**63 - 1)
        with pytest.raises(ValueError, match=r"samples=9223372036854775808 is more than a step"):
            w.step(samples=2**63)
        w.step(samples=1)
    assert [s.samples for s in w.report().timeline] == [2**63 - 1, 1]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"interval": 0}, "interval must be a positive number of seconds, got 0"),
        ({"interval": float("inf")}, "interval must be a positive number of seconds, got inf"),
        ({"interval": float("nan")}, "interval must be a positive number of seconds, got nan"),
        ({"interval": -1}, "interval must be a positive number of seconds, got -1"),
        ({"interval": True}, "interval must be a positive number of seconds, got True"),
        ({"interval": 1e300}, r"interval=1e\+300 s is longer than a timer can wait \(at most "),
        # Before: accepted, and the sampler thread sampled back to back beside the loop.
        ({"interval": 1e-12}, r"interval=1e-12 s is shorter than the sampler allows \(at least "),
        ({"interval": 0.009}, r"interval=0\.009 s is shorter .* pass 0\.01 or more, e\.g\. 0\.1"),
        ({"warmup_steps": -1}, "warmup_steps must be an int >= 0"),
        ({"device": "tpu"}, "invalid device 'tpu': expected 'cpu', 'cuda'"),
        ({"device": "meta"}, "device 'meta' is not supported here: expected 'cpu', 'cuda'"),
        ({"max_records": 0}, "max_records must be an int >= 1"),
        ({"max_records": 2.5}, "max_records must be an int >= 1"),
        ({"max_records": 2**63}, r"max_records=9223372036854775808 is more than a watch can keep"),
    ],
)
def test_watch_rejects_bad_arguments(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        watch(**kwargs)  # type: ignore[arg-type]


def test_watch_checks_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(TypeError, match=r"device must be a str, int or torch\.device, got 1\.5"):
        watch(device=1.5)  # type: ignore[arg-type]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DeviceError, match=r"device 'cuda' needs CUDA.*use device='cpu' instead"):
        watch(device="cuda")


def test_a_long_run_keeps_only_the_most_recent_steps() -> None:
    with watch(device="cpu", warmup_steps=2, max_records=4) as w:
        for i in range(11):
            w.step(samples=i)
            assert len(w._ends) < 8  # never more than 2 x max_records held
        inside = w.report()
    assert inside.steps == 11 and inside.dropped_steps == 7
    assert [s.index for s in inside.timeline] == [7, 8, 9, 10]
    assert [s.samples for s in inside.timeline] == [7, 8, 9, 10]
    # The first kept step starts where the last dropped one ended, not at 0.
    assert inside.timeline[0].start > 0
    assert inside.timeline[0].start + inside.timeline[0].duration == pytest.approx(
        inside.timeline[1].start
    )
    assert inside.warmup_steps == 2 and "figures over the last 4" in str(inside)
    assert inside.to_dict()["dropped_steps"] == 7


def test_using_a_watch_outside_its_with_block_is_an_error() -> None:
    w = Watch(device="cpu")
    with pytest.raises(RuntimeError, match="needs a watch that ran"):
        w.report()
    with pytest.raises(RuntimeError, match=r"w\.step\(\) needs a running watch"):
        w.step()
    with pytest.raises(RuntimeError, match=r"w\.iter\(\) needs a running watch"):
        w.iter([1])
    with w:
        w.step()
    with pytest.raises(RuntimeError, match="entered once"), w:
        pass
    with pytest.raises(RuntimeError, match=r"w\.step\(\) needs a running watch"):
        w.step()
    assert w.report().steps == 1


def test_watch_is_only_the_function() -> None:
    import trainperf

    assert trainperf.watch is watch and callable(watch)
    with pytest.raises(ModuleNotFoundError, match=r"trainperf\.watch"):
        importlib.import_module("trainperf.watch")


# --------------------------------------------------------------------------- start / stop


def _input_bound_loop(w: Watch) -> None:
    for _ in w.iter(sleepy_loader(20, 0.015)):
        burn(0.002)
        w.step()


@pytest.mark.slow
def test_start_and_stop_give_the_report_a_with_block_gives() -> None:
    before = sampler_threads()
    w = watch(device="cpu")
    assert w.start() is w
    assert len(sampler_threads()) == len(before) + 1
    _input_bound_loop(w)
    stopped = w.stop()
    assert sampler_threads() == before  # stop() ends the sampler thread
    with watch(device="cpu") as block:
        _input_bound_loop(block)
    in_block = block.report()
    assert isinstance(stopped, WatchReport)
    assert stopped.verdict.kind == in_block.verdict.kind == "input-bound", (stopped, in_block)
    assert stopped.steps == in_block.steps == 20
    assert stopped.to_dict().keys() == in_block.to_dict().keys()
    assert w.report().steps == 20  # report() stays available after stop()
    with pytest.raises(RuntimeError, match=r"w\.step\(\) needs a running watch"):
        w.step()


def test_start_and_stop_in_the_wrong_order_are_errors() -> None:
    before = sampler_threads()
    w = watch(device="cpu")
    with pytest.raises(RuntimeError, match=r"w\.stop\(\) before w\.start\(\): call w\.start"):
        w.stop()
    w.start()
    with pytest.raises(RuntimeError, match=r"w\.start\(\) on a watch that is already running"):
        w.start()
    with pytest.raises(RuntimeError, match=r"already started: use either `with"), w:
        pass
    w.step()
    w.stop()
    with pytest.raises(RuntimeError, match=r"w\.stop\(\) on a watch that already stopped"):
        w.stop()
    with pytest.raises(RuntimeError, match=r"w\.start\(\) on a watch that already ran"):
        w.start()
    with watch(device="cpu") as block:
        pass
    with pytest.raises(RuntimeError, match=r"w\.stop\(\) on a watch that already stopped"):
        block.stop()
    assert sampler_threads() == before


def test_stop_inside_a_with_block_ends_the_watch_there() -> None:
    before = sampler_threads()
    with watch(device="cpu") as w:
        w.step()
        report = w.stop()
        assert sampler_threads() == before
    assert report.steps == w.report().steps == 1


class _Broken(Exception):
    """What a monkeypatched step of the watch's start or end raises."""


def _broken(*args: object) -> None:
    raise _Broken("stand-in failure")


@pytest.mark.parametrize("fails", ["settle", "_background_saves"])
def test_a_failure_while_stopping_still_stops_the_sampler_thread(
    monkeypatch: pytest.MonkeyPatch, fails: str
) -> None:
    # Before: the sampler was stopped last, so an error before it (counting background saves,
    # settling the CPU figures) left the thread sampling while the watch stayed referenced.
    import trainperf.monitor._watch as watch_module

    before = sampler_threads()
    w = watch(device="cpu", interval=0.01).start()
    (thread,) = set(sampler_threads()) - set(before)
    w.step()
    monkeypatch.setattr(watch_module, fails, _broken)
    with pytest.raises(_Broken, match="stand-in failure"):
        w.stop()
    assert not thread.is_alive()
    with pytest.raises(RuntimeError, match=r"already stopped"):
        w.stop()


def test_a_failure_while_starting_stops_the_sampler_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: an error (or a Ctrl-C) after the sampler started left it running with the
    # watch marked running, and the next watch warned that two ran at once.
    before = sampler_threads()
    w = watch(device="cpu", interval=0.01)
    monkeypatch.setattr(w, "_maybe_start_cuda", _broken)
    with pytest.raises(_Broken, match="stand-in failure"), w:
        pass
    assert sampler_threads() == before
    with pytest.raises(RuntimeError, match=r"w\.start\(\) on a watch that already ran"):
        w.start()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no other watch runs: no "two at once" warning
        with watch(device="cpu"):
            pass


def test_a_sampler_thread_the_os_cannot_start_raises_its_own_error_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before: stopping the sampler joined a thread that never started, and that second
    # RuntimeError ("cannot join thread before it is started") hid the OS's.
    def no_thread(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    w = watch(device="cpu")
    with monkeypatch.context() as patched:
        patched.setattr(threading.Thread, "start", no_thread)
        with pytest.raises(RuntimeError, match="can't start new thread") as raised:
            w.start()
    assert raised.value.__context__ is None  # nothing raised while handling it
    with pytest.raises(RuntimeError, match=r"w\.start\(\) on a watch that already ran"):
        w.start()


def test_leaving_a_with_block_after_stop_keeps_what_stop_counted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before: `with` ended the watch a second time on exit, recounting the background saves
    # after stop()'s report (whose save probe makes some): the loop was said to make them.
    import trainperf.monitor._watch as watch_module
    import trainperf.monitor._watch_inputs as inputs_module

    saves = [1]  # one made before the watch started
    monkeypatch.setattr(watch_module, "_background_saves", lambda: saves[0])
    monkeypatch.setattr(inputs_module, "background_saves", lambda: saves[0])
    with watch(device="cpu") as w:
        w.step()
        saves[0] = 3  # the loop's own two
        w.stop()
        saves[0] = 7  # saves made after the loop, by the report's probe
    assert w.report().setup.background_saves == 2


def test_a_started_watch_that_is_dropped_stops_its_thread() -> None:
    before = sampler_threads()
    w = watch(device="cpu", interval=0.01)
    w.start()
    (thread,) = set(sampler_threads()) - set(before)
    del w
    gc.collect()
    thread.join(timeout=5)
    assert not thread.is_alive()


# --------------------------------------------------------------------------- CUDA


@pytest.mark.slow  # at least 1.5 s of GPU work, plus CUDA's start-up
@pytest.mark.requires_cuda
def test_a_gpu_loop_is_timed_with_cuda_events() -> None:
    x = torch.randn(4096, 4096, device="cuda")
    # At least 1.5 s of GPU work, each step waited for (loss.item() in a real loop does the
    # same), so the host's loop lasts as long as the GPU's and NVML (averaged over up to a
    # second) samples the work itself.
    end = time.perf_counter() + 1.5
    with watch(interval=0.02) as w:
        for batch in w.iter(itertools.repeat(x)):
            for _ in range(4):
                batch = batch @ x
            torch.cuda.synchronize()
            w.step()
            if time.perf_counter() > end:
                break
    report = w.report()
    assert report.device == f"cuda:{torch.cuda.current_device()}"
    assert all(s.gpu_busy is not None and s.gpu_busy > 0 for s in report.timeline)
    assert report.gpu_busy_fraction is not None and report.gpu_busy_fraction > 0.5
    assert report.verdict.kind == "compute-bound", report


@pytest.mark.slow  # sleeps 1.1 s, then 250 steps of 5 ms: at least 2.35 s
@pytest.mark.requires_cuda
def test_a_cpu_loop_on_a_gpu_machine_leaves_the_gpu_unused() -> None:
    torch.zeros(1, device="cuda")  # CUDA is up, but the loop never touches the GPU
    # NVML averages over up to a second: let earlier GPU work (other tests) age out of it.
    # (NVML counts the whole device, so another process using this GPU would fail this test.)
    torch.cuda.synchronize()
    time.sleep(1.1)
    with watch(interval=0.02) as w:
        for _ in w.iter([torch.zeros(8)] * 250):  # 250 x 5 ms: over NVML's second
            burn(0.005)
            w.step()
    report = w.report()
    # The idle stream's events span the host time of each step: the span alone says ~100 %.
    assert report.gpu_busy_fraction is not None and report.gpu_busy_fraction > 0.5
    # NVML's utilisation, sampled through the loop, is what shows the GPU idle.
    assert report.gpu_utilization_mean is not None, "NVML gave no utilisation samples"
    assert report.verdict.kind == "gpu-unused", report


def test_under_ddp_the_watch_judges_cpus_by_this_ranks_share(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from trainperf.limits import usable_cpus
    from trainperf.monitor import _watch

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert _watch._rank_cpus() == usable_cpus(2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "two")
    assert _watch._rank_cpus() == usable_cpus()


# --------------------------------------------------------------------------- what predictions need


def _busy_loader(n: int, seconds: float) -> Iterator[torch.Tensor]:
    for _ in range(n):
        cpu_work(seconds)
        yield torch.zeros(4, 2)


def test_the_watch_tells_loading_that_computes_from_loading_that_waits() -> None:
    reports = {}
    for name, loader in (("sleeps", sleepy_loader(12, 0.02)), ("computes", _busy_loader(12, 0.02))):
        with watch(device="cpu", warmup_steps=0) as w:
            for _ in w.iter(loader):
                w.step()
        reports[name] = w.report()
    cpu = {k: [s.wait_cpu for s in r.timeline] for k, r in reports.items()}
    assert all(c is not None for c in cpu["sleeps"] + cpu["computes"])
    # 20 ms of CPU work demands 20 ms of CPU per step (running or waiting for one);
    # 20 ms of sleep demands little. The kernel adds run time at scheduler ticks, so one
    # step's figure may be a few ms off; their mean is not.
    busy = [c for c in cpu["computes"] if c is not None]
    assert sum(busy) / len(busy) >= 0.017
    assert sum(c for c in cpu["sleeps"] if c is not None) < 0.5 * sum(
        c for c in cpu["computes"] if c is not None
    )
    timeline = reports["computes"].timeline
    delays = [s.cpu_delay for s in timeline]
    if Path("/proc/thread-self/schedstat").exists():
        assert all(d is not None and d >= 0 for d in delays), delays
        # A reading's delay is spread evenly over its steps, so on a busy host one short
        # step's share may pass its own duration; their sum cannot pass the steps' time.
        total = sum(d for d in delays if d is not None)
        assert total <= sum(s.duration for s in timeline) + 1e-3, timeline


def test_the_watch_reads_the_loaders_settings_and_torch_threads() -> None:
    loader = DataLoader(TensorDataset(torch.zeros(32, 2)), batch_size=4)
    with watch(device="cpu") as w:
        for _ in w.iter(loader):
            w.step()
    setup = w.report().setup
    assert (setup.num_workers, setup.batch_size) == (0, 4)
    assert setup.torch_threads == torch.get_num_threads()
    assert setup.gpu_name is None
    with watch(device="cpu") as plain:
        for _ in plain.iter([torch.zeros(2)] * 3):
            plain.step()
    assert plain.report().setup.num_workers is None  # not a DataLoader


def test_the_report_has_the_loaders_settings_as_they_are_now() -> None:
    # An adaptive loader changes its workers while watched (0 -> 2 here, as it would after
    # an input-bound epoch): the report's predictions must start from what runs now.
    loader = DataLoader(TensorDataset(torch.zeros(32, 2)), batch_size=4)
    with watch(device="cpu") as w:
        for _ in w.iter(loader):
            w.step()
        loader.num_workers, loader.prefetch_factor = 2, 3
    setup = w.report().setup
    assert (setup.num_workers, setup.prefetch_factor) == (2, 3)


def test_the_report_has_the_settings_of_the_loader_that_fed_the_steps() -> None:
    # Before: the loader w.iter() was given last, a validation pass at each epoch's end
    # (batch 8), so the predictions started from its settings, not the training loader's.
    train = DataLoader(TensorDataset(torch.zeros(24, 2)), batch_size=4)
    val = DataLoader(TensorDataset(torch.zeros(16, 2)), batch_size=8)
    with watch(device="cpu") as w:
        for _ in w.iter(val):  # a sanity pass before training, too
            pass
        for _ in range(2):
            for _ in w.iter(train):
                w.step()
            for _ in w.iter(val):
                pass
    assert w.report().setup.batch_size == 4
    with watch(device="cpu") as w:  # a loader made anew each epoch: the latest one's
        for n, per_batch in ((24, 4), (12, 2)):
            for _ in w.iter(DataLoader(TensorDataset(torch.zeros(n, 2)), batch_size=per_batch)):
                w.step()
    assert w.report().setup.batch_size == 2


def test_a_pass_that_ends_after_stop_leaves_the_report_as_stop_made_it() -> None:
    # The pass's end after stop() set the steps of an epoch to the steps watched (20 of 50).
    w = watch(device="cpu")
    w.start()
    for i, _ in enumerate(w.iter(list(range(50)))):
        if i < 20:
            w.step()
        if i == 19:
            w.stop()
    assert w.report().setup.steps_per_epoch is None


def test_the_report_knows_the_steps_of_an_epoch_of_the_loader_that_fed_the_loop() -> None:
    # Stalls once that many steps come between epochs (a validation pass, not only a save):
    # the watch counts the steps of a finished pass over the training loader, not the
    # validation loader's one step, nor a pass left by a break before it ended.
    train = DataLoader(TensorDataset(torch.zeros(24, 2)), batch_size=4)  # 6 batches
    val = DataLoader(TensorDataset(torch.zeros(16, 2)), batch_size=8)
    with watch(device="cpu") as w:
        assert w.report().setup.steps_per_epoch is None  # no pass ended yet
        for _ in range(2):
            for _ in w.iter(train):
                w.step()
            for _ in w.iter(val):
                pass
    assert w.report().setup.steps_per_epoch == 6
    with watch(device="cpu") as w:  # two batches a step (gradient accumulation): 3 steps
        for _ in range(2):
            for i, _ in enumerate(w.iter(train)):
                if i % 2:
                    w.step()
    assert w.report().setup.steps_per_epoch == 3
    with watch(device="cpu") as w:  # epochs cut short by a break, then a new pass
        for _ in range(3):
            for i, _ in enumerate(w.iter(train)):
                w.step()
                if i == 3:
                    break
    assert w.report().setup.steps_per_epoch == 4


def test_a_training_loader_made_anew_each_epoch_outranks_a_kept_validation_loader() -> None:
    # Before: ranked by all the steps each iterable fed, a validation loader kept across
    # epochs (one step an epoch) overtook training loaders built anew each epoch (4 steps
    # each) after 4 epochs, and the predictions used its settings (batch 8).
    val = DataLoader(TensorDataset(torch.zeros(16, 2)), batch_size=8)
    trains = [DataLoader(TensorDataset(torch.zeros(16, 2)), batch_size=4) for _ in range(6)]
    with watch(device="cpu") as w:
        for train in trains:  # all alive: no id is reused
            for _ in w.iter(train):
                w.step()
            for _ in w.iter(val):
                pass
    assert w.report().setup.batch_size == 4


def test_an_iterable_whose_id_a_new_one_reuses_leaves_it_nothing() -> None:
    # Before: sources were found by id alone, so a loader built after another was collected
    # could take over its entry (its step count) by reusing its id: a validation loader
    # then counted the training loader's steps. The reuse is made here by moving the dead
    # loader's entry to the new loader's id.
    from trainperf.monitor._watch_iter import note_source

    train = DataLoader(TensorDataset(torch.zeros(24, 2)), batch_size=4)
    with watch(device="cpu") as w:
        for _ in w.iter(train):
            w.step()
        val = DataLoader(TensorDataset(torch.zeros(16, 2)), batch_size=8)
        w._sources[id(val)] = w._sources.pop(id(train))
        del train
        gc.collect()
        note_source(w, val)
        assert w._sources[id(val)].steps == 0 and w._sources[id(val)].facts["batch_size"] == 8


def test_the_hand_over_probe_measures_the_batches_of_the_loader_that_fed_the_steps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before: the first batch w.iter() ever yielded, a sanity validation pass's (batch 2).
    import trainperf.monitor._watch_inputs as inputs

    probed: list[tuple[tuple[int, ...], int]] = []

    def spy(layout: tuple[int, ...], batch: int, **kwargs: Any) -> None:
        probed.append((layout, batch))

    monkeypatch.setattr(inputs, "measure_handover", spy)
    with watch(device="cpu") as w:
        for _ in w.iter([torch.zeros(2, 4)] * 3):  # a sanity pass before training
            pass
        for _ in w.iter(sleepy_loader(12, 0.01)):
            burn(0.002)
            w.step()
    w.report()
    assert probed == [((16 * 4 * 4,), 16)]


def _fake_perf_counter(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Make the watch's ``time.perf_counter()`` read a list the test moves on."""
    import types

    import trainperf.monitor._watch as watch_module
    import trainperf.monitor._watch_steps as steps_module

    clock = [1000.0]
    fake = types.SimpleNamespace(**{k: getattr(time, k) for k in dir(time) if k[0] != "_"})
    fake.perf_counter = lambda: clock[0]
    monkeypatch.setattr(watch_module, "time", fake)
    monkeypatch.setattr(steps_module, "time", fake)
    return clock


class _ScriptedClock:
    """Stands in for the schedstat clock: returns (demand, delay) readings from a script."""

    generation = 1

    def __init__(self, readings: list[tuple[float, float]]) -> None:
        self.readings = list(readings)
        self.calls = 0

    def read(self) -> tuple[float, float]:
        self.calls += 1
        return self.readings.pop(0)

    def close(self) -> None:
        pass


def test_schedstat_is_read_every_16_steps_and_spread_over_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ticks = itertools.count()
    monkeypatch.setattr(time, "thread_time", lambda: next(ticks) * 0.001)  # 1 ms per wait
    clock = _ScriptedClock([
        (1.000, 0.000),  # at the start: run 1.000
        (1.048, 0.016),  # after 16 steps: 32 ms run, 16 ms waiting for a CPU
        (1.056, 0.020),  # at the end, 4 steps later: 4 ms run, 4 ms waiting
    ])  # fmt: skip
    now = _fake_perf_counter(monkeypatch)  # the steps take all the time the readings span
    w = Watch(device="cpu", warmup_steps=0)
    w._clock = clock  # type: ignore[assignment]
    with w:
        for _ in w.iter([torch.zeros(2)] * 20):
            now[0] += 0.002
            w.step()
    assert clock.calls == 3  # not one a step
    steps = w.report().timeline
    assert [s.cpu_delay for s in steps] == pytest.approx([0.001] * 20)
    # Waiting for a CPU half as long as running, then as long: the waits' CPU time (1 ms
    # each) is scaled into demand by 1.5, then by 2.
    assert [s.wait_cpu for s in steps] == pytest.approx([0.0015] * 16 + [0.002] * 4)


def test_waiting_for_a_cpu_while_the_watch_starts_is_no_steps_delay(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before: the first schedstat reading came before the sampler thread started, so the
    # loop's thread's wait for a CPU meanwhile (long on a busy host) was spread over the
    # first steps, and a step could show more delay than it lasted.
    from trainperf.monitor import _sampler

    waited = [0.0]  # the loop's thread's delay so far
    real_start = _sampler._Sampler.start

    def slow_start(self: _sampler._Sampler) -> None:
        waited[0] += 0.05  # 50 ms runnable, waiting for a CPU, while the sampler starts
        real_start(self)

    class _Clock(_ScriptedClock):
        def read(self) -> tuple[float, float]:
            self.calls += 1
            return 1.0 + waited[0], waited[0]

    monkeypatch.setattr(_sampler._Sampler, "start", slow_start)
    w = Watch(device="cpu", warmup_steps=0)
    w._clock = _Clock([])  # type: ignore[assignment]
    with w:
        for _ in range(4):
            w.step(samples=1)
    assert [s.cpu_delay for s in w.report().timeline] == [0.0] * 4


def test_waiting_for_a_cpu_after_the_last_step_is_no_steps_delay(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before: the reading at the watch's end also held what the loop's thread waited for a
    # CPU after its last step (validation or a save inside the `with` block, the loader's
    # shutdown) and spread it over the last steps: 4 steps of 1 ms got 13 ms of delay each,
    # and the report predicted 80x "without the other processes".
    clock = _fake_perf_counter(monkeypatch)
    w = Watch(device="cpu", warmup_steps=0)
    w._clock = _ScriptedClock([  # type: ignore[assignment]
        (1.000, 0.000),  # at the start
        (1.156, 0.052),  # at the end: 104 ms run, 52 ms waiting for a CPU, half the time
    ])  # fmt: skip
    with w:
        for _ in range(4):
            clock[0] += 0.001
            w.step(samples=1)
        clock[0] += 0.1  # 100 ms of work after the loop, inside the block
    steps = w.report().timeline
    assert [s.cpu_delay for s in steps] == pytest.approx([0.0005] * 4)


def test_a_report_made_mid_step_leaves_that_steps_cpu_wait_to_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before: a report made inside the loop, halfway through a step, gave the steps before it
    # their share of the wait and the rest to no step: the half step's 0.5 ms of waiting for
    # a CPU was lost, and the 16 steps' delays summed to 15.5 ms of the 16 ms waited.
    clock = _fake_perf_counter(monkeypatch)
    w = Watch(device="cpu", warmup_steps=0)
    w._clock = _ScriptedClock([  # type: ignore[assignment]
        (1.000, 0.000),  # at the start
        (1.019, 0.0095),  # the report's, 9.5 ms in: every ms waited 1 ms for a CPU
        (1.032, 0.016),  # at the end, right after the 16th step
    ])  # fmt: skip
    with w:
        for i in range(16):
            clock[0] += 0.0005
            if i == 9:
                w.report()  # in step 10, before its w.step()
            clock[0] += 0.0005
            w.step(samples=1)
    steps = w.report().timeline
    assert [s.cpu_delay for s in steps] == pytest.approx([0.001] * 16)


def test_without_schedstat_the_delays_are_unknown_and_the_wait_is_cpu_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    w = Watch(device="cpu", warmup_steps=0, max_records=8)
    w._clock = _ScriptedClock([(0.0, math.nan)] * 10)  # type: ignore[assignment]
    with w:
        for _ in w.iter([torch.zeros(2)] * 40):  # past max_records: old steps are dropped
            w.step()
    steps = w.report().timeline
    assert len(steps) == 8 and all(s.cpu_delay is None for s in steps)
    assert all(s.wait_cpu is not None and s.wait_cpu >= 0 for s in steps)


def test_a_reading_after_old_steps_were_dropped_spreads_over_every_step_it_covers() -> None:
    w = Watch(device="cpu", warmup_steps=0, max_records=4)
    # 16 steps between the readings, 16 ms waiting for a CPU: 1 ms each, though only the
    # last 4 to 8 of those steps are still held when the reading comes.
    w._clock = _ScriptedClock([(1.0, 0.0), (1.048, 0.016)])  # type: ignore[assignment]
    with w:
        for _ in range(16):
            w.step()
    assert [s.cpu_delay for s in w.report().timeline] == pytest.approx([0.001] * 4)


class _OldSequence:
    """Iterable the old way: ``__getitem__`` until IndexError, no ``__iter__``."""

    def __getitem__(self, i: int) -> torch.Tensor:
        if i >= 3:
            raise IndexError(i)
        return torch.zeros(2, 1)


class _NotIterable:
    __iter__ = None  # what Python's data model says for "deliberately not iterable"


@pytest.mark.parametrize(
    ("given", "name"), [(5, "int"), (None, "NoneType"), (_NotIterable(), "_NotIterable")]
)
def test_w_iter_of_something_not_iterable_fails_at_the_call_naming_it(
    given: object, name: str
) -> None:
    # Before: w.iter(5) returned an iterator, and the loop's first next() failed with
    # Python's own "'int' object is not iterable", naming neither w.iter nor the fix.
    with watch(device="cpu") as w:
        with pytest.raises(TypeError, match=rf"w\.iter\(\) needs an iterable .*, got {name}") as e:
            w.iter(given)  # type: ignore[arg-type]
        assert "pass what the loop iterates: `for batch in w.iter(loader):`" in str(e.value)
        assert ("w.iter(range(n))" in str(e.value)) == (name == "int")
        assert len(list(w.iter(_OldSequence()))) == 3  # type: ignore[arg-type]


def test_w_iter_of_the_same_watchs_iterator_is_refused() -> None:
    # Before: accepted, and each batch's wait and samples counted twice in its step.
    with watch(device="cpu") as w:
        batches = w.iter([torch.zeros(4, 2)] * 3)
        with pytest.raises(ValueError, match=r"w\.iter\(\) was given an iterator this watch's"):
            w.iter(batches)
        for _ in batches:
            w.step()
    assert [s.samples for s in w.report().timeline] == [4, 4, 4]


def test_w_iter_of_another_watchs_iterator_is_timed_by_each() -> None:
    shared = pytest.warns(RuntimeWarning, match=r"two trainperf\.watch\(\) run at once")
    with shared, watch(device="cpu") as outer, watch(device="cpu") as inner:
        for _ in outer.iter(inner.iter([torch.zeros(4, 2)] * 2)):
            inner.step()
            outer.step()
    assert [s.samples for s in outer.report().timeline] == [4, 4]
    assert [s.samples for s in inner.report().timeline] == [4, 4]


def test_samples_are_counted_from_numpy_batches_as_from_tensors() -> None:
    # Before: a NumPy batch (alone or in a dict or tuple) counted no samples (None).
    batches = [np.zeros((5, 2)), {"x": np.zeros((3, 1)), "y": np.zeros(3)}, (np.zeros(6), 1)]
    with watch(device="cpu") as w:
        for _ in w.iter(batches):
            w.step()
        for _ in w.iter([np.float32(1.0)]):  # a 0-d array: no first dimension
            w.step()
    assert [s.samples for s in w.report().timeline] == [5, 3, 6, None]


@pytest.mark.parametrize(
    "data",
    [torch.zeros(3, 7), np.zeros((3, 7)), torch.zeros(3), np.zeros(3)],
    ids=["tensor-2d", "array-2d", "tensor-1d", "array-1d"],
)
def test_iterating_a_tensor_or_array_directly_counts_each_row_as_one_sample(data: Any) -> None:
    # Before: each row of a 2-D tensor counted its width (7) as samples, a 1-D one's None.
    with watch(device="cpu") as w:
        for _ in w.iter(data):
            w.step()
    assert [s.samples for s in w.report().timeline] == [1, 1, 1]


def test_iterating_a_3d_tensor_directly_counts_each_batchs_first_dimension() -> None:
    with watch(device="cpu") as w:
        for _ in w.iter(torch.zeros(2, 5, 7)):  # two pre-made batches of 5
            w.step()
    assert [s.samples for s in w.report().timeline] == [5, 5]


def test_w_iter_has_the_loaders_length_for_a_progress_bar() -> None:
    loader = DataLoader(TensorDataset(torch.zeros(10, 2)), batch_size=3)
    with watch(device="cpu") as w:
        batches = w.iter(loader)
        assert len(batches) == 4
        assert sum(1 for _ in batches) == 4
        assert len(batches) == 4  # the epoch's, as a DataLoader's len() is


def test_w_iter_of_a_generator_has_no_length_and_still_lists() -> None:
    with watch(device="cpu") as w:
        batches = w.iter(x for x in range(3))
        assert batches and w.iter([])  # true as any iterator, not by its len()
        with pytest.raises(TypeError, match=r"the generator given to w.iter\(\) has no len"):
            len(batches)
        assert list(batches) == [0, 1, 2]


class _SlowStart:
    """An iterable whose iter() takes ``start_s`` (a DataLoader starting its workers)."""

    def __init__(self, n: int, start_s: float) -> None:
        self.n, self.start_s = n, start_s

    def __iter__(self) -> Iterator[torch.Tensor]:
        time.sleep(self.start_s)
        return iter([torch.zeros(2, 1)] * self.n)


def test_starting_the_iterable_is_a_wait_for_data_not_the_step() -> None:
    # Before: iter(loader) ran in w.iter(), before the first timed next(), so starting the
    # workers counted as the first step's compute: a "periodic stall" each epoch.
    with watch(device="cpu", warmup_steps=0) as w:
        for _ in range(2):
            for _ in w.iter(_SlowStart(3, 0.2)):
                w.step()
    firsts = [s for i, s in enumerate(w.report().timeline) if i % 3 == 0]
    assert all(s.wait >= 0.2 and s.compute < 0.2 for s in firsts), firsts


class _BadBatch:
    def __init__(self) -> None:
        self.i = 0

    def __iter__(self) -> _BadBatch:
        return self

    def __next__(self) -> int:
        self.i += 1
        if self.i > 5:
            raise StopIteration
        if self.i == 3:
            raise ValueError("corrupt sample")
        return self.i


def test_an_exception_from_the_loader_passes_through_and_the_epoch_goes_on() -> None:
    # Before: w.iter was a generator, which an exception ends: the rest of the epoch was lost.
    seen: list[object] = []
    with watch(device="cpu") as w:
        it = w.iter(_BadBatch())
        while True:
            try:
                seen.append(next(it))
            except ValueError:
                seen.append("skip")
            except StopIteration:
                break
    assert seen == [1, 2, "skip", 4, 5]


def test_one_w_iter_object_iterated_each_epoch_gives_every_epoch() -> None:
    # Before: the second epoch of `for b in batches` was empty while len(batches) said 3.
    loader = DataLoader(TensorDataset(torch.arange(12.0)), batch_size=4)
    with watch(device="cpu") as w:
        batches = w.iter(loader)
        counts = [sum(1 for _ in batches) for _ in range(3)]
    assert counts == [3, 3, 3]


def test_a_batch_left_by_a_break_does_not_count_in_the_next_step() -> None:
    loader = DataLoader(TensorDataset(torch.zeros(80, 3)), batch_size=8)
    with watch(device="cpu", warmup_steps=0) as w:
        for _ in range(3):
            for i, _ in enumerate(w.iter(loader)):
                if i == 5:
                    break  # taken, not trained on
                w.step()
    assert [s.samples for s in w.report().timeline] == [8] * 15


def test_the_previous_batch_is_not_held_while_the_next_one_loads() -> None:
    import weakref

    alive: list[bool] = []

    class Tracked:
        def __init__(self) -> None:
            self.last: weakref.ref[torch.Tensor] | None = None

        def __iter__(self) -> Iterator[torch.Tensor]:
            for _ in range(3):
                gc.collect()
                alive.append(self.last is not None and self.last() is not None)
                batch = torch.zeros(4)
                self.last = weakref.ref(batch)
                yield batch
                del batch

    with watch(device="cpu") as w:
        for batch in w.iter(Tracked()):
            del batch
            w.step()
    assert alive == [False, False, False]


def test_a_second_loader_drawn_inside_a_step_does_not_wipe_its_count() -> None:
    # A validation or auxiliary w.iter() inside the loop is another pass: the training
    # batch's samples stay in the step, and a break in the training pass still drops only
    # its own untrained batch.
    train = DataLoader(TensorDataset(torch.zeros(48, 1)), batch_size=8)
    val = DataLoader(TensorDataset(torch.zeros(2, 1)), batch_size=1)
    with watch(device="cpu", warmup_steps=0) as w:
        for _ in range(2):
            for i, _ in enumerate(w.iter(train)):
                if i == 3:
                    break
                if i == 1:
                    for _ in w.iter(val):
                        pass
                w.step()
    assert [s.samples for s in w.report().timeline] == [8, 10, 8] * 2


@dataclass
class _Retune:
    """What an adaptive loader's ``tuning_history`` holds, as much as the watch reads."""

    time: float
    old: tuple[int, int | None] = (0, None)
    new: tuple[int, int | None] = (1, 2)
    reason: str = "input-bound"
    why: str = "forced"


class _RetuningLoader:
    """Batches of 4, with a change to its history as its fourth batch is taken."""

    def __init__(self) -> None:
        self.tuning_history: list[_Retune] = []

    def __iter__(self) -> Iterator[torch.Tensor]:
        for i in range(6):
            if i == 3:
                self.tuning_history.append(_Retune(time.time()))
            yield torch.zeros(4, 1)


def test_an_adaptive_loaders_change_after_stop_is_not_the_watched_loops() -> None:
    loader = _RetuningLoader()
    w = watch(device="cpu", warmup_steps=0).start()
    batches = w.iter(loader)
    for _ in range(2):
        next(batches)
        w.step()
    w.stop()
    list(batches)  # the loop goes on unwatched, and the loader retunes
    assert len(loader.tuning_history) == 1
    assert w.report().loader_changes == ()


def test_iterating_after_stop_leaves_the_report_as_it_was() -> None:
    w = watch(device="cpu", warmup_steps=0)
    w.start()
    batches = w.iter([torch.zeros(4, 1)] * 8)
    for _ in range(6):
        next(batches)
        w.step()
    w.stop()
    before = w.report().to_dict()
    list(batches)
    assert w.report().to_dict()["steps"] == before["steps"]
    assert w._items == 6


def test_a_report_from_another_thread_while_the_loop_runs_reads_a_whole_log() -> None:
    # The loop appends and trims the step log while a dashboard thread reports.
    errors: list[BaseException] = []
    done = threading.Event()
    old = sys.getswitchinterval()

    def poll(w: Watch) -> None:
        while not done.is_set():
            try:
                r = w.report()
                assert len(r.timeline) <= 64
            except BaseException as e:
                errors.append(e)
                return

    sys.setswitchinterval(1e-6)  # switch threads often: inside the log's updates too
    try:
        with watch(device="cpu", warmup_steps=0, max_records=32) as w:
            reporter = threading.Thread(target=poll, args=(w,))
            steps = 0
            for _ in w.iter(itertools.repeat(torch.zeros(2, 1), 100_000)):
                w.step()
                steps += 1
                if steps == 1:
                    reporter.start()
                if errors:
                    break
            done.set()
            reporter.join(60)
    finally:
        sys.setswitchinterval(old)
        done.set()
    assert errors == []
    assert w.report().steps == steps


def test_a_report_inside_the_loop_is_not_the_steps_time(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    import trainperf.monitor._watch as watch_module
    import trainperf.monitor._watch_report as report_module

    clock = [1000.0]  # the watch's perf_counter: each step takes 1 ms, a report 50 ms
    fake = types.SimpleNamespace(**{k: getattr(time, k) for k in dir(time) if k[0] != "_"})
    fake.perf_counter = lambda: clock[0]
    monkeypatch.setattr(watch_module, "time", fake)
    real = report_module.analyse

    def slow(*args: object, **kwargs: object) -> WatchReport:
        clock[0] += 0.05
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(report_module, "analyse", slow)
    with watch(device="cpu", warmup_steps=0) as w:
        for i in range(40):
            clock[0] += 0.001
            if i % 10 == 5:
                w.report()
            w.step(samples=1)
    durations = [round(s.wait + s.compute, 6) for s in w.report().timeline]
    assert durations == [0.001] * 40, durations  # the reports' 50 ms are in no step


def test_the_watchs_own_bookkeeping_every_16_steps_is_no_periodic_stall(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before: the schedstat reading every 16th w.step() ran after the step's end was read,
    # so it landed in the next step: a loop of short steps got "periodic-stalls: every 16
    # steps one step takes 0 ms instead of 0.0 ms" and advice to save checkpoints less often.
    import types

    import trainperf.monitor._watch as watch_module
    import trainperf.monitor._watch_steps as steps_module

    clock = [1000.0]  # each step takes 1 ms, each settle of the watch's 20 ms
    fake = types.SimpleNamespace(**{k: getattr(time, k) for k in dir(time) if k[0] != "_"})
    fake.perf_counter = lambda: clock[0]
    monkeypatch.setattr(watch_module, "time", fake)
    monkeypatch.setattr(steps_module, "time", fake)
    real = steps_module.settle

    def slow(w: Watch) -> None:
        clock[0] += 0.02
        real(w)

    monkeypatch.setattr(steps_module, "settle", slow)
    with watch(device="cpu", warmup_steps=0) as w:
        for _ in range(64):
            clock[0] += 0.001
            w.step(samples=1)
    report = w.report()
    durations = [round(s.wait + s.compute, 6) for s in report.timeline]
    assert durations == [0.001] * 64, durations
    assert report.stall_period is None
    kinds = [report.verdict.kind, *(f.kind for f in report.findings)]
    assert "periodic-stalls" not in kinds


@pytest.mark.timeout(60, method="thread")  # a deadlock blocks signal-based timeouts too
def test_a_report_from_a_signal_handler_inside_a_step_does_not_deadlock(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import signal

    import trainperf.monitor._watch_steps as steps_module

    reports: list[int] = []
    real = steps_module.settle

    def interrupted(w: Watch) -> None:  # the signal comes while the step log is written
        signal.raise_signal(signal.SIGUSR1)
        real(w)

    previous = signal.signal(signal.SIGUSR1, lambda *_: reports.append(w.report().steps))
    monkeypatch.setattr(steps_module, "settle", interrupted)
    try:
        with watch(device="cpu", warmup_steps=0) as w:
            for _ in range(40):
                w.step(samples=1)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert reports and w.report().steps == 40


def test_samples_are_unknown_without_w_iter_or_samples() -> None:
    with watch(device="cpu", warmup_steps=0) as w:
        for _ in range(5):
            w.step()
    r = w.report()
    assert r.samples_per_s is None and {s.samples for s in r.timeline} == {None}
    assert w.report().to_dict()["samples_per_s"] is None


def test_with_on_a_started_watch_says_to_use_one_way_not_both() -> None:
    w = watch(device="cpu").start()
    try:
        with pytest.raises(RuntimeError, match=r"w\.start\(\) already started: use either"), w:
            pass
    finally:
        w.stop()


class _ReportsOnce(list):  # type: ignore[type-arg]
    """A step-log array whose append (or trim) a "signal handler" interrupts with a report."""

    def __init__(self, w: Watch, at: int, seen: list[Any], on: str) -> None:
        super().__init__()
        self.w, self.at, self.seen, self.on = w, at, seen, on

    def _interrupt(self) -> None:
        if len(self) >= self.at and not self.seen:
            self.seen.append(self.w.report().timeline)

    def append(self, value: Any) -> None:
        super().append(value)
        if self.on == "append":
            self._interrupt()

    def __delitem__(self, key: Any) -> None:
        super().__delitem__(key)
        if self.on == "trim":
            self._interrupt()


@pytest.mark.timeout(60, method="thread")
@pytest.mark.parametrize("on", ["append", "trim"])
def test_a_report_that_interrupts_a_step_being_written_reads_only_whole_steps(on: str) -> None:
    seen: list[Any] = []
    with watch(device="cpu", warmup_steps=0, max_records=4) as w:
        w._ends = _ReportsOnce(w, 3, seen, on)  # type: ignore[assignment]
        for i in range(12):
            w.step(samples=i + 1)  # step i trains on i + 1 samples: its mark
    [timeline] = seen
    # Mid-append: the whole steps, none half-written; mid-trim: none rather than mismatched.
    assert all(s.samples == s.index + 1 for s in timeline), timeline
    assert len(timeline) == (2 if on == "append" else 0)
    final = w.report().timeline
    assert [(s.index, s.samples) for s in final] == [(8, 9), (9, 10), (10, 11), (11, 12)]


@pytest.mark.timeout(60, method="thread")  # a deadlock blocks signal-based timeouts too
def test_a_report_re_entered_in_a_thread_already_reporting_does_not_deadlock(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The loop runs in a thread; the main thread reports, and a signal handler in the main
    # thread reports again from inside that report.
    import trainperf.monitor._watch_report as report_module

    real, nested = report_module.step_records, []

    def interrupted(w: Watch) -> Any:
        if not nested:
            nested.append(-1)
            nested[0] = w.report().steps  # the "handler", inside the lock
        return real(w)

    monkeypatch.setattr(report_module, "step_records", interrupted)
    w = watch(device="cpu", warmup_steps=0).start()
    done = threading.Event()

    def loop() -> None:
        while not done.is_set():
            w.step(samples=1)

    runner = threading.Thread(target=loop)
    runner.start()
    try:
        time.sleep(0.05)
        assert w.report().steps >= nested[0] >= 0
    finally:
        done.set()
        runner.join(30)
        w.stop()


def test_a_report_from_another_thread_lets_the_loop_step_while_the_gpu_catches_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A dashboard thread's report waits for the GPU queue: the loop's w.step() must not
    # wait with it (it did: the report synchronised while holding the step log's lock).
    gate, waiting = threading.Event(), threading.Event()

    class FakeEvent:  # a CUDA event whose work ends when the gate opens
        def __init__(self, enable_timing: bool = False) -> None:
            pass

        def record(self, stream: object = None) -> None:
            pass

        def query(self) -> bool:
            return gate.is_set()

        def synchronize(self) -> None:
            waiting.set()
            gate.wait(60)

        def elapsed_time(self, end: object) -> float:
            return 1.0

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    opener = threading.Timer(20, gate.set)  # opens the gate if the loop is stuck
    reports: list[WatchReport] = []
    try:
        with watch(device="cpu", warmup_steps=0) as w:
            w._cuda = True  # the loop runs on a (fake) GPU
            w.step()
            reporter = threading.Thread(target=lambda: reports.append(w.report()))
            opener.start()
            reporter.start()
            assert waiting.wait(30)
            w.step()
            stepped_while_waiting = not gate.is_set()
            gate.set()
            reporter.join(60)
    finally:
        gate.set()
        opener.cancel()
    assert stepped_while_waiting
    # It reports the step logged when it was asked for: the one logged during its wait has
    # no GPU time yet, which would void the report's GPU figures.
    assert len(reports) == 1 and [s.index for s in reports[0].timeline] == [0]
    assert w.report().steps == 2


def _clock_module(perf_counter: Any) -> Any:
    import types

    fake = types.SimpleNamespace(**{k: getattr(time, k) for k in dir(time) if k[0] != "_"})
    fake.perf_counter = perf_counter
    return fake


def test_a_clock_that_steps_back_during_a_wait_gives_no_negative_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import trainperf.monitor._watch_iter as iter_module

    ticks = itertools.count()  # w.iter's clock: every reading 10 ms before the last
    monkeypatch.setattr(iter_module, "time", _clock_module(lambda: -0.01 * next(ticks)))
    with watch(device="cpu", warmup_steps=0) as w:
        for _ in w.iter([torch.zeros(4, 2)] * 8):
            burn(0.001)
            w.step()
    report = w.report()
    assert [s.wait for s in report.timeline] == [0.0] * 8
    assert report.wait_fraction == 0.0


def test_a_frozen_clock_is_inconclusive_not_compute_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    import trainperf.monitor._watch as watch_module
    import trainperf.monitor._watch_iter as iter_module

    frozen = _clock_module(lambda: 1000.0)  # what a time-freezing test library does
    monkeypatch.setattr(watch_module, "time", frozen)
    monkeypatch.setattr(iter_module, "time", frozen)
    with watch(device="cpu", warmup_steps=0) as w:
        for _ in w.iter([torch.zeros(4, 2)] * 8):
            w.step()
    assert w.report().verdict.kind == "inconclusive"


def test_watch_takes_numpy_counts_and_reports_python_ints() -> None:
    # Before: max_records=np.int64(...) reached deque(maxlen=...), a TypeError, and
    # warmup_steps=np.int64(...) made a report json.dumps refuses.
    np = pytest.importorskip("numpy")
    import json

    with watch(device="cpu", warmup_steps=np.int64(1), max_records=np.int64(100)) as w:
        for _ in range(4):
            w.step(samples=np.int64(8))
    report = w.report()
    data = report.to_dict(timeline=True)
    assert json.loads(json.dumps(data)) == data
    assert type(report.warmup_steps) is int and report.warmup_steps == 1
    assert [type(s.samples) for s in report.timeline] == [int] * 4


# --------------------------------------------------------------------------- threads


def _in_thread(fn: Any, name: str) -> BaseException | None:
    """Run ``fn`` in a thread called ``name``; what it raised, or None."""
    raised: list[BaseException] = []

    def target() -> None:
        try:
            fn()
        except BaseException as e:
            raised.append(e)

    thread = threading.Thread(target=target, name=name)
    thread.start()
    thread.join(60)
    return raised[0] if raised else None


def test_steps_from_a_second_thread_are_refused_not_merged_into_one_timeline() -> None:
    # Before: both threads' steps went into one timeline, each step the time since the other
    # thread's last one (400 steps of 0.8 ms for two loops of 1 ms steps), silently.
    with watch(device="cpu", warmup_steps=0) as w:
        for _ in range(3):
            w.step(samples=1)
        raised = _in_thread(lambda: w.step(samples=1), "other-loop")
    assert isinstance(raised, RuntimeError)
    with pytest.raises(RuntimeError, match="'other-loop', but thread 'MainThread' steps"):
        raise raised
    assert "give each thread its own trainperf.watch()" in str(raised)
    assert w.report().steps == 3


def test_a_watch_started_in_one_thread_is_stepped_and_iterated_in_another() -> None:
    w = watch(device="cpu", warmup_steps=0).start()

    def loop() -> None:
        for _ in w.iter([torch.zeros(2, 1)] * 6):
            w.step()

    assert _in_thread(loop, "trainer") is None
    report = w.stop()  # stopped, and reported on, from the starting thread
    assert report.steps == 6
    assert [s.samples for s in report.timeline] == [2] * 6


def test_a_thread_takes_over_the_steps_once_the_stepping_thread_has_ended() -> None:
    with watch(device="cpu", warmup_steps=0) as w:
        for epoch in range(2):  # a thread per epoch: each ends before the next steps
            assert _in_thread(lambda: [w.step(samples=1) for _ in range(3)], f"e{epoch}") is None
    assert w.report().steps == 6


class _ReusedIdents:
    """``threading`` as the watch's modules see it, with Python reusing an ended thread's
    ``get_ident()`` for the next thread started (as it often does): ``"epoch-2"`` gets
    ``first``, the ident ``"epoch-1"`` had."""

    def __init__(self) -> None:
        self.first: int | None = None

    def get_ident(self) -> int:
        reused = threading.current_thread().name == "epoch-2" and self.first is not None
        return self.first if reused else threading.get_ident()  # type: ignore[return-value]

    def __getattr__(self, name: str) -> Any:
        return getattr(threading, name)


def test_a_thread_reusing_an_ended_steppers_ident_still_takes_over_the_steps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before: the watch told threads apart by get_ident(), which Python reuses once a thread
    # has ended: epoch 2's thread, given epoch 1's ident, never took the steps over, so its
    # prefetch thread's waits went unnoticed into the report's data wait.
    import trainperf.monitor._watch as watch_module
    import trainperf.monitor._watch_iter as iter_module
    import trainperf.monitor._watch_report as report_module
    import trainperf.monitor._watch_steps as steps_module

    idents = _ReusedIdents()
    for module in (watch_module, iter_module, report_module, steps_module):
        monkeypatch.setattr(module, "threading", idents)

    def epoch_2() -> None:
        w.step(samples=1)  # this thread now steps the watch
        prefetch = threading.Thread(target=lambda: list(w.iter([torch.zeros(2, 1)] * 3)))
        prefetch.name = "prefetch"
        prefetch.start()
        prefetch.join(30)
        w.step()

    def epoch_1() -> None:
        idents.first = threading.get_ident()
        for _ in range(2):
            w.step(samples=1)

    w = watch(device="cpu", warmup_steps=0).start()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _in_thread(epoch_1, "epoch-1") is None
        assert _in_thread(epoch_2, "epoch-2") is None
    report = w.stop()
    mine = [str(x.message) for x in caught if "w.iter()" in str(x.message)]
    assert len(mine) == 1 and "thread 'prefetch' while thread 'epoch-2' steps" in mine[0]
    assert report.wait_fraction is None
    assert report.setup.prefetch_thread == "prefetch"


def _prefetched_loop(w: Watch, *, first_step_before: bool) -> None:
    """A loop fed through a queue by a prefetch thread that iterates ``w.iter(loader)``."""
    import queue

    batches: queue.Queue[torch.Tensor | None] = queue.Queue()

    def prefetch() -> None:
        for batch in w.iter(sleepy_loader(12, 0.002, batch=4)):
            batches.put(batch)
        batches.put(None)

    if first_step_before:
        w.step(samples=4)  # the loop's thread steps first: the next() calls come after
    fetcher = threading.Thread(target=prefetch, name="prefetch")
    fetcher.start()
    if not first_step_before:
        fetcher.join(30)  # every batch taken before the loop's first step
    while batches.get(timeout=30) is not None:
        burn(0.001)
        w.step()
    fetcher.join(30)


@pytest.mark.parametrize("first_step_before", [True, False])
def test_batches_taken_in_a_prefetch_thread_warn_once_and_leave_the_wait_unmeasured(
    first_step_before: bool,
) -> None:
    # Before: the prefetch thread's time in next() (overlapping the steps) was added to the
    # loop's steps as their wait for data, silently: a loop that never waits for a batch
    # could be called input-bound.
    with watch(device="cpu", warmup_steps=0) as w, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _prefetched_loop(w, first_step_before=first_step_before)
    mine = [str(x.message) for x in caught if "w.iter()" in str(x.message)]
    assert len(mine) == 1, mine  # once, however many batches
    assert "thread 'prefetch' while thread 'MainThread' steps the watch" in mine[0]
    assert "the report leaves the data wait unmeasured" in mine[0]
    report = w.report()
    assert report.wait_fraction is None
    assert report.verdict.kind != "input-bound"
    assert "w.iter() ran in thread 'prefetch'" in report.verdict.reasons[-1]
    assert sum("'prefetch'" in r for r in report.verdict.reasons) == 1  # said once
    assert sum(s.samples or 0 for s in report.timeline) == 4 * (12 + first_step_before)
    # Every text gives the cause that applies: not "wrap the loader", never "never was".
    assert report.setup.prefetch_thread == "prefetch"
    text = str(report)
    assert "data wait not measured (w.iter() ran in prefetch thread 'prefetch')" in text
    assert "never was" not in text and "w.iter(loader)" not in text, text


class _StepsMidCount(Watch):
    """A watch whose loop steps while the prefetch thread updates the samples pending for
    the step (``_pending_count += n``): between that update's read and its write."""

    def __init__(self, **kwargs: Any) -> None:
        self.read = threading.Event()  # the prefetch thread read the count for batch 2
        self.stepped = threading.Event()  # the loop's w.step() has returned
        self._reads = 0
        super().__init__(**kwargs)

    @property
    def _pending_count(self) -> int:
        value: int = self.__dict__["_pending_count"]
        if threading.current_thread().name == "prefetch":
            self._reads += 1
            if self._reads == 2:
                self.read.set()
                # The loop steps now, unless the watch keeps it out until the write: then
                # this wait ends unanswered and the step comes after.
                self.stepped.wait(1.0)
        return value

    @_pending_count.setter
    def _pending_count(self, value: int) -> None:
        self.__dict__["_pending_count"] = value


def test_a_step_during_a_prefetch_threads_count_neither_loses_nor_repeats_samples() -> None:
    # Before: w.step() reset the pending count between the prefetch thread's read and its
    # write of `+= n`, which then wrote back the old count plus n: the samples counted in
    # the step that ended were counted again in the next one.
    w = _StepsMidCount(device="cpu", warmup_steps=0)
    with w, warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "w.iter() is iterated in thread"
        w.step(samples=0)  # the loop's thread steps: the batches are taken elsewhere

        def prefetch() -> None:
            for _ in w.iter([torch.zeros(4, 1)] * 2):
                pass

        fetcher = threading.Thread(target=prefetch, name="prefetch")
        fetcher.start()
        assert w.read.wait(30)
        w.step()
        w.stepped.set()
        fetcher.join(30)
        w.step()
    assert [s.samples for s in w.report().timeline] == [0, 8, 0]


def test_a_loop_iterated_and_stepped_in_one_other_thread_does_not_warn() -> None:
    w = watch(device="cpu", warmup_steps=0).start()

    def epoch() -> None:
        for _ in w.iter([torch.zeros(2, 1)] * 3):
            w.step()

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for n in range(2):  # a thread per epoch, each iterating and stepping
            assert _in_thread(epoch, f"epoch-{n}") is None
    assert w.stop().wait_fraction is not None


def _host_bound_report(*args: object, **kwargs: object) -> WatchReport:
    from tests.monitor._fakes import samples, steps
    from trainperf.monitor import analyse

    return analyse(steps(60, 0.015, 0.005), samples(15, 40.0, 780, 99), cpus=8)


def test_two_watches_at_once_warn_and_their_host_bound_verdicts_say_the_cpu_is_shared(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before: each watch's process CPU silently held the other loop's work too, so a loop
    # could be called host-bound because of the other thread's loop.
    import trainperf.monitor._watch_report as report_module

    monkeypatch.setattr(report_module, "analyse", _host_bound_report)
    with watch(device="cpu") as first:
        with pytest.warns(RuntimeWarning, match="two trainperf.watch.. run at once in this"):
            second = watch(device="cpu")
            assert _in_thread(lambda: second.start() and None, "second-loop") is None
        second.stop()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one at a time again: no warning
        with watch(device="cpu") as alone:
            pass
    for w in (first, second):
        verdict = w.report().verdict
        assert verdict.kind == "host-bound"
        assert "another trainperf.watch() ran in this process meanwhile" in verdict.reasons[-1]
    assert not any("another trainperf.watch()" in r for r in alone.report().verdict.reasons)
