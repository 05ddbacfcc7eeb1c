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
    from deadpool.job import Job
    from deadpool.member_config import MemberConfig
    from deadpool.training_objects import OptimizerFactory, Wrapper

__all__ = ["attach", "ddp", "local_device"]


def local_device() -> Any:
    """The device this member trains on: the GPU `deadpool launch` gave it (made the current CUDA
    device), or the CPU when it was given none. Every member has a GPU of its own, spares included,
    and a promoted spare keeps it (see `cuda_devices`)."""
    import os

    import torch

    from deadpool.member_config import ENV

    index = os.environ.get(ENV.DEVICE)
    if index is None or not torch.cuda.is_available():
        return torch.device("cpu")
    device = torch.device("cuda", int(index))
    torch.cuda.set_device(device)
    return device


class _NotingDDP:
    """`wrap=deadpool.ddp`: DistributedDataParallel as the job needs it (`find_unused_parameters=True`,
    see `ddp_check`), over a group whose failures do not raise but end the step in a recovery
    (`noting_group`): the loop body needs no `with job.step()`. A `training_objects.NotesFailures`."""

    notes_failures = True

    def __call__(self, module: Any, group: Any) -> Any:
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(module, process_group=group, find_unused_parameters=True)


ddp = _NotingDDP()


def attach(
    model: Any,
    optimizer: OptimizerFactory | Any,
    *,
    wrap: Wrapper | None = None,
    state: dict[str, Any] | None = None,
    config: MemberConfig | None = None,
) -> Job:
    """Register this process with its job and return the `Job` that drives its training loop.

    model: the unwrapped `nn.Module`, built the same way on every member (spares too).
    optimizer: your optimizer over `model.parameters()`, kept for the whole run (its state is
        restored in place at every rebuild, so schedulers built on it stay bound to it); or a
        factory `params -> Optimizer` for an optimizer that needs the generation's process group
        (ZeroRedundancyOptimizer): the job builds it once it holds a rank, again after every rebuild.
    wrap: `(module, process_group) -> wrapped module`, e.g. DDP; called after every rebuild.
    state: objects to capture with every snapshot and restore at every rebuild, by name (see
        `Job.register`): schedulers, a GradScaler, a StatefulDataLoader, an EMA module.
    config: defaults to what `deadpool launch` put in the environment.
    """
    import structlog

    from deadpool.job import Job
    from deadpool.member_config import MemberConfig
    from deadpool.member_lifecycle import Member
    from deadpool_runtime.logs import configure_logging, get_logger

    config = config or MemberConfig.from_env()
    if not structlog.is_configured():
        configure_logging("member")
    log = get_logger(job=config.job, member=config.member)
    return Job(Member(model, optimizer, wrap, config, log, state))
