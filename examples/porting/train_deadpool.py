"""The torchrun script `train_torchrun.py`, ported to DeadPool (see docs/porting.md).

    deadpool launch --nproc 2 --spares 1 examples/porting/train_deadpool.py --steps 40

DDP with gradient accumulation (`no_sync`), clipping, a warm-up and cosine LR schedule, a GradScaler,
a shuffling data loader with worker processes, logging on rank 0 and a final checkpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

import deadpool

VOCAB, CONTEXT, WIDTH = 64, 16, 64


class Windows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Window i of a fixed pseudo-random corpus: the same on every process."""

    def __init__(self, length: int = 4096) -> None:
        self.corpus = torch.randint(VOCAB, (length + CONTEXT + 1,), generator=torch.Generator().manual_seed(7))

    def __len__(self) -> int:
        return len(self.corpus) - CONTEXT - 1

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.corpus[i : i + CONTEXT], self.corpus[i + 1 : i + CONTEXT + 1]


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.mix = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        loss: torch.Tensor = F.cross_entropy(self.head(h + self.mix(h)).flatten(0, 1), y.flatten())
        return loss


def warmup_cosine(total: int, warmup: int = 4) -> Callable[[int], float]:
    return lambda step: (step + 1) / warmup if step < warmup else 0.5 * (1 + math.cos(math.pi * step / total))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=8, help="per rank, per micro-step")
    parser.add_argument("--accumulate", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    world = int(os.environ["WORLD_SIZE"])
    torch.manual_seed(1234)
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(args.steps))
    scaler = torch.amp.GradScaler("cpu")
    data = Windows()
    loader = StatefulDataLoader(data, batch_size=args.batch * world, shuffle=True, num_workers=2)
    state = {"scheduler": scheduler, "scaler": scaler, "loader": loader}
    job = deadpool.attach(model, optimizer, wrap=deadpool.ddp, state=state)
    batches = job.iterate(loader)

    for step in job.steps(args.steps):
        rank, ddp = job.rank, job.model
        for micro in range(args.accumulate):
            x, y = (t[rank::world] for t in next(batches))
            with ddp.no_sync() if micro < args.accumulate - 1 else contextlib.nullcontext():
                loss = ddp(x, y) / args.accumulate
                scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        if rank == 0 and step % 10 == 0:
            print(f"step {step}  loss {loss.item() * args.accumulate:.4f}  lr {scheduler.get_last_lr()[0]:.2e}")

    if args.out is not None and job.rank is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, args.out / f"rank{job.rank}.pt")


if __name__ == "__main__":
    main()
