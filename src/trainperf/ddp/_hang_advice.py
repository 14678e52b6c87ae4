"""The fix a hang verdict gives, by its kind, with the ranks and the call site filled in.

Used by :mod:`~trainperf.ddp._hang` (the verdicts) and :mod:`~trainperf.ddp._hang_report`
(which names the timeout the way the caller does).
"""

from __future__ import annotations

from trainperf.ddp._hang_view import RankView, _ranks
from trainperf.ddp._progress_slots import BUSY_CAP
from trainperf.ddp._stacks import loads_in_process

# What launch()'s advice says of main, as watchdog() words it: it has no main, its ranks
# leave a ``with watchdog():`` block or end their script.
_NO_MAIN = {
    "finished main": "left the watchdog() block (or ended their script)",
    "make it return": "make it finish too",
}


def _named_as(advice: str, option: str) -> str:
    """``advice`` for a caller that names the limit ``option``: ``watchdog(timeout=...)``
    has no ``hang_timeout``, and no ``main``.

    Example:
        >>> _named_as("raise hang_timeout (or pass hang_timeout=None).", "timeout")
        "raise the watchdog's timeout (or pass timeout=None)."
        >>> _named_as("otherwise make it return.", "timeout")
        'otherwise make it finish too.'
    """
    if option == "hang_timeout":
        return advice
    for launched, watched in _NO_MAIN.items():
        advice = advice.replace(launched, watched)
    return advice.replace("hang_timeout=None", f"{option}=None").replace(
        "hang_timeout", f"the watchdog's {option}"
    )


_ADVICE = {
    "running": (
        "Fix: every rank must reach the same collectives. Look at what {who} does at {site}: "
        "an endless loop, a sleep, or work only some ranks do. If that work is slow on "
        "purpose, raise hang_timeout (or pass hang_timeout=None)."
    ),
    "starting": (
        "Fix: {who} never reached main: code that runs before it blocks, at {site}: the "
        "module-level code of your script (each spawned rank imports it again) or of main's "
        "module, or unpickling launch()'s arguments. Move slow or blocking work (a download, "
        "a wait for a file or a lock that another rank makes) into main, after the process "
        "group exists (one rank does it, then dist.barrier()), or under "
        '`if __name__ == "__main__":`.'
    ),
    "dataloader": (
        "Fix: {who}'s DataLoader delivers no batch: a worker is stuck in __getitem__ (I/O, "
        "a lock, a deadlock after fork) or died. DataLoader(..., timeout=60) makes the wait "
        "raise; num_workers=0 runs __getitem__ in the rank, so the next report shows its line."
    ),
    "dataloader-inline": (
        "Fix: {who} loads its batches itself (num_workers=0, so DataLoader(timeout=...) does "
        "not apply) and its dataset does not return, at {site}: an I/O call without a "
        "timeout, a lock it cannot get, an endless loop. Give that call a timeout, or make "
        "the dataset return on every rank."
    ),
    "busy": (
        "Fix: {who} spent more than {cap:g} x the timeout in that work, which counts as "
        "progress only that long. A checkpoint write that slow points at the storage (a full, "
        "slow or network filesystem: check the path's free space and write speed); if it is "
        "slow on purpose, raise hang_timeout."
    ),
    "compiling": (
        "Fix: {who} spent more than {cap:g} x the timeout in torch.compile's compiler, which "
        "counts as progress only that long. Either the compilation is stuck (a compile "
        "worker died or deadlocked: its stacks are below) or it recompiles again and again "
        "(TORCH_LOGS=recompiles names the guard that fails; mark changing sizes dynamic). If "
        "one compilation is that slow on purpose, raise hang_timeout."
    ),
    "silent": (
        "Fix: {who} could not say what it does: no Python thread of it ran, which happens "
        "when C code holds the GIL for the whole timeout (a regex, an extension call that "
        "does not release it) or when the process is stopped or swapped out. `py-spy dump "
        "--native --pid PID` on that rank's process shows where it is."
    ),
    "lock": (
        "Fix: {who} waits for a lock that nothing releases: another of its threads holds it "
        "(its threads are listed below). Release it on every path (`with lock:`), and do not "
        "hold it across blocking calls."
    ),
    "thread-wait": (
        "Fix: {who} waits for one of its own threads to finish or to signal (Thread.join, an "
        "Event or Condition, a queue) and it never does: that thread died, is stuck itself, "
        "or was never started (its threads are listed below). Signal on every path "
        "(try/finally), and give the wait a timeout."
    ),
    "process-wait": (
        "Fix: {who} waits for another process (a multiprocessing Queue or Pipe, "
        "Process.join, a subprocess) that never answers: it died, is stuck "
        "itself, or was never started; its own output says which. Give the wait a timeout "
        "(get(timeout=...), join(timeout), subprocess's timeout=) and check the other side's "
        "exit code."
    ),
    "unreachable": (
        "Fix: the rendezvous store that connects the ranks failed, so {who} could not say "
        "what they do: the process that hosts it (rank 0, or torchrun's agent) exited or lost "
        "the network. Look at that process's output first; the hang may be its crash."
    ),
    "gone": (
        "Fix: {who} exited while the others wait for it in a collective: its own output "
        "(stderr, or its log under torchrun) says why. A rank that fails must end the job "
        "(with watchdog(), an exception leaving the block counts as exiting); a rank that "
        "leaves early on purpose must still make every collective the others make."
    ),
    "returned": (
        "Fix: the other ranks finished main while {who} still runs code at {site} that they "
        "do not. If that is intended (work only {who} does at the end), raise hang_timeout; "
        "otherwise make it return."
    ),
    "ddp": (
        "Fix: make every rank's forward use the same parameters (no branch on the rank or the "
        "data around a layer), or wrap the model with find_unused_parameters=True."
    ),
    "mismatch": (
        "Fix: every rank must call the same collectives in the same order, with the same "
        "shapes and dtypes: look for an `if` that depends on the rank or the data around "
        "{site}. TORCH_DISTRIBUTED_DEBUG=DETAIL checks every call as it is made."
    ),
    "p2p": (
        "Fix: order the point-to-point calls so that one side of each pair sends while the "
        "other receives (even ranks send first, odd ranks receive first), or start both "
        "without blocking (dist.isend / dist.irecv, or dist.batch_isend_irecv) and wait on "
        "them; see {site}."
    ),
    "stalled": (
        "Fix: no rank is missing from the collective, so the stall is below Python: the "
        "interconnect (run `trainperf doctor --dist`; NCCL_DEBUG=INFO names the transport), "
        "a GPU kernel that never finishes, or a peer outside this job on the same port."
    ),
}


_SITES_SHOWN = 3  # call sites a fix names (thousands of ranks under watchdog())


def _site(kind: str, view: RankView) -> str | None:
    if view.collective and kind in ("mismatch", "behind", "p2p"):
        return view.collective.site
    return view.where.site if view.where else None


def _advice(kind: str, root: list[RankView]) -> str:
    unknown = "a line its stack could not show" if kind == "starting" else "the call site"
    # Every blamed rank's line, not the first one's only: two ranks in different
    # collectives are both named, and either line may be the one to change.
    sites = list(dict.fromkeys(s for v in root if (s := _site(kind, v)) is not None))
    if len(sites) > _SITES_SHOWN:
        sites = [*sites[:_SITES_SHOWN], f"{len(sites) - _SITES_SHOWN} more"]
    site = " and ".join([", ".join(sites[:-1]), sites[-1]] if len(sites) > 1 else sites)
    who = _ranks([v.rank for v in root]) if root else "every rank"
    return _ADVICE[kind].format(who=who, site=site or unknown, cap=BUSY_CAP)


def _reason(view: RankView) -> str:
    """Which advice fits a rank stuck outside any collective."""
    if view.stuck_in:
        return "busy"
    if not view.answered and view.activity == "running":
        return "silent"
    if view.activity == "dataloader" and loads_in_process(view.stack):
        return "dataloader-inline"
    return "compiling" if view.compiling else view.activity
