"""What the real-loop support costs a step: DDP over the noting group, and reading the state tree.

    .venv/bin/python bench/loop_hooks.py [--rounds 4] [--steps 30] [--width 512]

1. **The noting group** (`wrap=deadpool.ddp`, `deadpool/noting_group.py`): 2 gloo processes train
   the same DDP model (`find_unused_parameters=True`) over the plain world group and over a
   `NotingGroup` wrapping it, in alternating rounds (A B A B ...). Reported: each arm's median step
   time and their ratio.
2. **The state tree** (`capture_tree`), which every capture reads on the training thread. It is read
   for an AdamW over a GPT-medium-sized parameter list, with a scheduler, a GradScaler, a
   StatefulDataLoader and an EMA registered. Reported: its median and p99 in microseconds, and the
   bytes of its tensors.

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from measures import percentile
from torch import nn
from torch.nn.parallel import DistributedDataParallel

GOALS = {"noting_step_time_ratio_max": 1.02, "tree_read_us_p50_max": 500.0}


def model_of(width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(6)], nn.Linear(width, 1))


def ddp_worker(rank: int, port: int, rounds: int, steps: int, width: int, results: Any) -> None:
    from deadpool.noting_group import FailureNote, NotingGroup

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    times: dict[str, list[float]] = {"plain": [], "noting": []}
    for r in range(2 * rounds):
        arm = "plain" if r % 2 == 0 else "noting"
        module = model_of(width)
        group = dist.group.WORLD if arm == "plain" else NotingGroup(dist.group.WORLD, FailureNote())  # type: ignore[arg-type]
        model = DistributedDataParallel(module, process_group=group, find_unused_parameters=True)
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
        for step in range(steps):
            x = torch.randn(16, width, generator=torch.Generator().manual_seed(step * 2 + rank))
            dist.barrier()
            started = time.perf_counter()
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            if step >= 2:  # the first steps initialise lazily
                times[arm].append(time.perf_counter() - started)
        del model
    if rank == 0:
        results.put(times)
    dist.destroy_process_group()


def noting_group_figures(rounds: int, steps: int, width: int) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = 29000 + os.getpid() % 1000
    processes = [ctx.Process(target=ddp_worker, args=(r, port, rounds, steps, width, results)) for r in range(2)]
    for p in processes:
        p.start()
    times = results.get(timeout=600)
    for p in processes:
        p.join(60)
    plain, noting = statistics.median(times["plain"]), statistics.median(times["noting"])
    print(f"DDP step, median of {len(times['plain'])} steps per arm: plain group {plain * 1e3:.2f} ms,")
    print(f"  noting group {noting * 1e3:.2f} ms; ratio {noting / plain:.3f}")
    return {"plain_step_ms": plain * 1e3, "noting_step_ms": noting * 1e3, "noting_step_time_ratio": noting / plain}


def tree_figures(repeats: int) -> dict[str, float]:
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
    from torchdata.stateful_dataloader import StatefulDataLoader

    from deadpool.training_state import capture_tree

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(384, 384) for _ in range(48)])  # ~100 parameter tensors, as GPT-medium
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 384)).sum().backward()
    optimizer.step()
    user = {
        "scheduler": torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-3, total_steps=1000),
        "scaler": torch.amp.GradScaler("cpu"),
        "loader": StatefulDataLoader(list(range(1000)), batch_size=8, shuffle=True),
        "ema": AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.999)),  # type: ignore[no-untyped-call]
    }
    next(iter(user["loader"]))
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        tree = capture_tree(model, optimizer, user)
        samples.append((time.perf_counter() - started) * 1e6)
    tensor_bytes = sum(t.numel() * t.element_size() for t in tree.tensors)
    p50, p99 = statistics.median(samples), percentile(samples, 99)
    print(f"state tree read: p50 {p50:.0f} us, p99 {p99:.0f} us; {len(tree.tensors)} tensors, {tensor_bytes} bytes")
    print("  (the EMA's weights are the tree's tensors: they are copied at capture, as buffers are)")
    return {"tree_read_us_p50": p50, "tree_read_us_p99": p99, "tree_tensor_bytes": float(tensor_bytes)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4, help="rounds per arm, alternating")
    parser.add_argument("--steps", type=int, default=30, help="steps per round")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--tree-repeats", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    figures = noting_group_figures(args.rounds, args.steps, args.width) | tree_figures(args.tree_repeats)
    met = {
        "noting_step_time_ratio": figures["noting_step_time_ratio"] <= GOALS["noting_step_time_ratio_max"],
        "tree_read_us_p50": figures["tree_read_us_p50"] <= GOALS["tree_read_us_p50_max"],
    }
    print(
        json.dumps({"bench": "loop_hooks", **{k: round(v, 4) for k, v in figures.items()}, "goals": GOALS, "met": met})
    )


if __name__ == "__main__":
    main()
