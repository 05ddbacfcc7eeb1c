"""A model sharded with FSDP2 (`fully_shard` per block and at the root) over each generation's group,
AdamW built by the job; with `--replicas R` above 1, HSDP: a 2-D mesh of R replicas of world / R
shards. Rank 2 SIGKILLs itself half-way through step `--kill-step` (once: a flag file marks it
done). Each rank writes its shards of the weights and of the optimizer state to `--out`."""

from __future__ import annotations

import argparse
import functools
import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import deadpool

WIDTH = 24


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


def shard(module: nn.Module, group: object, replicas: int = 1) -> nn.Module:
    """FSDP2 over the generation's group: every block, then the root. HSDP builds its 2-D mesh from
    the default group (the generation's); a spare's warm-up wraps once in a group of one rank, and
    gets a 1 x 1 mesh."""
    world = dist.get_world_size(group)  # type: ignore[arg-type]
    if replicas == 1:
        mesh = DeviceMesh.from_group(group, "cpu")  # type: ignore[arg-type]
    else:
        shape = (replicas, world // replicas) if world > 1 else (1, 1)
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
    parser.add_argument("--replicas", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    wrap = functools.partial(shard, replicas=args.replicas)
    job = deadpool.attach(Net(), optimizer=lambda params: torch.optim.AdamW(params, lr=0.01), wrap=wrap)
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
        dims = 1 if args.replicas == 1 else 2
        assert all(isinstance(p, DTensor) and p.device_mesh.ndim == dims for p in params), "not sharded as asked"
        state = job.optimizer.state
        final = {
            "model": {name: local(v) for name, v in job.module.state_dict().items()},
            "optimizer": {i: {k: local(v) for k, v in state[p].items()} for i, p in enumerate(params)},
        }
        args.out.mkdir(parents=True, exist_ok=True)
        torch.save(final, args.out / f"rank{job.rank}.pt")


if __name__ == "__main__":
    main()
