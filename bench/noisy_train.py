"""The example GPT's training loop with the noise real jobs have, for bench/false_swaps.py.

- a slow first step (`--first-step-s`: compilation, data loader warm-up);
- a periodic evaluation between steps (`--eval-every`, `--eval-s`), declared with `job.section()`;
- GC pauses inside steps (`--gc-every`): garbage built and collected, holding the GIL, so the
  heartbeat thread stalls too;
- an occasional slow step (`--slow-every`, `--slow-s`): a straggling data batch.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

import deadpool

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
train_gpt: Any = importlib.import_module("train_gpt")


def gc_pause(objects: int) -> float:
    started = time.perf_counter()
    garbage = [[i, {"k": i}] for i in range(objects)]
    for i in range(0, len(garbage) - 1, 2):
        garbage[i].append(garbage[i + 1])  # cycles: only the collector frees them
        garbage[i + 1].append(garbage[i])
    del garbage
    gc.collect()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--model-size", default="tiny")
    parser.add_argument("--first-step-s", type=float, default=8.0)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--eval-s", type=float, default=6.0)
    parser.add_argument("--gc-every", type=int, default=10)
    parser.add_argument("--gc-objects", type=int, default=300_000, help="~0.3-1 s of collection here")
    parser.add_argument("--slow-every", type=int, default=37)
    parser.add_argument("--slow-s", type=float, default=1.5)
    args = parser.parse_args()

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    torch.manual_seed(1337)
    config = train_gpt.SIZES[args.model_size]
    model = train_gpt.GPT(config)
    job = deadpool.attach(
        model,
        optimizer=lambda params: ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, lr=3e-3),
        wrap=lambda module, pg: DDP(module, process_group=pg, find_unused_parameters=True),
    )
    for step in job.steps(args.steps):
        with job.step():
            assert job.optimizer is not None and job.rank is not None
            if step == 0:
                time.sleep(args.first_step_s)
            # Per-rank noise, staggered (one rank pauses while its peers wait on it, the case that looks
            # most like a hang); job-wide noise (the first step, evaluations) hits every rank at once.
            if args.slow_every and step % args.slow_every == (7 * job.rank) % args.slow_every:
                time.sleep(args.slow_s)
            if args.gc_every and step % args.gc_every == (3 + job.rank) % args.gc_every:
                gc_pause(args.gc_objects)
            for group in job.optimizer.param_groups:
                group["lr"] = train_gpt.lr_at(step, args.steps)
            x, y = train_gpt.batch_for(step, job.rank, config, 1337)
            job.model(x, y).backward()
            job.optimizer.step()
            job.optimizer.zero_grad(set_to_none=True)
        if args.eval_every and step % args.eval_every == args.eval_every - 1:
            with job.section("evaluation"), torch.no_grad():
                ends = time.monotonic() + args.eval_s
                while time.monotonic() < ends:
                    job.module(*train_gpt.batch_for(10_000_000 + step, job.rank, config, 7))


if __name__ == "__main__":
    main()
