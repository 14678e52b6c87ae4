"""Is this process already one rank of a distributed job started by torchrun or SLURM?

``launch`` spawns nothing inside such a job: the launcher (torchrun's agent, ``srun``) has
already started one process per rank, and the environment says which rank this one is.
Half-set or contradictory variables are refused with the variable's name rather than
left to hang in a rendezvous that can never complete.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

__all__ = ["DistributedEnv", "detect", "expand_nodelist", "slurm_default_port"]

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
# Any one of these means "a launcher started me"; MASTER_ADDR/MASTER_PORT alone do not,
# since users set them to choose the single-node spawner's port.
_TORCHRUN_MARKERS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")

# MASTER_PORT under SLURM when the job does not set one: every task of a job derives the
# same port from the job id, and concurrent jobs on one node rarely collide.
SLURM_PORT_BASE = 15000
SLURM_PORT_SPAN = 20000


@dataclass(frozen=True)
class DistributedEnv:
    """Where this process sits in a job that a launcher started.

    Attributes:
        source: which launcher's variables were read.
        rank: global rank.
        world_size: number of ranks in the job.
        local_rank: rank on this node (the GPU index under one-process-per-GPU).
        local_world_size: ranks on this node.
        master_addr: host of the rendezvous store.
        master_port: port of the rendezvous store.
    """

    source: Literal["torchrun", "slurm"]
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int


def _int(env: Mapping[str, str], name: str, *, minimum: int = 0) -> int:
    raw = env.get(name)
    if raw is None:
        raise ValueError(f"environment variable {name} is not set")
    try:
        value = int(raw)
    except ValueError as e:
        raise ValueError(f"environment variable {name} must be an integer, got {raw!r}") from e
    if value < minimum:
        raise ValueError(f"environment variable {name} must be >= {minimum}, got {raw!r}")
    return value


def _port(env: Mapping[str, str], name: str) -> int:
    port = _int(env, name, minimum=1)
    if port > 65535:
        raise ValueError(f"environment variable {name} must be a port in 1..65535, got {port!r}")
    return port


def _torchrun(env: Mapping[str, str]) -> DistributedEnv:
    missing = [name for name in TORCHRUN_VARS if not env.get(name)]
    if missing:
        found = ", ".join(f"{n}={env[n]}" for n in _TORCHRUN_MARKERS if n in env)
        raise ValueError(
            f"incomplete torchrun environment: {found} is set but {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not; a distributed job needs all of "
            f"{', '.join(TORCHRUN_VARS)} (unset {', '.join(n for n in _TORCHRUN_MARKERS)} "
            "to let launch() spawn the workers itself)"
        )
    world_size = _int(env, "WORLD_SIZE", minimum=1)
    rank = _int(env, "RANK")
    if rank >= world_size:
        raise ValueError(f"RANK must be < WORLD_SIZE={world_size}, got RANK={rank}")
    local_rank = _int(env, "LOCAL_RANK")
    local_world_size = (
        _int(env, "LOCAL_WORLD_SIZE", minimum=1) if "LOCAL_WORLD_SIZE" in env else world_size
    )
    if local_rank >= local_world_size:
        raise ValueError(
            f"LOCAL_RANK must be < LOCAL_WORLD_SIZE={local_world_size}, got LOCAL_RANK={local_rank}"
        )
    return DistributedEnv(
        "torchrun",
        rank,
        world_size,
        local_rank,
        local_world_size,
        env["MASTER_ADDR"],
        _port(env, "MASTER_PORT"),
    )


def _split_top_level(text: str) -> list[str]:
    """Split on commas outside brackets: "a[1,2],b" -> ["a[1,2]", "b"]."""
    parts: list[str] = []
    depth, start = 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in SLURM node list {text!r}")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"unbalanced '[' in SLURM node list {text!r}")
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _expand_range(spec: str, nodelist: str) -> list[str]:
    out: list[str] = []
    for item in spec.split(","):
        lo, sep, hi = item.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"bad range {item!r} in SLURM node list {nodelist!r}")
        if not sep:
            out.append(lo)
            continue
        width = len(lo)  # "01-04" keeps its zero padding
        out.extend(str(n).zfill(width) for n in range(int(lo), int(hi) + 1))
    return out


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a SLURM node list (``SLURM_JOB_NODELIST``) into host names, in order.

    Handles ranges with zero padding, lists inside brackets and several bracket groups in
    one name, without calling ``scontrol``.

    Args:
        nodelist: e.g. ``"node[01-03,07],gpu3"``.

    Returns:
        The host names.

    Raises:
        ValueError: the list is empty or malformed.

    Example:
        >>> expand_nodelist("node[01-03,07],gpu3")
        ['node01', 'node02', 'node03', 'node07', 'gpu3']
        >>> expand_nodelist("rack[1-2]-n[8-9]")
        ['rack1-n8', 'rack1-n9', 'rack2-n8', 'rack2-n9']
    """
    hosts: list[str] = []
    for part in _split_top_level(nodelist):
        names = [""]
        for literal, bracket in re.findall(r"([^\[\]]*)(?:\[([^\]]*)\])?", part):
            suffixes = _expand_range(bracket, nodelist) if bracket else [""]
            names = [n + literal + s for n in names for s in suffixes]
        hosts.extend(names)
    if not hosts:
        raise ValueError(f"SLURM node list is empty: {nodelist!r}")
    return hosts


def slurm_default_port(job_id: str) -> int:
    """MASTER_PORT for a SLURM job that sets none: derived from the job id.

    Example:
        >>> slurm_default_port("123456")
        18456
    """
    try:
        number = int(job_id)
    except ValueError as e:
        raise ValueError(f"SLURM_JOB_ID must be an integer, got {job_id!r}") from e
    return SLURM_PORT_BASE + number % SLURM_PORT_SPAN


def _tasks_on_first_node(value: str) -> int:
    """SLURM_TASKS_PER_NODE looks like "4(x2),3"; the first count is this layout's width."""
    match = re.match(r"\s*(\d+)", value)
    if not match:
        raise ValueError(f"SLURM_TASKS_PER_NODE must look like '4(x2),3', got {value!r}")
    return int(match.group(1))


def _slurm(env: Mapping[str, str]) -> DistributedEnv | None:
    ntasks = _int(env, "SLURM_NTASKS", minimum=1)
    rank = _int(env, "SLURM_PROCID")
    if rank >= ntasks:
        raise ValueError(f"SLURM_PROCID must be < SLURM_NTASKS={ntasks}, got SLURM_PROCID={rank}")
    if ntasks == 1:
        # A one-task job (or `srun --pty bash`) is a workstation: launch() spawns locally.
        return None
    local_rank = _int(env, "SLURM_LOCALID")
    if "SLURM_NTASKS_PER_NODE" in env:
        local_world_size = _int(env, "SLURM_NTASKS_PER_NODE", minimum=1)
    elif "SLURM_TASKS_PER_NODE" in env:
        local_world_size = _tasks_on_first_node(env["SLURM_TASKS_PER_NODE"])
    else:
        local_world_size = 1
    local_world_size = max(local_world_size, local_rank + 1)

    if env.get("MASTER_ADDR"):
        master_addr = env["MASTER_ADDR"]
    else:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
        if not nodelist:
            raise ValueError(
                "SLURM job step without SLURM_JOB_NODELIST: cannot tell which host runs rank 0; "
                "set MASTER_ADDR to it"
            )
        master_addr = expand_nodelist(nodelist)[0]

    if env.get("MASTER_PORT"):
        master_port = _port(env, "MASTER_PORT")
    elif env.get("SLURM_JOB_ID"):
        master_port = slurm_default_port(env["SLURM_JOB_ID"])
    else:
        raise ValueError(
            "SLURM job step without SLURM_JOB_ID or MASTER_PORT: set MASTER_PORT to a free port "
            "on the first host"
        )
    return DistributedEnv(
        "slurm", rank, ntasks, local_rank, local_world_size, master_addr, master_port
    )


def detect(environ: Mapping[str, str] | None = None) -> DistributedEnv | None:
    """The job this process belongs to, or None when no launcher started it.

    torchrun's variables win over SLURM's (torchrun inside an ``srun`` step).

    Args:
        environ: variables to read instead of ``os.environ``.

    Returns:
        The layout, or None outside a multi-process job.

    Raises:
        ValueError: the variables are incomplete or contradict each other; the message
            names the variable.

    Example:
        >>> detect({}) is None
        True
        >>> env = detect({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
        ...               "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"})
        >>> env.source, env.rank, env.world_size, env.master_port
        ('torchrun', 1, 2, 29500)
    """
    env = os.environ if environ is None else environ
    if any(name in env for name in _TORCHRUN_MARKERS):
        return _torchrun(env)
    if "SLURM_PROCID" in env:
        return _slurm(env)
    return None
