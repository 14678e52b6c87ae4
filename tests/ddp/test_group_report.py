"""trainperf.ddp._group_report: which failures read like a peer that went away.

The messages are the ones gloo, NCCL and PyTorch raise, as their sources word them (see
``_PEER_GONE``) and as they reach users (ranks, file:line and sizes vary).
"""

from __future__ import annotations

import pytest

from trainperf.ddp._failures import Problem
from trainperf.ddp._group_report import Outcome, failure_message, first_failure, peer_gone

_ABORTED = "NCCL communicator was aborted on rank 1.  Original reason for failure was: "


@pytest.mark.parametrize(
    "text",
    [
        # gloo
        "raised RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] "
        "Connection closed by peer [127.0.0.1]:43617",
        "raised RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:545] Read error "
        "[127.0.0.1]:20373: Connection reset by peer",
        # NCCL's ncclRemoteError, synchronous (C10D_NCCL_CHECK) and from the watchdog
        "raised torch.distributed.DistBackendError: NCCL error in: "
        "../torch/csrc/distributed/c10d/NCCLUtils.hpp:317, remote process exited or there "
        "was a network error, NCCL version 2.20.5\nncclRemoteError: A call failed possibly "
        "due to a network error or a remote process exiting prematurely.",
        "raised torch.distributed.DistBackendError: NCCL error: remote process exited or there "
        "was a network error, NCCL version 2.19.3",
        # ProcessGroupNCCL's watchdog, waiting for a peer that never joined the collective
        "raised torch.distributed.DistBackendError: [Rank 1] Watchdog caught collective "
        "operation timeout: WorkNCCL(SeqNum=1, OpType=ALLREDUCE, NumelIn=1048576, "
        "NumelOut=1048576, Timeout(ms)=120000) ran for 120092 milliseconds before timing out.",
        # An aborted communicator: with no reason, or a reason that is itself a lost peer
        "raised torch.distributed.DistBackendError: NCCL communicator was aborted on rank 12. ",
        _ABORTED + "[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=78, "
        "OpType=BROADCAST, NumelIn=80, NumelOut=80, Timeout(ms)=600000) ran for 600096 "
        "milliseconds before timing out.",
        # TCPStore, whose server (a rank) went away
        "raised torch.distributed.DistNetworkError: Failed to recv, got 0 bytes. Connection was "
        "likely closed. Did the remote server shutdown or crash?",
        "raised torch.distributed.DistNetworkError: Failed to send, sent 0 bytes. Connection was "
        "likely closed. Did the remote server shutdown or crash?",
        "raised torch.distributed.DistBackendError: [3] is setting up NCCL communicator and "
        "retrieving ncclUniqueId from [0] via c10d key-value store by key '0', but "
        "store->get('0') got error: failed to recv, got 0 bytes",
        "raised torch.distributed.DistNetworkError: Connection reset by peer",
        "raised torch.distributed.DistNetworkError: Broken pipe",
        "raised torch.distributed.DistNetworkError: Socket Timeout",
        "raised torch.distributed.DistBackendError: [1] is setting up NCCL communicator and "
        "retrieving ncclUniqueId from [0] via c10d key-value store by key '0', but "
        "store->get('0') got error: Socket Timeout",
    ],
)
def test_errors_raised_because_another_rank_went_away_read_as_a_lost_peer(text: str) -> None:
    assert peer_gone(text)


@pytest.mark.parametrize(
    "text",
    [
        "raised ValueError: bad batch",
        # NCCL errors of the rank's own making
        "raised torch.distributed.DistBackendError: NCCL error in: "
        "../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1691, invalid usage (run with "
        "NCCL_DEBUG=WARN for details), NCCL version 2.21.5\nncclInvalidUsage: This usually "
        "reflects invalid usage of NCCL library.\nLast error:\nDuplicate GPU detected : rank 1 "
        "and rank 0 both on CUDA device 1000",
        "raised torch.distributed.DistBackendError: NCCL error in: "
        "../torch/csrc/distributed/c10d/NCCLUtils.hpp:317, unhandled cuda error (run with "
        "NCCL_DEBUG=INFO for details), NCCL version 2.20.5\nncclUnhandledCudaError: Call to "
        "CUDA function failed.",
        # ncclSystemError says a remote exit is one possible cause among many (NCCL < 2.13)
        "raised RuntimeError: NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:219, "
        "unhandled system error, NCCL version 2.10.3\nncclSystemError: System call (e.g. "
        "socket, malloc) or external library call failed or device error. It can be also "
        "caused by unexpected exit of a remote peer.",
        "raised torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB",
        # An aborted communicator whose reason is the rank's own
        _ABORTED + "CUDA error: an illegal memory access was encountered",
        # A timeout of the user's own code is not the store's
        "raised TimeoutError: socket timeout while fetching https://example.com/shard-3",
    ],
)
def test_a_ranks_own_errors_including_nccl_ones_do_not_read_as_a_lost_peer(text: str) -> None:
    assert not peer_gone(text)


_SYSTEM_ERROR = (
    "raised RuntimeError: NCCL error in: NCCLUtils.hpp:219, unhandled system error, NCCL "
    "version 2.10.3"
)


def test_a_death_by_signal_is_dated_back_over_an_own_looking_error_within_its_slack() -> None:
    killed = Problem(0, 100.5, "died from signal SIGKILL ...", slack=1.0, by_signal=True)
    survivor = Problem(1, 100.2, _SYSTEM_ERROR)
    assert first_failure((survivor, killed)).rank == 0
    # Beyond the slack the error came first.
    assert first_failure((Problem(1, 99.2, _SYSTEM_ERROR), killed)).rank == 1


def test_an_own_error_beats_a_clean_exit_but_not_a_signal_death_before_it() -> None:
    own = Problem(1, 100.2, "raised ValueError: bad batch")
    exited = Problem(0, 100.5, "exited with code 0 ...", slack=1.0)
    assert first_failure((own, exited)).rank == 1
    # A rank killed before that error was raised (dated back) is blamed over both.
    killed = Problem(2, 100.6, "died from signal SIGKILL ...", slack=1.0, by_signal=True)
    assert first_failure((own, exited, killed)).rank == 2
    # One killed after the error is not.
    late = Problem(2, 101.3, "died from signal SIGKILL ...", slack=1.0, by_signal=True)
    assert first_failure((own, exited, late)).rank == 1


@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_deaths_seen_in_one_wakeup_blame_the_lower_rank_whatever_order_wait_returned(
    order: tuple[int, int],
) -> None:
    # Two ranks SIGABRT ended, seen at the same moment: neither death explains the other,
    # and the blame went to whichever sentinel wait() listed first.
    aborted = {
        r: Problem(r, 100.5, "died from signal SIGABRT", slack=1.0, by_signal=True, aborted=True)
        for r in (2, 1)
    }
    deaths = tuple(aborted[r + 1] for r in order)
    assert first_failure(deaths).rank == 1
    text = failure_message(Outcome(3, "", deaths, frozenset(), ()), None)
    assert text.splitlines()[0] == "rank 1 of 3 died from signal SIGABRT", text
    assert text.splitlines()[-1] == "  rank 2 died from signal SIGABRT", text


@pytest.mark.parametrize(
    ("exit_code", "signal_code", "blamed"),
    # SIGABRT after the peer went is NCCL's watchdog ending rank 1: the exit is blamed.
    [(0, -11, 1), (1, -9, 1), (3, -6, 0)],
)
def test_a_signal_death_seen_with_a_lower_ranks_exit_is_blamed_over_it(
    exit_code: int, signal_code: int, blamed: int
) -> None:
    # Rank 0 exited (code 0 or 1: it may have caught rank 1's fault and left) and rank 1
    # died by a signal, seen in one wake-up: the lower rank was blamed, though a signal
    # death caught nothing.
    from trainperf.ddp._group_exits import unreported

    deaths = tuple(
        unreported(r, c, 100.5, reimport=False, startup_text=None)[0]
        for r, c in ((0, exit_code), (1, signal_code))
    )
    assert first_failure(deaths).rank == blamed
    text = failure_message(Outcome(2, "", deaths, frozenset(), ()), None)
    assert text.startswith(f"rank {blamed} of 2 "), text


@pytest.mark.parametrize(
    ("exit_code", "signal_code", "seen_later", "blamed"),
    [
        # Rank 1's death is seen one wake-up after rank 0's exit: it may have come first (it
        # is dated up to the slack before it was seen), and a signal death caught nothing.
        (1, -9, 0.05, 1),
        (0, -11, 0.9, 1),
        # Seen more than the slack after the exit: it died after rank 0 had left.
        (1, -9, 1.5, 0),
        # SIGABRT may be NCCL's watchdog ending rank 1 because rank 0 had gone.
        (1, -6, 0.05, 0),
    ],
)
def test_a_signal_death_seen_a_wakeup_after_a_lower_ranks_exit_is_blamed_over_it(
    exit_code: int, signal_code: int, seen_later: float, blamed: int
) -> None:
    # Seen in one wake-up, the signal death was blamed; seen in the next, the exit was,
    # though it may have been rank 0 catching the broken collective and leaving.
    from trainperf.ddp._group_exits import unreported

    exited = unreported(0, exit_code, 100.3, reimport=False, startup_text=None)[0]
    died = unreported(1, signal_code, 100.3 + seen_later, reimport=False, startup_text=None)[0]
    assert first_failure((exited, died)).rank == blamed
    # A lost-peer error in between changes nothing: both deaths explain it.
    lost = Problem(2, 100.32, "raised RuntimeError: Connection reset by peer")
    assert first_failure((exited, lost, died)).rank == blamed


@pytest.mark.parametrize("signal_code", [-9, -11])
def test_a_signal_death_after_a_rank_lost_its_peer_is_not_blamed_over_the_exit(
    signal_code: int,
) -> None:
    # Rank 2 lost its peer at 100.0; rank 1's death, seen at 101.2, came at 100.2 at the
    # earliest: after it, so the peer rank 2 lost was rank 0, whose exit (seen at 100.3)
    # may have come first. Rank 1's signal must not outrank that exit for the blame.
    from trainperf.ddp._group_exits import unreported

    exited = unreported(0, 1, 100.3, reimport=False, startup_text=None)[0]
    lost = Problem(2, 100.0, "raised RuntimeError: Connection closed by peer")
    died = unreported(1, signal_code, 101.2, reimport=False, startup_text=None)[0]
    assert first_failure((exited, lost, died)).rank == 0


def test_ranks_that_called_sys_exit_0_are_listed_apart_from_those_that_returned() -> None:
    lost = Problem(0, 100.0, "raised RuntimeError: Connection closed by peer")
    outcome = Outcome(4, "", (lost,), frozenset({1, 2, 3}), (), exit_calls=((2, "sys.exit(0)"),))
    text = failure_message(outcome, None)
    assert "\nAlready returned from main: ranks 1, 3\n" in text, text
    assert text.endswith(
        "\nCalled sys.exit(0) in main: rank 2 (a collective that not every rank "
        "calls fails like this)"
    ), text
