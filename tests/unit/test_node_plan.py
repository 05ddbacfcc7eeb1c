"""A launcher's place in a job over several hosts: torchrun's flags, Slurm's environment inside srun, a
Kubernetes Indexed Job's index, and hosts of spares only."""

from __future__ import annotations

import pytest

from deadpool_cli.node_plan import NodePlan, plan_node

SLURM = {"SLURM_JOB_ID": "8812", "SLURM_STEP_ID": "0", "SLURM_NNODES": "4", "SLURM_NODEID": "2"}


def test_one_host_keeps_a_job_of_its_own_ranks_and_a_fresh_name() -> None:
    plan = plan_node(script_name="train", nproc=4, environ={})
    assert (plan.world_size, plan.rank_offset, plan.run, plan.multi_host) == (4, 0, "", False)
    assert plan.job.startswith("train-") and plan.job != plan_node(script_name="train", nproc=4, environ={}).job


def test_torchrun_flags_give_the_world_the_offset_and_the_job_name_as_the_run() -> None:
    plan = plan_node(script_name="train", nproc=8, job="gpt", nnodes=4, node_rank=3, environ={})
    assert plan == NodePlan("gpt", "gpt", 32, 24, "flags")


def test_a_multi_host_launch_without_a_job_name_is_refused_saying_why() -> None:
    with pytest.raises(ValueError, match="--job NAME"):
        plan_node(script_name="train", nproc=8, nnodes=2, node_rank=0, environ={})
    with pytest.raises(ValueError, match="--job NAME"):
        plan_node(script_name="train", nproc=2, world_size=4, rank_offset=2, environ={})
    with pytest.raises(ValueError, match="--job NAME"):
        plan_node(script_name="train", nproc=0, environ={})  # spares only: it joins a job, which one?


def test_several_nodes_need_this_nodes_rank_and_it_must_fit() -> None:
    with pytest.raises(ValueError, match="--node-rank"):
        plan_node(script_name="t", nproc=8, job="j", nnodes=2, environ={})
    with pytest.raises(ValueError, match="not below --nnodes 2"):
        plan_node(script_name="t", nproc=8, job="j", nnodes=2, node_rank=2, environ={})
    with pytest.raises(ValueError, match="do not fit"):
        plan_node(script_name="t", nproc=8, job="j", world_size=8, rank_offset=4, environ={})


def test_a_host_of_spares_only_takes_the_jobs_world_size_from_the_job() -> None:
    plan = plan_node(script_name="t", nproc=0, job="gpt", nnodes=2, environ={})
    assert (plan.world_size, plan.run, plan.multi_host) == (0, "gpt", True)


def test_explicit_world_size_and_offset_still_work_and_win_over_the_node_rank() -> None:
    plan = plan_node(script_name="t", nproc=2, job="j", run="r1", world_size=6, rank_offset=4, environ={})
    assert plan == NodePlan("j", "r1", 6, 4, "flags")


def test_inside_srun_slurm_names_the_nodes_the_node_rank_the_job_and_the_run() -> None:
    plan = plan_node(script_name="t", nproc=4, environ=SLURM)
    assert plan == NodePlan("slurm-8812", "8812", 16, 8, "slurm")
    stepped = plan_node(script_name="t", nproc=4, environ={**SLURM, "SLURM_STEP_NUM_NODES": "3"})
    assert stepped.world_size == 12, "the step's node count, not the allocation's"
    requeued = plan_node(script_name="t", nproc=4, job="gpt", environ={**SLURM, "SLURM_RESTART_COUNT": "2"})
    assert (requeued.job, requeued.run) == ("gpt", "8812-2"), "a requeued allocation is a new run"
    flags_win = plan_node(script_name="t", nproc=4, nnodes=2, node_rank=1, environ=SLURM)
    assert (flags_win.world_size, flags_win.rank_offset) == (8, 4)


def test_the_batch_script_itself_is_not_a_node_of_the_job() -> None:
    """sbatch's own shell has SLURM_JOB_ID and SLURM_NNODES, but runs on the first node only: a launcher
    there is a single host unless told otherwise."""
    batch = {k: v for k, v in SLURM.items() if k != "SLURM_STEP_ID"}
    assert not plan_node(script_name="t", nproc=4, environ=batch).multi_host


def test_slurm_values_that_are_not_counts_are_refused() -> None:
    with pytest.raises(ValueError, match="SLURM_NODEID"):
        plan_node(script_name="t", nproc=4, environ={**SLURM, "SLURM_NODEID": "two"})


def test_a_kubernetes_indexed_job_gives_the_node_rank() -> None:
    plan = plan_node(script_name="t", nproc=8, job="gpt", nnodes=4, environ={"JOB_COMPLETION_INDEX": "1"})
    assert plan == NodePlan("gpt", "gpt", 32, 8, "kubernetes")
    with pytest.raises(ValueError, match="not below --nnodes 1"):
        plan_node(script_name="t", nproc=8, job="gpt", environ={"JOB_COMPLETION_INDEX": "3"})
