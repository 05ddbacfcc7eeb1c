"""Reassemble replicated state after a rebuild: every rank sends its snapshot's partition to the others.

Under data parallelism each rank's snapshot holds only its partition of the parameters (see
`training_state`). When a generation restores step s, each rank has its own snapshot of s (from its
ping-pong buffer, or fetched from a store by a promoted spare), and the new process group carries the
W partitions to everyone: first the small layouts (so a rank whose optimizer has no state yet knows
the shapes), then the bytes, one broadcast per owner. The bytes are exact copies, so the result is
bit-identical to a rank that never stopped.

On NCCL the partitions travel through device memory (NCCL moves device tensors only), staged in
chunks of `EXCHANGE_CHUNK_BYTES` through one device buffer, so a rebuild needs that much GPU memory,
not a model's worth; the partitions received land in host memory. On gloo they stay in host memory.
"""

from __future__ import annotations

import ctypes
from typing import Any

import msgpack
import torch
import torch.distributed as dist

from deadpool.snapshot_layout import FlatBuffer, SnapshotLayout
from deadpool.training_state import SnapshotMeta
from deadpool_protocol.dataplane import chunk_spans
from deadpool_protocol.errors import DeadPoolError

__all__ = [
    "EXCHANGE_CHUNK_BYTES",
    "ReplicaMismatchError",
    "broadcast_bytes",
    "exchange_device",
    "exchange_partitions",
]

EXCHANGE_CHUNK_BYTES = 64 << 20
"""The device staging buffer of the exchange on NCCL: the most GPU memory a rebuild's exchange takes."""


class ReplicaMismatchError(DeadPoolError, RuntimeError):
    """The ranks' snapshots do not belong together (different steps, or partitions of different worlds)."""


def exchange_partitions(
    snapshot: FlatBuffer,
    meta: SnapshotMeta,
    rank: int,
    world_size: int,
    group: Any,
    chunk_bytes: int = EXCHANGE_CHUNK_BYTES,
) -> list[FlatBuffer]:
    """The other ranks' replicated partitions of step `meta.step` (an empty list if `meta` is whole).

    Every rank of the new group must call this with its own snapshot of the same step.
    """
    mine = {
        "step": meta.step,
        "partition": [meta.partition.rank, meta.partition.world_size],
        "shared": meta.shared_layout().to_fields(),
    }
    device = exchange_device(group)
    packed = msgpack.packb(mine, use_bin_type=True)
    gathered = [msgpack.unpackb(b, raw=False) for b in _all_gather_bytes(packed, world_size, group, device)]
    _check_consistent(gathered, rank, world_size)
    if not meta.partitioned:
        return []
    staging = device if device.type != "cpu" else None
    parts: list[FlatBuffer] = []
    for owner, theirs in enumerate(gathered):
        layout = SnapshotLayout.from_fields(theirs["shared"])
        if owner == rank:
            payload = snapshot.data
        else:
            payload = torch.empty(max(layout.total_bytes, 1), dtype=torch.uint8, pin_memory=staging is not None)
        broadcast_bytes(payload, layout.total_bytes, owner, rank, group, staging, chunk_bytes)
        if owner != rank:
            parts.append(FlatBuffer(layout, data=payload))
    return parts


def broadcast_bytes(
    host: torch.Tensor,
    nbytes: int,
    src: int,
    rank: int,
    group: Any,
    staging_device: torch.device | None,
    chunk_bytes: int = EXCHANGE_CHUNK_BYTES,
) -> None:
    """Broadcast the first `nbytes` of the host uint8 tensor `host` from `src` (a rank of `group`, and
    `rank` this one's there) to every rank's `host`.
    With `staging_device`, the bytes go through one buffer of at most `chunk_bytes` there, a chunk at a
    time (NCCL moves device tensors only); without, the host tensor is broadcast as it is."""
    if nbytes == 0:
        return
    root = dist.get_global_rank(group, src) if group is not None else src  # `src` is a rank of `group`
    if staging_device is None:
        dist.broadcast(host[:nbytes], src=root, group=group)
        return
    stage = torch.empty(min(chunk_bytes, nbytes), dtype=torch.uint8, device=staging_device)
    for offset, size in chunk_spans(nbytes, chunk_bytes):
        piece = stage[:size]
        if rank == src:
            piece.copy_(host[offset : offset + size])
        dist.broadcast(piece, src=root, group=group)
        if rank != src:
            host[offset : offset + size].copy_(piece)


def _all_gather_bytes(data: bytes, world_size: int, group: Any, device: torch.device) -> list[bytes]:
    """Every rank's `data` (torch's `all_gather_object` needs NumPy, which a training image may lack)."""
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world_size)]
    dist.all_gather(sizes, size, group=group)
    lengths = [int(s.item()) for s in sizes]
    longest = max(max(lengths), 1)
    mine = torch.zeros(longest, dtype=torch.uint8)
    if data:
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    gathered = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(world_size)]
    dist.all_gather(gathered, mine.to(device), group=group)
    host = [t.cpu() for t in gathered]
    return [ctypes.string_at(t.data_ptr(), n) for t, n in zip(host, lengths, strict=True)]


def _check_consistent(gathered: list[Any], rank: int, world_size: int) -> None:
    steps = {entry["step"] for entry in gathered}
    if len(steps) != 1:
        raise ReplicaMismatchError(f"ranks restored different steps: {sorted(steps)}")
    worlds = {entry["partition"][1] for entry in gathered}
    if worlds not in ({1}, {world_size}):
        raise ReplicaMismatchError(
            f"snapshots partitioned for worlds {sorted(worlds)}, the group has {world_size} ranks"
        )
    if worlds == {world_size}:
        owners = [entry["partition"][0] for entry in gathered]
        if owners != list(range(world_size)):
            raise ReplicaMismatchError(f"rank {rank}: partitions arrived from ranks {owners}, not one per rank")


def exchange_device(group: Any) -> torch.device:
    """Where small collectives on `group` keep their tensors (NCCL moves device tensors only)."""
    if dist.get_backend(group) == "nccl":  # pragma: no cover - needs a GPU
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
