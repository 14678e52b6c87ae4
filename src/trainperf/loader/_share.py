"""Under DDP, tune once per host: local rank 0 tunes and hands the choice to the others.

Every rank of a host would otherwise measure at once, each on its share of the CPUs, while
the others' measurements disturb its own. When a process group is initialised and several
ranks share this host, local rank 0 tunes (or reads the cache) and writes the result to the
process group's key-value store under a key naming this host, the call's arguments (the
cache key's fields) and how many such calls this process has made; the other local ranks
wait for that key and build their loader from it with their own arguments (their own
sampler, say).

The hand-over uses the store, not a collective, so that a call made on some ranks only
cannot hang: local rank 0 never waits for anyone, and the others wait at most the budget
plus :data:`GRACE_S`, then tune on their own and say so. A failure on local rank 0 is
handed over too, and raised on the others. Without a process group (launcher variables
only) there is nothing to hand over with, and each rank tunes on its own, as the report
notes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from trainperf._utils import launch_env
from trainperf.limits import local_world_size
from trainperf.loader._cached import share_entry
from trainperf.loader._report import TuningReport

__all__ = [
    "GRACE_S",
    "Peers",
    "call_key",
    "local_peers",
    "receive_entry",
    "receive_or_tune",
    "send_entry",
    "send_failure",
    "tune_and_send",
]

GRACE_S = 30.0
"""How much longer than the budget the other local ranks wait for local rank 0."""

_counters: dict[str, itertools.count[int]] = {}


@dataclass(frozen=True)
class Peers:
    """This process among the ranks of its host.

    Attributes:
        store: the process group's key-value store.
        rank: this process's global rank.
        local_rank: its rank on this host.
        local_ranks: ranks on this host.
        host: this host's name (what the ranks of a host have in common).
    """

    store: Any
    rank: int
    local_rank: int
    local_ranks: int
    host: str


def _local_rank(local_ranks: int) -> int | None:
    """``LOCAL_RANK``, else ``SLURM_LOCALID`` inside an ``srun`` step (a batch script's is
    every rank's), else the global rank when every rank is here."""
    value = launch_env.read_int_or_srun("LOCAL_RANK", "SLURM_LOCALID")
    if value is not None:
        return value
    return dist.get_rank() if dist.get_world_size() == local_ranks else None


def local_peers() -> tuple[Peers | None, str | None]:
    """The ranks to share with, or None; and a note when ranks share this host but cannot
    share the tuning.

    Raises:
        ValueError: a launcher variable it reads is malformed (the message names it).

    Example:
        >>> local_peers()  # a plain process
        (None, None)
    """
    ranks = local_world_size()
    if ranks <= 1:
        return None, None
    how = "initialise the process group first (trainperf.ddp.launch does)"
    if not (dist.is_available() and dist.is_initialized()):
        return None, (
            f"{ranks} local ranks but no process group: each rank tuned on its own; {how} "
            f"to tune once per host"
        )
    local_rank = _local_rank(ranks)
    get_store = getattr(dist.distributed_c10d, "_get_default_store", None)
    if local_rank is None or get_store is None:
        return None, (
            f"{ranks} local ranks, but this rank's place on its host is unknown (set "
            f"LOCAL_RANK, as torchrun does): each rank tuned on its own"
        )
    return Peers(get_store(), dist.get_rank(), local_rank, ranks, socket.gethostname()), None


def call_key(host: str, fields_key: str) -> str:
    """The store key of this process's next call with these arguments on this host.

    The n-th call on local rank 0 pairs with the n-th call on the others, so a call
    repeated with ``cache=False`` is not answered with the previous call's result.

    Example:
        >>> call_key("node1", "abc") != call_key("node1", "abc")
        True
    """
    n = next(_counters.setdefault(f"{host}/{fields_key}", itertools.count()))
    return f"trainperf/tune_loader/{host}/{fields_key}/{n}"


def send_entry(store: Any, key: str, rank: int, entry: Mapping[str, Any]) -> None:
    """Hand ``entry`` (JSON-safe), tuned on global rank ``rank``, to the local ranks
    waiting on ``key``."""
    store.set(key, json.dumps({"entry": dict(entry), "rank": rank}))


def send_failure(store: Any, key: str, rank: int, error: BaseException) -> None:
    """Tell the local ranks waiting on ``key`` that tuning failed on ``rank``, and why.

    A store that cannot take it (the job is going down) is ignored: ``error`` is what the
    caller must see, and the others stop waiting after the budget anyway.
    """
    message = json.dumps({"failed": f"{type(error).__name__}: {error}", "rank": rank})
    with contextlib.suppress(RuntimeError):
        store.set(key, message)


def receive_entry(store: Any, key: str, timeout_s: float) -> tuple[int, dict[str, Any]] | None:
    """The sender's global rank and what it sent under ``key``; None when nothing (usable)
    came within ``timeout_s``.

    Raises:
        RuntimeError: local rank 0 sent a failure (its message is quoted).

    Example:
        >>> store = dist.HashStore()
        >>> send_entry(store, "k", 0, {"best": {"num_workers": 2}})
        >>> receive_entry(store, "k", 1.0)
        (0, {'best': {'num_workers': 2}})
    """
    try:
        store.wait([key], timedelta(seconds=timeout_s))
        message = json.loads(store.get(key))
    except (RuntimeError, ValueError):  # torch's DistStoreError is a RuntimeError
        return None
    if not isinstance(message, dict):
        return None
    if "failed" in message:
        raise RuntimeError(
            f"local rank 0 (rank {message.get('rank')}) failed to tune the loader, so it has "
            f"no settings to share: {message['failed']}; its traceback says why"
        )
    entry, rank = message.get("entry"), message.get("rank")
    if not isinstance(entry, dict) or not isinstance(rank, int):
        return None
    return rank, entry


def _noted(report: TuningReport, note: str) -> TuningReport:
    return dataclasses.replace(report, notes=(*report.notes, note))


def tune_and_send(peers: Peers, key: str, tune: Callable[[], TuningReport]) -> TuningReport:
    """Local rank 0: ``tune()``, and hand its result (or its failure) to the host's other
    ranks waiting on ``key``."""
    try:
        report = tune()
    except BaseException as e:
        send_failure(peers.store, key, peers.rank, e)
        raise
    send_entry(peers.store, key, peers.rank, share_entry(report))
    others = peers.local_ranks - 1
    return _noted(
        report,
        f"tuned here on local rank 0 and shared with the other {others} local "
        f"rank{'' if others == 1 else 's'} of this host (the usable CPUs above are one "
        f"rank's share)",
    )


def receive_or_tune(
    peers: Peers,
    key: str,
    timeout_s: float,
    build: Callable[[int, dict[str, Any]], TuningReport | None],
    tune_alone: Callable[[], TuningReport],
) -> TuningReport:
    """Another local rank: the report ``build(sender, entry)`` makes of what local rank 0
    sent under ``key``; when nothing usable comes within ``timeout_s``, ``tune_alone()``,
    with a note saying so.

    Raises:
        RuntimeError: local rank 0 sent a failure (see :func:`receive_entry`).
    """
    sent = receive_entry(peers.store, key, timeout_s)
    report = None if sent is None else build(*sent)
    if report is not None:
        return report
    return _noted(
        tune_alone(),
        f"local rank 0 sent no settings within {timeout_s:.1f} s (is tune_loader called on "
        f"every local rank, with the same arguments?), so this rank tuned on its own",
    )
