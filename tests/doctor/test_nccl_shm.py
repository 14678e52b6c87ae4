"""The nccl_shm check (``doctor/_nccl_shm.py``): each rule on made-up figures."""

from __future__ import annotations

import warnings

import pytest

from trainperf import doctor
from trainperf.doctor import _nccl_shm, check_nccl_shm, nccl_shm_need

MiB = 2**20
GiB = 2**30
SEGMENT = 4096 + 524288 + 4915200 + 4 * MiB  # the 9,637,888 bytes of nccl#342


def test_nccl_shm_lives_in_its_own_module() -> None:
    # Before: in _dist_checks, which had grown past the house style's ~500 lines.
    assert doctor.check_nccl_shm is _nccl_shm.check_nccl_shm
    assert doctor.nccl_shm_need is _nccl_shm.nccl_shm_need


def test_nccl_shm_need_is_ranks_channels_peers_segments() -> None:
    assert SEGMENT == 9637888
    assert nccl_shm_need(8)[0] == 8 * 2 * 2 * SEGMENT
    assert nccl_shm_need(2)[0] == 2 * 2 * 1 * SEGMENT  # one peer only
    assert nccl_shm_need(1)[0] == 0
    _, rule = nccl_shm_need(4)
    assert rule == "4 ranks x 2 channels x 2 peers x 9.2 MiB segments"


def test_nccl_shm_need_follows_the_buffer_variables() -> None:
    env = {"NCCL_BUFFSIZE": str(MiB), "NCCL_MIN_NCHANNELS": "4"}
    assert nccl_shm_need(8, env)[0] == 8 * 4 * 2 * (SEGMENT - 3 * MiB)
    # NCCL reads "lots" as a 0-byte buffer (no use: the default counts) and 1 channel as 1.
    junk = {"NCCL_BUFFSIZE": "lots", "NCCL_MIN_NCHANNELS": "1"}
    with pytest.warns(RuntimeWarning, match=r"NCCL_BUFFSIZE='lots' as a buffer of 0 bytes"):
        assert nccl_shm_need(8, junk)[0] == nccl_shm_need(8)[0]


@pytest.mark.parametrize(
    ("raw", "simple"),
    [("16k", 16), ("1_000", 1), ("010", 8), ("0x10", 16), (" 16", 16), ("\t16\n", 16),
     ("08", 4 * MiB), ("0b100", 4 * MiB), ("0o10", 4 * MiB), ("-2", 4 * MiB),
     ("99999999999999999999", 4 * MiB), (str(2**32 + 16), 16), (str(2**32), 4 * MiB)],
)  # fmt: skip
def test_nccl_shm_need_reads_nccl_buffsize_with_strtoll_as_nccl_does(raw: str, simple: int) -> None:
    # NCCL: strtoll(value, NULL, 0), its default only on overflow or -2, stored in an int; a
    # size of 0 or less cannot work, so the estimate keeps the default for it.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        need = nccl_shm_need(2, {"NCCL_BUFFSIZE": raw})[0]
    assert need == 2 * 2 * 1 * (SEGMENT - 4 * MiB + simple)
    notes = [str(w.message) for w in caught]
    if raw in ("0x10", " 16", "\t16\n", "-2"):  # read as written: nothing to say
        assert notes == []
    else:
        assert len(notes) == 1 and f"NCCL_BUFFSIZE={raw!r}" in notes[0]


def test_nccl_shm_need_clamps_min_nchannels_as_nccl_does() -> None:
    assert nccl_shm_need(2, {"NCCL_MIN_NCHANNELS": "1000"})[0] == 2 * 64 * 1 * SEGMENT
    with pytest.warns(RuntimeWarning, match=r"NCCL_MIN_NCHANNELS='010' as 8 \(C's strtoll"):
        assert nccl_shm_need(2, {"NCCL_MIN_NCHANNELS": "010"})[0] == 2 * 8 * 1 * SEGMENT
    assert nccl_shm_need(2, {"NCCL_MIN_NCHANNELS": "-5"})[0] == 2 * 2 * 1 * SEGMENT


@pytest.mark.parametrize("raw", ["16M", "1_000", "010", "lots", "0", "99999999999999999999"])
def test_nccl_shm_names_a_buffer_size_nccl_misreads(raw: str) -> None:
    check = check_nccl_shm(16 * GiB, 8, backend="nccl", env={"NCCL_BUFFSIZE": raw})
    assert check.verdict == "warn" and f"NCCL_BUFFSIZE={raw!r}" in check.value
    assert "NCCL_BUFFSIZE=4194304" in check.fix
    small = check_nccl_shm(64 * MiB, 8, backend="nccl", env={"NCCL_BUFFSIZE": raw})
    assert small.verdict == "fail" and "--shm-size" in small.fix and "plain decimal" in small.fix


@pytest.mark.parametrize(
    ("name", "raw", "read"),
    [("NCCL_BUFFSIZE", str(2**32 + 16), "16"), ("NCCL_LL_BUFFSIZE", str(2**33 + 4096), "4096"),
     ("NCCL_MIN_NCHANNELS", str(2**32 + 4), "4")],
)  # fmt: skip
def test_nccl_shm_names_a_value_too_large_for_ncclls_int(name: str, raw: str, read: str) -> None:
    # Before: NCCL keeps the low 32 bits (2**32 + 16 is a 16-byte buffer) and the check said
    # nothing (ok), where 2**32 (0 bytes) and other misreads were named (warn).
    check = check_nccl_shm(16 * GiB, 8, backend="nccl", env={name: raw})
    assert check.verdict == "warn" and f"NCCL reads {name}={raw!r} as {read} " in check.value
    assert "32 bits" in check.value and "plain decimal" in check.fix


@pytest.mark.parametrize("raw", ["nan", "inf", "lots", "16k", str(2**32 + 16), "-1"])
def test_nccl_shm_need_warns_of_a_buffer_size_nccl_misreads(raw: str) -> None:
    # Before: nccl_shm_need() read NCCL_BUFFSIZE=nan as the default, a too-large one as its
    # low 32 bits, and said nothing of either.
    with pytest.warns(RuntimeWarning, match=rf"NCCL reads NCCL_BUFFSIZE={raw!r} as .*plain"):
        nccl_shm_need(8, {"NCCL_BUFFSIZE": raw})


def test_nccl_shm_need_is_quiet_about_values_read_as_written() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        nccl_shm_need(8, {"NCCL_BUFFSIZE": "4194304", "NCCL_MIN_NCHANNELS": "4"})
        check_nccl_shm(64 * MiB, 8, backend="nccl", env={"NCCL_BUFFSIZE": "lots"})


@pytest.mark.parametrize("raw", ["4194304", "0x400000", " 4194304", "+4194304"])
def test_nccl_shm_is_quiet_about_a_buffer_size_read_as_written(raw: str) -> None:
    check = check_nccl_shm(16 * GiB, 8, backend="nccl", env={"NCCL_BUFFSIZE": raw})
    assert check.verdict == "ok" and check.fix == ""


@pytest.mark.parametrize("ranks", [0, -1, 2.0, True, "8"])
def test_nccl_shm_refuses_a_rank_count_that_is_not_a_positive_int(ranks: object) -> None:
    with pytest.raises(ValueError, match=r"ranks must be an int >= 1, got "):
        check_nccl_shm(16 * GiB, ranks, backend="nccl")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"ranks must be an int >= 1, got "):
        nccl_shm_need(ranks)  # type: ignore[arg-type]


def test_nccl_shm_refuses_a_negative_gpu_count() -> None:
    with pytest.raises(ValueError, match=r"gpus must be None or an int >= 0, got -1"):
        check_nccl_shm(16 * GiB, 2, backend="gloo", gpus=-1)


@pytest.mark.parametrize("gpus", [0, 1])
def test_nccl_shm_is_a_skip_with_fewer_than_two_gpus(gpus: int) -> None:
    # One NCCL rank per GPU: with 0 or 1 there are no two ranks on this host to share memory.
    check = check_nccl_shm(16 * MiB, 2, backend="gloo", gpus=gpus)
    assert check.verdict == "skip" and check.fix == ""
    assert f"{gpus} GPU" in check.value and "one rank per GPU" in check.value
    assert check_nccl_shm(16 * MiB, 2, backend="gloo", gpus=2).verdict == "warn"


def test_dockers_64_mb_fails_eight_nccl_ranks_but_not_two() -> None:
    small = check_nccl_shm(64 * MiB, 8, backend="nccl")
    assert small.verdict == "fail"
    assert "294 MiB" in small.value and "8 ranks" in small.value
    assert "--shm-size" in small.fix and "unhandled system error" in small.fix
    assert check_nccl_shm(64 * MiB, 2, backend="nccl").verdict == "ok"  # ~37 MiB
    assert check_nccl_shm(16 * GiB, 8, backend="nccl").verdict == "ok"


def test_a_small_shm_under_gloo_is_a_warning_naming_nccl() -> None:
    check = check_nccl_shm(16 * MiB, 2, backend="gloo")
    assert check.verdict == "warn" and "gloo does not use /dev/shm" in check.fix


def test_nccl_shm_with_shm_disabled_or_absent() -> None:
    off = check_nccl_shm(16 * MiB, 8, backend="nccl", env={"NCCL_SHM_DISABLE": "1"})
    assert off.verdict == "ok" and "NCCL_SHM_DISABLE=1" in off.value
    # Read as NCCL reads it: "01" and "0x1" are 1; 2 leaves shared memory on.
    assert (
        check_nccl_shm(16 * MiB, 8, backend="nccl", env={"NCCL_SHM_DISABLE": "0x1"}).verdict == "ok"
    )
    assert (
        check_nccl_shm(16 * MiB, 8, backend="nccl", env={"NCCL_SHM_DISABLE": "2"}).verdict == "fail"
    )


def test_no_dev_shm_on_linux_fails_nccl_as_a_small_one_does() -> None:
    # Before: a skip, "no /dev/shm here", where check_shm fails and NCCL's SHM transport
    # (and its proxy's segments) cannot open a file there.
    missing = check_nccl_shm(None, 8, backend="nccl", platform="linux")
    assert missing.verdict == "fail"
    assert "no /dev/shm here" in missing.value and "294 MiB" in missing.value
    assert missing.fix.startswith("NCCL fails at start-up")
    assert "mount a tmpfs at /dev/shm" in missing.fix and "enlarge" not in missing.fix
    gloo = check_nccl_shm(None, 8, backend="gloo", platform="linux")
    assert gloo.verdict == "warn" and "mount a tmpfs at /dev/shm" in gloo.fix
    # One rank has no peer to share memory with; NCCL_SHM_DISABLE=1 turns the transport off.
    assert check_nccl_shm(None, 1, backend="nccl", platform="linux").verdict == "ok"
    off = check_nccl_shm(None, 8, backend="nccl", env={"NCCL_SHM_DISABLE": "1"}, platform="linux")
    assert off.verdict == "ok" and off.value.startswith("no /dev/shm here; NCCL_SHM_DISABLE=1")


def test_no_dev_shm_off_linux_is_a_skip() -> None:
    check = check_nccl_shm(None, 8, backend="nccl", platform="win32")
    assert check.verdict == "skip" and "NCCL runs on Linux only" in check.value


@pytest.mark.parametrize("backend", ["NCCL", "cpu:gloo,cuda:nccl"])
def test_nccl_shm_fails_nccl_however_the_backend_names_it(backend: str) -> None:
    # Before: anything but exactly "nccl" was judged as gloo, a warning.
    assert check_nccl_shm(64 * 2**20, 8, backend=backend).verdict == "fail"


def test_nccl_shm_refuses_a_backend_that_is_no_string() -> None:
    with pytest.raises(TypeError, match=r"backend must be a str such as 'nccl'"):
        check_nccl_shm(64 * 2**20, 8, backend=None)  # type: ignore[arg-type]


@pytest.mark.parametrize("backend", ["bogus", "", "nccl2", "cuda:bogus", "cpu:gloo,", "mpi"])
def test_nccl_shm_refuses_a_backend_it_does_not_know(backend: str) -> None:
    # Before: anything without "nccl" in it was judged as gloo, a warning.
    with pytest.raises(ValueError, match=rf"backend must be 'nccl' or 'gloo' .*, got {backend!r}"):
        check_nccl_shm(64 * 2**20, 8, backend=backend)


@pytest.mark.parametrize("backend", ["gloo", "GLOO", "cuda:gloo", "cpu:gloo, cuda:gloo"])
def test_nccl_shm_judges_gloo_however_the_backend_names_it(backend: str) -> None:
    assert check_nccl_shm(64 * 2**20, 8, backend=backend).verdict == "warn"


def test_an_unreadable_shm_is_unknown_to_nccl_not_missing() -> None:
    check = check_nccl_shm(
        None, 8, backend="nccl", platform="linux", shm_error="EACCES: Permission denied"
    )
    assert check.verdict == "warn"
    assert "could not read /dev/shm" in check.value and "EACCES" in check.value
    assert "294 MiB" in check.value and "df -h /dev/shm" in check.fix
    assert check_nccl_shm(None, 8, backend="nccl", platform="linux").verdict == "fail"


@pytest.mark.parametrize(("ranks", "gpus"), [(8, 4), (2, 1), (3, 2)])
def test_more_nccl_ranks_than_gpus_fails_as_nccl_refuses_them(ranks: int, gpus: int) -> None:
    # Before: sized /dev/shm for the ranks (ok with a roomy one) or skipped with 1 GPU; NCCL
    # refuses two ranks on one GPU at start-up ("Duplicate GPU detected").
    check = check_nccl_shm(16 * GiB, ranks, backend="nccl", gpus=gpus)
    assert check.verdict == "fail", check
    assert f"{ranks} ranks on {gpus} GPU" in check.value and "Duplicate GPU" in check.value
    assert f"--nproc-per-node={gpus}" in check.fix


def test_more_gloo_ranks_than_gpus_warns_that_nccl_would_refuse_them() -> None:
    check = check_nccl_shm(16 * GiB, 8, backend="gloo", gpus=4)
    assert check.verdict == "warn" and "Duplicate GPU" in check.value
    assert "--nproc-per-node=4" in check.fix
    # gloo with 0 or 1 GPU: NCCL would not run here at all, the skip stands.
    assert check_nccl_shm(16 * GiB, 2, backend="gloo", gpus=1).verdict == "skip"
    assert check_nccl_shm(16 * GiB, 2, backend="nccl", gpus=0).verdict == "skip"
    assert check_nccl_shm(16 * GiB, 4, backend="nccl", gpus=4).verdict == "ok"


@pytest.mark.parametrize("shm_free", [-5, 1.5, True])
def test_a_shm_free_that_is_no_byte_count_is_refused(shm_free: object) -> None:
    # Before: -5 was reported as "/dev/shm -5 B free" and failed the check.
    with pytest.raises(ValueError, match=rf"shm_free must be .*int >= 0.*got {shm_free!r}"):
        check_nccl_shm(shm_free, 2, backend="nccl")  # type: ignore[arg-type]
