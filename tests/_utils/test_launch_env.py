"""trainperf._utils.launch_env: the one parser of the launcher's environment.

One table of environments (torchrun, SLURM with ``8``, ``2(x3)`` and ``4(x2),3``, malformed
values) is read by ``trainperf.limits`` and ``trainperf.ddp``; both must give the same answer
for every row, or fail with the same message.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import pytest

import trainperf.ddp as ddp
from trainperf import limits
from trainperf._utils import launch_env
from trainperf.ddp import _env

_SLURM_JOB = {"SLURM_JOB_NODELIST": "node[01-03]", "SLURM_JOB_ID": "7"}
_TORCHRUN_RENDEZVOUS = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}


@dataclass(frozen=True)
class Row:
    """An environment, and what it means: processes on this host and the job, or an error."""

    name: str
    env: dict[str, str]
    local_world_size: int | None = None  # None: reading it is an error (``error``)
    job: tuple[str, int, int, int] | None = None  # (source, rank, world size, local rank)
    error: str | None = None
    tasks_on_this_node: int | None = None


def _torchrun(**values: str) -> dict[str, str]:
    return {**_TORCHRUN_RENDEZVOUS, **values}


def _slurm(**values: str) -> dict[str, str]:
    return {**_SLURM_JOB, **values}


ROWS = [
    Row("nothing set", {}, 1),
    Row(
        "torchrun, 2 nodes of 2",
        _torchrun(RANK="3", WORLD_SIZE="4", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2"),
        2,
        ("torchrun", 3, 4, 1),
    ),
    Row(
        "torchrun, one node of 8",
        _torchrun(RANK="5", WORLD_SIZE="8", LOCAL_RANK="5", LOCAL_WORLD_SIZE="8"),
        8,
        ("torchrun", 5, 8, 5),
    ),
    Row(
        "torch launcher without LOCAL_WORLD_SIZE: all ranks on this host",
        _torchrun(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1"),
        2,
        ("torchrun", 1, 2, 1),
    ),
    Row(
        # WORLD_SIZE=2 set by hand inside a batch script of --ntasks-per-node=4: SLURM's count
        # is the allocation's, and a host runs no more of the job's processes than it has.
        "torch launcher without LOCAL_WORLD_SIZE, SLURM's tasks per node over WORLD_SIZE",
        _torchrun(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", **_slurm(SLURM_NTASKS_PER_NODE="4")),
        2,
        ("torchrun", 1, 2, 1),
        tasks_on_this_node=4,
    ),
    Row(
        "torchrun inside an srun step: torchrun's variables win",
        _torchrun(
            RANK="6",
            WORLD_SIZE="8",
            LOCAL_RANK="2",
            LOCAL_WORLD_SIZE="4",
            **_slurm(SLURM_PROCID="1", SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="1"),
        ),
        4,
        ("torchrun", 6, 8, 2),
        tasks_on_this_node=1,
    ),
    Row(
        "SLURM 8 per node (--ntasks-per-node): every node's count",
        _slurm(
            SLURM_PROCID="9",
            SLURM_NTASKS="16",
            SLURM_LOCALID="1",
            SLURM_NODEID="1",
            SLURM_NTASKS_PER_NODE="8",
        ),
        8,
        ("slurm", 9, 16, 1),
        tasks_on_this_node=8,
    ),
    Row(
        "SLURM 2(x3), third node",
        _slurm(
            SLURM_PROCID="5",
            SLURM_NTASKS="6",
            SLURM_LOCALID="1",
            SLURM_NODEID="2",
            SLURM_TASKS_PER_NODE="2(x3)",
        ),
        2,
        ("slurm", 5, 6, 1),
        tasks_on_this_node=2,
    ),
    Row(
        "SLURM 4(x2),3 on the first node",
        _slurm(
            SLURM_PROCID="1",
            SLURM_NTASKS="11",
            SLURM_LOCALID="1",
            SLURM_NODEID="0",
            SLURM_TASKS_PER_NODE="4(x2),3",
        ),
        4,
        ("slurm", 1, 11, 1),
        tasks_on_this_node=4,
    ),
    Row(
        "SLURM 4(x2),3 on the third node: its own entry",
        _slurm(
            SLURM_PROCID="10",
            SLURM_NTASKS="11",
            SLURM_LOCALID="2",
            SLURM_NODEID="2",
            SLURM_TASKS_PER_NODE="4(x2),3",
        ),
        3,
        ("slurm", 10, 11, 2),
        tasks_on_this_node=3,
    ),
    Row(
        "SLURM 4(x2),3 without SLURM_NODEID: the first entry",
        _slurm(
            SLURM_PROCID="9",
            SLURM_NTASKS="11",
            SLURM_LOCALID="1",
            SLURM_TASKS_PER_NODE="4(x2),3",
        ),
        4,
        ("slurm", 9, 11, 1),
        tasks_on_this_node=4,
    ),
    Row(
        "SLURM_NTASKS_PER_NODE=4(x2) (was 4 in limits, an error in ddp)",
        _slurm(
            SLURM_PROCID="5",
            SLURM_NTASKS="8",
            SLURM_LOCALID="1",
            SLURM_NODEID="1",
            SLURM_NTASKS_PER_NODE="4(x2)",
        ),
        4,
        ("slurm", 5, 8, 1),
        tasks_on_this_node=4,
    ),
    Row(
        "SLURM_NTASKS_PER_NODE before SLURM_TASKS_PER_NODE; blank counts as unset",
        _slurm(
            SLURM_PROCID="3",
            SLURM_NTASKS="4",
            SLURM_LOCALID="1",
            SLURM_NTASKS_PER_NODE=" ",
            SLURM_TASKS_PER_NODE="2(x2)",
        ),
        2,
        ("slurm", 3, 4, 1),
        tasks_on_this_node=2,
    ),
    Row(
        "a one-task SLURM job is a workstation",
        _slurm(SLURM_PROCID="0", SLURM_NTASKS="1", SLURM_TASKS_PER_NODE="1"),
        1,
        None,
        tasks_on_this_node=1,
    ),
    # ------------------------------------------------------------------ malformed values
    Row(
        "LOCAL_WORLD_SIZE=abc",
        _torchrun(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="abc"),
        error=r"LOCAL_WORLD_SIZE must be a whole number >= 1 \(processes on this host\), "
        r"got 'abc'; unset it or fix the launcher that set it",
    ),
    Row(
        "WORLD_SIZE=-1",
        _torchrun(RANK="0", WORLD_SIZE="-1", LOCAL_RANK="0"),
        error=r"WORLD_SIZE must be a whole number >= 1 .*, got '-1'; unset it",
    ),
    Row(
        "SLURM_NTASKS_PER_NODE=-1",
        _slurm(SLURM_PROCID="1", SLURM_NTASKS="2", SLURM_LOCALID="1", SLURM_NTASKS_PER_NODE="-1"),
        error=r"SLURM_NTASKS_PER_NODE must look like '4', '4\(x2\)' or '4\(x2\),3' .*, "
        r"got '-1'; unset it",
    ),
    Row(
        "SLURM_TASKS_PER_NODE=4(x",
        _slurm(SLURM_PROCID="1", SLURM_NTASKS="2", SLURM_LOCALID="1", SLURM_TASKS_PER_NODE="4(x"),
        error=r"SLURM_TASKS_PER_NODE must look like .*, got '4\(x'; unset it",
    ),
    Row(
        "SLURM_TASKS_PER_NODE=abc",
        _slurm(SLURM_PROCID="1", SLURM_NTASKS="2", SLURM_LOCALID="1", SLURM_TASKS_PER_NODE="abc"),
        error=r"SLURM_TASKS_PER_NODE must look like .*, got 'abc'",
    ),
    Row(
        "SLURM_TASKS_PER_NODE=4(x0)",
        _slurm(SLURM_PROCID="1", SLURM_NTASKS="2", SLURM_LOCALID="1", SLURM_TASKS_PER_NODE="4(x0)"),
        error=r"SLURM_TASKS_PER_NODE must look like .*every count >= 1\), got '4\(x0\)'",
    ),
    Row(
        "SLURM_NODEID=abc",
        _slurm(
            SLURM_PROCID="1",
            SLURM_NTASKS="2",
            SLURM_LOCALID="1",
            SLURM_NODEID="abc",
            SLURM_TASKS_PER_NODE="2",
        ),
        error=r"SLURM_NODEID must be a whole number >= 0 .*, got 'abc'",
    ),
    Row(
        "SLURM_NODEID past the listed nodes",
        _slurm(
            SLURM_PROCID="1",
            SLURM_NTASKS="11",
            SLURM_LOCALID="1",
            SLURM_NODEID="3",
            SLURM_TASKS_PER_NODE="4(x2),3",
        ),
        error=r"SLURM_NODEID=3 but SLURM_TASKS_PER_NODE='4\(x2\),3' lists tasks for 3 node\(s\) "
        r"only: .*unset them, or run inside one srun step",
    ),
]


def _ids(row: Row) -> str:
    return row.name


@pytest.fixture
def launcher_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """``monkeypatch`` with every launcher variable of this process removed."""
    for name in list(os.environ):
        if name.startswith("SLURM_") or name in (
            "RANK",
            "LOCAL_RANK",
            "WORLD_SIZE",
            "LOCAL_WORLD_SIZE",
            "MASTER_ADDR",
            "MASTER_PORT",
        ):
            monkeypatch.delenv(name)
    return monkeypatch


@pytest.mark.parametrize("row", [r for r in ROWS if r.error is None], ids=_ids)
def test_each_environment_means_one_thing(row: Row) -> None:
    assert launch_env.local_world_size(row.env) == row.local_world_size
    assert launch_env.tasks_on_this_node(row.env) == row.tasks_on_this_node
    job = _env.detect(row.env)
    if row.job is None:
        assert job is None
    else:
        assert job is not None
        assert (job.source, job.rank, job.world_size, job.local_rank) == row.job


@pytest.mark.parametrize("row", ROWS, ids=_ids)
def test_limits_and_ddp_give_the_same_answer(row: Row, launcher_env: pytest.MonkeyPatch) -> None:
    if row.error is not None:
        with pytest.raises(ValueError, match=row.error) as from_limits:
            limits.local_world_size(row.env)
        with pytest.raises(ValueError, match=row.error) as from_ddp:
            _env.detect(row.env)
        assert str(from_limits.value) == str(from_ddp.value)
        return
    job = _env.detect(row.env)
    if job is not None:
        assert limits.local_world_size(row.env) == job.local_world_size
    else:
        assert limits.local_world_size(row.env) == row.local_world_size
    # The same through os.environ, which the ddp helpers and limits' defaults read.
    for name, value in row.env.items():
        launcher_env.setenv(name, value)
    assert limits.local_world_size() == limits.local_world_size(row.env)
    assert _env.detect() == job
    if job is not None and job.source == "torchrun":
        helpers = (ddp.rank(), ddp.world_size(), ddp.local_rank())
        assert helpers == (job.rank, job.world_size, job.local_rank)


@pytest.mark.parametrize(
    ("raw", "entries"),
    [
        ("8", ((8, 1),)),
        ("2(x3)", ((2, 3),)),
        ("4(x2),3", ((4, 2), (3, 1))),
        (" 4(x2) , 3 ", ((4, 2), (3, 1))),
        ("1,2(x2),3", ((1, 1), (2, 2), (3, 1))),
    ],
)
def test_parse_tasks_per_node(raw: str, entries: tuple[tuple[int, int], ...]) -> None:
    assert launch_env.parse_tasks_per_node("SLURM_TASKS_PER_NODE", raw) == entries


@pytest.mark.parametrize("raw", ["abc", "-1", "4(x", "0", "4(x2", "4(2)", "4,,3", "", "+4"])
def test_parse_tasks_per_node_refuses_malformed_lists(raw: str) -> None:
    with pytest.raises(
        ValueError, match=rf"SLURM_TASKS_PER_NODE must look like .*got {re.escape(repr(raw))}"
    ):
        launch_env.parse_tasks_per_node("SLURM_TASKS_PER_NODE", raw)


def test_this_nodes_entry_by_slurm_nodeid() -> None:
    layout = "4(x2),3"
    nodes = [
        launch_env.tasks_on_this_node({"SLURM_TASKS_PER_NODE": layout, "SLURM_NODEID": str(i)})
        for i in range(3)
    ]
    assert nodes == [4, 4, 3]
    # A single count without (xN) is every node's, however many there are.
    assert launch_env.tasks_on_this_node({"SLURM_NTASKS_PER_NODE": "8", "SLURM_NODEID": "5"}) == 8
    with pytest.raises(ValueError, match=r"SLURM_NODEID=2 but SLURM_NTASKS_PER_NODE='8\(x2\)'"):
        launch_env.tasks_on_this_node({"SLURM_NTASKS_PER_NODE": "8(x2)", "SLURM_NODEID": "2"})
    assert launch_env.tasks_on_this_node({}) is None


@pytest.mark.parametrize(
    ("name", "raw", "value"),
    [
        ("RANK", "0", 0),
        ("RANK", " 12 ", 12),
        ("WORLD_SIZE", "1", 1),
        ("SLURM_JOB_ID", "42", 42),
        ("SLURM_NPROCS", " 8 ", 8),  # read by the same rule as SLURM_NTASKS, its newer name
    ],
)
def test_whole_numbers(name: str, raw: str, value: int) -> None:
    assert launch_env.parse_int(name, raw) == value
    assert launch_env.read_int(name, {name: raw}) == value
    assert launch_env.read_int(name, {}) is None
    assert launch_env.read_int(name, {name: "  "}) is None  # blank is unset


@pytest.mark.parametrize(
    ("name", "raw", "minimum"),
    [
        ("RANK", "abc", 0),
        ("RANK", "-1", 0),
        ("RANK", "1.0", 0),
        ("RANK", "+1", 0),
        ("WORLD_SIZE", "0", 1),
        ("LOCAL_WORLD_SIZE", "4(x2)", 1),  # SLURM's list form is not torchrun's
        ("SLURM_CPUS_PER_TASK", "0", 1),
        ("SLURM_NTASKS", "two", 1),
        ("SLURM_PROCID", "-3", 0),
        ("SLURM_LOCALID", "x", 0),
        ("SLURM_NPROCS", "0", 1),
        ("SLURM_NPROCS", "٤", 1),  # a digit to str.isdigit, not to SLURM
    ],
)
def test_whole_numbers_refuse_malformed_values(name: str, raw: str, minimum: int) -> None:
    pattern = (
        rf"environment variable {name} must be a whole number >= {minimum} \(.*\), "
        rf"got {re.escape(repr(raw))}; unset it or fix the launcher that set it"
    )
    with pytest.raises(ValueError, match=pattern):
        launch_env.read_int(name, {name: raw})


def test_master_port() -> None:
    assert launch_env.read_port({"MASTER_PORT": "29500"}) == 29500
    assert launch_env.read_port({"MASTER_PORT": ""}) is None
    for bad in ("0", "65536", "http", "-1"):
        with pytest.raises(
            ValueError, match=rf"MASTER_PORT must be a port in 1\.\.65535, got '{bad}'; set it"
        ):
            launch_env.read_port({"MASTER_PORT": bad})


def test_text_and_nodelist() -> None:
    assert launch_env.text("MASTER_ADDR", {"MASTER_ADDR": " head "}) == "head"
    assert not launch_env.is_set("MASTER_ADDR", {"MASTER_ADDR": ""})
    step = {"SLURM_STEP_NODELIST": "gpu[10-11]", "SLURM_JOB_NODELIST": "node1"}
    assert launch_env.nodelist(step) == ["gpu10", "gpu11"]  # the step's own hosts first
    assert launch_env.nodelist({"SLURM_JOB_NODELIST": "node1"}) == ["node1"]
    assert launch_env.nodelist({}) is None


def test_the_environment_is_read_only_here(launcher_env: pytest.MonkeyPatch) -> None:
    launcher_env.setenv("LOCAL_WORLD_SIZE", "3")
    assert launch_env.environ() is os.environ
    assert launch_env.local_world_size() == 3


def test_expand_nodelist() -> None:
    assert ddp.expand_nodelist("node[01-04,07],gpu3") == [
        "node01",
        "node02",
        "node03",
        "node04",
        "node07",
        "gpu3",
    ]
    assert ddp.expand_nodelist("a1,b[9-10]") == ["a1", "b9", "b10"]
    assert ddp.expand_nodelist("r[1-2]-n[1,3]") == ["r1-n1", "r1-n3", "r2-n1", "r2-n3"]
    with pytest.raises(ValueError, match=r"unbalanced '\]'"):
        ddp.expand_nodelist("node1-2]")
    with pytest.raises(ValueError, match=r"bad range 'a-b'"):
        ddp.expand_nodelist("node[a-b]")
    with pytest.raises(ValueError, match=r"SLURM node list . , . is malformed \(no host names\)"):
        ddp.expand_nodelist(" , ")


@pytest.mark.parametrize("name", ["SLURM_JOB_NODELIST", "SLURM_STEP_NODELIST"])
@pytest.mark.parametrize(
    ("raw", "problem"),
    [
        ("n[1-", r"unbalanced '\['"),
        ("n1-2]", r"unbalanced '\]'"),
        ("n[a-b]", r"bad range 'a-b'"),
        (" , ", "no host names"),
        ("n[03-01]", r"range '03-01' runs backwards: write it '01-03'"),
        ("n[]", r"empty brackets in 'n\[\]'"),
    ],
)
def test_a_malformed_node_list_names_its_variable_the_value_and_the_fix(
    name: str, raw: str, problem: str
) -> None:
    # "unbalanced '[' in SLURM node list 'n[1-'" did not say which variable held it.
    with pytest.raises(ValueError, match=rf"^environment variable {name}=") as info:
        launch_env.nodelist({name: raw})
    text = str(info.value)
    assert repr(raw) in text and re.search(problem, text), text
    assert text.endswith("unset it or fix the launcher that set it"), text


def test_a_malformed_node_list_passed_directly_says_how_to_write_one() -> None:
    with pytest.raises(ValueError, match=r"such as 'node\[01-03,07\],gpu3'"):
        ddp.expand_nodelist("n[1-")


def test_a_reversed_range_is_refused_with_its_fix() -> None:
    # "node[03-01]" expanded to no hosts: alone it said "no host names", beside another
    # host it silently dropped the three nodes.
    problem = r"range '03-01' runs backwards: write it '01-03'"
    for raw in ("node[03-01]", "node[03-01],gpu3", "node[07,03-01]"):
        with pytest.raises(ValueError, match=rf"is malformed \({problem}\): write it as"):
            ddp.expand_nodelist(raw)
    assert ddp.expand_nodelist("node[03-03]") == ["node03"]  # one host, not backwards


def test_empty_brackets_are_refused_not_read_as_the_bare_name() -> None:
    # "node[]" was read as the host "node", one that the job never ran on.
    for raw in ("node[]", "gpu1,node[]", "rack[1-2]-n[]"):
        with pytest.raises(ValueError, match=r"is malformed \(empty brackets in '.*\[\]'\)"):
            ddp.expand_nodelist(raw)


def test_an_inherited_tasks_per_node_is_at_most_the_steps_tasks() -> None:
    # `srun -n 2` inside an --ntasks-per-node=4 allocation: limits read 4 processes on the
    # host (ddp read 2), and the loader tuner split the CPUs four ways.
    env = {"SLURM_NTASKS_PER_NODE": "4", "SLURM_NTASKS": "2"}
    assert launch_env.local_world_size(env) == 2


def test_an_srun_preserve_env_step_counts_the_steps_tasks_not_the_jobs() -> None:
    # `srun --preserve-env -N2 -n4 --ntasks-per-node=2` in a job of 4 tasks on each of 2
    # nodes keeps SLURM_NTASKS=8 and SLURM_TASKS_PER_NODE='4(x2)': limits read 4 processes
    # on the host, and the CPUs were split four ways among two.
    step = {
        "SLURM_PROCID": "1",
        "SLURM_NODEID": "0",
        "SLURM_NTASKS": "8",
        "SLURM_TASKS_PER_NODE": "4(x2)",
        "SLURM_STEP_ID": "3",
        "SLURM_STEP_NUM_TASKS": "4",
        "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
    }
    assert launch_env.step_tasks(step) == 4
    assert launch_env.tasks_on_this_node(step) == 2
    assert launch_env.local_world_size(step) == 2
    assert launch_env.in_srun_step(step)
    # `srun --preserve-env -n 1`: one process, whatever the job's count.
    assert not launch_env.in_srun_step({**step, "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1"})
    # Outside an srun step (the batch script, salloc's interactive step) the job's counts.
    for special in ("4294967294", "4294967290"):
        shell = {**step, "SLURM_STEP_ID": special}
        assert launch_env.step_tasks(shell) == 8
        assert launch_env.tasks_on_this_node(shell) == 4
