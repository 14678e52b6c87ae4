"""One protocol for every result object: ``str()`` is the table, ``to_dict()`` is JSON-safe.

Each package's own tests check what the text and the dict say; this test checks that no
result type is left without the protocol, on real instances made cheaply on the CPU.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
import torch
from torch import nn

import trainperf
from trainperf import batchsize, bench, checkpoint, device, doctor, loader, monitor


def _watch_report() -> object:
    steps = [
        monitor.StepRecord(i, start=i * 0.02, wait=0.015, compute=0.005, samples=32, gpu_busy=None)
        for i in range(50)
    ]
    return monitor.analyse(steps)


def _load_result() -> object:
    model = nn.Linear(2, 2)
    state = {k: v.clone() for k, v in model.state_dict().items() if k == "weight"}
    return trainperf.load_state_dict(model, state, strict=False)


def _gpu_info() -> object:
    return device.GpuInfo(
        index=0,
        nvml_index=0,
        name="NVIDIA H200",
        uuid="GPU-0",
        memory_total=141 * 2**30,
        memory_used=2**30,
        memory_free=140 * 2**30,
        utilization=3,
        compute_capability=(9, 0),
        pci_bus_id="00000000:3B:00.0",
    )


def _check() -> object:
    return doctor.check_load(load_average=0.5, cpus=4)


FACTORIES: dict[str, Callable[[], object]] = {
    "DoctorReport": lambda: doctor.DoctorReport(checks=(_check(),)),  # type: ignore[arg-type]
    "WatchReport": _watch_report,
    "WhatIf": lambda: _watch_report().what_if(),  # type: ignore[attr-defined]
    "LoaderChange": lambda: monitor.LoaderChange(3, 1.5, (0, None), (4, 2), "input-bound", "x"),
    "BenchResult-matmul": lambda: bench.bench_matmul("fp32", size=64, iterations=2, device="cpu"),
    "Skipped": lambda: bench.Skipped("matmul", "fp16", "not on the CPU"),
    "ReferenceComparison": lambda: bench.compare_to_reference(
        "NVIDIA A100-SXM4-80GB", "resnet50", "fp32", 1000.0
    ),
    "LoadResult": _load_result,
    "HostLimits": trainperf.host_limits,
    "GpuInfo": _gpu_info,
    "BatchSizeReport": lambda: batchsize.BatchSizeReport(
        8,
        1,
        10.0,
        None,
        None,
        (batchsize.BatchSizeCandidate(8, "ok", samples_per_s=10.0),),
        1.0,
        5.0,
        0.1,
        "cpu",
    ),
}


@pytest.mark.parametrize("kind", sorted(FACTORIES))
def test_result_prints_a_table_and_serialises_to_json(kind: str) -> None:
    result = FACTORIES[kind]()
    assert type(result).__str__ is not object.__str__, f"{kind} has no __str__ of its own"
    text = str(result)
    assert text and text != repr(result)
    data = result.to_dict()  # type: ignore[attr-defined]
    assert isinstance(data, dict) and data
    assert json.loads(json.dumps(data)) == data


def test_tuning_report_follows_the_protocol() -> None:
    data = torch.utils.data.TensorDataset(torch.randn(64, 4))
    report = loader.tune_loader(
        data, 8, device="cpu", max_workers=0, budget_s=5, cache=False, progress=False
    )
    assert "num_workers" in str(report)
    assert (
        json.loads(json.dumps(report.to_dict()))["num_workers"] == report.best_kwargs["num_workers"]
    )


def test_every_public_result_type_has_the_protocol() -> None:
    public = [checkpoint.LoadResult, device.GpuInfo, trainperf.HostLimits, doctor.DoctorReport]
    public += [monitor.WatchReport, loader.TuningReport, bench.BenchResult, bench.MatmulResult]
    public += [bench.H2DResult, bench.ReferenceComparison, bench.Skipped, loader.UserSetting]
    public += [doctor.AllReduceSweep, batchsize.BatchSizeReport, batchsize.BatchSizeCandidate]
    public += [loader.TuningChange, monitor.WhatIf, monitor.LoaderChange]
    for cls in public:
        assert callable(getattr(cls, "to_dict", None)), f"{cls.__name__} has no to_dict()"
        assert "__str__" in vars(cls), f"{cls.__name__} has no __str__ of its own"
