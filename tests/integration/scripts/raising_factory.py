"""A training script whose optimizer factory raises once a flag file exists (a user error that shows
only at a rebuild, like a factory closing over a name the script later rebinds)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import deadpool


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--model-size", default="tiny")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    flag = Path(os.environ["RAISING_FACTORY_FLAG"])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))

    def factory(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        if flag.exists():
            raise RuntimeError("factory broke: it closed over the wrong model")
        return torch.optim.SGD(params, lr=0.01)

    job = deadpool.attach(
        model, optimizer=factory, wrap=lambda m, pg: DDP(m, process_group=pg, find_unused_parameters=True)
    )
    for step in job.steps(args.steps):
        with job.step():
            assert job.optimizer is not None and job.rank is not None
            g = torch.Generator().manual_seed(step * 100 + job.rank)
            x = torch.randn(8, 16, generator=g)
            loss = job.model(x).pow(2).mean()
            loss.backward()
            job.optimizer.step()
            job.optimizer.zero_grad()


if __name__ == "__main__":
    main()
