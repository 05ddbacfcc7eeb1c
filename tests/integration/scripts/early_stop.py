"""A torchrun-style script run as a module (`deadpool launch -m`): it records the torchrun variables
it was started with, then leaves its loop early, the way early stopping or a step budget does: every
rank `break`s at the same step. The loop body is not under `with job.step()`: each pass of the loop is
a step. Each member, spares too, writes what it saw to `--out`."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import deadpool

TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "CUDA_VISIBLE_DEVICES", "DEADPOOL_DEVICE")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--stop-at", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    seen = {name: os.environ.get(name) for name in TORCHRUN_VARIABLES}
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    job = deadpool.attach(model, optimizer, wrap=lambda m, pg: DDP(m, process_group=pg, find_unused_parameters=True))
    last = -1
    for step in job.steps(args.steps):
        if step == args.stop_at:  # a condition every rank meets at the same step
            break
        job.model(torch.randn(2, 4)).square().mean().backward()  # no `with job.step()`: the body is the step
        optimizer.step()
        optimizer.zero_grad()
        last = step
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"env": seen, "rank": job.rank, "last_step": last}
    (args.out / f"{os.environ['DEADPOOL_MEMBER']}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
