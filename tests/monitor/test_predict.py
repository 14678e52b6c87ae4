"""The predicted gains (``monitor/_predict*.py``): each model on hand-made figures.

The figures are chosen so that each prediction can be worked out by hand; the comments
give the arithmetic.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import inspect
import math
import statistics
from pathlib import Path
from typing import Any

import pytest

from tests.monitor._fakes import cpu_loop, figures
from trainperf.bench import reference_throughput
from trainperf.monitor import LoopSetup
from trainperf.monitor._predict_cpus import free_cpus_fix, threads_fix
from trainperf.monitor._predict_loader import (
    GPU_DECODE_CALL,
    LOADER_CALL,
    gpu_decode_fix,
    load_cost,
    loader_fix,
    step_cores,
    tuner_workers,
)
from trainperf.monitor._predict_stalls import ASYNC_SAVE_CALL, LESS_OFTEN, stall_fixes
from trainperf.monitor._predict_step import (
    BATCH_CALL,
    PRECISION_CALL,
    batch_fix,
    gpu_fix,
    precision_fix,
    reference_ratio,
)

# --------------------------------------------------------------------------- the loader


def test_sleepy_loading_in_the_loop_gets_the_workers_that_keep_up_with_the_step() -> None:
    # 20 ms steps, 16 ms of them waiting, 1.6 ms of that on a CPU: one worker keeps a
    # tenth of a core busy, so 15 would fill the core left to workers, but 5 keep up with
    # the 4 ms step (16 ms / 4 ms, 10 % to spare) and deliver every 3.2 ms: 20 ms -> 4 ms.
    f = cpu_loop(wait_fraction=0.8, wait_cpu_s=0.0016)
    cost = load_cost(f)
    assert (cost.wall_s, cost.cpu_s, cost.cores) == pytest.approx((0.016, 0.0016, 0.1))
    assert tuner_workers(f, cost) == (5, 1)
    fix = loader_fix(f, "input-bound")
    assert fix is not None and fix.finding == "input-bound"
    assert fix.call == "trainperf.autotune_loader(dataset, batch_size, step_fn=train_step)"
    assert fix.predicted_speedup == pytest.approx(5.0)
    assert fix.basis == (
        "the loop's thread waits 16.0 ms per step for its batches, 1.6 ms of it running or "
        "waiting for a CPU; 5 workers (the tuner's pick for 1 core left to workers, 10% of "
        "a core each) would deliver them every 3.2 ms against the step's 4.0 ms (receiving "
        "them from workers not counted): 20.0 ms -> 4.0 ms per step"
    )
    # A step that is only 1 ms: the tuner's most on 2 CPUs, 8, deliver every 2 ms.
    short = cpu_loop(wait_fraction=0.95, wait_cpu_s=0.0019)  # 19 ms waiting, 1 ms step
    assert tuner_workers(short, load_cost(short))[0] == 8
    assert loader_fix(short, "input-bound").predicted_speedup == pytest.approx(20 / 2.375)  # type: ignore[union-attr]


def test_a_measured_hand_over_is_counted_in_the_step_and_the_workers() -> None:
    # As above (20 ms steps, 16 ms waiting, 1.6 ms of it CPU), with the probe's figures:
    # receiving a batch costs the loop's thread 1 ms, a worker 0.4 ms more to produce it.
    # Each worker then takes 16.4 ms (2.0 ms CPU) a batch; 5 keep up with the 4 ms step,
    # delivering every 3.3 ms, under the step's 4 + 1 ms: 20 ms -> 5 ms.
    setup = LoopSetup(handover_receive_s=0.001, handover_produce_s=0.0004)
    f = cpu_loop(wait_fraction=0.8, wait_cpu_s=0.0016, setup=setup)
    cost = load_cost(f)
    assert (cost.wall_s, cost.cpu_s) == pytest.approx((0.0164, 0.002))
    assert cost.how.endswith("and a worker 0.4 ms more to hand them over (measured)")
    fix = loader_fix(f, "input-bound")
    assert fix is not None and fix.predicted_speedup == pytest.approx(20 / 5)
    assert "and the 1.0 ms it would take to receive them (measured by a one-worker probe" in (
        fix.basis
    )
    # Two batches a step (accumulation inside the step): twice the hand-over.
    two = cpu_loop(wait_fraction=0.8, wait_cpu_s=0.0016,
                   setup=LoopSetup(handover_receive_s=0.001, batches_per_step=2.0))  # fmt: skip
    fix2 = loader_fix(two, "input-bound")
    assert fix2 is not None and fix2.predicted_speedup == pytest.approx(20 / 6)


def test_the_cores_left_to_workers_are_the_cpus_the_step_leaves() -> None:
    # A GPU-like step that keeps 0.1 of a core busy (this process: 0.3 cores, 0.2 of them
    # the loading in its own thread) leaves both CPUs to workers.
    f = cpu_loop(wait_fraction=0.5, wait_cpu_s=0.004, process_cpu=30.0)
    cost = load_cost(f)
    assert step_cores(f, cost) == pytest.approx((0.3 * 0.02 - 0.004) / 0.01)
    assert tuner_workers(f, cost)[1] == 2
    busy = cpu_loop(wait_fraction=0.5, wait_cpu_s=0.004, process_cpu=70.0)  # a core's step
    assert tuner_workers(busy, load_cost(busy))[1] == 1
    assert step_cores(cpu_loop(wait_fraction=0.5), cost) == 1.0  # not sampled: one core


def test_with_workers_the_step_keeps_its_cost_of_receiving_batches() -> None:
    # 2 workers keep the loop waiting 10 ms of each 20 ms step, 2 ms of it the loop's own
    # CPU taking the batches: with more workers the step is 10 + 2 ms.
    f = cpu_loop(wait_fraction=0.5, wait_cpu_s=0.002, workers_cpu=10.0,
                 setup=LoopSetup(num_workers=2))  # fmt: skip
    fix = loader_fix(f, "input-bound")
    assert fix is not None and fix.predicted_speedup == pytest.approx(20 / 12)
    assert "and the 2.0 ms it takes to receive them" in fix.basis


def test_cpu_bound_loading_is_bounded_by_the_cores_left_to_workers() -> None:
    # All 16 ms of loading on a CPU: one worker on the one core left delivers every 16 ms.
    fix = loader_fix(cpu_loop(wait_fraction=0.8, wait_cpu_s=0.016), "input-bound")
    assert fix is not None and fix.predicted_speedup == pytest.approx(20 / 16)
    # Not measured: the cautious case, all CPU.
    unknown = loader_fix(cpu_loop(wait_fraction=0.8), "input-bound")
    assert unknown is not None and unknown.predicted_speedup == pytest.approx(20 / 16)


def test_workers_that_keep_the_loop_waiting_are_judged_by_their_delivered_rate() -> None:
    # 2 workers deliver a step's batches every 20 ms, so each takes 40 ms; together they
    # use 0.1 cores (2 ms of CPU per step). 8 would deliver every 5 ms, under the 10 ms
    # step: 20 ms -> 10 ms.
    f = cpu_loop(wait_fraction=0.5, workers_cpu=10.0, setup=LoopSetup(num_workers=2))
    cost = load_cost(f)
    assert (cost.wall_s, cost.cpu_s) == pytest.approx((0.040, 0.002))
    assert cost.how.startswith("2 workers deliver a step's batches every 20.0 ms")
    fix = loader_fix(f, "input-bound")
    assert fix is not None and fix.predicted_speedup == pytest.approx(2.0)


def test_a_loader_already_at_the_tuners_choice_gains_nothing_more() -> None:
    # 4 CPUs, the tuner left 3 to workers and chose 3; they keep 3 cores busy and the loop
    # still waits: more workers cannot get more cores.
    setup = LoopSetup(num_workers=3, tuned_num_workers=3, tuned_worker_cpus=3, tuned_max_workers=3)
    f = cpu_loop(cpus=4, wait_fraction=0.5, workers_cpu=300.0, setup=setup)
    assert tuner_workers(f, load_cost(f)) == (3, 3)
    fix = loader_fix(f, "input-bound")
    assert fix is not None and fix.predicted_speedup == pytest.approx(1.0)


def test_workers_whose_cpu_was_not_sampled_are_never_predicted_slower() -> None:
    # Without the workers' CPU the loading counts as all CPU: 2 workers at 40 ms each would
    # need 2 cores where 1 is left, but they deliver every 20 ms now, and the tuner would
    # keep that: no gain, and no loss.
    f = cpu_loop(wait_fraction=0.5, setup=LoopSetup(num_workers=2))
    fix = loader_fix(f, "input-bound")
    assert fix is not None and fix.predicted_speedup == pytest.approx(1.0)


def test_the_tuner_never_predicts_fewer_workers_than_the_loader_has() -> None:
    f = cpu_loop(wait_fraction=0.5, workers_cpu=600.0, setup=LoopSetup(num_workers=6))
    assert tuner_workers(f, load_cost(f))[0] == 6


def test_no_loader_fix_without_a_data_wait() -> None:
    assert loader_fix(cpu_loop(wait_fraction=0.1), "input-bound") is None
    assert loader_fix(cpu_loop(wait_fraction=0.8, wait_measured=False), "input-bound") is None


def test_gpu_decoding_moves_the_loadings_cpu_work_off_the_host() -> None:
    # A CUDA loop of 10 ms steps, 6 ms waiting for CPU-bound decoding: on the GPU, the
    # 4 ms step is left (an upper bound: the GPU's decode time is not known).
    f = figures(wait_fraction=0.6, wait_cpu_s=0.006)
    fix = gpu_decode_fix(f, "input-bound")
    assert fix is not None and fix.predicted_speedup == pytest.approx(2.5)
    assert fix.call == 'trainperf.pipelines.image_loader(folder, batch_size, backend="nvjpeg")'
    assert fix.basis.startswith("at most: ")
    assert gpu_decode_fix(figures(wait_fraction=0.6, wait_cpu_s=0.001), "input-bound") is None
    assert gpu_decode_fix(cpu_loop(wait_fraction=0.6, wait_cpu_s=0.012), "input-bound") is None
    assert gpu_decode_fix(figures(wait_fraction=0.1, wait_cpu_s=0.001), "input-bound") is None


# --------------------------------------------------------------------------- stalls


def test_stalls_every_few_steps_are_not_predicted_as_saves() -> None:
    # Gradient accumulation watched per micro-batch: every 4th "step" takes 100 ms after
    # three of 1 ms, 96 % of the run. A save's gain is not predicted (and no 1 / (1 - 1)).
    cadence = cpu_loop(stall_period=4, stall_steps=(3, 7, 11, 15), stall_fraction=0.96)
    (fix,) = stall_fixes(cadence)
    assert fix.predicted_speedup == 1.0
    assert fix.basis.startswith("not predicted: a stall every 4 steps costing 96% of the run")
    whole = cpu_loop(stall_period=10, stall_steps=(9, 19, 29), stall_fraction=1.0)
    assert [f.predicted_speedup for f in stall_fixes(whole)] == [1.0]


def test_workers_behind_an_iterable_that_is_not_a_dataloader_are_not_guessed() -> None:
    # A prefetcher around a 3-worker DataLoader: num_workers unknown, 3 cores of children.
    hidden = cpu_loop(wait_fraction=0.5, wait_cpu_s=0.0003, process_cpu=310.0, workers_cpu=300.0)
    fix = loader_fix(hidden, "input-bound")
    assert fix is not None and fix.predicted_speedup == 1.0
    assert "pass the DataLoader itself to w.iter()" in fix.basis


def test_workers_not_yet_sampled_count_as_all_cpu() -> None:
    # Workers the sampler has not found yet read 0 %: the cautious case, not "free".
    zero = cpu_loop(wait_fraction=0.5, workers_cpu=0.0, setup=LoopSetup(num_workers=2))
    unknown = cpu_loop(wait_fraction=0.5, workers_cpu=None, setup=LoopSetup(num_workers=2))
    assert load_cost(zero) == load_cost(unknown)
    assert load_cost(zero).cpu_s == load_cost(zero).wall_s


def test_the_stalls_excess_goes_with_a_non_blocking_save() -> None:
    f = figures(stall_period=10, stall_steps=(9, 19, 29), stall_fraction=0.2, stall_median_s=0.2)
    async_save, less_often = stall_fixes(f)
    assert async_save.call == ASYNC_SAVE_CALL
    assert async_save.predicted_speedup == pytest.approx(1 / 0.8)
    assert async_save.basis.startswith(
        "the run without the stalls' excess (3 stalls every 10 steps, each 13.3 ms over the "
        "median step, 20% of 0.20 s)"
    )
    assert less_often.call == f"trainperf.save_checkpoint(...) every {LESS_OFTEN * 10} steps"
    assert less_often.predicted_speedup == pytest.approx(1 / (1 - 0.2 * 0.9))
    assert stall_fixes(figures()) == ()
    # A CPU state's non-blocking save blocks 5 ms (its fork): 5 of each 13.3 ms excess stay.
    forked = dataclasses.replace(f, setup=LoopSetup(save_block_s=0.005))
    async_forked = stall_fixes(forked)[0]
    assert async_forked.predicted_speedup == pytest.approx(
        1 / (1 - 0.2 * (1 - 0.005 / (0.2 * 0.2 / 3)))
    )
    assert "a non-blocking save of a CPU state blocked this process for 5.0 ms" in (
        async_forked.basis
    )
    slow_fork = dataclasses.replace(f, setup=LoopSetup(save_block_s=0.05))  # longer than a stall
    assert stall_fixes(slow_fork)[0].predicted_speedup == 1.0
    assert stall_fixes(figures(stall_period=None, stall_steps=(3, 7), stall_fraction=0.2)) == ()


def test_stalls_between_epochs_are_a_bound_for_a_save_not_its_gain() -> None:
    # Before: a validation pass after each 25-step epoch (no save at all) was predicted
    # 1.53x for saving "every 250 steps" and 1.27x for a non-blocking save, as if certain;
    # measured: 1.0x (nothing to save less often). Between epochs a loop validates as often
    # as it saves: the gains are bounds, and "less often" counts epochs.
    epoch = LoopSetup(steps_per_epoch=25)
    f = figures(stall_period=25, stall_steps=(25, 50, 75), stall_fraction=0.38, setup=epoch)
    async_save, less_often = stall_fixes(f)
    between = (
        "at most: the stalls come between epochs (every 25 steps, 1 pass over the loader), "
        "where a loop validates as often as it saves: this is their gain if all that work is "
        "a save, none if it is a validation pass; "
    )
    assert async_save.basis.startswith(between + "the run without the stalls' excess")
    assert async_save.predicted_speedup == pytest.approx(1 / (1 - 0.38))
    assert less_often.call == "trainperf.save_checkpoint(...) every 10 epochs"
    assert less_often.basis.startswith(between) and less_often.basis.endswith(
        "saving every 10 epochs instead of every epoch"
    )
    every_other = dataclasses.replace(f, stall_period=50)
    assert stall_fixes(every_other)[1].call == "trainperf.save_checkpoint(...) every 20 epochs"
    assert "(every 50 steps, 2 passes over the loader)" in stall_fixes(every_other)[1].basis
    # A validation pass longer than the epoch's training is no gradient accumulation: still
    # a bound, not "the loop's own cadence".
    long_pass = stall_fixes(dataclasses.replace(f, stall_fraction=0.6))
    assert long_pass[0].basis.startswith(between) and long_pass[0].predicted_speedup > 1.0
    # Stalls every 10 steps of a 25-step epoch are no epoch's: as before.
    saves = stall_fixes(dataclasses.replace(f, stall_period=10, stall_steps=(9, 19, 29)))
    assert saves[1].call == "trainperf.save_checkpoint(...) every 100 steps"
    assert not saves[0].basis.startswith("at most")
    assert stall_fixes(dataclasses.replace(f, setup=LoopSetup()))[1].call.endswith("250 steps")
    # A peek at one batch before the loop's own pass is a "pass" of 1 step: no epoch.
    peeked = dataclasses.replace(f, setup=LoopSetup(steps_per_epoch=1))
    assert stall_fixes(peeked)[1].call.endswith("250 steps")


def test_a_loop_already_saving_in_the_background_is_not_told_to() -> None:
    f = figures(stall_period=10, stall_steps=(9, 19, 29), stall_fraction=0.2, stall_median_s=0.2)
    already = dataclasses.replace(f, setup=LoopSetup(save_block_s=0.001, background_saves=3))
    async_save, less_often = stall_fixes(already)
    assert async_save.predicted_speedup == 1.0
    assert async_save.basis.startswith("already in use: the loop started 3 background save(s)")
    assert less_often.predicted_speedup > 1.0  # saving less often still helps


def test_the_watch_counts_the_background_saves_its_loop_started(tmp_path: Path) -> None:
    from trainperf import Checkpointer, watch

    ckpt = Checkpointer(tmp_path)
    ckpt.save({"n": 0}, step=0, blocking=False)  # before the loop: not the loop's
    with watch(device="cpu", warmup_steps=0) as w:
        for step in range(1, 7):
            if step % 3 == 0:
                ckpt.save({"n": step}, step=step, blocking=False)
            w.step()
    ckpt.wait()
    ckpt.save({"n": 9}, step=9, blocking=False)  # after it: not the loop's either
    ckpt.wait()
    assert w.report().setup.background_saves == 2


# --------------------------------------------------------------------------- precision


def _ratio(row: dict[str, float]) -> float:
    cnn = row["resnet50_fp16"] / row["resnet50_fp32"]
    vit = row["vit_base_patch16_224_fp16"] / row["vit_base_patch16_224_fp32"]
    return math.sqrt(cnn * vit)


def test_the_reference_ratio_is_the_tables_for_a_listed_gpu() -> None:
    table = reference_throughput()
    ratio, where = reference_ratio("NVIDIA A100-SXM4-80GB")
    assert ratio == pytest.approx(_ratio(table["A100"]))
    assert where.startswith("the reference table's fp16/fp32 throughput for the A100 (ResNet-50")


def test_an_unlisted_gpu_gets_the_tables_tensor_core_median() -> None:
    table = reference_throughput()
    tensor = [_ratio(r) for r in table.values() if r["resnet50_fp16"] > r["resnet50_fp32"]]
    ratio, where = reference_ratio("NVIDIA H200")
    assert ratio == pytest.approx(statistics.median(tensor))
    assert where.startswith(f"NVIDIA H200 is not in the reference table: the median of its "
                            f"{len(tensor)} tensor-core GPUs'")  # fmt: skip
    assert reference_ratio(None)[1].startswith("this GPU is not in the reference table")


def test_mixed_precision_on_a_gpu_speeds_up_the_share_it_is_busy() -> None:
    a100 = LoopSetup(gpu_name="NVIDIA A100-SXM4-80GB", gpu_capability=(8, 0))
    r = reference_ratio(a100.gpu_name)[0]
    busy = precision_fix(figures(gpu_span=1.0, utilisation=(80.0,) * 3, setup=a100))
    assert busy is not None and busy.call == "trainperf.MixedPrecision()"
    assert busy.predicted_speedup == pytest.approx(1 / (0.2 + 0.8 / r))  # Amdahl on 80 %
    assert busy.basis.endswith("on the 80% of step time the GPU is busy")
    unknown = precision_fix(figures(setup=a100))
    assert unknown is not None and unknown.predicted_speedup == pytest.approx(r)
    assert "all (not measured)" in unknown.basis


def test_mixed_precision_gains_nothing_where_it_keeps_fp32() -> None:
    pascal = precision_fix(figures(setup=LoopSetup(gpu_name="TITAN Xp", gpu_capability=(6, 1))))
    assert pascal is not None and pascal.predicted_speedup == 1.0
    assert pascal.basis.startswith("compute capability 6.1 has no fast fp16")
    plain = precision_fix(cpu_loop(setup=LoopSetup(cpu_native_bf16=False)))
    assert plain is not None and plain.predicted_speedup == 1.0 and "no native bf16" in plain.basis
    native = precision_fix(cpu_loop(setup=LoopSetup(cpu_native_bf16=True)))
    assert native is not None and native.predicted_speedup == 1.0
    assert native.basis.startswith("not predicted: bf16 on this CPU")
    why = "auto: the CPU has no native bf16 -> fp32"
    chosen = precision_fix(cpu_loop(precision=("fp32", why)))
    assert chosen is not None and chosen.predicted_speedup == 1.0 and why in chosen.basis
    assert precision_fix(figures(precision=("bf16", "auto"))) is None  # already lower


def test_bf16_on_a_cpu_speeds_up_the_share_not_waiting_by_what_the_probe_measured() -> None:
    # 20 ms steps, 4 ms waiting: the 80 % computing runs 1.6x faster: 1 / (0.2 + 0.8 / 1.6).
    setup = LoopSetup(cpu_native_bf16=True, cpu_bf16_speedup=1.6)
    fix = precision_fix(cpu_loop(wait_fraction=0.2, setup=setup))
    assert fix is not None and fix.call == "trainperf.MixedPrecision()"
    assert fix.predicted_speedup == pytest.approx(1 / 0.7)
    assert fix.basis == (
        "a small MLP training step ran 1.60x faster under bf16 autocast than in fp32 on this "
        "CPU (measured by a probe), on the 80% of step time not spent waiting for data (an "
        "upper bound: the process's CPU was not sampled; a longer run, or a shorter "
        "`interval`, measures it)"
    )
    # A probe that found bf16 no faster: no gain, the measurement named.
    slower = LoopSetup(cpu_native_bf16=True, cpu_bf16_speedup=0.9)
    none = precision_fix(cpu_loop(wait_fraction=0.2, setup=slower))
    assert none is not None and none.predicted_speedup == 1.0
    assert none.basis.endswith("on this CPU (0.90x, measured by a probe): no gain")
    # A CPU without native bf16 keeps fp32 whatever a figure says.
    plain = LoopSetup(cpu_native_bf16=False, cpu_bf16_speedup=1.6)
    kept = precision_fix(cpu_loop(setup=plain))
    assert kept is not None and kept.predicted_speedup == 1.0


def test_bf16_on_a_cpu_does_not_speed_up_a_step_that_does_not_compute() -> None:
    # 20 ms steps, 4 ms waiting (0.2 ms of it on a CPU), the loop's process 6 % of a core:
    # 1.2 ms of CPU a step, 1 ms outside the wait, so bf16 speeds up 5 % of the step, not
    # the 80 % a step that sleeps (or waits on the network) spends outside the data wait.
    setup = LoopSetup(cpu_native_bf16=True, cpu_bf16_speedup=1.6)
    idle = cpu_loop(wait_fraction=0.2, wait_cpu_s=0.0002, process_cpu=6.0, setup=setup)
    fix = precision_fix(idle)
    assert fix is not None and fix.predicted_speedup == pytest.approx(1 / (0.95 + 0.05 / 1.6))
    assert fix.basis.endswith(
        "on the 5% of step time the loop's process computed (its sampled CPU)"
    )
    # A step that keeps a core busy: all of its 80 % counts, as before.
    busy = precision_fix(dataclasses.replace(idle, process_cpu=100.0))
    assert busy is not None and busy.predicted_speedup == pytest.approx(1 / 0.7)
    assert busy.basis.endswith("on the 80% of step time not spent waiting for data")


def test_a_larger_batch_fills_a_gpu_the_host_keeps_waiting() -> None:
    starved = batch_fix(figures(gpu_span=0.4))
    assert starved is not None and starved.predicted_speedup == 2.0  # doubled, capped at 2
    assert starved.call == BATCH_CALL
    half = batch_fix(figures(gpu_span=0.8))
    assert half is not None and half.predicted_speedup == pytest.approx(1.25)
    full = batch_fix(figures(gpu_span=1.0))
    assert full is not None and full.predicted_speedup == pytest.approx(1.0)
    assert batch_fix(figures()) is None  # nothing says how busy the GPU is
    assert batch_fix(cpu_loop()) is None


def test_moving_to_the_gpu_is_not_predicted() -> None:
    fix = gpu_fix(cpu_loop())
    assert fix.finding == "gpu-unused" and fix.predicted_speedup == 1.0
    assert fix.basis.startswith("not predicted: ") and "trainperf.to_device" in fix.call


# --------------------------------------------------------------------------- the CPUs


def test_fewer_threads_let_the_workers_keep_up() -> None:
    # 20 ms steps, 6 ms waiting; 16 threads on 2 CPUs; the 2 workers use 0.6 cores (12 ms
    # of CPU per step, 6 ms each) and other processes 0.1: 1 thread fits. The workers then
    # keep up with the 14 ms step, whose own gain is not predicted, and the 1.9 CPUs left
    # hold its 14 ms and their 12 ms: 20 ms -> 14 ms.
    setup = LoopSetup(torch_threads=16, num_workers=2)
    f = cpu_loop(process_cpu=180.0, workers_cpu=60.0, host_cpu=95.0, wait_fraction=0.3,
                 setup=setup)  # fmt: skip
    fix = threads_fix(f)
    assert fix is not None and fix.call == "torch.set_num_threads(1)"
    assert fix.predicted_speedup == pytest.approx(20 / 14)
    assert fix.basis.startswith("at least: torch runs 16 threads on 2 usable CPUs, 1 core left")
    # One worker needing 0.9 cores (18 ms of CPU per step): it is the bound.
    one = dataclasses.replace(setup, num_workers=1)
    slow_worker = cpu_loop(process_cpu=180.0, workers_cpu=90.0, host_cpu=95.0,
                           wait_fraction=0.3, setup=one)  # fmt: skip
    bounded = threads_fix(slow_worker)
    assert bounded is not None and bounded.predicted_speedup == pytest.approx(20 / 18)
    # Workers needing 1.2 cores (24 ms): with the step's 14 ms the CPUs are full already.
    full = threads_fix(dataclasses.replace(f, workers_cpu=140.0))
    assert full is not None and full.predicted_speedup == pytest.approx(1.0)
    assert "but the CPUs hold its 14.0 ms of CPU and the workers' 28.0 ms in no less than" in (
        full.basis
    )
    assert threads_fix(cpu_loop(process_cpu=180.0, host_cpu=95.0)) is None  # threads unknown


def test_fewer_threads_keep_the_loop_s_own_loading() -> None:
    # The probe's 4x makes the 14 ms step 3.5 ms; the workers' 12 ms of CPU and the step's
    # leave the CPUs the bound. Receiving the batches from the workers cost the loop's
    # thread 1 ms of CPU while it waited: it stays, 16.5 ms of CPU in 8.7 ms.
    fast = LoopSetup(torch_threads=16, num_workers=2, fewer_threads=1, fewer_threads_speedup=4.0)
    loop = {"process_cpu": 180.0, "workers_cpu": 60.0, "host_cpu": 95.0, "wait_fraction": 0.3}
    bare = threads_fix(cpu_loop(**loop, setup=fast))
    receiving = threads_fix(cpu_loop(**loop, setup=fast, wait_cpu_s=0.001))
    assert bare is not None and receiving is not None
    assert bare.predicted_speedup == pytest.approx(20 / (15.5 / 1.9))
    assert receiving.predicted_speedup == pytest.approx(20 / (16.5 / 1.9))
    assert "data wait goes but for the 1.0 ms the loop takes to receive its batches" in (
        receiving.basis
    )
    # A wait that is all receiving stays whole: 21.5 ms of CPU in 11.3 ms.
    all_receiving = threads_fix(cpu_loop(**loop, setup=fast, wait_cpu_s=0.008))
    assert all_receiving is not None
    assert all_receiving.predicted_speedup == pytest.approx(20 / (21.5 / 1.9))
    assert "the workers keep up; the 6.0 ms data wait, the loop receiving its batches, stays" in (
        all_receiving.basis
    )
    # Without workers the loop loads in its own thread: its 6 ms wait stays, and with the
    # step's 3.5 ms that is the bound (9.5 ms), not the step alone.
    alone = dataclasses.replace(fast, num_workers=0, fewer_threads=2)
    own = threads_fix(cpu_loop(process_cpu=190.0, host_cpu=95.0, wait_fraction=0.3, setup=alone))
    assert own is not None and own.call == "torch.set_num_threads(2)"
    assert own.predicted_speedup == pytest.approx(20 / 9.5)
    assert "the 6.0 ms the loop spends loading in its own thread stays" in own.basis
    # Reads that sleep: the loop's thread demanded no CPU while it waited. Other processes
    # keep 0.5 of the 2 CPUs busy; 2 threads make the step 7 ms (probed 2x), and the loop's
    # own 13 ms bind. Had the 6 ms wait been CPU, the 1.5 CPUs would hold 20 ms of it in
    # 13.3 ms, the bound instead.
    shared = LoopSetup(torch_threads=16, num_workers=0, fewer_threads=2,
                       fewer_threads_speedup=2.0, host_cpus=16)  # fmt: skip
    sleepy = {"process_cpu": 190.0, "host_cpu": 36.875, "wait_fraction": 0.3, "setup": shared}
    asleep = threads_fix(cpu_loop(**sleepy, wait_cpu_s=0.0))
    computing = threads_fix(cpu_loop(**sleepy))  # its demand not measured: all of it
    assert asleep is not None and computing is not None
    assert asleep.predicted_speedup == pytest.approx(20 / 13)
    assert computing.predicted_speedup == pytest.approx(20 / (20 / 1.5))
    assert "the CPUs hold its 20.0 ms of CPU" in computing.basis
    # Child processes behind an iterable that is not a DataLoader are workers too (their
    # count unknown, only the CPUs bound them; here the CPUs bind anyway).
    hidden = dataclasses.replace(fast, num_workers=None)
    behind = threads_fix(cpu_loop(**loop, setup=hidden, wait_cpu_s=0.001))
    assert behind is not None and behind.predicted_speedup == receiving.predicted_speedup
    assert "data wait goes but for the 1.0 ms the loop takes to receive its batches" in (
        behind.basis
    )
    # A loop whose wait was not measured: no wait to speak of.
    unwatched = threads_fix(cpu_loop(**{**loop, "wait_fraction": 0.0}, setup=fast))
    assert unwatched is not None and "with 1 the workers keep up, the step's own" in (
        unwatched.basis
    )


def test_fewer_threads_shrink_the_step_by_what_the_crowding_probe_measured() -> None:
    # 20 ms steps, 6 ms waiting; the two workers keep 0.6 of a core busy (6 ms of CPU each
    # per step, 12 ms together), other processes 0.1. The probe found the workload 2x
    # faster with 1 thread than with 16: the step's own 14 ms becomes 7 ms, which the
    # workers keep up with, but the 1.9 CPUs left hold its 7 ms and the workers' 12 ms in
    # 10 ms: 20 -> 10 ms.
    setup = LoopSetup(torch_threads=16, num_workers=2, fewer_threads=1, fewer_threads_speedup=2.0)
    f = cpu_loop(process_cpu=180.0, workers_cpu=60.0, host_cpu=95.0, wait_fraction=0.3,
                 setup=setup)  # fmt: skip
    fix = threads_fix(f)
    assert fix is not None and fix.call == "torch.set_num_threads(1)"
    assert fix.predicted_speedup == pytest.approx(20 / 10)
    assert fix.basis.startswith("torch runs 16 threads on 2 usable CPUs, 1 core left")
    assert "runs 2.00x faster, as a parallel torch workload did with 1 thread instead of 16" in (
        fix.basis
    )
    assert fix.basis.endswith(
        "beside processes as busy as the workers (7.0 ms), and the CPUs hold its 7.0 ms of "
        "CPU and the workers' 12.0 ms in 10.0 ms: 20.0 ms -> 10.0 ms per step"
    )
    # A smaller gain (1.1x: 12.7 ms) and no other processes: the 2 CPUs hold the step and
    # the workers' 12 ms in 12.4 ms, so the step itself binds.
    small = dataclasses.replace(setup, fewer_threads_speedup=1.1)
    alone = threads_fix(dataclasses.replace(f, setup=small, host_cpu=90.0))
    assert alone is not None and alone.predicted_speedup == pytest.approx(20 / (14 / 1.1))
    assert alone.basis.endswith("as busy as the workers (12.7 ms): 20.0 ms -> 12.7 ms per step")
    # A step the probe found 4x faster (3.5 ms): the CPUs, 15.5 ms / 1.9, are the bound.
    fast = dataclasses.replace(setup, fewer_threads_speedup=4.0)
    bound = threads_fix(dataclasses.replace(f, setup=fast))
    assert bound is not None and bound.predicted_speedup == pytest.approx(20 / (15.5 / 1.9))
    # A hypervisor withholding a quarter of the CPU time leaves 1.5 CPUs; the host's 85 %
    # busy is that 25 % and this tree's 60 %, no other process. The step's 3.5 ms of wall
    # time is 2.6 ms of CPU (the rest stolen): 14.6 ms of CPU in 9.75 ms. Each worker's
    # 6 ms of CPU takes it 8 ms, still inside that.
    stolen = threads_fix(
        dataclasses.replace(f, setup=fast, process_cpu=120.0, host_cpu=85.0, host_steal=25.0)
    )
    assert stolen is not None
    assert stolen.predicted_speedup == pytest.approx(20 / ((0.75 * 3.5 + 12) / 1.5))
    assert "the CPUs hold its 2.6 ms of CPU and the workers' 12.0 ms in 9.8 ms" in stolen.basis
    # One worker, with 12 ms of CPU per step: with a third of the time stolen it takes
    # 18 ms on its core, longer than the 1.33 CPUs left need for its CPU and the step's.
    one = dataclasses.replace(fast, num_workers=1)
    slow = threads_fix(
        dataclasses.replace(f, setup=one, workers_cpu=60.0, process_cpu=120.0, host_cpu=90.0,
                            host_steal=100 / 3)
    )  # fmt: skip
    assert slow is not None and slow.call == "torch.set_num_threads(1)"
    assert slow.predicted_speedup == pytest.approx(20 / 18)
    assert "with 1 the workers get cores back and the 6.0 ms data wait goes" in slow.basis
    assert slow.basis.endswith(
        "(3.5 ms), but each worker takes 18.0 ms a step to deliver its share: "
        "20.0 ms -> 18.0 ms per step"
    )
    # Other processes keeping a core of these two busy (8 of the host's 16, 61.25 % busy
    # with this tree's 1.8) leave the step and the workers one: 20 -> 15.5 ms.
    spread = dataclasses.replace(fast, host_cpus=16)
    crowded = threads_fix(dataclasses.replace(f, setup=spread, host_cpu=61.25))
    assert crowded is not None and crowded.predicted_speedup == pytest.approx(20 / 15.5)
    # A probe that found fewer threads no faster: the step's own time kept, and said so.
    slower = dataclasses.replace(setup, fewer_threads_speedup=0.8)
    kept = threads_fix(dataclasses.replace(f, setup=slower))
    assert kept is not None and kept.predicted_speedup == pytest.approx(20 / 14)
    assert "14.0 ms is kept, as a parallel torch workload ran no faster (0.80x) with 1 thread" in (
        kept.basis
    )
    # A probe of another thread count does not apply to this k: the lower bound again.
    other = dataclasses.replace(setup, fewer_threads=2)
    lower = threads_fix(dataclasses.replace(f, setup=other))
    assert lower is not None and lower.basis.startswith("at least:")
    assert lower.predicted_speedup == pytest.approx(20 / 14)


def test_the_hosts_cpus_back_take_the_wait_for_a_cpu_off_the_step() -> None:
    fix = free_cpus_fix(cpu_loop(cpu_delay_s=0.005))
    assert fix.predicted_speedup == pytest.approx(20 / 15)
    assert fix.basis == (
        "the loop's thread waited 5.0 ms per step for a CPU other processes held: 20.0 ms -> "
        "15.0 ms per step without them"
    )
    unknown = free_cpus_fix(cpu_loop())
    assert unknown.predicted_speedup == 1.0 and unknown.basis.startswith("not predicted")
    odd = free_cpus_fix(cpu_loop(cpu_delay_s=0.02))
    assert odd.predicted_speedup == 1.0 and "not shorter than the step" in odd.basis


def test_cpu_bound_loading_gets_only_the_cores_other_processes_leave() -> None:
    # 15 ms of CPU-bound loading, a 5 ms step that leaves both CPUs to workers: 2 workers.
    # On a quiet host they deliver every 7.5 ms; where other processes keep 1.5 cores busy
    # they have one core between them: every 15 ms.
    quiet = cpu_loop(wait_fraction=0.75, wait_cpu_s=0.015, process_cpu=30.0, host_cpu=15.0)
    busy = cpu_loop(wait_fraction=0.75, wait_cpu_s=0.015, process_cpu=30.0, host_cpu=90.0)
    assert tuner_workers(quiet, load_cost(quiet)) == tuner_workers(busy, load_cost(busy)) == (2, 2)
    fast, slow = loader_fix(quiet, "input-bound"), loader_fix(busy, "input-bound")
    assert fast is not None and fast.predicted_speedup == pytest.approx(20 / 7.5)
    assert slow is not None and slow.predicted_speedup == pytest.approx(20 / 15)
    assert "2 cores left to workers, 1.5 of them busy with other processes" in slow.basis
    # The loop thread's CPU demand (wait_cpu_s) already counts a hypervisor's steal: the
    # same figures with a quarter of the time stolen predict the same.
    stolen = dataclasses.replace(quiet, host_steal=25.0)
    same = loader_fix(stolen, "input-bound")
    assert same is not None and same.predicted_speedup == pytest.approx(20 / 7.5)
    assert "stolen" not in same.basis


def test_workers_cpu_gets_only_the_time_the_hypervisor_leaves() -> None:
    # Two workers sampled at 1.5 cores (30 ms of CPU a step): 3 workers on the 2 cores
    # left deliver every 15 ms; with a quarter of the time stolen, 1.5 cores: every 20 ms.
    loop = {"wait_fraction": 0.75, "process_cpu": 160.0, "workers_cpu": 150.0,
            "host_cpu": 80.0, "setup": LoopSetup(num_workers=2)}  # fmt: skip
    quiet = loader_fix(cpu_loop(**loop), "input-bound")
    assert quiet is not None and quiet.predicted_speedup == pytest.approx(20 / 15)
    robbed = loader_fix(cpu_loop(**loop, host_steal=25.0), "input-bound")
    assert robbed is not None and robbed.predicted_speedup == pytest.approx(1.0)
    assert "2 cores left to workers, 25% of their time stolen by the hypervisor" in robbed.basis


def _resolve(expr: ast.expr) -> Any:
    """The object a dotted ``trainperf.a.b`` expression names, or None for anything else."""
    dotted = ast.unparse(expr)
    if not dotted.startswith("trainperf."):
        return None
    module, attr = dotted.rsplit(".", 1)
    return getattr(importlib.import_module(module), attr)


def _bound_calls(code: str) -> list[inspect.BoundArguments]:
    """Each ``trainperf.`` call in a fix's code bound to the real signature; a method of
    a constructed object (``trainperf.X(...).m(...)``) to ``X.m``, with a stand-in self."""
    out = []
    for node in ast.walk(ast.parse(code.split(";")[-1].strip())):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        method = isinstance(node.func.value, ast.Call)
        owner = _resolve(node.func.value.func) if method else _resolve(node.func)  # type: ignore[attr-defined]
        if owner is None:
            continue
        fn = functools.partial(getattr(owner, node.func.attr), None) if method else owner
        args = [None] * sum(not isinstance(a, ast.Starred) for a in node.args)
        kwargs = {k.arg: None for k in node.keywords if k.arg is not None}
        out.append(inspect.signature(fn).bind(*args, **kwargs))
    return out


@pytest.mark.parametrize(
    "call", [LOADER_CALL, GPU_DECODE_CALL, ASYNC_SAVE_CALL, PRECISION_CALL, BATCH_CALL]
)
def test_every_named_call_runs_as_written(call: str) -> None:
    # A user copies the fix from the report: its arguments must bind to the real signature
    # (``save(state, step, ...)`` raised TypeError: step is keyword-only).
    bound = _bound_calls(call)  # bind() raises TypeError where an argument does not fit
    assert len(bound) == call.count("trainperf.") + call.count(")."), call


def test_the_cpu_bound_counts_each_of_the_threads_that_fit() -> None:
    # 8 CPUs, 32 threads, 4 workers on 2 cores (40 ms of CPU a step), no others: 6
    # threads fit. The probe found them 1.5x faster: the step's 14 ms becomes 9.3 ms on
    # each of 6 threads, 56 ms of CPU, which with the workers' 40 ms takes the 8 CPUs 12 ms.
    setup = LoopSetup(torch_threads=32, num_workers=4, fewer_threads=6, fewer_threads_speedup=1.5)
    f = cpu_loop(cpus=8, process_cpu=700.0, workers_cpu=200.0, host_cpu=87.5,
                 wait_fraction=0.3, setup=setup)  # fmt: skip
    fix = threads_fix(f)
    assert fix is not None and fix.call == "torch.set_num_threads(6)"
    assert fix.predicted_speedup == pytest.approx(20 / 12)
    assert "the CPUs hold its 56.0 ms of CPU and the workers' 40.0 ms in 12.0 ms" in fix.basis


def test_one_worker_is_named_in_the_singular() -> None:
    # Before: "1 workers deliver a step's batches every ...".
    f = cpu_loop(wait_fraction=0.5, workers_cpu=10.0, setup=LoopSetup(num_workers=1))
    assert load_cost(f).how.startswith("1 worker delivers a step's batches every")
