"""trainperf.pipelines._dali_graph: the DALI graph, defined (not run) for the CPU and the GPU."""

from __future__ import annotations

from typing import Any

import pytest

from tests.pipelines._images import needs_dali
from trainperf.pipelines import IMAGENET_MEAN, IMAGENET_STD


def _graph_ops(pipe: Any) -> list[tuple[str, str, str]]:
    """(operator, device, spec text) of a defined, unbuilt DALI pipeline."""
    pipe._build_graph()
    out = []
    for op in pipe._ops:
        spec = str(op.spec)
        name = spec.splitlines()[0].removeprefix("OpSpec for ").rstrip(":")
        device = next(line.split(":")[1].strip() for line in spec.splitlines() if "device:" in line)
        out.append((name, device, spec))
    return out


def _dali_graph(**kw: Any) -> Any:
    """A DALI pipeline, defined without a GPU (``device_id=None``), batches of 2, one thread,
    unless ``kw`` says otherwise. Its input is never called: it is not built."""
    from trainperf.pipelines._dali_graph import build_pipeline

    def never() -> Any:
        raise AssertionError("a graph that is only defined reads no input")

    args: dict[str, Any] = {
        "gpu": False,
        "device_id": None,
        "batch_size": 2,
        "num_threads": 1,
        "mean": IMAGENET_MEAN,
        "std": IMAGENET_STD,
        **kw,
    }
    return build_pipeline(never, **args)


@needs_dali
@pytest.mark.parametrize("train", [True, False])
def test_dali_gpu_graph_decodes_mixed_and_augments_on_the_gpu(train: bool) -> None:
    # device_id=None lets the graph be defined without a GPU; gpu=True picks the GPU operators.
    pipe = _dali_graph(gpu=True, train=train, size=224)
    ops = _graph_ops(pipe)
    devices = {name: device for name, device, _ in ops}
    # The files come from trainperf's feed (sharded and shuffled there, see test_dali_feed.py),
    # never from DALI's file reader, so DALI is given no file name at all.
    assert devices["ExternalSource"] == "cpu" and "readers__File" not in devices
    decoder = "decoders__ImageSlice" if train else "decoders__Image"
    assert devices[decoder] == "mixed"
    assert devices["Resize"] == "gpu" and devices["CropMirrorNormalize"] == "gpu"
    if not train:
        assert devices["Slice"] == "gpu"


@needs_dali
@pytest.mark.parametrize("gpu", [False, True])
def test_dali_zero_copy_executor_on_the_cpu_only(gpu: bool) -> None:
    pipe = _dali_graph(gpu=gpu, train=True, size=32)
    assert pipe.exec_dynamic is (not gpu)


@needs_dali
@pytest.mark.parametrize("gpu", [False, True])
def test_dali_train_graph_resizes_antialiased_on_the_gpu_and_leaves_the_cpu_crops_to_torch(
    gpu: bool,
) -> None:
    pipe = _dali_graph(gpu=gpu, train=True, size=32)
    ops = {name: spec for name, _, spec in _graph_ops(pipe)}
    assert "decoders__ImageSlice" in ops
    if gpu:
        assert "antialias: True" in ops["Resize"] and "CropMirrorNormalize" in ops
    else:  # CpuTrainFinish resizes (antialiased), mirrors and normalises in torch
        assert "Resize" not in ops and "CropMirrorNormalize" not in ops


@needs_dali
@pytest.mark.parametrize("gpu", [False, True])
def test_dali_train_graph_draws_nothing_at_random(gpu: bool) -> None:
    # DALI's random operators are seeded once per pipeline: an epoch run again got other
    # crops. The feed hands over each image's crop box and flip instead.
    ops = _graph_ops(_dali_graph(gpu=gpu, train=True, size=32))
    assert not [name for name, _, _ in ops if "random" in name.lower()]
