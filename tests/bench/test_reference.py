"""trainperf.bench._reference: the reference tables, GPU-name matching, the comparison."""

from __future__ import annotations

import csv
import importlib
import io
import json
import re
from importlib.resources import files

import numpy as np
import pytest
import torch

from trainperf.bench import (
    compare_to_reference,
    find_gpu_spec,
    find_reference_gpu,
    gpu_specs,
    normalize_gpu_name,
    reference_throughput,
)
from trainperf.bench._reference import SLOW_RATIO, TF32_CAVEAT


def _csv_rows(name: str) -> list[dict[str, str]]:
    text = (files("trainperf.bench") / "data" / name).read_text()
    return list(csv.DictReader(io.StringIO("\n".join(
        line for line in text.splitlines() if line and not line.startswith("#")
    ))))  # fmt: skip


# --------------------------------------------------------------------------- reference tables


def test_reference_table_has_every_row_and_column_of_the_csv() -> None:
    rows = _csv_rows("seed_gpu_throughput.csv")
    table = reference_throughput()
    assert list(table) == [r["gpu"] for r in rows]
    for row in rows:
        assert table[row["gpu"]] == {k: float(v) for k, v in row.items() if k != "gpu"}
    assert set(table["V100"]) == {
        "resnet50_fp16",
        "resnet50_fp32",
        "vit_base_patch16_224_fp16",
        "vit_base_patch16_224_fp32",
    }


def test_reference_table_is_a_fresh_copy() -> None:
    reference_throughput()["3090"]["resnet50_fp16"] = -1.0
    assert reference_throughput()["3090"]["resnet50_fp16"] > 0


def test_specs_table_loads() -> None:
    specs = gpu_specs()
    assert [s.gpu for s in specs] == [r["gpu"] for r in _csv_rows("seed_gpu_specs.csv")]
    assert all(s.fp32_tflops > 0 and s.fp16_tflops > 0 for s in specs)


@pytest.mark.parametrize(
    ("reported", "row"),
    [
        ("NVIDIA GeForce RTX 3090", "3090"),
        ("NVIDIA GeForce RTX 3090 Ti", "3090 Ti"),
        ("NVIDIA GeForce RTX 3080 Ti", "3080 Ti"),
        ("NVIDIA GeForce RTX 3080", "3080"),
        ("NVIDIA GeForce RTX 3060", "3060"),
        ("NVIDIA GeForce RTX 3060 Ti", None),
        ("NVIDIA GeForce RTX 3060 Laptop GPU", None),
        ("NVIDIA GeForce RTX 4090", "4090"),
        ("NVIDIA GeForce RTX 4080 SUPER", None),
        ("NVIDIA GeForce RTX 2080 Ti", "2080 Ti"),
        ("NVIDIA GeForce GTX 1080 Ti", "1080 Ti"),
        ("GeForce GTX 1080", None),
        ("NVIDIA TITAN Xp", "TITAN Xp"),
        ("NVIDIA TITAN X (Pascal)", None),
        ("Tesla V100-SXM2-32GB", "V100"),
        ("Tesla V100-PCIE-16GB", "V100"),
        ("Tesla V100-DGXS-32GB", "V100"),
        ("Tesla V100S-PCIE-32GB", None),
        ("Tesla T4", "Tesla T4"),
        ("Tesla P40", "Tesla P40"),
        ("NVIDIA A100-SXM4-80GB", "A100"),
        ("NVIDIA A100 80GB PCIe", "A100"),
        ("NVIDIA A100-PCIE-40GB", "A100"),
        ("NVIDIA A10", "A10"),
        ("NVIDIA A10G", None),
        ("NVIDIA A40", "A40"),
        ("NVIDIA RTX A4000", "A4000"),
        ("NVIDIA RTX A5000", "A5000"),
        ("NVIDIA L40", "L40"),
        ("NVIDIA L40S", None),
        ("NVIDIA H200", None),
        ("NVIDIA H100 80GB HBM3", None),
    ],
)
def test_gpu_names_match_reference_rows_exactly(reported: str, row: str | None) -> None:
    assert find_reference_gpu(reported) == row


def test_every_reference_row_matches_itself_and_only_itself() -> None:
    keys = [normalize_gpu_name(gpu) for gpu in reference_throughput()]
    assert len(set(keys)) == len(keys)
    for gpu in reference_throughput():
        assert find_reference_gpu(gpu) == gpu


def test_specs_lookup_by_reported_name() -> None:
    a100 = find_gpu_spec("NVIDIA A100-SXM4-40GB")
    assert a100 is not None and a100.gpu == "A100 SXM4"
    rtx = find_gpu_spec("NVIDIA GeForce RTX 3090")
    assert rtx is not None and rtx.fp32_tflops == 35.58
    assert find_gpu_spec("NVIDIA GeForce RTX 3090 Ti") is None


# --------------------------------------------------------------------------- comparison


def test_known_gpu_at_its_reference_speed() -> None:
    ref = reference_throughput()["A100"]["resnet50_fp16"]
    c = compare_to_reference("NVIDIA A100-SXM4-80GB", "resnet50", "fp16", ref)
    assert c.reference_gpu == "A100" and c.ratio == pytest.approx(1.0)
    assert c.warning is None
    faster = [g for g, v in reference_throughput().items() if g != "A100" and v[c.column] > ref]
    assert c.rank == len(faster) + 1
    assert c.out_of == len(reference_throughput())
    assert "Rank" in str(c) and "1.00x" in str(c)


def test_known_gpu_well_under_reference_is_warned_about() -> None:
    ref = reference_throughput()["3090"]["vit_base_patch16_224_fp16"]
    c = compare_to_reference("NVIDIA GeForce RTX 3090", "vit_b_16", "fp16", ref * 0.5)
    assert c.column == "vit_base_patch16_224_fp16"
    assert c.ratio == pytest.approx(0.5)
    assert c.warning is not None and "0.50x" in c.warning and "nvidia-smi" in c.warning
    assert "WARNING" in str(c)
    ok = compare_to_reference("NVIDIA GeForce RTX 3090", "vit_b_16", "fp16", ref * SLOW_RATIO)
    assert ok.warning is None


def test_unknown_gpu_is_ranked_among_the_reference_gpus() -> None:
    table = reference_throughput()
    top = max(table, key=lambda g: table[g]["resnet50_fp16"])
    fast = compare_to_reference("NVIDIA H200", "resnet50", "fp16", 10_000.0)
    assert fast.reference_gpu is None and fast.ratio is None and fast.warning is None
    assert (fast.rank, fast.out_of) == (1, len(table) + 1)
    assert fast.next_faster is None
    assert fast.next_slower == (top, table[top]["resnet50_fp16"])
    slow = compare_to_reference("NVIDIA H200", "resnet50", "fp16", 1.0)
    assert slow.rank == slow.out_of and slow.next_slower is None


def test_bf16_is_compared_with_the_fp16_column_and_says_so() -> None:
    c = compare_to_reference("NVIDIA A40", "resnet50", "bf16", 1800.0)
    assert c.column == "resnet50_fp16"
    assert any("bf16" in n for n in c.notes)


def test_fp32_on_ampere_carries_the_tf32_caveat_and_no_false_alarm() -> None:
    ref = reference_throughput()["A100"]["vit_base_patch16_224_fp32"]
    off = compare_to_reference(
        "NVIDIA A100-SXM4-40GB", "vit_b_16", "fp32", ref / 3,
        compute_capability=(8, 0), tf32_matmul=False,
    )  # fmt: skip
    assert TF32_CAVEAT in off.notes
    # The Python API's words (the command line's are --tf32: trainperf.cli rewrites them).
    assert off.warning is None and any("run with tf32=True for a like" in n for n in off.notes)
    assert not any("--tf32" in n for n in off.notes)
    on = compare_to_reference(
        "NVIDIA A100-SXM4-40GB", "vit_b_16", "fp32", ref / 3,
        compute_capability=(8, 0), tf32_matmul=True,
    )  # fmt: skip
    assert on.warning is not None
    volta = compare_to_reference(
        "Tesla V100-SXM2-16GB", "resnet50", "fp32", 1300.0, compute_capability=(7, 0)
    )
    assert TF32_CAVEAT not in volta.notes


def test_fp32_resnet50_goes_by_the_cudnn_tf32_flag_not_the_matmul_one() -> None:
    # PyTorch's defaults: convolutions on TF32, matmuls off it. ResNet-50 is convolutions.
    ref = reference_throughput()["A100"]["resnet50_fp32"]
    default = compare_to_reference(
        "NVIDIA A100-SXM4-80GB", "resnet50", "fp32", ref / 3,
        compute_capability=(8, 0), tf32_matmul=False, tf32_cudnn=True,
    )  # fmt: skip
    assert default.warning is not None and "0.33x" in default.warning
    off = compare_to_reference(
        "NVIDIA A100-SXM4-80GB", "resnet50", "fp32", ref / 3,
        compute_capability=(8, 0), tf32_matmul=True, tf32_cudnn=False,
    )  # fmt: skip
    assert off.warning is None
    assert any("convolutions off TF32" in n and "tf32=True" in n for n in off.notes)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"model": "resnet18"}, "model must be one of"),
        ({"precision": "fp8"}, "precision must be"),
        ({"images_per_s": 0.0}, "images_per_s must be > 0"),
        ({"images_per_s": float("inf")}, r"images_per_s must be > 0 and finite, got inf"),
        ({"images_per_s": float("nan")}, "images_per_s must be > 0 and finite, got nan"),
    ],
)
def test_compare_to_reference_rejects_bad_arguments(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {
        "gpu_name": "NVIDIA A40", "model": "resnet50", "precision": "fp16", "images_per_s": 1.0,
    }  # fmt: skip
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        compare_to_reference(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize("images_per_s", [True, "1800", torch.tensor(1800.0)])
def test_compare_to_reference_refuses_a_rate_that_is_no_number(images_per_s: object) -> None:
    # Before: True compared as 1 image/s, a tensor was kept (json.dumps refused to_dict()),
    # and "1800" raised a bare TypeError from the comparison; then all three were a
    # ValueError "must be > 0 and finite", though 1800 is, and the type is what is wrong.
    with pytest.raises(TypeError) as caught:
        compare_to_reference("NVIDIA A40", "resnet50", "fp16", images_per_s)  # type: ignore[arg-type]
    assert str(caught.value) == (
        "images_per_s must be a real number (int, float or NumPy scalar), got "
        f"{images_per_s!r}: pass float(x)"
    )


def test_compare_to_reference_keeps_a_numpy_rate_as_a_python_float() -> None:
    # Before: np.float32 was kept, and json.dumps refused to_dict().
    c = compare_to_reference("NVIDIA A40", "resnet50", "fp16", np.float32(1800.0))  # type: ignore[arg-type]
    assert type(c.images_per_s) is float and type(c.ratio) is float
    assert json.loads(json.dumps(c.to_dict()))["images_per_s"] == 1800.0


# --------------------------------------------------------------------------- the result protocol


def test_comparison_to_dict_is_json_safe_and_its_str_is_the_report() -> None:
    c = compare_to_reference("NVIDIA GeForce RTX 3090", "resnet50", "fp16", 1800.0)
    data = c.to_dict()
    assert json.loads(json.dumps(data)) == data
    assert data["reference_gpu"] == "3090" and data["warning"] == c.warning
    assert data["next_faster"] == list(c.next_faster or []) and isinstance(data["notes"], list)
    assert str(c).startswith("Reference: 3090 resnet50_fp16") and "WARNING: " in str(c)


def test_a_row_without_the_compared_column_is_left_out_not_a_key_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The loader skips empty cells (a card measured on one model only); the comparison then
    # raised KeyError for the card's own row, or for any other row, missing the column.
    reference = importlib.import_module("trainperf.bench._reference")
    header = "gpu,resnet50_fp16,resnet50_fp32,vit_base_patch16_224_fp16,vit_base_patch16_224_fp32"
    rows = [header, "3090,2395.3,1492.8,1045.5,598.4", "A10,1754.7,1035.7,,"]
    monkeypatch.setattr(
        reference, "_read_csv", lambda _: list(csv.DictReader(io.StringIO("\n".join(rows))))
    )
    reference._throughput_rows.cache_clear()
    try:
        other = compare_to_reference("NVIDIA GeForce RTX 3090", "vit_b_16", "fp16", 1000.0)
        own = compare_to_reference("NVIDIA A10", "vit_b_16", "fp16", 800.0)
    finally:
        monkeypatch.undo()
        reference._throughput_rows.cache_clear()
    assert other.reference_gpu == "3090" and other.out_of == 1  # A10 has no ViT figure
    assert own.ratio is None and own.reference_images_per_s is None and own.warning is None
    assert own.out_of == 2 and own.next_faster == ("3090", 1045.5)
    assert any("no vit_base_patch16_224_fp16 figure for A10" in n for n in own.notes)


@pytest.mark.parametrize(
    ("reported", "row"),
    [
        ("rtx3090", "3090"),
        ("RTX3090TI", "3090 Ti"),
        ("geforce rtx 3090ti", "3090 Ti"),
        ("GTX1080Ti", "1080 Ti"),
        ("RTXA4000", "A4000"),
        ("rtx3060ti", None),  # its own card, which has no row: not the 3060's
        ("RTX4080SUPER", None),  # not the 4080's
        ("Quadro RTX 6000", None),  # not the RTX A6000, nor any other
        ("NVIDIA TITAN RTX", None),  # not the TITAN Xp
        ("NVIDIA A10G", None),
        ("NVIDIA L40S", None),
    ],
)
def test_compact_spellings_match_their_row_and_no_other(reported: str, row: str | None) -> None:
    # Before: "rtx3090" (no space) matched nothing, the RTX 3090's row included.
    assert find_reference_gpu(reported) == row


def test_a_compact_spelling_finds_its_datasheet_figures() -> None:
    spec = find_gpu_spec("rtx3090")
    assert spec is not None and spec.gpu == "3090"


@pytest.mark.parametrize("name", [None, 3, b"NVIDIA A40"])
def test_a_gpu_name_that_is_not_a_str_is_a_type_error_naming_it(name: object) -> None:
    # Before: a bare AttributeError ("'NoneType' object has no attribute 'upper'").
    message = rf"name must be a GPU's name as a str .*, got {re.escape(repr(name))}"
    with pytest.raises(TypeError, match=rf"normalize_gpu_name: {message}"):
        normalize_gpu_name(name)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=rf"find_gpu_spec: {message}"):
        find_gpu_spec(name)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=rf"find_reference_gpu: {message}"):
        find_reference_gpu(name)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=rf"compare_to_reference: gpu_name must be a GPU's name "
                       rf"as a str .*, got {re.escape(repr(name))}"):  # fmt: skip
        compare_to_reference(name, "resnet50", "fp16", 1.0)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "capability", [np.array([8, 0]), (8,), (8, 0, 0), ("8", "0"), (8.0, 0), (True, 0), 80]
)
def test_a_compute_capability_that_is_not_a_pair_of_ints_is_refused_naming_it(
    capability: object,
) -> None:
    # Before: np.array([8, 0]) raised NumPy's "truth value of an array ... is ambiguous".
    with pytest.raises(TypeError, match=r"compute_capability must be None or a \(major, minor\) "
                       r"pair of ints, e.g. \(8, 0\) as torch.cuda.get_device_capability\(\) "
                       r"gives it, got "):  # fmt: skip
        compare_to_reference("NVIDIA A40", "resnet50", "fp32", 1.0, compute_capability=capability)  # type: ignore[arg-type]


def test_a_compute_capability_of_numpy_ints_or_a_list_is_taken_as_a_pair() -> None:
    for capability in ([8, 0], (np.int64(8), np.int64(0))):
        c = compare_to_reference("NVIDIA A40", "resnet50", "fp32", 1.0,
                                 compute_capability=capability)  # type: ignore[arg-type]  # fmt: skip
        assert TF32_CAVEAT in c.notes
