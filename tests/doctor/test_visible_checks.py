"""The ``CUDA_VISIBLE_DEVICES`` check (``doctor/_visible_checks.py``)."""

from __future__ import annotations

import pytest

from trainperf.doctor import (
    check_visible_devices,
)


@pytest.mark.parametrize(
    ("visible", "order", "gpus", "verdict", "needle"),
    [
        (None, None, 4, "ok", "all 4"),
        ("", None, 2, "warn", "hides every GPU"),
        ("-1", None, 2, "warn", "hides every GPU"),
        ("", None, 0, "ok", "hides every GPU"),
        ("0,0", "PCI_BUS_ID", 2, "fail", "listed twice"),
        ("0,gpu1", None, 2, "fail", "'gpu1'"),
        ("5", "PCI_BUS_ID", 2, "fail", "index 5 does not exist"),
        ("1,3", None, 4, "warn", "CUDA_DEVICE_ORDER=PCI_BUS_ID"),
        ("1,3", "FASTEST_FIRST", 4, "warn", "CUDA_DEVICE_ORDER=PCI_BUS_ID"),
        ("1,3", "PCI_BUS_ID", 4, "ok", ""),
        ("0", None, 1, "ok", ""),
        ("GPU-8d3b,GPU-77aa", None, 4, "ok", ""),
        ("GPU-8d3b,GPU-8D3B", None, 4, "fail", "listed twice"),
        ("0,GPU-8d3b", "PCI_BUS_ID", 4, "fail", "so only 0 are visible"),
        ("GPU-8d3b,1", None, 4, "fail", "'1' is not a GPU- UUID"),
        ("abc", None, 2, "fail", "no GPU is visible"),
        ("abc", None, 0, "ok", "hides every GPU"),  # no GPU to hide: CUDA sees none either way
        ("NoDevFiles", None, 0, "ok", "hides every GPU"),  # SLURM's value for a GPU-less job
        ("NoDevFiles", None, 2, "warn", "unset CUDA_VISIBLE_DEVICES"),
        ("abc", None, 2, "fail", "'abc' is neither an index nor a GPU- or MIG- UUID"),
        ("0,abc", None, 2, "fail", "'abc' is not an index, as the first entry sets:"),
        ("0,GPU-8d3b", None, 2, "fail", "entries cannot mix indices, GPU- and MIG- UUIDs"),
        ("GPU-8d3b,MIG-1a2b", None, 2, "fail", "entries cannot mix"),
        ("+1", "PCI_BUS_ID", 2, "ok", ""),
        (None, "PCI", 2, "warn", "ignores"),
    ],
)
def test_visible_devices(
    visible: str | None, order: str | None, gpus: int, verdict: str, needle: str
) -> None:
    check = check_visible_devices(visible, order, gpus)
    assert check.verdict == verdict
    assert needle in check.value + check.fix


@pytest.mark.parametrize(
    ("visible", "needle"),
    [("0 1", "'0 1' as 0"), ("0;1", "'0;1' as 0"), ("2,1gpu", "'1gpu' as 1"), ("1.5", "as 1")],
)
def test_visible_devices_warns_of_an_index_with_more_after_it(visible: str, needle: str) -> None:
    # CUDA reads an index like strtoul: "0 1" (spaces for commas) shows GPU 0 alone.
    check = check_visible_devices(visible, "PCI_BUS_ID", gpu_count=4)
    assert check.verdict == "warn"
    assert needle in check.fix and "separate GPUs with commas" in check.fix
    both = check_visible_devices(visible, None, gpu_count=4)  # with the numbering warning
    assert needle in both.fix and "CUDA_DEVICE_ORDER=PCI_BUS_ID" in both.fix
    for plain in ("+1", " 2 ,03", "0,1"):
        assert check_visible_devices(plain, "PCI_BUS_ID", gpu_count=4).verdict == "ok", plain


@pytest.mark.parametrize("visible", ["0,-1", "0,0", "0,abc", "3", "GPU-8d3b,GPU-8d3b", "0,GPU-1"])
def test_visible_devices_on_a_host_without_gpus_is_not_a_failure(visible: str) -> None:
    # No GPU to show or hide: CUDA sees none whatever the list says, so doctor must not exit 1.
    check = check_visible_devices(visible, None, gpu_count=0)
    assert check.verdict == "ok" and "no GPU here" in check.value
    assert "are visible" not in check.value + check.fix


@pytest.mark.parametrize(
    ("visible", "order", "verdict", "needle"),
    [
        ("0,-1", "PCI_BUS_ID", "ok", "the list ends at '-1'"),  # CUDA's documented terminator
        ("0,2,-1,1", "PCI_BUS_ID", "ok", "CUDA ignores '1' after it"),  # CUDA's docs' example
        ("1,-1", None, "warn", "CUDA_DEVICE_ORDER=PCI_BUS_ID"),  # the usual order advice
        ("0,0,-1", "PCI_BUS_ID", "fail", "listed twice"),  # what precedes it still counts
        ("0,7,-1", "PCI_BUS_ID", "fail", "index 7 does not exist"),
        ("0,-x", "PCI_BUS_ID", "fail", "'-x' is not an index"),  # junk, not a terminator
    ],
)
def test_visible_devices_a_negative_entry_ends_the_list_on_purpose(
    visible: str, order: str, verdict: str, needle: str
) -> None:
    check = check_visible_devices(visible, order, gpu_count=4)
    assert check.verdict == verdict
    assert needle in check.value + check.fix


def test_visible_devices_says_unset_for_an_unset_variable() -> None:
    check = check_visible_devices(None, None, gpu_count=2)
    assert "CUDA_VISIBLE_DEVICES=unset, CUDA_DEVICE_ORDER=unset" in check.value
    assert "None" not in check.value


@pytest.mark.parametrize(
    ("visible", "shown", "verdict"),
    [
        ("GPU-9999", 0, "fail"),  # matches no card
        ("GPU-1111,GPU-1111aaaa", 0, "fail"),  # one card twice: CUDA shows none
        ("GPU-1111,GPU-9999", 1, "fail"),  # CUDA stops at the second
        ("GPU-1111,GPU-2222", 2, "ok"),
        ("GPU-1111,GPU-2222", None, "ok"),  # the cards could not be listed: not judged
        ("MIG-1111", 0, "fail"),
    ],
)
def test_visible_devices_checks_uuids_against_the_gpus_they_make_visible(
    visible: str, shown: int | None, verdict: str
) -> None:
    check = check_visible_devices(visible, None, 2, shown=shown)
    assert check.verdict == verdict
    if verdict == "fail":
        assert f"only {shown} of its" in check.fix and "nvidia-smi -L" in check.fix


@pytest.mark.parametrize(
    ("visible", "needle"),
    [
        ("5", "index 5 does not exist"),
        ("0,0", "listed twice"),
        ("0,x", "'x' is not an index"),
    ],
)
def test_an_invalid_order_does_not_hide_a_list_that_fails(visible: str, needle: str) -> None:
    # A typo in CUDA_DEVICE_ORDER (CUDA ignores it) must not turn a list that shows the wrong
    # GPUs, or none, into a mere warning: doctor would exit 0 and never name the list's fault.
    check = check_visible_devices(visible, "pci_bus_id", gpu_count=2, shown=0)
    assert check.verdict == "fail"
    assert needle in check.fix and "CUDA ignores CUDA_DEVICE_ORDER='pci_bus_id'" in check.fix


def test_an_invalid_order_with_a_sound_list_warns_about_the_order() -> None:
    check = check_visible_devices("1", "pci_bus_id", gpu_count=2, shown=1)
    assert check.verdict == "warn" and "CUDA ignores CUDA_DEVICE_ORDER" in check.fix
    assert "fastest-first" in check.fix  # CUDA then numbers them by its default
