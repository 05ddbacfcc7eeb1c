"""The training job of bench/versus.py, the same under every system it compares.

    --mode deadpool   started by `deadpool launch`: hot swap from the snapshot stores
    --mode torchrun   started by torchrun (--max-restarts): every rank restarts from the newest
                      `torch.save` checkpoint, written every --checkpoint-every steps
    --mode torchft    one replica group per rank, each under its own torchrun (--max-restarts),
                      against a torchft lighthouse: the survivors go on without the dead replica,
                      which restarts and heals from a live peer's state

A small language model (DDP, AdamW, a warm-up and cosine schedule) on gloo, each step's batch a
function of the step, so a restarted run recomputes exactly the steps it lost. Every process appends
`{"step", "t", "rank"}` to --stats-dir/<pid>.jsonl as each step completes. With --die-at-step S, rank
--die-rank SIGKILLs itself in the middle of step S (after backward, before the optimizer step), once:
the marker file records when.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

VOCAB, CONTEXT = 256, 32


class LM(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.mix = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.head = nn.Linear(width, VOCAB)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        loss: torch.Tensor = F.cross_entropy(self.head(h + self.mix(h)).flatten(0, 1), y.flatten())
        return loss


def batch(step: int, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s batch for `rank`: the same wherever and however often it is computed."""
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    tokens = torch.randint(VOCAB, (size, CONTEXT + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def warmup_cosine(total: int, warmup: int = 5) -> Callable[[int], float]:
    return lambda step: (step + 1) / warmup if step < warmup else 0.5 * (1 + math.cos(math.pi * step / total))


class Stats:
    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self._f = open(directory / f"{os.getpid()}.jsonl", "a")  # noqa: SIM115 (the process's life)

    def completed(self, step: int, rank: int) -> None:
        self._f.write(json.dumps({"step": step, "t": time.time(), "rank": rank}) + "\n")
        self._f.flush()


def maybe_die(args: argparse.Namespace, step: int, rank: int) -> None:
    if step != args.die_at_step or rank != args.die_rank or args.die_marker is None:
        return
    try:
        fd = os.open(args.die_marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    except FileExistsError:
        return  # died here once already: this is the rerun
    os.write(fd, json.dumps({"t": time.time(), "step": step, "rank": rank}).encode())
    os.close(fd)
    os.kill(os.getpid(), signal.SIGKILL)


def one_step(
    ddp: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, args: argparse.Namespace, step: int, rank: int
) -> None:
    x, y = batch(step, rank, args.batch)
    ddp(x, y).backward()
    maybe_die(args, step, rank)
    torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()


def save_final(args: argparse.Namespace, rank: int, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, args.out / f"rank{rank}.pt")


def build(args: argparse.Namespace) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(1234)
    model = LM(args.width)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(args.steps))
    return model, optimizer, scheduler


def run_deadpool(args: argparse.Namespace) -> None:
    import deadpool

    model, optimizer, scheduler = build(args)
    job = deadpool.attach(model, optimizer, wrap=deadpool.ddp, state={"scheduler": scheduler})
    stats = Stats(args.stats_dir)
    for step in job.steps(args.steps):
        assert job.rank is not None
        one_step(job.model, optimizer, scheduler, args, step, job.rank)
        stats.completed(step, job.rank)
    if job.rank is not None:
        save_final(args, job.rank, model, optimizer)


def _checkpoint_dir(args: argparse.Namespace, step: int) -> Path:
    root: Path = args.checkpoint_dir
    return root / f"step-{step:08d}"


def init_restartable_group() -> None:
    """The process group of this restart of the workers. Under torchrun (torch 2.13, --standalone),
    a restarted worker's gloo read the previous attempt's addresses from the agent's store, which it
    keeps across restarts, and every restart failed with "connection refused": the keys are put under
    the restart count here."""
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ["WORLD_SIZE"]),
        is_master=False,
        use_libuv=True,
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(f"versus/attempt-{attempt}", store),
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
    )


def run_torchrun(args: argparse.Namespace) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    init_restartable_group()
    rank = dist.get_rank()
    model, optimizer, scheduler = build(args)
    start = 0
    complete = sorted(args.checkpoint_dir.glob("step-*/complete")) if args.checkpoint_every else []
    if complete:  # the newest checkpoint every rank finished writing
        saved = torch.load(complete[-1].parent / f"rank{rank}.pt", weights_only=False)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
        torch.set_rng_state(saved["rng"])
        start = saved["step"]
    ddp = DDP(model)
    stats = Stats(args.stats_dir)
    for step in range(start, args.steps):
        one_step(ddp, optimizer, scheduler, args, step, rank)
        stats.completed(step, rank)
        if args.checkpoint_every and (step + 1) % args.checkpoint_every == 0:
            where = _checkpoint_dir(args, step + 1)
            where.mkdir(parents=True, exist_ok=True)
            state = {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "rng": torch.get_rng_state(),
                "step": step + 1,
            }
            torch.save(state, where / f"rank{rank}.pt.tmp")
            os.replace(where / f"rank{rank}.pt.tmp", where / f"rank{rank}.pt")
            dist.barrier()
            if rank == 0:
                (where / "complete").touch()
    save_final(args, rank, model, optimizer)
    dist.destroy_process_group()


def run_torchft(args: argparse.Namespace) -> None:
    """torchft 0.2.0: a Manager per replica group (here one process each) with its ProcessGroupGloo,
    each step's gradients averaged over the quorum with `manager.allreduce`, and the optimizer stepped
    only where `manager.should_commit()`. The quorum is taken synchronously, so each step's batch is
    known (and the same) after a heal.

    Not torchft's DistributedDataParallel: in 0.2.0 its comm hook raises (`assert fut._fut`) when a peer
    dies during the allreduce, and the survivor dies with it; torchrun then restarts every replica, and
    with no live replica to heal from they start again from step 0. Manager.allreduce itself turns the
    error into a step that is not committed, which is the recovery torchft is designed for.

    A replica restarted after another trained the last step leaves at once: with nothing to heal from
    it would train from step 0 alone, and the job (whose weights the finished replica holds) is done."""
    from datetime import timedelta

    from torchft import Manager, ProcessGroupGloo

    replica = int(os.environ["REPLICA_GROUP_ID"])
    model, optimizer, scheduler = build(args)

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=5)),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=1,
        use_async_quorum=False,
        replica_id=f"versus_{replica}",
        hostname="localhost",
        timeout=timedelta(seconds=10),
        init_sync=False,  # every replica builds the same model from the same seed
    )
    stats = Stats(args.stats_dir)
    _replicas_ready(args, replica)
    finished = args.stats_dir / "finished"  # a replica trained the last step: the job is done
    while manager.current_step() < args.steps:
        if finished.exists():  # restarted after the others ended: no live replica to heal from
            manager.shutdown(wait=False)
            return
        optimizer.zero_grad(set_to_none=True)
        manager.start_quorum()  # a replica that was away heals here
        step = manager.current_step()
        x, y = batch(step, replica, args.batch)
        model(x, y).backward()
        maybe_die(args, step, replica)
        for work in [manager.allreduce(p.grad) for p in model.parameters() if p.grad is not None]:
            work.wait()  # an error is recorded, and the step is not committed
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if manager.should_commit():
            optimizer.step()
            scheduler.step()
            stats.completed(step, replica)
    finished.touch()
    save_final(args, replica, model, optimizer)
    manager.shutdown(wait=False)


def _replicas_ready(args: argparse.Namespace, replica: int, wait_s: float = 120.0) -> None:
    """At the start, every replica waits until all have a heartbeating manager: else the first to
    ask for a quorum gets one of its own, and the reference run would not train with every replica.
    A replica that restarts finds the files there and goes on."""
    ready = args.stats_dir / "ready"
    ready.mkdir(parents=True, exist_ok=True)
    (ready / str(replica)).touch()
    deadline = time.monotonic() + wait_s
    while len(list(ready.iterdir())) < args.replicas:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the other replicas did not start within {wait_s} s")
        time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["deadpool", "torchrun", "torchft"], required=True)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--stats-dir", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--replicas", type=int, default=2, help="torchft: replica groups in the job")
    parser.add_argument("--checkpoint-every", type=int, default=0)
    parser.add_argument("--checkpoint-dir", type=Path, default=Path("checkpoints"))
    parser.add_argument("--die-at-step", type=int, default=-1)
    parser.add_argument("--die-rank", type=int, default=-1)
    parser.add_argument("--die-marker", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    {"deadpool": run_deadpool, "torchrun": run_torchrun, "torchft": run_torchft}[args.mode](args)


if __name__ == "__main__":
    main()
