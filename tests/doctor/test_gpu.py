"""The GPU and PyTorch-build checks (``doctor/_gpu.py``) against faked GPUs and builds."""

from __future__ import annotations

import pytest

from tests.doctor._fakes import GiB, gpu
from trainperf.doctor import check_cuda_arch, check_gpus, check_torch_build


def test_gpus_none_ok_busy_and_broken() -> None:
    assert check_gpus([]).verdict == "skip"
    ok = check_gpus([gpu(0), gpu(1)], driver="580.1")
    assert ok.verdict == "ok" and "cuda:1 NVIDIA A100" in ok.value and "580.1" in ok.value
    busy = check_gpus([gpu(0, utilization=97, memory_used=40 * GiB)])
    assert busy.verdict == "warn" and "97% busy" in busy.value and "select_gpus" in busy.fix
    broken = check_gpus([], error="NVML refused access")
    assert broken.verdict == "fail" and "refused" in broken.value


def test_gpus_hidden_by_cuda_visible_devices_are_not_called_a_cpu_only_machine() -> None:
    hidden = check_gpus([], driver="580.1", physical=2)
    assert hidden.verdict == "skip" and "hides all 2 GPU(s)" in hidden.value
    assert "CPU-only" not in hidden.fix and "unset CUDA_VISIBLE_DEVICES" in hidden.fix
    assert "nothing to do on a CPU-only machine" in check_gpus([]).fix


def test_torch_build_versions_and_failures() -> None:
    ok = check_torch_build(
        torch_version="2.5.0", cuda="12.4", cudnn=90100, nccl=(2, 21, 5), gpu_count=1,
        driver_cuda=12040,
    )  # fmt: skip
    assert ok.verdict == "ok"
    assert "cuDNN 9.1.0" in ok.value and "NCCL 2.21.5" in ok.value and "CUDA 12.4" in ok.value
    old_cudnn = check_torch_build(
        torch_version="1.13", cuda="11.7", cudnn=8902, nccl=None, gpu_count=0
    )
    assert "cuDNN 8.9.2" in old_cudnn.value
    cpu_only = check_torch_build(
        torch_version="2.5.0+cpu", cuda=None, cudnn=None, nccl=None, gpu_count=2
    )
    assert cpu_only.verdict == "fail" and "CPU-only" in cpu_only.fix
    assert check_torch_build(
        torch_version="2.5.0+cpu", cuda=None, cudnn=None, nccl=None, gpu_count=0
    ).verdict == "ok"  # fmt: skip
    old_driver = check_torch_build(
        torch_version="2.5.0", cuda="12.4", cudnn=None, nccl=None, gpu_count=1, driver_cuda=11080
    )
    assert old_driver.verdict == "fail" and "update the NVIDIA driver" in old_driver.fix
    minor = check_torch_build(
        torch_version="2.5.0", cuda="12.4", cudnn=None, nccl=None, gpu_count=1, driver_cuda=12020
    )
    assert minor.verdict == "warn"


@pytest.mark.parametrize(
    ("arch_list", "cc", "verdict"),
    [
        (["sm_80", "sm_90"], (8, 6), "ok"),  # sm_80 machine code runs on 8.6
        (["sm_70", "sm_80"], (9, 0), "fail"),  # an old build on a Hopper card
        (["sm_50", "sm_60", "sm_70"], (8, 0), "fail"),
        (["sm_80", "compute_80"], (9, 0), "warn"),  # PTX only: JIT at start-up
        (["sm_90a"], (9, 0), "ok"),
        (["sm_90a"], (10, 0), "fail"),  # arch-specific code runs on that arch only
        (["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"], (12, 0), "ok"),
        (["sm_86"], (8, 0), "fail"),  # newer minor does not run on an older one
    ],
)
def test_cuda_arch_against_compute_capability(
    arch_list: list[str], cc: tuple[int, int], verdict: str
) -> None:
    check = check_cuda_arch(arch_list, [("GPU", cc)])
    assert check.verdict == verdict
    if verdict == "fail":
        assert f"sm_{cc[0]}{cc[1]}" in check.value and "pytorch.org" in check.fix


def test_cuda_arch_skips_without_gpus_or_arch_list() -> None:
    assert check_cuda_arch(["sm_80"], []).verdict == "skip"
    assert check_cuda_arch([], [("GPU", (8, 0))]).verdict == "skip"


def test_cuda_arch_does_not_vouch_for_a_gpu_whose_capability_is_unknown() -> None:
    # Before: "every GPU has native kernels", ok, though no GPU had been checked.
    none_known = check_cuda_arch(["sm_80"], [("GPU 0", None)])
    assert none_known.verdict == "skip" and "compute capability is known" in none_known.value
    one_known = check_cuda_arch(["sm_80"], [("A100", (8, 0)), ("GPU 1", None)])
    assert one_known.verdict == "ok" and "every GPU but GPU 1" in one_known.value
    assert "every GPU has native kernels" not in none_known.value + one_known.value
