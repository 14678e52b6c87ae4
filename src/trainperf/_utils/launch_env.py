"""The launcher's environment variables, read and parsed here only, with one rule each.

torchrun sets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``
and ``MASTER_PORT``; a SLURM job step (``srun``) sets ``SLURM_PROCID``, ``SLURM_LOCALID``,
``SLURM_NTASKS``, ``SLURM_NODEID``, ``SLURM_TASKS_PER_NODE`` (and ``SLURM_NTASKS_PER_NODE``
under ``--ntasks-per-node``), ``SLURM_CPUS_PER_TASK``, ``SLURM_JOB_ID``, the node lists, and
the step's own ``SLURM_STEP_NUM_TASKS`` and ``SLURM_STEP_TASKS_PER_NODE``; under
``srun --preserve-env`` (and in salloc's interactive step, which uses it) ``SLURM_NTASKS``,
``SLURM_NPROCS`` and ``SLURM_TASKS_PER_NODE`` keep the job's values, and only the two
``SLURM_STEP_*`` variables describe the step.
:mod:`trainperf.limits` (``local_world_size``, ``usable_cpus``) and :mod:`trainperf.ddp`
(``detect``, ``rank()`` and friends, the spawner's ``MASTER_PORT``) read them through this
module, so a value means the same thing, and fails the same way, everywhere.

The rules:

- Unset or blank is unset: the caller's default applies (the functions here return None).
- A set value that breaks its rule is a ``ValueError`` naming the variable, the value and the
  fix; never a silent default.
- ``RANK``, ``LOCAL_RANK``, ``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURM_NODEID``,
  ``SLURM_JOB_ID``: a whole number >= 0 (decimal digits; no sign).
- ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``SLURM_NTASKS`` (and ``SLURM_NPROCS``, its older
  name), ``SLURM_STEP_NUM_TASKS``, ``SLURM_CPUS_PER_TASK``: a whole number >= 1.
- ``MASTER_PORT``: a whole number in 1..65535.
- Tasks in this job step (:func:`step_tasks`): in an srun step (a ``SLURM_STEP_ID`` below
  SLURM's special ids), ``SLURM_STEP_NUM_TASKS`` where set, else ``SLURM_NTASKS``.
- ``SLURM_STEP_TASKS_PER_NODE``, ``SLURM_NTASKS_PER_NODE``, ``SLURM_TASKS_PER_NODE``: tasks
  per node in SLURM's compressed form, ``"4"``, ``"4(x2)"`` or ``"4(x2),3"`` (4 tasks on
  each of the first 2 nodes, then 3 on the third); every count >= 1.
- Tasks on this node: in an srun step ``SLURM_STEP_TASKS_PER_NODE`` where set, else
  ``SLURM_NTASKS_PER_NODE``, else ``SLURM_TASKS_PER_NODE``; of its entries, the
  ``SLURM_NODEID``-th node's, or the first node's when ``SLURM_NODEID`` is unset.
  A single count without ``(xN)`` (how ``--ntasks-per-node=4`` is written) is every node's.
- Processes on this host (:func:`local_world_size`): ``LOCAL_WORLD_SIZE``, else SLURM's
  tasks on this node (a job script's ``WORLD_SIZE=$SLURM_NTASKS`` is the whole job) but no
  more than ``WORLD_SIZE`` or the step's tasks where set (SLURM's count is the
  allocation's; a launcher or an ``srun -n 2`` started inside it may run fewer
  processes), else ``WORLD_SIZE`` (a torch launcher that does not say how many ranks share
  a host is taken to run them all on this one; torchrun always says), else 1.
- ``SLURM_STEP_NODELIST``, else ``SLURM_JOB_NODELIST``: a host list such as
  ``"node[01-03,07],gpu3"`` (:func:`expand_nodelist`); a range runs from low to high, and
  brackets are never empty.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

__all__ = [
    "environ",
    "expand_nodelist",
    "in_srun_step",
    "is_set",
    "local_world_size",
    "nodelist",
    "parse_int",
    "parse_tasks_per_node",
    "read_int",
    "read_int_or_srun",
    "read_port",
    "step_tasks",
    "step_tasks_variable",
    "tasks_on_this_node",
    "tasks_per_node_variable",
    "text",
]

_FIX = "unset it or fix the launcher that set it"

# Whole-number variables: the least value allowed, and what the number counts.
_WHOLE_NUMBERS: dict[str, tuple[int, str]] = {
    "RANK": (0, "this process's global rank"),
    "LOCAL_RANK": (0, "this process's rank on its host"),
    "WORLD_SIZE": (1, "processes in the job"),
    "LOCAL_WORLD_SIZE": (1, "processes on this host"),
    "SLURM_PROCID": (0, "this task's global rank"),
    "SLURM_LOCALID": (0, "this task's rank on its node"),
    "SLURM_NODEID": (0, "this node's index in the job step"),
    "SLURM_NTASKS": (1, "tasks in the job step"),
    "SLURM_NPROCS": (1, "tasks in the job step; the older name of SLURM_NTASKS"),
    "SLURM_STEP_NUM_TASKS": (1, "tasks in the srun step"),
    "SLURM_CPUS_PER_TASK": (1, "CPUs per task"),
    "SLURM_JOB_ID": (0, "the job's id"),
}
_DIGITS = re.compile(r"[0-9]+")
_TASK_ENTRY = re.compile(r"([0-9]+)(?:\(x([0-9]+)\))?")
_TASK_VARIABLES = ("SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
# The step's own layout; read first inside an srun step (see _is_srun_step_id).
_STEP_TASK_VARIABLE = "SLURM_STEP_TASKS_PER_NODE"


def environ(env: Mapping[str, str] | None = None) -> Mapping[str, str]:
    """``env``, or this process's environment when None: the one place it is looked up."""
    return os.environ if env is None else env


def text(name: str, env: Mapping[str, str] | None = None) -> str | None:
    """The variable's value with surrounding blanks removed; None when unset or blank.

    Example:
        >>> text("MASTER_ADDR", {"MASTER_ADDR": " head "}), text("MASTER_ADDR", {})
        ('head', None)
    """
    value = environ(env).get(name)
    if value is None or not value.strip():
        return None
    return value.strip()


def is_set(name: str, env: Mapping[str, str] | None = None) -> bool:
    """Whether the variable is set to something other than blanks.

    Example:
        >>> is_set("RANK", {"RANK": "0"}), is_set("RANK", {"RANK": ""})
        (True, False)
    """
    return text(name, env) is not None


# SLURM's step ids from here up are not srun steps: the batch script (4294967294), the
# extern step (4294967295), an interactive step.
_SPECIAL_STEPS = 4294967290


def _is_srun_step_id(env: Mapping[str, str] | None) -> bool:
    """``SLURM_STEP_ID`` names an srun step, not the batch script, extern or interactive one."""
    step = text("SLURM_STEP_ID", env) or text("SLURM_STEPID", env) or ""
    return step.isdigit() and int(step) < _SPECIAL_STEPS


def step_tasks_variable(env: Mapping[str, str] | None = None) -> str:
    """The variable that counts this job step's tasks: ``SLURM_STEP_NUM_TASKS`` in an srun
    step that sets it (srun always does, the step's own count), else ``SLURM_NTASKS``.

    ``SLURM_NTASKS`` is the step's too, except under ``srun --preserve-env``, which keeps
    the job's: read as the world size, ranks that never start were waited for.

    Example:
        >>> step = {"SLURM_STEP_ID": "0", "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "4"}
        >>> step_tasks_variable(step), step_tasks_variable({"SLURM_NTASKS": "8"})
        ('SLURM_STEP_NUM_TASKS', 'SLURM_NTASKS')
    """
    if _is_srun_step_id(env) and is_set("SLURM_STEP_NUM_TASKS", env):
        return "SLURM_STEP_NUM_TASKS"
    return "SLURM_NTASKS"


def step_tasks(env: Mapping[str, str] | None = None) -> int | None:
    """Tasks in this job step (the variable :func:`step_tasks_variable` names), or None.

    Raises:
        ValueError: the variable is set but is not a whole number >= 1.

    Example:
        >>> step = {"SLURM_STEP_ID": "0", "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "4"}
        >>> step_tasks(step), step_tasks({"SLURM_NTASKS": "8"}), step_tasks({})
        (4, 8, None)
    """
    return read_int(step_tasks_variable(env), env)


def in_srun_step(env: Mapping[str, str] | None = None) -> bool:
    """This process is one task of an ``srun`` step of several (``SLURM_PROCID`` set, the
    step's tasks (:func:`step_tasks`) > 1, and a step id: the batch script itself has the
    first two too, and a script it runs directly is one process, not task 0 of N).

    Example:
        >>> task = {"SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_STEP_ID": "0"}
        >>> in_srun_step(task), in_srun_step({**task, "SLURM_STEP_ID": "4294967294"})
        (True, False)
        >>> in_srun_step({**task, "SLURM_STEP_NUM_TASKS": "1"})  # srun --preserve-env -n 1
        False
    """
    ntasks = step_tasks(env)
    if ntasks is None or ntasks <= 1 or read_int("SLURM_PROCID", env) is None:
        return False
    return _is_srun_step_id(env)


def parse_int(name: str, raw: str) -> int:
    """``raw`` as the whole number variable ``name`` holds, checked against its rule.

    Args:
        name: one of the whole-number variables in the module docstring.
        raw: its value.

    Raises:
        ValueError: ``raw`` is not a whole number at least the variable's minimum.

    Example:
        >>> parse_int("WORLD_SIZE", " 8 ")
        8
        >>> parse_int("WORLD_SIZE", "0")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: environment variable WORLD_SIZE must be a whole number >= 1 (...), got '0'; ...
    """
    minimum, meaning = _WHOLE_NUMBERS[name]
    value = raw.strip()
    if not _DIGITS.fullmatch(value) or int(value) < minimum:
        raise ValueError(
            f"environment variable {name} must be a whole number >= {minimum} ({meaning}), "
            f"got {raw!r}; {_FIX}"
        )
    return int(value)


def read_int(name: str, env: Mapping[str, str] | None = None) -> int | None:
    """The whole-number variable ``name`` (see :func:`parse_int`), or None when unset.

    Example:
        >>> read_int("RANK", {"RANK": "3"}), read_int("RANK", {})
        (3, None)
    """
    raw = environ(env).get(name)
    if raw is None or not raw.strip():
        return None
    return parse_int(name, raw)


def read_int_or_srun(name: str, slurm: str, env: Mapping[str, str] | None = None) -> int | None:
    """The whole-number variable ``name``; else, inside an ``srun`` step (see
    :func:`in_srun_step`), SLURM's ``slurm``; else None.

    Raises:
        ValueError: the variable read is set but breaks its rule (see :func:`parse_int`).

    Example:
        >>> task = {"SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_STEP_ID": "0"}
        >>> read_int_or_srun("LOCAL_RANK", "SLURM_LOCALID", {**task, "SLURM_LOCALID": "1"})
        1
        >>> read_int_or_srun("LOCAL_RANK", "SLURM_LOCALID", {"SLURM_LOCALID": "1"}) is None
        True
    """
    value = read_int(name, env)
    if value is None and in_srun_step(env):
        value = read_int(slurm, env)
    return value


def read_port(env: Mapping[str, str] | None = None) -> int | None:
    """``MASTER_PORT`` as a port number, or None when unset.

    Raises:
        ValueError: it is set, but not a whole number in 1..65535.

    Example:
        >>> read_port({"MASTER_PORT": "29500"}), read_port({})
        (29500, None)
    """
    raw = text("MASTER_PORT", env)
    if raw is None:
        return None
    if not _DIGITS.fullmatch(raw) or not 1 <= int(raw) <= 65535:
        raise ValueError(
            f"environment variable MASTER_PORT must be a port in 1..65535, got "
            f"{environ(env)['MASTER_PORT']!r}; set it to a free port, or unset it"
        )
    return int(raw)


def parse_tasks_per_node(name: str, raw: str) -> tuple[tuple[int, int], ...]:
    """SLURM's compressed tasks-per-node list as ``(tasks, nodes)`` pairs.

    Args:
        name: the variable, for the message.
        raw: e.g. ``"4(x2),3"``.

    Raises:
        ValueError: ``raw`` is not a list of counts >= 1, each optionally ``(xN)``.

    Example:
        >>> parse_tasks_per_node("SLURM_TASKS_PER_NODE", "4(x2),3")
        ((4, 2), (3, 1))
    """
    entries: list[tuple[int, int]] = []
    for part in raw.split(","):
        match = _TASK_ENTRY.fullmatch(part.strip())
        tasks = int(match.group(1)) if match else 0
        nodes = int(match.group(2) or "1") if match else 0
        if tasks < 1 or nodes < 1:
            raise ValueError(
                f"environment variable {name} must look like '4', '4(x2)' or '4(x2),3' "
                f"(tasks on each node, every count >= 1), got {raw!r}; {_FIX}"
            )
        entries.append((tasks, nodes))
    return tuple(entries)


def _entry_for_node(name: str, raw: str, entries: tuple[tuple[int, int], ...], node: int) -> int:
    if len(entries) == 1 and entries[0][1] == 1 and "(" not in raw:
        return entries[0][0]  # --ntasks-per-node=4: every node's count
    remaining = node
    for tasks, nodes in entries:
        if remaining < nodes:
            return tasks
        remaining -= nodes
    listed = sum(nodes for _, nodes in entries)
    raise ValueError(
        f"SLURM_NODEID={node} but {name}={raw!r} lists tasks for {listed} node(s) only: the "
        "variables come from different jobs or steps; unset them, or run inside one srun step"
    )


def tasks_per_node_variable(env: Mapping[str, str] | None = None) -> str | None:
    """The variable :func:`tasks_on_this_node` reads (the rule is in the module docstring),
    or None when none is set.

    Example:
        >>> step = {"SLURM_STEP_ID": "0", "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}
        >>> tasks_per_node_variable({**step, "SLURM_TASKS_PER_NODE": "4(x2)"})
        'SLURM_STEP_TASKS_PER_NODE'
        >>> tasks_per_node_variable({"SLURM_TASKS_PER_NODE": "4(x2)"})
        'SLURM_TASKS_PER_NODE'
    """
    step = (_STEP_TASK_VARIABLE,) if _is_srun_step_id(env) else ()
    return next((name for name in (*step, *_TASK_VARIABLES) if is_set(name, env)), None)


def tasks_on_this_node(env: Mapping[str, str] | None = None) -> int | None:
    """SLURM's tasks on this node (the rule is in the module docstring), or None when unset.

    Raises:
        ValueError: a variable breaks its rule, or ``SLURM_NODEID`` is past the listed nodes.

    Example:
        >>> tasks_on_this_node({"SLURM_TASKS_PER_NODE": "4(x2),3", "SLURM_NODEID": "2"})
        3
        >>> tasks_on_this_node({"SLURM_TASKS_PER_NODE": "4(x2),3"})  # node unknown: the first
        4
    """
    name = tasks_per_node_variable(env)
    if name is None:
        return None
    raw = environ(env)[name].strip()
    entries = parse_tasks_per_node(name, raw)
    node = read_int("SLURM_NODEID", env)
    return entries[0][0] if node is None else _entry_for_node(name, raw, entries, node)


def local_world_size(env: Mapping[str, str] | None = None) -> int:
    """Processes on this host: ``LOCAL_WORLD_SIZE``, else SLURM's tasks on this node (at
    most ``WORLD_SIZE`` and the step's tasks, :func:`step_tasks`), else ``WORLD_SIZE``, else
    1 (see the module docstring).

    SLURM's count comes before ``WORLD_SIZE`` because job scripts often export
    ``WORLD_SIZE=$SLURM_NTASKS``, the whole job's size, not this node's. It is capped at
    ``WORLD_SIZE`` because it describes the allocation: a launcher that starts 2 processes
    inside a batch script of ``--ntasks-per-node=4`` runs 2, not 4.

    Raises:
        ValueError: a variable it reads breaks its rule.

    Example:
        >>> local_world_size({"LOCAL_WORLD_SIZE": "4", "WORLD_SIZE": "8"})
        4
        >>> local_world_size({"SLURM_NTASKS_PER_NODE": "2(x3)", "WORLD_SIZE": "6"})
        2
        >>> local_world_size({"SLURM_NTASKS_PER_NODE": "4", "WORLD_SIZE": "2"})
        2
        >>> local_world_size({"SLURM_NTASKS_PER_NODE": "4", "SLURM_NTASKS": "2"})
        2
        >>> local_world_size({"WORLD_SIZE": "2"}), local_world_size({})
        (2, 1)
    """
    local = read_int("LOCAL_WORLD_SIZE", env)
    if local is not None:
        return local
    tasks = tasks_on_this_node(env)
    world = read_int("WORLD_SIZE", env)
    if tasks is None:
        return 1 if world is None else world
    # The step's tasks too: --ntasks-per-node=4 of the allocation is inherited by `srun -n 2`.
    caps = [n for n in (world, step_tasks(env)) if n is not None]
    return min([tasks, *caps])


# How a node list is written, for the errors.
_NODELIST_FORM = "host names with bracketed ranges, such as 'node[01-03,07],gpu3'"


def _split_top_level(nodes: str) -> list[str]:
    """Split on commas outside brackets: "a[1,2],b" -> ["a[1,2]", "b"]."""
    parts: list[str] = []
    depth, start = 0, 0
    for i, ch in enumerate(nodes):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError("unbalanced ']'")
        elif ch == "," and depth == 0:
            parts.append(nodes[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError("unbalanced '['")
    parts.append(nodes[start:])
    return [p.strip() for p in parts if p.strip()]


def _expand_range(spec: str) -> list[str]:
    out: list[str] = []
    for item in spec.split(","):
        lo, sep, hi = item.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"bad range {item!r}")
        if not sep:
            out.append(lo)
            continue
        if int(hi) < int(lo):
            raise ValueError(f"range {item.strip()!r} runs backwards: write it '{hi}-{lo}'")
        width = len(lo)  # "01-04" keeps its zero padding
        out.extend(str(n).zfill(width) for n in range(int(lo), int(hi) + 1))
    return out


def _hosts(nodelist: str) -> list[str]:
    """The host names; a ValueError that says only what is wrong (the callers add whose
    value it is and the fix)."""
    hosts: list[str] = []
    for part in _split_top_level(nodelist):
        names = [""]
        for match in re.finditer(r"([^\[\]]*)(?:\[([^\]]*)\])?", part):
            literal, bracket = match.group(1), match.group(2)
            if bracket is not None and not bracket.strip():
                raise ValueError(f"empty brackets in {part!r}")  # not the bare name
            suffixes = _expand_range(bracket) if bracket else [""]
            names = [n + literal + s for n in names for s in suffixes]
        hosts.extend(names)
    if not hosts:
        raise ValueError("no host names")
    return hosts


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a SLURM node list (``SLURM_JOB_NODELIST``) into host names, in order.

    Handles ranges with zero padding, lists inside brackets and several bracket groups in
    one name, without calling ``scontrol``.

    Args:
        nodelist: e.g. ``"node[01-03,07],gpu3"``.

    Returns:
        The host names.

    Raises:
        ValueError: the list is empty or malformed (a range that runs backwards, such as
            ``03-01``, or empty brackets, ``node[]``, included).

    Example:
        >>> expand_nodelist("node[01-03,07],gpu3")
        ['node01', 'node02', 'node03', 'node07', 'gpu3']
        >>> expand_nodelist("rack[1-2]-n[8-9]")
        ['rack1-n8', 'rack1-n9', 'rack2-n8', 'rack2-n9']
    """
    try:
        return _hosts(nodelist)
    except ValueError as e:
        raise ValueError(
            f"SLURM node list {nodelist!r} is malformed ({e}): write it as {_NODELIST_FORM}"
        ) from e


def nodelist(env: Mapping[str, str] | None = None) -> list[str] | None:
    """The hosts of this job step (``SLURM_STEP_NODELIST``, else ``SLURM_JOB_NODELIST``),
    or None when neither is set.

    Raises:
        ValueError: the list is malformed (see :func:`expand_nodelist`); the message names
            the variable it came from.

    Example:
        >>> nodelist({"SLURM_JOB_NODELIST": "gpu[1-2]"}), nodelist({})
        (['gpu1', 'gpu2'], None)
    """
    name = "SLURM_STEP_NODELIST" if is_set("SLURM_STEP_NODELIST", env) else "SLURM_JOB_NODELIST"
    raw = text(name, env)
    if raw is None:
        return None
    try:
        return _hosts(raw)
    except ValueError as e:
        raise ValueError(
            f"environment variable {name}={environ(env)[name]!r} is not a SLURM node list "
            f"({e}; expected {_NODELIST_FORM}); {_FIX}"
        ) from e
