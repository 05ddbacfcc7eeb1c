"""HSDP: a model sharded with FSDP2 (`fully_shard`) on a 2 x 2 mesh of each generation's group,
replicated across its first dimension and sharded across its second; AdamW built by the job. Rank 2
(replica 1, shard 0) SIGKILLs itself half-way through step `--kill-step` (once: a flag file marks it
done). Each rank writes its shards of the weights and of the optimizer state to `--out`."""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import deadpool

WIDTH = 24
REPLICAS, SHARDS = 2, 2


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()) for _ in range(3))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        out: torch.Tensor = self.head(x).square().mean()
        return out


def shard(module: nn.Module, group: object) -> nn.Module:
    """HSDP over the generation's group (the default group): every block, then the root. A spare's
    warm-up wraps once in a group of its own, of one rank: a 1 x 1 mesh then."""
    world = dist.get_world_size(group)  # type: ignore[arg-type]
    shape = (REPLICAS, SHARDS) if world == REPLICAS * SHARDS else (1, world)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    assert isinstance(module, Net)
    for block in module.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(module, mesh=mesh)
    return module


def local(value: object) -> object:
    return value.to_local() if isinstance(value, DTensor) else value


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--kill-step", type=int, default=-1)
    parser.add_argument("--flag", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    job = deadpool.attach(Net(), optimizer=lambda params: torch.optim.AdamW(params, lr=0.01), wrap=shard)
    for step in job.steps(args.steps):
        with job.step():
            assert job.rank is not None and job.optimizer is not None
            x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(step * 100 + job.rank))
            job.model(x).backward()
            if job.rank == 2 and step == args.kill_step and not args.flag.exists():
                args.flag.touch()
                os.kill(os.getpid(), signal.SIGKILL)
            job.optimizer.step()
            job.optimizer.zero_grad()
    if job.rank is not None:
        assert job.optimizer is not None
        params = list(job.module.parameters())
        assert all(isinstance(p, DTensor) and p.device_mesh.ndim == 2 for p in params), "the model is not HSDP"
        state = job.optimizer.state
        final = {
            "model": {name: local(v) for name, v in job.module.state_dict().items()},
            "optimizer": {i: {k: local(v) for k, v in state[p].items()} for i, p in enumerate(params)},
        }
        args.out.mkdir(parents=True, exist_ok=True)
        torch.save(final, args.out / f"rank{job.rank}.pt")


if __name__ == "__main__":
    main()
