"""DeadPool's trainer hooks: attach a model and optimizer to a job that survives the loss of ranks.

    import deadpool
    job = deadpool.attach(model, optimizer=factory, wrap=lambda m, pg: DDP(m, process_group=pg,
                                                                          find_unused_parameters=True))
    for step in job.steps(total_steps):
        with job.step():
            ...

`import deadpool` does not import torch; `attach` does (the launcher lives here too and stays light).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from deadpool.job import Job, OptimizerFactory, Wrapper
    from deadpool.member_config import MemberConfig

__all__ = ["attach"]


def attach(
    model: Any,
    optimizer: OptimizerFactory,
    *,
    wrap: Wrapper | None = None,
    config: MemberConfig | None = None,
) -> Job:
    """Register this process with its job and return the `Job` that drives its training loop.

    model: the unwrapped `nn.Module`, built the same way on every member (spares too).
    optimizer: a factory `params -> Optimizer`; the job builds the optimizer once it holds a rank
        (again after every rebuild), so sharded optimizers such as ZeroRedundancyOptimizer get the
        generation's process group as their default group.
    wrap: `(module, process_group) -> wrapped module`, e.g. DDP; called after every rebuild.
    config: defaults to what `deadpool launch` put in the environment.
    """
    import structlog

    from deadpool.job import Job
    from deadpool.member_config import MemberConfig
    from deadpool_protocol.logs import configure_logging, get_logger

    config = config or MemberConfig.from_env()
    if not structlog.is_configured():
        configure_logging("member")
    log = get_logger(job=config.job, member=config.member)
    return Job(model, optimizer, wrap, config, log)
