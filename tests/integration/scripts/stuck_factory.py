"""A training script whose optimizer factory never returns on rank 1 of the formation (a deadlock in
user code run during a rebuild, like a data loader forking its workers after threads started). Its
peer finishes the rebuild and trains, and its first collective times out; the stuck one beats
"rebuilding" for ever. Later rebuilds (the spare's, the survivor's) find the factory unblocked."""

from __future__ import annotations

import argparse
import os
import threading
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import deadpool


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--model-size", default="tiny")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    flags = Path(os.environ["STUCK_FACTORY_DIR"])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))

    def factory(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        if dist.get_world_size() > 1 and dist.get_rank() == 1:  # not a spare warming up (a group of one)
            try:
                (flags / "blocked").touch(exist_ok=False)  # rank 1 of the first rebuild only
            except FileExistsError:
                pass
            else:
                threading.Event().wait()  # never returns
        return torch.optim.SGD(params, lr=0.01)

    job = deadpool.attach(model, optimizer=factory, wrap=deadpool.ddp)  # a failed collective ends the step
    for step in job.steps(args.steps):
        assert job.optimizer is not None and job.rank is not None
        g = torch.Generator().manual_seed(step * 100 + job.rank)
        loss = job.model(torch.randn(8, 16, generator=g)).pow(2).mean()
        loss.backward()
        job.optimizer.step()
        job.optimizer.zero_grad()


if __name__ == "__main__":
    main()
