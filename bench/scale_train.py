"""The member `bench/scale.py` launches: a real state of `--state-gb` per rank and a GPU-like step.

    deadpool launch ... bench/scale_train.py --steps 12 --state-gb 1 --step-s 1 [--device cuda]

The state is what a sharded job's rank holds: fp32 parameters and AdamW's two moments, 12 bytes per
parameter, in tensors of `--tensor-mb` (a large layer's size). No rank shares any of it with another
(no DDP: each rank's snapshot holds its whole state, as under FSDP).

Each step stands in for a GPU step that leaves the host's cores to the snapshot path: a sleep of
`--step-s` seconds (forward and backward), a one-element all-reduce standing in for the step's
collectives (they keep a real job's ranks in lockstep: without one, a survivor trained on past a killed
rank's last step until its own step ended, which a real job's cannot), then a fused AdamW step over
every parameter (new gradients each step, so every byte of the state changes). Whatever the training
thread waits for inside DeadPool (a capture, the optimizer step's wait for the previous capture's
copy) lengthens the step, as it would on a GPU whose next kernels that thread has not yet launched.
On `--device cuda` the state lives on the member's GPU and the optimizer step runs there.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import deadpool

BYTES_PER_PARAMETER = 12
"""fp32 parameter + AdamW's exp_avg and exp_avg_sq."""


def build_state(state_gb: float, tensor_mb: float, device: torch.device) -> nn.Module:
    """Parameters whose AdamW state holds `state_gb` GiB in all, in tensors of about `tensor_mb` MiB."""
    total = int(state_gb * 2**30 / BYTES_PER_PARAMETER)
    per_tensor = max(1, int(tensor_mb * 2**20 / 4))
    sizes = [min(per_tensor, total - start) for start in range(0, total, per_tensor)]
    return nn.ParameterList(nn.Parameter(torch.randn(n, device=device)) for n in sizes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--state-gb", type=float, default=1.0, help="GiB of state per rank (12 bytes per parameter)")
    parser.add_argument("--step-s", type=float, default=1.0, help="seconds each step takes, as a GPU's would")
    parser.add_argument("--tensor-mb", type=float, default=64.0, help="MiB per parameter tensor")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()

    torch.set_num_threads(1)
    device = torch.device("cpu")
    if args.device == "cuda":
        device = deadpool.local_device()
        if device.type != "cuda":
            sys.exit("--device cuda: this member was given no GPU (see deadpool launch --gpus)")
    torch.manual_seed(args.seed)
    model = build_state(args.state_gb, args.tensor_mb, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    job = deadpool.attach(model, optimizer)
    for step in job.steps(args.steps):
        with job.step():
            assert job.rank is not None
            time.sleep(args.step_s)  # forward and backward, on the GPU of the job this stands in for
            dist.all_reduce(torch.ones(1, device=device if dist.get_backend() == "nccl" else "cpu"))
            for p in model.parameters():  # new gradients: every byte of the moments changes
                if p.grad is None:  # the first step, and after a rebuild (a restore drops gradients)
                    p.grad = torch.empty_like(p)
                p.grad.fill_(1e-3 * (1 + (step * 7 + job.rank) % 13))
            optimizer.step()  # waits, inside DeadPool's hook, for a capture still copying the state
            if device.type == "cuda":
                torch.cuda.synchronize(device)


if __name__ == "__main__":
    main()
