"""Is this process already one rank of a distributed job started by torchrun or SLURM?

``launch`` spawns nothing inside such a job: the launcher (torchrun's agent, ``srun``) has
already started one process per rank, and the environment says which rank this one is.
Half-set or contradictory variables are refused with the variable's name rather than
left to hang in a rendezvous that can never complete. Each variable is read and parsed by
:mod:`trainperf._utils.launch_env` (the same rules ``trainperf.limits`` follows); this module
decides which launcher started the process and whether its variables agree.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from trainperf._utils import launch_env
from trainperf._utils.launch_env import expand_nodelist

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


def _required(name: str, env: Mapping[str, str]) -> int:
    """A whole-number variable that a SLURM job step always sets (SLURM_PROCID is set)."""
    value = launch_env.read_int(name, env)
    if value is None:
        raise ValueError(
            f"environment variable {name} is not set, but SLURM_PROCID is: a SLURM job step "
            "(srun) sets both; run under srun, or unset SLURM_PROCID to let launch() spawn "
            "the workers itself"
        )
    return value


def _incomplete(env: Mapping[str, str]) -> ValueError:
    missing = [name for name in TORCHRUN_VARS if not launch_env.is_set(name, env)]
    found = ", ".join(
        f"{n}={launch_env.text(n, env)}" for n in _TORCHRUN_MARKERS if launch_env.is_set(n, env)
    )
    return ValueError(
        f"incomplete torchrun environment: {found} is set but {', '.join(missing)} "
        f"{'is' if len(missing) == 1 else 'are'} not; a distributed job needs all of "
        f"{', '.join(TORCHRUN_VARS)} (unset {', '.join(n for n in _TORCHRUN_MARKERS)} "
        "to let launch() spawn the workers itself)"
    )


def _torchrun(env: Mapping[str, str]) -> DistributedEnv:
    rank, world_size, local_rank = (
        launch_env.read_int(name, env) for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK")
    )
    master_addr, master_port = launch_env.text("MASTER_ADDR", env), launch_env.read_port(env)
    if rank is None or world_size is None or local_rank is None:
        raise _incomplete(env)
    if master_addr is None or master_port is None:
        raise _incomplete(env)
    if rank >= world_size:
        raise ValueError(f"RANK must be < WORLD_SIZE={world_size}, got RANK={rank}")
    local_world_size = launch_env.local_world_size(env)
    if launch_env.is_set("LOCAL_WORLD_SIZE", env) and local_world_size > world_size:
        # Else any LOCAL_RANK up to it passes, and NCCL ranks pick GPUs for a bigger job.
        raise ValueError(
            f"LOCAL_WORLD_SIZE={local_world_size} is more than WORLD_SIZE={world_size} (a host "
            "cannot run more of the job's processes than the job has): the variables come "
            "from different jobs; unset LOCAL_WORLD_SIZE or fix the launcher that set it"
        )
    if local_rank >= local_world_size:
        raise ValueError(
            f"LOCAL_RANK must be < LOCAL_WORLD_SIZE={local_world_size}, got LOCAL_RANK={local_rank}"
        )
    return DistributedEnv(
        "torchrun", rank, world_size, local_rank, local_world_size, master_addr, master_port
    )


def slurm_default_port(job_id: str) -> int:
    """MASTER_PORT for a SLURM job that sets none: derived from the job id.

    Raises:
        ValueError: ``job_id`` is not a whole number.

    Example:
        >>> slurm_default_port("123456")
        18456
    """
    number = launch_env.parse_int("SLURM_JOB_ID", job_id)
    return SLURM_PORT_BASE + number % SLURM_PORT_SPAN


def _slurm_master_addr(env: Mapping[str, str]) -> str:
    addr = launch_env.text("MASTER_ADDR", env)
    if addr is not None:
        return addr
    hosts = launch_env.nodelist(env)
    if hosts is None:
        raise ValueError(
            "SLURM job step without SLURM_JOB_NODELIST: cannot tell which host runs rank 0; "
            "set MASTER_ADDR to it"
        )
    return hosts[0]


def _slurm_master_port(env: Mapping[str, str]) -> int:
    port = launch_env.read_port(env)
    if port is not None:
        return port
    job_id = launch_env.text("SLURM_JOB_ID", env)
    if job_id is None:
        raise ValueError(
            "SLURM job step without SLURM_JOB_ID or MASTER_PORT: set MASTER_PORT to a free port "
            "on the first host"
        )
    return slurm_default_port(job_id)


def _refuse_outside_srun(ntasks: int, env: Mapping[str, str]) -> None:
    """The batch script (or salloc's interactive step) has SLURM_PROCID=0 and SLURM_NTASKS=N
    too, but it is one process: the other N-1 ranks never start, and the rendezvous would
    wait out the whole timeout. Its step id says so (an srun step's is a small number)."""
    step = launch_env.text("SLURM_STEP_ID", env) or launch_env.text("SLURM_STEPID", env)
    if step is None or launch_env.in_srun_step(env):
        return  # an srun task, or a SLURM too old to tell: trust SLURM_PROCID
    raise ValueError(
        f"launch() runs in a SLURM job of SLURM_NTASKS={ntasks} tasks, but not in an srun "
        f"step (SLURM_STEP_ID={step}: the batch script or an interactive step), so the other "
        f"{ntasks - 1} ranks never start and the rendezvous would wait for them until timeout; "
        "run the script through srun (`srun python train.py`), or unset SLURM_PROCID to let "
        "launch() spawn the workers on this node itself"
    )


def _check_nprocs(ntasks: int, env: Mapping[str, str]) -> None:
    """SLURM sets SLURM_NPROCS, the older name of SLURM_NTASKS, to the step's tasks, or in a
    heterogeneous step (``srun -n2 a : -n2 b``, which need not set SLURM_HET_SIZE) to one
    component's: never more than SLURM_NTASKS (``srun --preserve-env`` keeps both of the
    job's). More means the variables of two jobs or steps are mixed (one exported into the
    other)."""
    nprocs = launch_env.read_int("SLURM_NPROCS", env)
    if nprocs is not None and nprocs > ntasks:
        raise ValueError(
            f"SLURM_NPROCS={nprocs} is more than SLURM_NTASKS={ntasks}: SLURM sets it to the "
            "tasks of the job step (or of one component of a heterogeneous step), so the "
            "variables come from different jobs or steps; run inside one srun step, or unset "
            "the stale one"
        )


def _check_tasks_listed(ntasks: int, env: Mapping[str, str]) -> None:
    """SLURM writes SLURM_NTASKS and SLURM_TASKS_PER_NODE from one layout (an srun step's, a
    heterogeneous step's whole one, or the job's, kept under ``srun --preserve-env``), and
    an srun step's SLURM_STEP_NUM_TASKS and SLURM_STEP_TASKS_PER_NODE from its own, so the
    list adds up to the step's tasks; fewer listed means ranks that never start, and a
    rendezvous that waits for them until timeout. Not SLURM_NTASKS_PER_NODE (the option's
    count, a per-node maximum with no node count), nor a single count without (xN) (every
    node's: the total is unknown); more listed than run is left alone (an older salloc wrote
    CPUs per node there)."""
    step_layout = "SLURM_STEP_TASKS_PER_NODE"
    name = step_layout
    if launch_env.tasks_per_node_variable(env) != step_layout:
        name = "SLURM_TASKS_PER_NODE"
    raw = launch_env.text(name, env)
    if raw is None:
        return
    entries = launch_env.parse_tasks_per_node(name, raw)
    if len(entries) == 1 and "(" not in raw:
        return
    listed = sum(tasks * nodes for tasks, nodes in entries)
    if listed < ntasks:
        raise ValueError(
            f"{launch_env.step_tasks_variable(env)}={ntasks} but {name}={raw!r} lists {listed} "
            "tasks: srun sets both from the step's layout, so the variables come from "
            "different jobs or steps; run inside one srun step, or unset the stale one"
        )


def _slurm_local_world_size(ntasks: int, local_rank: int, env: Mapping[str, str]) -> int:
    """Tasks on this node: SLURM's count (a stray LOCAL_WORLD_SIZE from elsewhere does not
    override it). Without SLURM_NODEID the first node's count stands for this node's; a task
    numbered past it shows this node has more. With it, a task numbered past this node's own
    count contradicts it."""
    if local_rank >= ntasks:
        raise ValueError(
            f"SLURM_LOCALID must be < {launch_env.step_tasks_variable(env)}={ntasks}, got "
            f"{local_rank}: a node cannot "
            "run more tasks than the job step has; the variables come from different jobs or "
            "steps; run inside one srun step, or unset the stale ones"
        )
    on_node = launch_env.tasks_on_this_node(env)
    node = launch_env.read_int("SLURM_NODEID", env)
    if on_node is not None and node is not None and local_rank >= on_node:
        name = launch_env.tasks_per_node_variable(env) or "SLURM_TASKS_PER_NODE"
        raise ValueError(
            f"SLURM_LOCALID must be < {on_node} (the tasks {name}={launch_env.text(name, env)!r} "
            f"gives node SLURM_NODEID={node}), got SLURM_LOCALID={local_rank}: the variables "
            "come from different jobs or steps; run inside one srun step, or unset the stale "
            "ones"
        )
    # At most the step's tasks: SLURM_NTASKS_PER_NODE may be the batch job's, inherited by
    # an `srun -n 2` inside an --ntasks-per-node=4 allocation.
    return max(min(on_node or 1, ntasks), local_rank + 1)


def _slurm(env: Mapping[str, str]) -> DistributedEnv | None:
    job_tasks = launch_env.read_int("SLURM_NTASKS", env)
    if job_tasks is not None:
        _check_nprocs(job_tasks, env)
    # The step's tasks, not SLURM_NTASKS: under `srun --preserve-env` that is the job's (or
    # unset, in a job submitted without --ntasks), and the rendezvous waited for ranks the
    # step never starts.
    tasks_name = launch_env.step_tasks_variable(env)
    ntasks = _required(tasks_name, env)
    rank = _required("SLURM_PROCID", env)
    if rank >= ntasks:
        raise ValueError(f"SLURM_PROCID must be < {tasks_name}={ntasks}, got SLURM_PROCID={rank}")
    if ntasks == 1:
        # A one-task job (or `srun --pty bash`) is a workstation: launch() spawns locally.
        return None
    _refuse_outside_srun(ntasks, env)
    _check_tasks_listed(ntasks, env)
    local_rank = _required("SLURM_LOCALID", env)
    local_world_size = _slurm_local_world_size(ntasks, local_rank, env)
    return DistributedEnv(
        "slurm",
        rank,
        ntasks,
        local_rank,
        local_world_size,
        _slurm_master_addr(env),
        _slurm_master_port(env),
    )


def detect(environ: Mapping[str, str] | None = None) -> DistributedEnv | None:
    """The job this process belongs to, or None when no launcher started it.

    torchrun's variables win over SLURM's (torchrun inside an ``srun`` step).

    Args:
        environ: variables to read instead of ``os.environ``.

    Returns:
        The layout, or None outside a multi-process job.

    Raises:
        ValueError: the variables are incomplete or contradict each other, or a SLURM job
            of several tasks runs outside an ``srun`` step (the batch script itself); the
            message names the variable.

    Example:
        >>> detect({}) is None
        True
        >>> env = detect({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
        ...               "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"})
        >>> env.source, env.rank, env.world_size, env.master_port
        ('torchrun', 1, 2, 29500)
    """
    env = launch_env.environ(environ)
    if any(launch_env.is_set(name, env) for name in _TORCHRUN_MARKERS):
        return _torchrun(env)
    if launch_env.is_set("SLURM_PROCID", env):
        return _slurm(env)
    return None
