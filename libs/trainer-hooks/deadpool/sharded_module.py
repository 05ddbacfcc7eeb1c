"""FSDP2 (`fully_shard`) across generations.

`fully_shard` shards a module in place over one process group, and there is no undoing it: a module
sharded over a generation's group cannot be sharded again over the next one's. So each generation
after the first shards a **fresh copy** of the model, made from a template on the meta device: the
template is copied from the model as the user built it, before its first wrap, without copying a
byte of its data (its parameters and buffers are meta tensors). The user's wrapper shards the copy
over the new group, `to_empty` gives it local shards, and the snapshot's shards fill them.

Each rank's snapshot holds its own shards (the DTensors' local tensors) of the parameters and of
the optimizer state, so a spare that takes rank r loads rank r's shards: the same world size and the
same rank give the same sharding.

HSDP (`fully_shard` on a 2-D mesh: replicate by shard) keeps each shard on every rank of its replica
group (`replica_group`): those ranks snapshot a partition of it each, and exchange the partitions over
that group when a rebuild loads them.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate

__all__ = ["ReplicaGroup", "fresh_copy", "is_fully_sharded", "meta_template", "replica_group"]


@dataclass(frozen=True)
class ReplicaGroup:
    """The ranks that hold the same shards as this one (HSDP's replicate dimension): this rank is
    `index` of `size`, and `group` is their process group."""

    index: int
    size: int
    group: Any


def is_fully_sharded(module: nn.Module) -> bool:
    """Whether `fully_shard` was applied to `module` or to any module inside it."""
    return any(isinstance(m, FSDPModule) for m in module.modules())


def meta_template(module: nn.Module) -> nn.Module:
    """A copy of `module` whose parameters and buffers are meta tensors (no data is copied)."""
    memo: dict[int, Any] = {}
    for p in module.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in module.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    template: nn.Module = copy.deepcopy(module, memo)
    return template


def fresh_copy(template: nn.Module) -> nn.Module:
    """A new module to shard, from `meta_template`'s template (still on the meta device)."""
    fresh: nn.Module = copy.deepcopy(template)
    return fresh


def replica_group(module: nn.Module) -> ReplicaGroup | None:
    """This rank's replica group if `module` is sharded by HSDP: every parameter a DTensor on one 2-D
    mesh, replicated on its first dimension (of more than one rank) and sharded on its second. None
    otherwise (plain FSDP, DDP, a single replica, or a layout DeadPool does not partition)."""
    params = [p for p in module.parameters() if isinstance(p, DTensor)]
    if not params or len(params) != sum(1 for _ in module.parameters()):
        return None
    mesh = params[0].device_mesh
    if mesh.ndim != 2 or mesh.size(0) < 2 or any(p.device_mesh is not mesh for p in params):
        return None
    if not all(isinstance(p.placements[0], Replicate) for p in params):
        return None
    return ReplicaGroup(mesh.get_local_rank(0), mesh.size(0), mesh.get_group(0))
