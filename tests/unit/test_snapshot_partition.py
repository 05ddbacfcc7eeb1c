"""Snapshotting only this rank's share of replicated state: the split, and that the shares add up."""

from __future__ import annotations

import msgpack
import pytest
import torch
from torch import nn

from deadpool.snapshot_layout import FlatBuffer
from deadpool.training_state import (
    Partition,
    SnapshotMeta,
    load_module,
    load_optimizer,
    replica_owners,
    snapshot_now,
)


def test_replicated_tensors_are_split_into_nearly_equal_shares_the_same_way_everywhere() -> None:
    sizes = [4096, 10, 300, 300, 2048, 2048, 7, 1024, 512]
    owners = replica_owners(sizes, 3)
    assert owners == replica_owners(list(sizes), 3)  # deterministic: every rank agrees
    loads = [sum(s for s, o in zip(sizes, owners, strict=True) if o == r) for r in range(3)]
    assert max(loads) - min(loads) <= max(sizes)
    assert replica_owners(sizes, 1) == [0] * len(sizes)


def trained(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 3, bias=False), nn.Linear(3, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randn(4, 8)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer, part: Partition) -> tuple[FlatBuffer, SnapshotMeta]:
    return snapshot_now(model, optimizer, 3, part)


def test_the_shares_of_all_ranks_hold_every_replicated_tensor_once_and_restore_exactly() -> None:
    model, optimizer = trained(0)
    world = 3
    shots = [snapshot(model, optimizer, Partition(r, world)) for r in range(world)]
    whole, _ = snapshot(model, optimizer, Partition())
    names = [n for buffer, meta in shots for n in buffer.layout.names()[: meta.shared_count]]
    replicated = [n for n in whole.layout.names() if not n.startswith("buffer.")]
    assert sorted(names) == sorted(replicated)  # each parameter and optimizer tensor exactly once
    assert sum(b.layout.total_bytes for b, _ in shots) < 2 * whole.layout.total_bytes
    for buffer, meta in shots:  # buffers are per rank: in every share, after the replicated part
        assert all(not n.startswith("buffer.") for n in buffer.layout.names()[: meta.shared_count])
        assert sum(n.startswith("buffer.") for n in buffer.layout.names()) == 3

    # Rank 1's view of a recovery: its own snapshot plus the others' replicated prefixes.
    own, meta = shots[1]
    others = [
        FlatBuffer(m.shared_layout(), data=b.data[: m.shared_layout().total_bytes]) for b, m in (shots[0], shots[2])
    ]
    replica, replica_optimizer = trained(99)  # different weights, different optimizer state
    load_module(replica, [own, *others])
    load_optimizer(replica, replica_optimizer, [own, *others], meta.decode_tree(own))
    for a, b in zip(model.state_dict().values(), replica.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    for p, q in zip(model.parameters(), replica.parameters(), strict=True):
        for key, value in optimizer.state[p].items():
            assert torch.equal(value, replica_optimizer.state[q][key])


def test_a_missing_share_is_refused_rather_than_leaving_weights_stale() -> None:
    model, optimizer = trained(0)
    own, _ = snapshot(model, optimizer, Partition(0, 2))
    with pytest.raises(ValueError, match="missing"):
        load_module(trained(1)[0], [own])


def test_a_partition_says_in_its_metadata_whether_it_is_over_the_group_or_a_shards_replicas() -> None:
    model, optimizer = trained(0)
    for part in (Partition(), Partition(1, 3), Partition(1, 2, within_shard=True)):
        _, meta = snapshot(model, optimizer, part)
        assert SnapshotMeta.decode(meta.encode()).partition == part
    _, meta = snapshot(model, optimizer, Partition(1, 3))
    fields = msgpack.unpackb(meta.encode(), raw=False, strict_map_key=False)
    fields["partition"] = [1, 3]  # written before HSDP: over the group
    assert SnapshotMeta.decode(msgpack.packb(fields)).partition == Partition(1, 3)
    for forged in ([1, 3, 1], [1, 3, True, False], [1, 3, "yes"]):
        fields["partition"] = forged
        with pytest.raises(ValueError, match="malformed snapshot metadata"):
            SnapshotMeta.decode(msgpack.packb(fields))
