"""A loop shaped like a torchrun script, keeping the state real loops keep: an optimizer of its own
with an LR scheduler bound to it, a GradScaler, a StatefulDataLoader with worker processes, an EMA of
the weights; or the job's ZeRO optimizer with a OneCycleLR built for each generation; or one of the
optimizers whose state is not plain tensors (SparseAdam, LBFGS, a tensor learning rate).

Rank 1 SIGKILLs itself half-way through step `--kill-step` (once: a flag file marks it done), so a
spare takes its rank. Each rank writes its final state, user objects included, to `--out`.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import signal
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.lr_scheduler import LambdaLR, OneCycleLR
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

import deadpool

WIDTH = 16
BATCH = 4


class Numbers(Dataset[torch.Tensor]):
    """Item i is a function of i alone, so every process sees the same data."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.randn(WIDTH, generator=torch.Generator().manual_seed(index))


class Model(nn.Module):
    def __init__(self, sparse: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, WIDTH, sparse=sparse)
        # SparseAdam takes sparse gradients only: then the embedding is all there is to train
        self.body: nn.Module = (
            nn.Tanh() if sparse else nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 1))
        )

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.body(x + self.embed(ids)).square().mean()
        return out


def loss_and_grad(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, ids: torch.Tensor) -> float:
    """LBFGS's closure."""
    optimizer.zero_grad()
    loss = model(x, ids)
    loss.backward()
    return float(loss)


def build_optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    params = list(model.parameters())
    if kind == "sgd-momentum":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True)
    if kind == "sparse-adam":
        return torch.optim.SparseAdam(params, lr=0.01)
    if kind == "lbfgs":  # one iteration per step: ranks agree on how many closures a step evaluates
        return torch.optim.LBFGS(params, lr=0.5, max_iter=1, history_size=3)
    if kind == "adam-tensor-lr":
        return torch.optim.Adam(params, lr=torch.tensor(0.01), foreach=False)
    return torch.optim.AdamW(params, lr=0.01)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--kill-step", type=int, default=-1)
    parser.add_argument("--flag", type=Path, required=True, help="exists once rank 1 was killed")
    parser.add_argument("--optimizer", default="adamw")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--no-step-context", action="store_true", help="wrap=deadpool.ddp and no `with job.step()` around the body"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    sparse = args.optimizer == "sparse-adam"
    model = Model(sparse)
    zero = args.optimizer == "zero"
    state: dict[str, Any] = {}
    if zero:  # the job builds this optimizer for each generation, and the scheduler with it
        optimizer: Any = lambda params: ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, lr=0.01)  # noqa: E731
        state["scheduler"] = lambda opt: OneCycleLR(opt, max_lr=0.05, total_steps=args.steps, cycle_momentum=False)
    else:  # an optimizer of the script's own, as under torchrun
        optimizer = build_optimizer(args.optimizer, model)
        state["scheduler"] = LambdaLR(optimizer, lambda step: 0.9**step)
    state["scaler"] = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=3)
    state["ema"] = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))  # type: ignore[no-untyped-call]
    loader = StatefulDataLoader(Numbers(), batch_size=2 * BATCH, shuffle=True, num_workers=2)
    state["loader"] = loader
    wrap = None if sparse else (lambda m, pg: DDP(m, process_group=pg, find_unused_parameters=True))
    if args.no_step_context:
        wrap = deadpool.ddp  # its collectives' failures end the step in a recovery, without raising

    job = deadpool.attach(model, optimizer=optimizer, wrap=wrap, state=state)
    batches = job.iterate(loader)  # resumes where the restored loader state says, after every rebuild
    for step in job.steps(args.steps):
        with contextlib.nullcontext() if args.no_step_context else job.step():
            assert job.rank is not None and job.optimizer is not None
            x = next(batches)[job.rank :: job.world_size]  # every rank reads the same loader: its share
            ids = torch.arange(step, step + x.shape[0]) % 64
            scaler, opt = job.state["scaler"], job.optimizer

            if args.optimizer == "lbfgs":
                opt.step(functools.partial(loss_and_grad, job.model, opt, x, ids))
            else:
                scaler.scale(job.model(x, ids)).backward()
                if job.rank == 1 and step == args.kill_step and not args.flag.exists():
                    args.flag.touch()
                    os.kill(os.getpid(), signal.SIGKILL)
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
            job.state["scheduler"].step()
            job.state["ema"].update_parameters(model)
            if not args.no_step_context:  # a collective of the loop's own (it keeps ranks without DDP in step)
                dist.all_reduce(torch.tensor([float(step)]))
            if args.optimizer == "lbfgs" and job.rank == 1 and step == args.kill_step and not args.flag.exists():
                args.flag.touch()
                os.kill(os.getpid(), signal.SIGKILL)

    if job.rank is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        assert job.optimizer is not None
        local = getattr(job.optimizer, "optim", job.optimizer)
        final = {
            "model": model.state_dict(),
            "optimizer": local.state_dict(),
            "user": {name: job.state[name].state_dict() for name in ("scheduler", "scaler", "ema", "loader")},
        }
        torch.save(final, args.out / f"rank{job.rank}.pt")


if __name__ == "__main__":
    main()
