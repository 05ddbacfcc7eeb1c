"""A small GPT trained with DDP and a sharded optimizer (ZeRO), made fault tolerant by DeadPool.

Run it the way you would run it with torchrun, naming how many warm spares to keep:

    deadpool launch --nproc 4 --spares 1 examples/train_gpt.py --steps 40

Read top to bottom: the model (a nanoGPT-style decoder), the data (a function of step and rank, so a
replayed step sees the same batch), and the loop, where the five DeadPool lines are marked.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import deadpool


# ----------------------------------------------------------------------------- the model
@dataclass(frozen=True)
class GPTConfig:
    n_layer: int
    n_head: int
    n_embd: int
    block_size: int
    batch_size: int
    vocab_size: int = 256  # bytes
    dropout: float = 0.1


SIZES = {
    "tiny": GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, batch_size=4),
    "small": GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=64, batch_size=8),
    "base": GPTConfig(n_layer=6, n_head=6, n_embd=192, block_size=128, batch_size=8),
    "medium": GPTConfig(n_layer=8, n_head=8, n_embd=384, block_size=128, batch_size=8),
}


class Block(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(c.n_embd), nn.LayerNorm(c.n_embd)
        self.qkv, self.proj = nn.Linear(c.n_embd, 3 * c.n_embd), nn.Linear(c.n_embd, c.n_embd)
        self.mlp = nn.Sequential(nn.Linear(c.n_embd, 4 * c.n_embd), nn.GELU(), nn.Linear(4 * c.n_embd, c.n_embd))
        self.drop = nn.Dropout(c.dropout)
        self.n_head = c.n_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, c)))
        out: torch.Tensor = x + self.drop(self.mlp(self.ln2(x)))
        return out


class GPT(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(c.vocab_size, c.n_embd)
        self.pos = nn.Embedding(c.block_size, c.n_embd)
        self.blocks = nn.Sequential(*[Block(c) for _ in range(c.n_layer)])
        self.ln_f = nn.LayerNorm(c.n_embd)
        self.head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        self.head.weight = self.tok.weight  # weight tying, as in GPT-2
        self.drop = nn.Dropout(c.dropout)
        for module in self.modules():  # GPT-2's initialisation
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.blocks(self.drop(self.tok(idx) + self.pos(pos)))
        logits = self.head(self.ln_f(x))
        loss: torch.Tensor = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return loss


# ----------------------------------------------------------------------------- the data
CORPUS = torch.tensor(list(Path(__file__).read_bytes() * 4), dtype=torch.long)


def batch_for(step: int, rank: int, c: GPTConfig, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of (step, rank): the same numbers every time that step is run, on any process."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1_009 + rank)
    starts = torch.randint(len(CORPUS) - c.block_size - 1, (c.batch_size,), generator=g)
    x = torch.stack([CORPUS[s : s + c.block_size] for s in starts])
    y = torch.stack([CORPUS[s + 1 : s + 1 + c.block_size] for s in starts])
    return x, y


def lr_at(step: int, total: int, peak: float = 3e-3) -> float:
    """Warm-up then cosine decay: a function of the step, so a replayed step uses the same rate."""
    warmup = max(1, total // 10)
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


# ----------------------------------------------------------------------------- the loop
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--model-size", choices=sorted(SIZES), default="small")
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--out", type=Path, default=None, help="write each rank's final state here")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--deterministic", action="store_true", help="CUDA: deterministic algorithms only")
    args = parser.parse_args()

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)  # CPU: denormals make backward up to 50x slower
    device = torch.device("cpu")
    if args.device == "cuda":  # the GPU `deadpool launch` gave this member (spares get one of their own)
        if args.deterministic:  # cuBLAS reads this when CUDA starts: before the first CUDA call
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        device = deadpool.local_device()
        if device.type != "cuda":
            sys.exit("--device cuda: this member was given no GPU (see deadpool launch --gpus)")
        if args.deterministic:  # bit-identity on a GPU needs deterministic kernels (cuBLAS included)
            torch.use_deterministic_algorithms(True)
    torch.manual_seed(args.seed)  # every member, spares too, builds the same model
    config = SIZES[args.model_size]
    model = GPT(config).to(device)

    job = deadpool.attach(  # (1) join the job; a spare waits in job.steps()
        model,
        optimizer=lambda params: ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, lr=3e-3),
        wrap=lambda module, pg: DDP(module, process_group=pg, find_unused_parameters=True),
    )
    for step in job.steps(args.steps):  # (2) resumes at the right step after a swap
        with job.step():  # (3) a broken collective in here is handled
            assert job.optimizer is not None and job.rank is not None
            for group in job.optimizer.param_groups:
                group["lr"] = lr_at(step, args.steps)
            x, y = batch_for(step, job.rank, config, args.seed)
            loss = job.model(x.to(device), y.to(device))  # (4) the wrapped model of the current generation
            loss.backward()
            job.optimizer.step()  # (5) the optimizer of the current generation
            job.optimizer.zero_grad(set_to_none=True)
            if job.rank == 0 and (step % 10 == 0 or step == args.steps - 1):
                print(f"step {step:4d}  loss {loss.item():.4f}  generation {job.generation}", flush=True)

    if args.out is not None and job.rank is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        local = getattr(job.optimizer, "optim", job.optimizer)  # ZeRO keeps this rank's shard here
        assert local is not None
        torch.save({"model": model.state_dict(), "optimizer": local.state_dict()}, args.out / f"rank{job.rank}.pt")


if __name__ == "__main__":
    main()
