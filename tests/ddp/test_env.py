"""trainperf.ddp._env: is this process one rank of a torchrun or SLURM job?"""

from __future__ import annotations

import pytest

from tests.ddp._envs import SLURM, TORCHRUN
from trainperf.ddp import _env

# -------------------------------------------------------------- environment detection


def test_detect_torchrun_and_slurm() -> None:
    assert _env.detect({}) is None
    assert _env.detect({"MASTER_PORT": "1234"}) is None  # choosing a port is not a job
    assert _env.detect(TORCHRUN) == _env.DistributedEnv("torchrun", 3, 4, 1, 2, "10.1.2.3", 29500)
    assert _env.detect(SLURM) == _env.DistributedEnv(
        "slurm", 5, 8, 1, 4, "node07", _env.SLURM_PORT_BASE + 4242
    )
    assert _env.detect({**SLURM, "MASTER_PORT": "23456", "MASTER_ADDR": "head"}) == (
        _env.DistributedEnv("slurm", 5, 8, 1, 4, "head", 23456)
    )
    step = {**SLURM, "SLURM_STEP_NODELIST": "gpu[10-11]", "SLURM_NTASKS_PER_NODE": "3"}
    assert _env.detect(step) == _env.DistributedEnv(
        "slurm", 5, 8, 1, 3, "gpu10", _env.SLURM_PORT_BASE + 4242
    )
    # A one-task SLURM job is a workstation: launch spawns locally.
    assert _env.detect({**SLURM, "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}) is None
    # torchrun inside an srun step: torchrun's variables win.
    assert _env.detect({**SLURM, **TORCHRUN}).source == "torchrun"  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"RANK": "0"}, r"RANK=0 is set but WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT"),
        ({k: v for k, v in TORCHRUN.items() if k != "MASTER_PORT"}, r"but MASTER_PORT is not"),
        ({**TORCHRUN, "RANK": "4"}, r"RANK must be < WORLD_SIZE=4, got RANK=4"),
        (
            {**TORCHRUN, "WORLD_SIZE": "four"},
            r"WORLD_SIZE must be a whole number.*'four'; unset it",
        ),
        ({**TORCHRUN, "WORLD_SIZE": "0"}, r"WORLD_SIZE must be a whole number >= 1 .*, got '0'"),
        ({**TORCHRUN, "LOCAL_RANK": "2"}, r"LOCAL_RANK must be < LOCAL_WORLD_SIZE=2"),
        ({**TORCHRUN, "MASTER_PORT": "70000"}, r"MASTER_PORT must be a port in 1\.\.65535"),
        ({"SLURM_PROCID": "0"}, r"SLURM_NTASKS is not set"),
        ({k: v for k, v in SLURM.items() if k != "SLURM_LOCALID"}, r"SLURM_LOCALID is not set"),
        ({**SLURM, "SLURM_PROCID": "8"}, r"SLURM_PROCID must be < SLURM_NTASKS=8"),
        ({k: v for k, v in SLURM.items() if k != "SLURM_JOB_NODELIST"}, r"SLURM_JOB_NODELIST"),
        ({k: v for k, v in SLURM.items() if k != "SLURM_JOB_ID"}, r"SLURM_JOB_ID or MASTER_PORT"),
        ({**SLURM, "SLURM_JOB_ID": "x1"}, r"SLURM_JOB_ID must be a whole number >= 0 .*, got 'x1'"),
        ({**SLURM, "SLURM_TASKS_PER_NODE": "many"}, r"SLURM_TASKS_PER_NODE must look like"),
        ({**SLURM, "SLURM_JOB_NODELIST": "node[1-2"}, r"unbalanced '\['"),
    ],
)
def test_detect_rejects_inconsistent_environments(env: dict[str, str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _env.detect(env)


@pytest.mark.parametrize("step", ["4294967294", "4294967290"])
def test_a_batch_script_of_several_tasks_outside_srun_is_refused_at_once(step: str) -> None:
    # The batch script (and salloc's interactive step) has SLURM_PROCID=0 and SLURM_NTASKS=8
    # too, but the other 7 tasks never start: the rendezvous waited out the whole timeout.
    with pytest.raises(
        ValueError, match=rf"not in an srun step \(SLURM_STEP_ID={step}:.*`srun python"
    ):
        _env.detect({**SLURM, "SLURM_PROCID": "0", "SLURM_STEP_ID": step})


def test_a_task_of_an_srun_step_is_one_rank_of_the_job() -> None:
    env = _env.detect({**SLURM, "SLURM_STEP_ID": "0"})
    assert env is not None and (env.rank, env.world_size) == (5, 8)


@pytest.mark.parametrize(
    ("env", "match"),
    [
        # More processes on this host than in the whole job: LOCAL_RANK=2 would pass too.
        (
            {**TORCHRUN, "LOCAL_WORLD_SIZE": "8"},
            r"LOCAL_WORLD_SIZE=8 is more than WORLD_SIZE=4 .*unset",
        ),
        # Old and new names of one count disagree: two jobs' variables are mixed.
        (
            {**SLURM, "SLURM_NPROCS": "16"},
            r"SLURM_NPROCS=16 is more than SLURM_NTASKS=8: .*srun step",
        ),
        ({**SLURM, "SLURM_NPROCS": "four"}, r"SLURM_NPROCS must be a whole number >= 1"),
        # This node runs 4 tasks (SLURM_NODEID says which node): local id 4 is not one.
        (
            {**SLURM, "SLURM_NODEID": "1", "SLURM_LOCALID": "4"},
            r"SLURM_LOCALID must be < 4 \(the tasks SLURM_TASKS_PER_NODE='4\(x2\)' gives node "
            r"SLURM_NODEID=1\), got SLURM_LOCALID=4",
        ),
        # More tasks on this node than in the whole step.
        ({**SLURM, "SLURM_LOCALID": "8"}, r"SLURM_LOCALID must be < SLURM_NTASKS=8, got 8"),
        # The step's nodes run 4 tasks: ranks 4 to 7 never start, and rank 0 waits for them.
        (
            {**SLURM, "SLURM_PROCID": "1", "SLURM_TASKS_PER_NODE": "2(x2)"},
            r"SLURM_NTASKS=8 but SLURM_TASKS_PER_NODE='2\(x2\)' lists 4 tasks: .*run inside "
            r"one srun step, or unset the stale one",
        ),
    ],
)
def test_detect_rejects_local_counts_that_contradict_the_job(
    env: dict[str, str], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        _env.detect(env)


def test_slurm_nprocs_that_agrees_or_stands_alone_is_read() -> None:
    expected = _env.detect(SLURM)
    assert _env.detect({**SLURM, "SLURM_NPROCS": "8"}) == expected
    # A heterogeneous step (`srun -n2 a : -n2 b`, with or without SLURM_HET_SIZE):
    # SLURM_NPROCS is one component's tasks, SLURM_NTASKS the whole step's.
    assert _env.detect({**SLURM, "SLURM_NPROCS": "2"}) == expected
    assert _env.detect({**SLURM, "SLURM_NPROCS": "2", "SLURM_HET_SIZE": "2"}) == expected
    # Without SLURM_NODEID a local id past the first node's count still means a bigger node.
    found = _env.detect({**SLURM, "SLURM_LOCALID": "5"})
    assert found is not None and found.local_world_size == 6


@pytest.mark.parametrize(
    "tasks_per_node",
    [
        "4(x2)",  # what srun sets: the step's own layout, adding up to SLURM_NTASKS
        "4",  # one count without (xN) is every node's: the total is not known
        "4(x3)",  # more listed than run: an older salloc wrote CPUs per node here
    ],
)
def test_slurm_tasks_per_node_that_can_hold_the_step_is_read(tasks_per_node: str) -> None:
    found = _env.detect({**SLURM, "SLURM_TASKS_PER_NODE": tasks_per_node})
    assert found is not None and (found.world_size, found.local_world_size) == (8, 4)
    # SLURM_NTASKS_PER_NODE is the option's per-node count, with no node count: not summed.
    found = _env.detect({**SLURM, "SLURM_NTASKS_PER_NODE": "2(x2)", "SLURM_TASKS_PER_NODE": " "})
    assert found is not None and found.world_size == 8


def test_an_inherited_ntasks_per_node_over_the_steps_tasks_is_capped() -> None:
    # `srun -n 2` inside an --ntasks-per-node=4 allocation inherits SLURM_NTASKS_PER_NODE=4:
    # it read as 4 local ranks in a step of 2.
    step = {
        **SLURM,
        "SLURM_NTASKS": "2",
        "SLURM_PROCID": "1",
        "SLURM_NTASKS_PER_NODE": "4",
        "SLURM_TASKS_PER_NODE": "2",
    }
    found = _env.detect(step)
    assert found is not None and (found.world_size, found.local_world_size) == (2, 2)


# `srun --preserve-env -N2 -n4 --ntasks-per-node=2` inside an 8-task allocation of
# --ntasks-per-node=4: SLURM_NTASKS, SLURM_NPROCS and SLURM_TASKS_PER_NODE keep the job's
# values; only SLURM_STEP_NUM_TASKS and SLURM_STEP_TASKS_PER_NODE are the step's.
PRESERVED_ENV_STEP = {
    **SLURM,
    "SLURM_PROCID": "3",
    "SLURM_NODEID": "1",
    "SLURM_NPROCS": "8",
    "SLURM_NTASKS_PER_NODE": "4",
    "SLURM_STEP_ID": "1",
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
}


def test_an_srun_preserve_env_step_is_as_big_as_the_step_not_the_job() -> None:
    # World size 8 made rank 0 wait in the rendezvous for 4 ranks the step never starts.
    assert _env.detect(PRESERVED_ENV_STEP) == _env.DistributedEnv(
        "slurm", 3, 4, 1, 2, "node07", _env.SLURM_PORT_BASE + 4242
    )
    # A job submitted without --ntasks (`sbatch -N 2`) has no SLURM_NTASKS to preserve.
    jobs = ("SLURM_NTASKS", "SLURM_NPROCS", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE")
    no_job_count = {k: v for k, v in PRESERVED_ENV_STEP.items() if k not in jobs}
    assert _env.detect(no_job_count) == _env.detect(PRESERVED_ENV_STEP)
    # `srun --preserve-env -n 1 python train.py`: one process, so launch() spawns locally.
    one = {**PRESERVED_ENV_STEP, "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}
    assert (
        _env.detect({**one, "SLURM_STEP_NUM_TASKS": "1", "SLURM_STEP_TASKS_PER_NODE": "1"}) is None
    )


@pytest.mark.parametrize(
    ("env", "match"),
    [
        (
            {**PRESERVED_ENV_STEP, "SLURM_PROCID": "4"},
            r"SLURM_PROCID must be < SLURM_STEP_NUM_TASKS=4, got SLURM_PROCID=4",
        ),
        (
            {**PRESERVED_ENV_STEP, "SLURM_LOCALID": "2"},
            r"SLURM_LOCALID must be < 2 \(the tasks SLURM_STEP_TASKS_PER_NODE='2\(x2\)' gives "
            r"node SLURM_NODEID=1\)",
        ),
        (
            {**PRESERVED_ENV_STEP, "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_LOCALID": "0"},
            r"SLURM_STEP_NUM_TASKS=4 but SLURM_STEP_TASKS_PER_NODE='1\(x2\)' lists 2 tasks",
        ),
        (
            {**PRESERVED_ENV_STEP, "SLURM_STEP_NUM_TASKS": "0"},
            r"SLURM_STEP_NUM_TASKS must be a whole number >= 1 \(tasks in the srun step\)",
        ),
    ],
)
def test_a_preserve_env_step_is_checked_against_the_steps_own_variables(
    env: dict[str, str], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        _env.detect(env)


def test_the_step_variables_of_salloc_s_interactive_step_do_not_hide_the_job() -> None:
    # salloc's interactive step runs `srun --preserve-env --pty $SHELL`: one task, but a
    # script started from that shell is still refused as outside any srun step of the job.
    shell = {**PRESERVED_ENV_STEP, "SLURM_PROCID": "0", "SLURM_STEP_ID": "4294967290"}
    with pytest.raises(ValueError, match=r"SLURM_NTASKS=8 tasks, but not in an srun step"):
        _env.detect({**shell, "SLURM_STEP_NUM_TASKS": "1", "SLURM_STEP_TASKS_PER_NODE": "1"})
