"""``tune_batch_size`` end to end on the CPU: OOM recovery, state and RNG, errors, cache."""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from tests.batchsize._fakes import MeanOnFirstForward, Trainer, same_state, sample, state_of
from trainperf import BatchSizeReport, MixedPrecision, tune_batch_size
from trainperf._utils.imports import is_available
from trainperf.batchsize import _accumulation, _probe, _tune
from trainperf.batchsize._cache import cache_path

pytestmark = pytest.mark.usefixtures("quick")


def tune(t: Trainer, **kw: Any) -> BatchSizeReport:
    kw = {"device": "cpu", "min_size": 2, "budget_s": 30.0, "progress": False, **kw}
    kw.setdefault("cache", False)
    return tune_batch_size(t, kw.pop("sample", sample), model=t.model, optimizer=t.opt, **kw)


def rng_states() -> tuple[Any, ...]:
    return random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state()


@pytest.mark.slow
def test_a_size_that_runs_out_of_memory_is_never_chosen_nor_any_untested_one() -> None:
    # From 16 the growth tries 32 whatever the throughput measured, so an OOM happens
    # however noisy this host is; the refinement then runs into it again between them.
    t = Trainer(oom_above=24, sleep_s=0.004)
    report = tune(t, min_size=16, max_size=256)
    chosen = report.chosen()
    assert chosen is not None and chosen.status == "ok" and report.batch_size <= 24
    # It ran: its warm-up and its timed steps, at that very size.
    assert t.sizes.count(report.batch_size) >= chosen.warmup_steps + chosen.steps >= 3
    assert report.peak_memory is not None and report.peak_memory == chosen.peak_memory
    ooms = [c for c in report.candidates if c.status == "oom"]
    assert [c.batch_size for c in report.candidates][:2] == [16, 32]
    assert ooms and all(c.batch_size > 24 and "simulated" in (c.reason or "") for c in ooms)
    assert all(c.batch_size <= 24 or c.status != "ok" for c in report.candidates)


@pytest.mark.slow
def test_tuning_leaves_parameters_moments_and_every_rng_exactly_as_they_were() -> None:
    t = Trainer(oom_above=32)
    for _ in range(3):
        t(sample(4))  # a run in progress: Adam moments, BatchNorm statistics
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    before, rngs = state_of(t.model, t.opt), rng_states()
    tune(t, max_size=64)
    assert same_state(before, state_of(t.model, t.opt))
    after = rng_states()
    assert after[0] == rngs[0] and np.array_equal(after[1], rngs[1])
    assert torch.equal(after[2], rngs[2])


def test_an_error_in_step_propagates_after_the_state_is_restored() -> None:
    t = Trainer(error_at=4, error=KeyError("a bug in the step"))
    t(sample(2))  # moments exist: they must come back too
    before = state_of(t.model, t.opt)
    torch.manual_seed(5)
    rng = torch.get_rng_state()
    with pytest.raises(KeyError, match="a bug in the step"):
        tune(t, max_size=64)
    assert same_state(before, state_of(t.model, t.opt))
    assert torch.equal(torch.get_rng_state(), rng)


def test_a_runtime_error_saying_out_of_memory_marks_the_size_oom() -> None:
    # Before: "CUDA driver error: out of memory" escaped tune_batch_size as the step's
    # own error, though it is the driver running out of memory at that size.
    t = Trainer(error_at=4, error=RuntimeError("CUDA driver error: out of memory"))
    t(sample(2))
    before = state_of(t.model, t.opt)
    report = tune(t, max_size=4)
    assert report.batch_size < 4
    assert [(c.batch_size, c.status) for c in report.candidates if c.batch_size == 4] == [
        (4, "oom")
    ]
    assert same_state(before, state_of(t.model, t.opt))


def test_a_real_error_at_the_first_size_propagates_with_the_fix() -> None:
    t = Trainer()  # BatchNorm refuses a batch of one sample in training mode
    with pytest.raises(ValueError, match="Expected more than 1 value per channel") as caught:
        tune(t, min_size=1, max_size=4)
    assert str(caught.value).endswith("(1 unless given); pass min_size=2")
    assert isinstance(caught.value.__cause__, ValueError)  # torch's own error, chained


_COMPILED_ONE_PER_CHANNEL = (
    "RuntimeError when making fake tensor call\n  Explanation: Dynamo failed to run FX node "
    "with fake tensors: call_function <function batch_norm>(...): got ValueError('Expected "
    "more than 1 value per channel when training, got input size torch.Size([1, 16])')"
)
"""What ``torch.compile`` raises (as dynamo's ``TorchRuntimeError``) for BatchNorm's refusal."""


def test_batchnorm_refusing_one_sample_inside_torch_compile_also_names_the_fix() -> None:
    # Before: a torch.compile'd model raises BatchNorm's refusal as dynamo's
    # TorchRuntimeError, a RuntimeError: it escaped without the fix, min_size=2.
    error = RuntimeError(_COMPILED_ONE_PER_CHANNEL)
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        x, y = batch
        nn.functional.mse_loss(model(x), y).backward()
        if len(x) == 1:
            raise error
        opt.step()

    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=r"^Expected more than 1 value per channel") as caught:
        tune_batch_size(step, sample, model=model, optimizer=opt, device="cpu", max_size=4,
                        budget_s=10.0, progress=False, cache=False)  # fmt: skip
    assert "(inside a RuntimeError)" in str(caught.value)
    assert str(caught.value).endswith("(1 unless given); pass min_size=2")
    assert caught.value.__cause__ is error
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(torch, "compile"), reason="needs torch.compile")
def test_batchnorm_refusing_one_sample_in_a_compiled_model_names_the_fix() -> None:
    t = Trainer()
    compiled = torch.compile(t.model)

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        x, y = batch
        t.opt.zero_grad()
        nn.functional.mse_loss(compiled(x), y).backward()
        t.opt.step()

    with pytest.raises(ValueError, match="Expected more than 1 value per channel") as caught:
        tune_batch_size(step, sample, model=t.model, optimizer=t.opt, device="cpu", max_size=4,
                        budget_s=30.0, progress=False, cache=False)  # fmt: skip
    assert str(caught.value).endswith("(1 unless given); pass min_size=2")


def test_a_sample_of_the_wrong_size_is_a_clear_error() -> None:
    t = Trainer()
    with pytest.raises(ValueError, match=r"sample\(2\) returned a batch of 3 samples"):
        tune(t, sample=lambda n: sample(n + 1), max_size=8)


def test_a_sample_that_returns_none_is_a_clear_error() -> None:
    # Before: the None went on to step, which failed on it with "cannot unpack
    # non-iterable NoneType object", naming neither sample nor the likely missing return.
    t = Trainer()
    with pytest.raises(ValueError, match=r"sample\(2\) returned None: .*return the batch"):
        tune(t, sample=lambda n: None, max_size=8)
    assert t.sizes == []  # step never ran


def test_device_meta_is_refused_with_the_fix() -> None:
    # Before: "Tensor on device cpu is not on the expected device meta!" from inside a probe.
    t = Trainer()
    with pytest.raises(ValueError, match=r"device='meta': .* no memory to measure.*device='cpu'"):
        tune(t, device="meta", max_size=8)
    assert t.sizes == []


def test_a_sequence_first_batch_tunes_with_batch_dim() -> None:
    # Before: an nn.LSTM without batch_first could not be tuned: its (seq_len, n, features)
    # batch was refused as one of seq_len samples, and there was no way to say otherwise.
    lstm, head = nn.LSTM(8, 4), nn.Linear(4, 1)
    model = nn.ModuleDict({"lstm": lstm, "head": head})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sizes: list[int] = []

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        x, y = batch
        sizes.append(x.shape[1])
        opt.zero_grad()
        nn.functional.mse_loss(head(lstm(x)[0][-1]), y).backward()
        opt.step()

    def seq_first(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(5, n, 8), torch.randn(n, 1)

    kw: dict[str, Any] = {"device": "cpu", "min_size": 2, "max_size": 4, "progress": False}
    with pytest.raises(ValueError, match=r"along dimension 1: .* pass batch_dim=1"):
        tune_batch_size(step, seq_first, model=model, optimizer=opt, **kw)
    report = tune_batch_size(step, seq_first, model=model, optimizer=opt, batch_dim=1, **kw)
    assert report.batch_size in (2, 3, 4) and set(sizes) <= {2, 3, 4}
    assert report.pipeline is not None and report.pipeline.batch_bytes == 4 * (
        5 * report.batch_size * 8 + report.batch_size
    )
    with pytest.raises(ValueError, match=r"batch_dim must be .*, got -1"):
        tune_batch_size(step, seq_first, model=model, optimizer=opt, batch_dim=-1, **kw)


@pytest.mark.slow
def test_the_global_batch_is_kept_with_accumulation() -> None:
    t = Trainer()
    report = tune(t, global_batch=48, max_size=16)
    assert report.world_size == 1 and report.global_batch == 48
    assert report.batch_size * report.accumulation_steps == 48 == report.effective_batch
    assert all(48 % c.batch_size == 0 and c.batch_size <= 16 for c in report.candidates)
    assert all(c.accumulation_steps == 48 // c.batch_size for c in report.candidates)


def test_numpy_arguments_tune_and_leave_a_json_safe_report() -> None:
    # Before: headroom=np.float32(0.1) and budget_s=np.float32(30) were refused on entry.
    report = tune(
        Trainer(), min_size=np.int64(2), max_size=np.int64(4), global_batch=np.int64(8),
        budget_s=np.float32(30), headroom=np.float32(0.1), num_workers=np.int64(1),
    )  # fmt: skip
    assert report.global_batch == 8 and type(report.global_batch) is int
    assert type(report.headroom) is float and type(report.budget_s) is float
    data = json.loads(json.dumps(report.to_dict()))
    assert data["pipeline"]["num_workers"] == 1 and data["effective_batch"] == 8


@pytest.mark.slow
def test_when_no_size_fits_the_error_lists_what_was_tried() -> None:
    t = Trainer(oom_above=1)
    with pytest.raises(RuntimeError, match=r"no batch size that fits: 2: oom \(CUDA out of"):
        tune(t, max_size=8)


def test_a_sample_that_runs_out_of_memory_is_an_oom_with_the_cache_on_too() -> None:
    # The cache key is built from the first size's batch; building it may run out first.
    def oom_sample(n: int) -> Any:
        if n >= 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return sample(n)

    t = Trainer()
    with pytest.raises(RuntimeError, match=r"no batch size that fits: 2: oom \(CUDA out of"):
        tune(t, max_size=8, sample=oom_sample, cache=True)


@pytest.mark.slow
def test_the_choice_is_cached_and_cache_false_tunes_again() -> None:
    t = Trainer()
    first = tune(t, max_size=8, cache=True)
    assert not first.from_cache and cache_path().is_file()
    steps = len(t.sizes)
    hit = tune(t, max_size=8, cache=True)
    assert hit.from_cache and len(t.sizes) == steps  # nothing ran
    assert (hit.batch_size, hit.accumulation_steps) == (first.batch_size, first.accumulation_steps)
    assert [c.batch_size for c in hit.candidates] == [c.batch_size for c in first.candidates]
    assert any("from the cache" in n for n in hit.notes)
    _alive = torch.optim.lr_scheduler.StepLR(t.opt, step_size=1)  # found: not in the key
    assert tune(t, max_size=8, cache=True).from_cache
    other = tune(t, max_size=4, cache=True)  # another range: another key
    assert not other.from_cache
    again = tune(t, max_size=8, cache=False)
    assert not again.from_cache and len(t.sizes) > steps


@pytest.mark.slow
def test_a_mixed_precision_or_checkpointing_the_step_reads_unpassed_misses_the_cache() -> None:
    # Before: the key held the step's body and the objects passed only: a step switched to
    # another precision (a MixedPrecision it reads, not passed), or a model whose gradient
    # checkpointing was turned off, got the size cached for the other setting.
    t = Trainer()
    t.mp = MixedPrecision("cpu", precision="bf16")  # type: ignore[attr-defined]
    assert not tune(t, max_size=2, cache=True).from_cache
    assert tune(t, max_size=2, cache=True).from_cache
    t.mp = MixedPrecision("cpu", precision="fp32")  # type: ignore[attr-defined]
    assert not tune(t, max_size=2, cache=True).from_cache
    t.model[0].gradient_checkpointing = True  # Hugging Face's flag
    assert not tune(t, max_size=2, cache=True).from_cache
    assert tune(t, max_size=2, cache=True).from_cache


@pytest.mark.slow
def test_a_cached_choice_this_call_cannot_use_is_tuned_again_with_a_note() -> None:
    t = Trainer()
    tune(t, max_size=8, cache=True)
    path = cache_path()
    data = json.loads(path.read_text())
    for entry in data["entries"].values():
        entry["batch_size"] = 7  # hand-edited: a size this call allows...
        entry["accumulation_steps"] = 3  # ...with an accumulation it would never choose
    path.write_text(json.dumps(data))
    report = tune(t, max_size=8, cache=True)
    assert not report.from_cache
    assert report.notes[0].startswith("the cached choice was not used (accumulation_steps=3")


@pytest.mark.slow
def test_the_report_prints_a_table_serialises_and_plots(tmp_path: Path) -> None:
    t = Trainer(oom_above=8, sleep_s=0.004)
    report = tune(t, min_size=8, max_size=32, num_workers=2)  # 16 is tried: an OOM
    text = str(report)
    assert text.startswith("Batch size tuning: device cpu, 1 rank,")
    assert "<- chosen" in text and " oom: CUDA out of memory" in text
    assert f"chosen: batch_size={report.batch_size}, accumulation_steps=1" in text
    assert "num_workers=2 x prefetch_factor=2 + 1 holds 5 batches" in text
    data = json.loads(json.dumps(report.to_dict()))
    assert data["batch_size"] == report.batch_size and data["memory_kind"] == "rss"
    assert data["pipeline"]["batches_in_flight"] == 5
    assert [c["status"] for c in data["candidates"]] == [c.status for c in report.candidates]
    if not is_available("matplotlib"):
        pytest.skip("matplotlib is not installed")
    out = report.plot(tmp_path / "batch.png")
    assert out.stat().st_size > 1000


def test_the_device_defaults_to_the_models_and_the_bar_names_the_tuner(
    capsys: pytest.CaptureFixture[str],
) -> None:
    t = Trainer()
    report = tune_batch_size(
        t, sample, model=t.model, optimizer=t.opt, min_size=4, max_size=4, cache=False
    )
    assert report.device == "cpu" and report.batch_size == 4
    err = capsys.readouterr().err
    assert err.startswith("tune_batch_size: measuring batch sizes (budget 60 s)")
    assert "tune_loader" not in err


def test_a_scheduler_the_step_advances_stands_still_and_need_not_be_passed() -> None:
    # A OneCycleLR stepped inside `step` ran past its total_steps within the first probe
    # (ValueError), and any scheduler left unpassed came back further along its schedule.
    t = Trainer()
    sched = torch.optim.lr_scheduler.OneCycleLR(t.opt, max_lr=0.05, total_steps=40)
    for _ in range(3):
        t(sample(4))
        sched.step()
    before, lr = sched.state_dict(), t.opt.param_groups[0]["lr"]

    def step(batch: Any) -> None:
        t(batch)
        sched.step()

    report = tune_batch_size(
        step, sample, model=t.model, optimizer=t.opt, device="cpu", min_size=2, max_size=64,
        budget_s=30.0, progress=False, cache=False,
    )  # fmt: skip
    assert report.batch_size >= 2 and len(t.sizes) > 40  # far more steps than its schedule
    assert sched.state_dict() == before and t.opt.param_groups[0]["lr"] == lr
    assert "step" not in vars(sched)  # its own step() again
    sched.step()
    assert sched.last_epoch == before["last_epoch"] + 1


@pytest.mark.slow
def test_a_choice_cut_short_by_the_budget_is_not_cached() -> None:
    # Before: a 0-second budget's choice (the first size) was stored, and a later call with
    # a minute to spare reused it without measuring anything.
    t = Trainer()
    short = tune(t, max_size=8, budget_s=1e-9, cache=True)
    assert any(c.status == "skipped" and "budget" in (c.reason or "") for c in short.candidates)
    assert "the choice was not cached: budget_s cut the search short" in short.notes
    assert not cache_path().exists()
    assert not tune(t, max_size=8, cache=True).from_cache


def test_a_single_size_whose_timing_the_budget_cut_is_not_cached() -> None:
    # Before: only a size skipped for the budget counted; one whose windows the deadline
    # ended ("the budget cut the timing short") was stored.
    short = tune(Trainer(), max_size=2, budget_s=1e-9, cache=True)
    assert [c.reason for c in short.candidates] == ["the budget cut the timing short"]
    assert "the choice was not cached: budget_s cut the search short" in short.notes
    assert not cache_path().exists()


class VirtualClock:
    """A ``time`` module whose ``perf_counter`` only the step moves: every figure the tuner
    times is exact, however loaded the host is."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


@pytest.mark.filterwarnings("ignore:tune_batch_size. step made gradients")  # never stepped
def test_an_alternation_the_budget_left_no_time_for_keeps_the_choice_out_of_the_cache(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before: "no time left to measure 2, 4 in alternation" was a note, and the choice
    # was stored anyway. Every size runs at exactly 500 samples/s on the virtual clock, so
    # the fastest sizes always make the final shortlist and must alternate (on the real
    # clock a loaded host could put one 40 % behind, and no alternation was attempted).
    clock = VirtualClock()
    for module in (_tune, _probe, _accumulation):
        monkeypatch.setattr(module, "time", clock)
    monkeypatch.setattr("trainperf.batchsize._search.compare_cost", lambda *a: 1e9)
    m = Trainer().model

    def step(batch: Any) -> None:
        clock.now += 0.002 * len(batch[0])
        m(batch[0]).sum().backward()

    report = tune_batch_size(step, sample, model=m, device="cpu", min_size=2, max_size=4,
                             budget_s=30.0, progress=False, cache=True)  # fmt: skip
    assert all(c.ok and c.samples_per_s == pytest.approx(500.0) for c in report.candidates)
    assert any(n.startswith("no time left to measure 2, ") for n in report.notes)
    assert "the choice was not cached: budget_s cut the search short" in report.notes
    assert not cache_path().exists()


def test_the_device_defaults_to_where_the_optimizer_s_parameters_are() -> None:
    # Before: optimizer= without model= fell back to the best device, not theirs.
    weight = nn.Parameter(torch.zeros(2, device="meta"))
    opt = torch.optim.SGD([weight], lr=0.1)
    assert _tune._device(None, [opt]) == torch.device("meta")
    assert _tune._device("cpu", [opt]) == torch.device("cpu")


def quiet(**kw: Any) -> dict[str, Any]:
    return {"device": "cpu", "min_size": 2, "max_size": 4, "progress": False, "cache": False, **kw}


def test_state_that_could_not_be_put_back_is_refused_before_any_step_runs() -> None:
    # Before: without model=/optimizer= the probes trained the real weights (Adam's step
    # count in the thousands); a lazy module crashed in torch; a generator `sample` trained
    # every step after the first on nothing.
    t = Trainer()
    before = state_of(t.model, t.opt)
    with pytest.raises(ValueError, match=r"neither model= nor optimizer="):
        tune_batch_size(t, sample, **quiet())
    lazy = nn.Sequential(nn.LazyLinear(1))
    with pytest.raises(ValueError, match=r"submodule '0' \(LazyLinear\) .* forward pass"):
        tune_batch_size(lambda b: lazy(b[0]), sample, model=lazy, **quiet())
    with pytest.raises(ValueError, match=r"returned a one-shot iterator"):
        tune_batch_size(t, lambda n: iter([sample(n)]), model=t.model, **quiet())
    assert t.sizes == [] and same_state(before, state_of(t.model, t.opt))
    tune_batch_size(lambda b: None, sample, model=(), **quiet(max_size=2))  # no state: fine


def test_an_optimizer_and_a_mixed_precision_the_step_uses_come_back_unpassed() -> None:
    # Before: model= alone left Adam with the probes' moments and step count, and an
    # unpassed MixedPrecision's loss scale and growth tracker as the probes moved them.
    from trainperf.amp import MixedPrecision

    model = nn.Linear(8, 1)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    mp = MixedPrecision("cpu", precision="fp16")

    def step(batch: Any) -> None:
        x, y = batch
        with mp.autocast():
            loss = nn.functional.mse_loss(model(x).float(), y)
        mp.backward(loss)
        mp.step(opt)
        mp.zero_grad(opt)

    step(sample(4))
    before, scaler = state_of(model, opt), mp.state_dict()
    tune_batch_size(step, sample, model=model, **quiet())
    assert same_state(before, state_of(model, opt)) and mp.state_dict() == scaler


def test_a_buffer_set_by_the_first_forward_pass_is_none_again_after_tuning() -> None:
    # Before: every call failed restoring it ("Missing key(s) in state_dict: mean").
    model = MeanOnFirstForward()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(batch: Any) -> None:
        x, _ = batch
        model(x[:, :4]).sum().backward()
        opt.step()
        opt.zero_grad()

    tune_batch_size(step, sample, model=model, optimizer=opt, **quiet())
    assert model.mean is None


class _NoisyDataset(torch.utils.data.Dataset[torch.Tensor]):
    """Augments each sample with noise from a generator of its own."""

    def __init__(self) -> None:
        self.rng = torch.Generator().manual_seed(7)

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((8,), float(i)) + torch.rand(8, generator=self.rng)


@pytest.mark.filterwarnings("ignore:tune_batch_size. step made gradients")  # never stepped
def test_a_dataset_s_own_generator_draws_the_same_samples_after_tuning() -> None:
    # Before: batches_from read samples in this process, and the dataset's generator came
    # back advanced by every batch the probes built.
    from trainperf import batches_from

    ds, untouched = _NoisyDataset(), _NoisyDataset()
    model = nn.Linear(8, 1)

    def step(x: torch.Tensor) -> None:
        model(x).sum().backward()
        model.zero_grad()

    tune_batch_size(step, batches_from(ds), model=model, **quiet())
    assert all(torch.equal(ds[i], untouched[i]) for i in range(4))


@pytest.mark.parametrize("passed", [False, True], ids=["found", "passed"])
def test_a_zero_redundancy_optimizer_comes_back_passed_or_not(tmp_path: Path, passed: bool) -> None:
    # Before: its state_dict() refuses until consolidate_state_dict() ran on every rank,
    # so model= alone, with one alive over the model, made tuning fail.
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer

    dist.init_process_group("gloo", init_method=(tmp_path / "store").as_uri(), rank=0, world_size=1)
    try:
        model = nn.Linear(8, 1)
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam)

        def step(batch: Any) -> None:
            x, y = batch
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()

        step(sample(4))
        before = state_of(model, opt.optim)
        tune_batch_size(step, sample, model=model, optimizer=opt if passed else None, **quiet())
        assert same_state(before, state_of(model, opt.optim))
        assert [g["lr"] for g in opt.param_groups] == [0.001]

        def warm_up(batch: Any) -> None:  # a step that sets the rate by hand
            for group in opt.param_groups:
                group["lr"] *= 0.5
            step(batch)

        tune_batch_size(warm_up, sample, model=model, optimizer=opt if passed else None, **quiet())
        # Before: the local optimizer came back, but ZeRO's own groups, copied into it at
        # its next step, kept the halved rate.
        assert [g["lr"] for g in opt.param_groups] == [0.001]
        assert same_state(before, state_of(model, opt.optim))
    finally:
        dist.destroy_process_group()


_DATA_RNG = np.random.default_rng(0)  # a module-level generator a sample function draws from


@pytest.mark.filterwarnings("ignore:tune_batch_size. step made gradients")  # never stepped
def test_generators_that_step_and_sample_draw_from_come_back_unadvanced() -> None:
    # Before: only a batches_from dataset's generators were put back; a seeded generator a
    # sample or step closes over (or reads as a global) came back advanced by every probe,
    # and the training run that followed drew other batches and other noise.
    g = torch.Generator().manual_seed(0)
    noise = random.Random(0)
    model = nn.Linear(8, 1)

    def sample_fn(n: int) -> torch.Tensor:
        return torch.randn(n, 8, generator=g) + float(_DATA_RNG.random())

    class Step:
        def __init__(self) -> None:
            self.noise = noise

        def __call__(self, x: torch.Tensor) -> None:
            (model(x).sum() * self.noise.random()).backward()
            model.zero_grad()

    before = g.get_state(), _DATA_RNG.bit_generator.state, noise.getstate()
    tune_batch_size(Step(), sample_fn, model=model, **quiet())
    assert torch.equal(g.get_state(), before[0])
    assert _DATA_RNG.bit_generator.state == before[1] and noise.getstate() == before[2]


def test_when_even_one_sample_runs_out_of_memory_the_error_suggests_no_lower_min_size() -> None:
    # Before: "Lower min_size (now 1) or headroom (now 0.1)": neither can help an OOM at 1.
    model = nn.Linear(8, 1)

    def step(x: torch.Tensor) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")

    with pytest.raises(RuntimeError, match=r"1: oom \(CUDA out of memory.*\)\. Free") as e:
        tune_batch_size(step, lambda n: torch.zeros(n, 8), model=model, **quiet(min_size=1))
    assert "min_size" not in str(e.value) and "headroom" not in str(e.value)


class _EmaOf(nn.Module):
    """An EMA kept as a plain module holding a copy of the model (timm's ``ModelEmaV3``)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.module = copy.deepcopy(model)

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        now_state = model.state_dict().values()
        for ema, now in zip(self.module.state_dict().values(), now_state, strict=True):
            ema.copy_(0.9 * ema + 0.1 * now if ema.is_floating_point() else now)


def test_an_ema_or_swa_average_the_step_updates_comes_back_unpassed() -> None:
    # Before: an AveragedModel (or a timm-style EMA) updated by step but not passed came
    # back averaged over every probe step (n_averaged 2 -> hundreds), silently.
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    t = Trainer()
    swa = AveragedModel(t.model, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
    ema = _EmaOf(t.model)

    def step(batch: Any) -> None:
        t(batch)
        swa.update_parameters(t.model)
        ema.update(t.model)

    for _ in range(2):
        step(sample(4))
    before = copy.deepcopy(swa.state_dict()), copy.deepcopy(ema.state_dict())
    tune_batch_size(step, sample, model=t.model, optimizer=t.opt, **quiet())
    assert same_state({"swa": before[0], "ema": before[1]},
                      {"swa": swa.state_dict(), "ema": ema.state_dict()})  # fmt: skip
    assert int(swa.n_averaged) == 2


class _Noise(nn.Module):
    """Noise drawn from generators a submodule owns (a seeded augmentation layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.gen = torch.Generator().manual_seed(0)
        self.np_rng = np.random.default_rng(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.randn(x.shape, generator=self.gen) * float(self.np_rng.random())


@pytest.mark.parametrize("passed", ["model", "optimizer"])
def test_generators_a_submodule_of_the_model_owns_come_back_unadvanced(passed: str) -> None:
    # Before: only generators the step read directly (or one attribute down) came back; a
    # layer's own generator inside the model came back advanced by every probe step.
    model = nn.Sequential(nn.Linear(8, 8), _Noise(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(batch: Any) -> None:
        x, y = batch
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    noise = model[1]
    before = noise.gen.get_state(), noise.np_rng.bit_generator.state
    # model= as passed (its optimizer found), or the model found by its optimizer
    given = {"model": model} if passed == "model" else {"optimizer": opt}
    tune_batch_size(step, sample, **given, **quiet())
    assert torch.equal(noise.gen.get_state(), before[0])
    assert noise.np_rng.bit_generator.state == before[1]


def test_the_model_an_optimizer_steps_is_looked_for_once_per_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Each look is a scan of every object the garbage collector tracks; the generators and
    # the saved state both need the model found (before, each looked for it on its own).
    from trainperf.batchsize import _holders, _state

    looks: list[int] = []
    original = _holders.owning_modules

    def counted(objects: Any) -> list[nn.Module]:
        looks.append(1)
        return original(objects)

    for module in (_holders, _state, _tune):
        monkeypatch.setattr(module, "owning_modules", counted, raising=False)
    t = Trainer()
    before = state_of(t.model, t.opt)
    tune_batch_size(t, sample, optimizer=t.opt, **quiet())
    assert len(looks) == 1
    assert same_state(before, state_of(t.model, t.opt))  # the model found came back as it was
