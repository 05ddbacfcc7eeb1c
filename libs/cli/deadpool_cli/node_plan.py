"""Where one launcher stands in a job over several hosts: torchrun's flags, or what Slurm or a
Kubernetes Indexed Job tells each node.

torchrun's habits carry over: `--nnodes N --node-rank I --nproc-per-node G` gives a job of N x G ranks
whose ranks I x G … I x G + G - 1 this host asks for, and `--job` doubles as `--rdzv-id`. A scheduler
fills in what the flags leave out:
- inside `srun`, Slurm's step node count (`SLURM_STEP_NUM_NODES`, else `SLURM_NNODES`), the node's
  place in the step (`SLURM_NODEID`) and the job id (`SLURM_JOB_ID`, which also names the run);
- in a Kubernetes Indexed Job (or a JobSet's), the pod's index (`JOB_COMPLETION_INDEX`) as node rank.
A flag given on the command line always wins.

A host with no ranks of its own (`--nproc-per-node 0 --spares S`) takes the job's world size from the
run its other launchers started (`RunStart.world_size` 0, answered in `RunReply.world_size`).

Every launcher of a job over several hosts must name the same job and the same run: a name left to
chance (the default job name has a random suffix) would silently form separate jobs, so a multi-host
launch needs `--job` (or Slurm's job id) and says so.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["NodePlan", "plan_node"]

SLURM_STEP = "SLURM_STEP_ID"
"""Set by `srun` in each task: a launcher started in the batch script itself is not one per node."""
SLURM_NODE_COUNTS = ("SLURM_STEP_NUM_NODES", "SLURM_NNODES")
SLURM_NODE_RANK = "SLURM_NODEID"
SLURM_JOB = "SLURM_JOB_ID"
SLURM_RESTARTS = "SLURM_RESTART_COUNT"
KUBERNETES_INDEX = "JOB_COMPLETION_INDEX"


@dataclass(frozen=True)
class NodePlan:
    job: str
    run: str
    """The run every launcher of the job names ('' on one host: the launcher makes a new one)."""
    world_size: int
    """Ranks in the whole job; 0 on a host of spares only: the job's, once its run is joined."""
    rank_offset: int
    source: str
    """Where the node's place came from: 'one host', 'flags', 'slurm' or 'kubernetes'."""

    @property
    def multi_host(self) -> bool:
        return self.source != "one host"


def _env_int(environ: Mapping[str, str], name: str) -> int | None:
    value = environ.get(name, "")
    if not value:
        return None
    if not value.isdigit():
        raise ValueError(f"{name}={value!r} is not a count")
    return int(value)


def plan_node(
    *,
    script_name: str,
    nproc: int,
    job: str = "",
    run: str = "",
    nnodes: int | None = None,
    node_rank: int | None = None,
    world_size: int | None = None,
    rank_offset: int | None = None,
    environ: Mapping[str, str],
) -> NodePlan:
    """This launcher's job, run, world size and first rank. Raises ValueError saying what to pass."""
    source = "flags" if nnodes is not None or node_rank is not None else "one host"
    in_slurm = SLURM_STEP in environ and SLURM_JOB in environ
    if in_slurm:
        source = "slurm"
        if nnodes is None:
            nnodes = next((n for n in (_env_int(environ, v) for v in SLURM_NODE_COUNTS) if n is not None), None)
        if node_rank is None:
            node_rank = _env_int(environ, SLURM_NODE_RANK)
        run = run or _slurm_run(environ)
        job = job or f"slurm-{environ[SLURM_JOB]}"
    elif KUBERNETES_INDEX in environ and node_rank is None:
        source = "kubernetes"
        node_rank = _env_int(environ, KUBERNETES_INDEX)
    if nnodes is not None and nnodes < 1:
        raise ValueError("--nnodes is at least 1")
    if nproc < 0:
        raise ValueError("--nproc-per-node is not negative")
    nodes = nnodes or 1
    if node_rank is not None and not 0 <= node_rank < nodes and nproc > 0:
        raise ValueError(f"node rank {node_rank} is not below --nnodes {nodes}")
    if world_size is None:
        world_size = nodes * nproc  # 0 on a host of spares only: the job's, once joined
    if rank_offset is None:
        if nodes > 1 and nproc > 0 and node_rank is None:
            raise ValueError(f"a job over {nodes} nodes needs this node's --node-rank (0 to {nodes - 1})")
        rank_offset = (node_rank or 0) * nproc
    if world_size and rank_offset + nproc > world_size:
        raise ValueError(f"ranks {rank_offset}..{rank_offset + nproc - 1} do not fit a world of {world_size}")
    if world_size == nproc and nproc > 0 and source == "one host":
        return NodePlan(job or _random_job(script_name), run, world_size, rank_offset, source)
    if source == "one host":
        source = "flags"  # --world-size or --rank-offset, or a host of spares only
    if not job:
        raise ValueError(
            "a job over several hosts needs its name, the same on every host: --job NAME (or --rdzv-id NAME, "
            "as under torchrun); without it each host would form a job of its own"
        )
    return NodePlan(job, run or job, world_size, rank_offset, source)


def _slurm_run(environ: Mapping[str, str]) -> str:
    """The job id, and the restart count of a requeued job: a requeued allocation is a new run."""
    restarts = environ.get(SLURM_RESTARTS, "0")
    job_id = environ[SLURM_JOB]
    return job_id if restarts in ("", "0") else f"{job_id}-{restarts}"


def _random_job(script_name: str) -> str:
    return f"{script_name.replace('.', '_')}-{secrets.token_hex(3)}"
