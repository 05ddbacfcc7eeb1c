"""What a snapshot holds, and how it is taken from and put back into a model and its optimizer.

Tensors: the unwrapped module's parameters and buffers, and this rank's optimizer state (for a
`ZeroRedundancyOptimizer`, the local shard's state, which exists nowhere else).

Copy only what must be copied: under data parallelism every rank holds the same parameters (and, with
an unsharded optimizer, the same optimizer state). Then each rank snapshots only its **partition** of
that replicated state (`replica_owners` splits it into W parts of nearly equal bytes, the same way on
every rank), plus its unique state: buffers (a forward pass updates them per rank) and a sharded
optimizer's shard. The union of the W snapshots of a step holds everything once. The replicated
partition comes first in the layout (`SnapshotMeta.shared_bytes`), so on recovery each rank sends its
partition to the others over the new process group (see `replica_exchange`).

Metadata (msgpack):
the step, the RNG states (torch, CUDA, Python, NumPy), the optimizer's param-group hyper-parameters
and non-tensor state, and the user's `extra` dict. Parameters are referred to by their index in
`module.parameters()`, which is the same on every rank and across restarts of the same script.
"""

from __future__ import annotations

import ctypes
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from deadpool.snapshot_layout import FlatBuffer, SnapshotLayout

__all__ = [
    "Partition",
    "SnapshotMeta",
    "SnapshotSources",
    "check_fits",
    "collect_sources",
    "load_module",
    "load_optimizer",
    "local_optimizer",
    "replica_owners",
    "restore_rng",
    "rng_state",
]

_SCALARS = (bool, int, float, str, type(None))


def local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that holds this rank's state tensors (ZeRO's local shard optimizer)."""
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        local: torch.optim.Optimizer = optimizer.optim
        return local
    return optimizer


@dataclass(frozen=True)
class Partition:
    """This rank's share of replicated state: rank `rank` of `world_size` (world_size 1: everything)."""

    rank: int = 0
    world_size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside a world of {self.world_size}")


WHOLE = Partition()


def replica_owners(nbytes: Sequence[int], world_size: int) -> list[int]:
    """Which rank snapshots each replicated tensor: largest first, each to the least-loaded rank
    (ties to the lower rank), so every rank computes the same split and the W parts have nearly
    equal bytes."""
    load = [0] * world_size
    owners = [0] * len(nbytes)
    for index in sorted(range(len(nbytes)), key=lambda i: (-nbytes[i], i)):
        owner = min(range(world_size), key=lambda r: (load[r], r))
        owners[index] = owner
        load[owner] += nbytes[index]
    return owners


@dataclass
class SnapshotSources:
    """The live tensors a snapshot copies, split by when they may be copied.

    `early` tensors (module buffers) can change in the next forward pass, so they are copied on the
    training thread at capture time; `late` tensors (parameters, optimizer state) only change in the
    next optimizer step, so their copy runs on the snapshot thread, fenced by the optimizer pre-hook.
    """

    names: list[str]
    early: list[int] = field(default_factory=list)
    late: list[int] = field(default_factory=list)
    tensors: list[torch.Tensor] = field(default_factory=list)
    scalars: dict[str, Any] = field(default_factory=dict)
    """Non-tensor optimizer state, keyed 'param_index.key'."""
    shared_count: int = 0
    """The first `shared_count` tensors are this rank's partition of replicated state."""
    partition: Partition = WHOLE
    whole_bytes: int = 0
    """What the snapshot would hold without partitioning (every replicated tensor), for reports."""
    early_tensors: list[torch.Tensor] = field(default_factory=list)
    late_tensors: list[torch.Tensor] = field(default_factory=list)


def collect_sources(
    module: nn.Module, optimizer: torch.optim.Optimizer | None, partition: Partition = WHOLE
) -> SnapshotSources:
    """The tensors of this rank's snapshot. With a partition of world_size > 1 the parameters (and an
    unsharded optimizer's state) are taken as replicated across ranks and only this rank's share is
    included; pass `WHOLE` unless the model is data-parallel."""
    src = SnapshotSources(names=[], partition=partition)
    params = list(module.parameters())
    owners = replica_owners([_nbytes(p) for p in params], partition.world_size)
    sharded = optimizer is not None and local_optimizer(optimizer) is not optimizer
    shared: list[tuple[str, torch.Tensor]] = []
    unique: list[tuple[str, torch.Tensor, bool]] = []
    for i, p in enumerate(params):
        src.whole_bytes += _nbytes(p)
        if owners[i] == partition.rank:
            shared.append((f"param.{i}", p))
    for i, b in enumerate(module.buffers()):
        src.whole_bytes += _nbytes(b)
        unique.append((f"buffer.{i}", b, True))
    if optimizer is not None:
        index = {id(p): i for i, p in enumerate(params)}
        local = local_optimizer(optimizer)
        for group in local.param_groups:
            for p in group["params"]:
                for key, value in sorted(local.state.get(p, {}).items()):
                    name = f"{index[id(p)]}.{key}"
                    if isinstance(value, torch.Tensor):
                        src.whole_bytes += _nbytes(value)
                        if sharded:
                            unique.append((f"optim.{name}", value, False))
                        elif owners[index[id(p)]] == partition.rank:
                            shared.append((f"optim.{name}", value))
                    elif isinstance(value, _SCALARS):
                        src.scalars[name] = value
    for name, tensor in shared:
        src.late.append(len(src.tensors))
        src.names.append(name)
        src.tensors.append(tensor.detach())
    src.shared_count = len(shared)
    for name, tensor, early in unique:
        (src.early if early else src.late).append(len(src.tensors))
        src.names.append(name)
        src.tensors.append(tensor.detach())
    src.early_tensors = [src.tensors[i] for i in src.early]
    src.late_tensors = [src.tensors[i] for i in src.late]
    return src


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": _tensor_bytes(torch.get_rng_state())}
    version, internal, gauss = random.getstate()
    state["python"] = [version, list(internal), gauss]
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = [_tensor_bytes(s) for s in torch.cuda.get_rng_state_all()]
    np = sys.modules.get("numpy")
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = [kind, keys.tobytes(), int(pos), int(has_gauss), float(cached)]
    return state


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    """A CPU uint8 tensor's bytes (a 5 KB RNG state: 25x faster than going through `tolist()`)."""
    return ctypes.string_at(tensor.data_ptr(), tensor.numel())


def _bytes_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(_bytes_tensor(state["torch"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_bytes_tensor(s) for s in state["cuda"]])
    np = sys.modules.get("numpy")
    if "numpy" in state and np is not None:
        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, np.frombuffer(keys, dtype=np.uint32), pos, has_gauss, cached))


def _group_hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    groups = []
    for group in optimizer.param_groups:
        saved: dict[str, Any] = {}
        for key, value in group.items():
            if key == "params":
                continue
            if isinstance(value, tuple | list) and all(isinstance(v, _SCALARS) for v in value):
                saved[key] = list(value)
            elif isinstance(value, _SCALARS):
                saved[key] = value
        groups.append(saved)
    return groups


@dataclass
class SnapshotMeta:
    step: int
    layout: SnapshotLayout
    rng: dict[str, Any]
    param_groups: list[dict[str, Any]]
    optim_scalars: dict[str, Any]
    extra: dict[str, Any]
    partition: Partition = WHOLE
    shared_count: int = 0
    """The layout's first `shared_count` tensors are the partition of replicated state."""

    @property
    def partitioned(self) -> bool:
        return self.partition.world_size > 1

    def shared_layout(self) -> SnapshotLayout:
        """The layout of the replicated partition alone (a prefix of the snapshot's bytes)."""
        specs = self.layout.specs[: self.shared_count]
        end = self.layout.specs[self.shared_count].offset if self.shared_count < len(self.layout.specs) else None
        return SnapshotLayout(specs, self.layout.total_bytes if end is None else end)

    @classmethod
    def capture(
        cls,
        step: int,
        layout: SnapshotLayout,
        optimizer: torch.optim.Optimizer | None,
        sources: SnapshotSources,
        extra: dict[str, Any],
    ) -> SnapshotMeta:
        groups = _group_hyperparameters(optimizer) if optimizer is not None else []
        return cls(
            step,
            layout,
            rng_state(),
            groups,
            dict(sources.scalars),
            dict(extra),
            sources.partition,
            sources.shared_count,
        )

    def encode(self) -> bytes:
        data: bytes = msgpack.packb(
            {
                "step": self.step,
                "layout": self.layout.packed,
                "rng": self.rng,
                "param_groups": self.param_groups,
                "optim_scalars": self.optim_scalars,
                "extra": self.extra,
                "partition": [self.partition.rank, self.partition.world_size],
                "shared_count": self.shared_count,
            },
            use_bin_type=True,
        )
        return data

    @classmethod
    def decode(cls, data: bytes) -> SnapshotMeta:
        try:
            m = msgpack.unpackb(data, raw=False, strict_map_key=False)
            rank, world_size = (int(v) for v in m["partition"])
            meta = cls(
                step=int(m["step"]),
                layout=SnapshotLayout.unpack(m["layout"]),
                rng=dict(m["rng"]),
                param_groups=list(m["param_groups"]),
                optim_scalars=dict(m["optim_scalars"]),
                extra=dict(m["extra"]),
                partition=Partition(rank, world_size),
                shared_count=int(m["shared_count"]),
            )
        except (KeyError, TypeError, ValueError, msgpack.UnpackException) as exc:
            raise ValueError(f"malformed snapshot metadata: {exc}") from None
        if not 0 <= meta.shared_count <= len(meta.layout.specs):
            raise ValueError("malformed snapshot metadata: shared_count outside the layout")
        return meta


def check_fits(module: nn.Module, layout: SnapshotLayout) -> None:
    """Raise ValueError, saying why, unless every parameter and buffer `layout` holds is one of
    `module`'s, with its shape and dtype. Checked on a fetched snapshot's layout before its bytes are
    received, so a snapshot of another model (or a mangled layout) is never loaded."""
    tensors: dict[str, torch.Tensor] = {f"param.{i}": t for i, t in enumerate(module.parameters())}
    tensors |= {f"buffer.{i}": t for i, t in enumerate(module.buffers())}
    for spec in layout.specs:
        if spec.name.partition(".")[0] not in ("param", "buffer"):
            continue
        own = tensors.get(spec.name)
        if own is None:
            raise ValueError(f"snapshot holds {spec.name}, which the model does not have")
        dtype = str(own.dtype).removeprefix("torch.")
        if tuple(own.shape) != spec.shape or dtype != spec.dtype:
            raise ValueError(
                f"snapshot's {spec.name} is {spec.shape}/{spec.dtype}, the model's {tuple(own.shape)}/{dtype}"
            )


def load_module(module: nn.Module, parts: Sequence[FlatBuffer]) -> None:
    """Copy the parameters and buffers held by `parts` into `module` (and clear gradients).

    `parts`: one whole snapshot, or this rank's snapshot and the other ranks' replicated partitions;
    together they must hold every parameter and buffer exactly once.
    """
    params = list(module.parameters())
    buffers = list(module.buffers())
    found: dict[str, torch.Tensor] = {}
    for part in parts:
        for name, view in part.by_name.items():
            kind = name.partition(".")[0]
            if kind in ("param", "buffer"):
                if name in found:
                    raise ValueError(f"snapshot parts hold {name} twice")
                found[name] = view
    expected = [f"param.{i}" for i in range(len(params))] + [f"buffer.{i}" for i in range(len(buffers))]
    missing = [name for name in expected if name not in found]
    if missing or len(found) != len(expected):
        raise ValueError(
            f"snapshot holds {len(found)} parameters and buffers, the model has {len(expected)}"
            + (f" (missing {missing[:3]})" if missing else "")
        )
    dst = params + buffers
    src = [found[name] for name in expected]
    with torch.no_grad():
        for d, s in zip(dst, src, strict=True):
            if d.shape != s.shape or d.dtype != s.dtype:
                raise ValueError(f"snapshot tensor {tuple(s.shape)}/{s.dtype} does not fit {tuple(d.shape)}/{d.dtype}")
        torch._foreach_copy_(dst, src)
    for p in params:
        p.grad = None


def load_optimizer(
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    parts: Sequence[FlatBuffer],
    meta: SnapshotMeta,
    take_buffers: bool = False,
) -> None:
    """Give a freshly built optimizer the state held by `parts`: tensors and hyper-parameters.

    State tensors are copied out of the parts, unless `take_buffers`: then CPU state tensors are views
    into them (no allocation, no copy: a spare restoring from a store owns the buffer it fetched into,
    and keeps it alive this way). Never take buffers that will be reused (the snapshot ping-pong slots).
    """
    params = list(module.parameters())
    local = local_optimizer(optimizer)
    owned = {id(p) for group in local.param_groups for p in group["params"]}
    local.state.clear()
    for part in parts:
        for name, view in part.by_name.items():
            kind, _, rest = name.partition(".")
            if kind != "optim":
                continue
            index, _, key = rest.partition(".")
            param = params[int(index)]
            if id(param) not in owned:
                raise ValueError(
                    f"snapshot holds optimizer state for parameter {index}, which this rank's optimizer does not "
                    "own (the optimizer's partition differs from the snapshot's rank)"
                )
            device = param.device if view.dim() > 0 else view.device
            if device != view.device:
                local.state[param][key] = view.to(device)
            else:
                local.state[param][key] = view if take_buffers else view.clone()
    for name, value in meta.optim_scalars.items():
        index, _, key = name.partition(".")
        local.state[params[int(index)]][key] = value
    if len(meta.param_groups) != len(optimizer.param_groups):
        raise ValueError("snapshot and optimizer have different numbers of param groups")
    for group, saved in zip(optimizer.param_groups, meta.param_groups, strict=True):
        for key, value in saved.items():
            group[key] = tuple(value) if isinstance(group.get(key), tuple) else value
