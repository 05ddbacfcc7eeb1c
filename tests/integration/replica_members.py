"""Process body for the replica exchange test (module-level so `multiprocessing` can spawn it)."""

from __future__ import annotations

import os
from typing import Any


def restore_from_partitions(rank: int, world_size: int, port: int, results: Any) -> None:
    """Snapshot this rank's share of a trained model, then restore a differently initialised copy from
    its own share plus the others' shares received over a real gloo group; report whether every
    parameter and optimizer tensor equals the original, bit for bit."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from deadpool.replica_exchange import broadcast_bytes, exchange_partitions
    from deadpool.training_state import Partition, collect_sources, load_module, load_optimizer, snapshot_now

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"

    def trained(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.Linear(64, 5))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for _ in range(3):
            model(torch.randn(8, 32)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        return model, optimizer

    model, optimizer = trained(0)  # data parallel: the same on every rank
    own, meta = snapshot_now(model, optimizer, 3, Partition(rank, world_size))
    layout = own.layout

    store = dist.TCPStore("127.0.0.1", port, world_size, rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        others = exchange_partitions(own, meta, rank, world_size, dist.group.WORLD)
        replica, replica_optimizer = trained(100 + rank)
        load_module(replica, [own, *others])
        load_optimizer(replica, replica_optimizer, [own, *others], meta.decode_tree(own))
        same = all(torch.equal(a, b) for a, b in zip(model.parameters(), replica.parameters(), strict=True))
        for p, q in zip(model.parameters(), replica.parameters(), strict=True):
            same = same and all(torch.equal(v, replica_optimizer.state[q][k]) for k, v in optimizer.state[p].items())
        # the staged path NCCL takes (a bounded device buffer, chunk by chunk), here staged on the CPU
        sent = torch.randint(0, 256, (5000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))
        received = sent.clone() if rank == 1 else torch.zeros(5000, dtype=torch.uint8)
        broadcast_bytes(received, 4999, 1, rank, dist.group.WORLD, torch.device("cpu"), chunk_bytes=1024)
        staged = torch.equal(received[:4999], sent[:4999]) and (rank == 1 or int(received[4999]) == 0)
        results.put((rank, same and staged, layout.total_bytes, collect_sources(model, optimizer).whole_bytes))
    finally:
        dist.destroy_process_group()
