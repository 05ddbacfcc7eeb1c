"""A loop whose StatefulDataLoader has worker processes, counting every process fork this member
makes and those made from inside a rebuild (`deadpool/member_rebuild.py` on the forking stack).
Writes both counts to `--out` as JSON."""

from __future__ import annotations

import argparse
import json
import os
import traceback
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

import deadpool

WORKERS = 2


class Numbers(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.full((4,), float(index))


forks = {"total": 0, "in_rebuild": 0}


def count_fork() -> None:
    forks["total"] += 1
    if any(frame.filename.endswith(f"deadpool{os.sep}member_rebuild.py") for frame in traceback.extract_stack()):
        forks["in_rebuild"] += 1


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    os.register_at_fork(before=count_fork)
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = StatefulDataLoader(Numbers(), batch_size=8, shuffle=True, num_workers=WORKERS)
    job = deadpool.attach(model, optimizer=optimizer, state={"loader": loader})
    batches = job.iterate(loader)
    for _ in job.steps(args.steps):
        with job.step():
            job.model(next(batches)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    if job.rank is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"rank{job.rank}.json").write_text(json.dumps(forks))


if __name__ == "__main__":
    main()
