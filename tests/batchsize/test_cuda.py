"""On a GPU: a real out-of-memory error is caught, the choice keeps the headroom, and 200
training steps at the chosen size run without running out of memory."""

from __future__ import annotations

import math
import time

import pytest
import torch
from torch import nn

from tests.batchsize._fakes import QUICK
from trainperf import tune_batch_size
from trainperf.batchsize import BatchSizeCandidate
from trainperf.batchsize._agree import Agreement
from trainperf.batchsize._compare import Comparison
from trainperf.batchsize._memory import CudaMemory
from trainperf.batchsize._probe import Prober
from trainperf.batchsize._state import SavedState

pytestmark = [pytest.mark.requires_cuda, pytest.mark.slow]


def test_a_real_oom_is_recovered_and_200_steps_at_the_choice_fit() -> None:
    dev = torch.device("cuda", 0)
    free, _ = torch.cuda.mem_get_info(dev)
    per_sample = free // 40  # sizes past ~40 cannot fit: a real allocation failure
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Dropout(0.1), nn.Linear(64, 1)).to(dev)
    opt = torch.optim.Adam(model.parameters())

    def step(x: torch.Tensor) -> None:
        time.sleep(0.01)  # a fixed cost per step: throughput grows with the size up to OOM
        activations = torch.empty(len(x) * per_sample, dtype=torch.uint8, device=dev)
        activations.fill_(1)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        del activations

    before = [p.detach().clone() for p in model.parameters()]
    cuda_rng = torch.cuda.get_rng_state(dev)
    report = tune_batch_size(
        step, lambda n: torch.randn(n, 64), model=model, optimizer=opt, max_size=256,
        budget_s=60, progress=False, cache=False,
    )  # fmt: skip
    print(report)
    assert report.device == "cuda:0" and report.memory_kind == "cuda"
    statuses = {c.status for c in report.candidates}
    assert "oom" in statuses or "over-headroom" in statuses or "skipped" in statuses
    chosen = report.chosen()
    assert chosen is not None and chosen.peak_memory is not None
    assert report.usable_memory is not None and chosen.peak_memory <= report.usable_memory
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert torch.equal(torch.cuda.get_rng_state(dev), cuda_rng)
    for _ in range(200):  # the choice was measured: training at it must not run out
        step(torch.randn(report.batch_size, 64, device=dev))
    torch.cuda.synchronize(dev)


def test_the_alternation_holds_one_sizes_batch_on_the_gpu_at_a_time() -> None:
    dev = torch.device("cuda", 0)
    mib = 2**20
    seen: list[tuple[int, int]] = []

    def sample(n: int) -> torch.Tensor:  # n MiB, built on the GPU
        return torch.ones(n, mib // 4, device=dev)

    def step(x: torch.Tensor) -> None:
        seen.append((x.numel() * 4 // mib, torch.cuda.memory_allocated(dev)))

    torch.cuda.synchronize(dev)
    base = torch.cuda.memory_allocated(dev)
    p = Prober(
        step, sample, dev, CudaMemory(dev), SavedState.save([]), Agreement(), deadline=math.inf,
        usable=lambda: None, policy=QUICK,
    )  # fmt: skip
    rates = [BatchSizeCandidate(n, "ok", samples_per_s=100.0 * n, spread=0.01) for n in (64, 128)]
    cmp = p.compare(rates, 2)
    assert isinstance(cmp, Comparison) and len(cmp.rounds) == 2
    assert {n for n, _ in seen} == {64, 128}
    # Only the batch of the size running is on the GPU (not the other size's too).
    assert all(allocated - base <= (n + 1) * mib for n, allocated in seen), seen
