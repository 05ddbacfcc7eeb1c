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

Under HSDP (`fully_shard` on a 2-D mesh, replicas by shards) the ranks of one replica group hold the
same shards: each snapshots its partition of them (`Partition.within_shard`), so the bytes per rank are
the shard's divided by the replicas, and the partitions travel over the mesh's replicate dimension.

The **state tree** (`state_tree`): everything that is not a top-level optimizer state tensor, read
afresh at every capture: the optimizer's param groups (a tensor learning rate included), its
non-tensor and nested state (SparseAdam's integer `step`, LBFGS's history lists), and the state of
every object registered with the job (a scheduler, a GradScaler, a data loader, an EMA). Its tensors
are copied at capture time, on the training thread, as `state.<i>` entries of the snapshot.

Metadata (msgpack): the step, the RNG states (torch, CUDA, Python, NumPy), the state tree's bytes and
the user's `extra` dict. Parameters are referred to by their index in `module.parameters()`, which
is the same on every rank and across restarts of the same script.
"""

from __future__ import annotations

import ctypes
import math
import random
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

from deadpool.snapshot_layout import FlatBuffer, SnapshotLayout, aligned_bytes, plan_layout
from deadpool.state_tree import decode_tree, encode_tree

__all__ = [
    "SNAPSHOT_MODEL_MULTIPLE_MAX",
    "SNAPSHOT_SLACK_BYTES",
    "TREE_PREFIX",
    "Partition",
    "SnapshotMeta",
    "SnapshotSources",
    "StateTree",
    "capture_tree",
    "check_fits",
    "collect_sources",
    "load_module",
    "load_optimizer",
    "load_user_state",
    "local_optimizer",
    "local_tensor",
    "replica_owners",
    "restore_rng",
    "rng_state",
    "snapshot_bytes_max",
    "snapshot_now",
    "tensor_state_ids",
]

TREE_PREFIX = "state."
"""Snapshot entries named `state.<i>` are the state tree's tensors."""
SNAPSHOT_MODEL_MULTIPLE_MAX = 256
"""How many times its model's parameters and buffers a rank's snapshot may hold (`check_fits`). The
model's own tensors are there once at most; the rest is optimizer state. Adam with amsgrad keeps 3
tensors the size of each parameter; LBFGS keeps the most: 2 vectors as large as all the parameters
together, and a history of 2 more per iteration remembered (100 by default), 202 in all."""
SNAPSHOT_SLACK_BYTES = 64 * 1024 * 1024
"""A snapshot's bytes allowed on top of `SNAPSHOT_MODEL_MULTIPLE_MAX` times its model: the tensors of
registered objects (RNG states, a data loader's state, counters) and the alignment of small ones."""


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
    within_shard: bool = False
    """Among the replicas of this rank's shards (HSDP: its coordinate on the mesh's replicate
    dimension), not among all ranks of the group (DDP)."""

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
    shared_count: int = 0
    """The first `shared_count` tensors are this rank's partition of replicated state."""
    partition: Partition = WHOLE
    whole_bytes: int = 0
    """What the snapshot would hold without partitioning (every replicated tensor), for reports."""
    early_tensors: list[torch.Tensor] = field(default_factory=list)
    late_tensors: list[torch.Tensor] = field(default_factory=list)
    tree_count: int = 0
    """The last `tree_count` early tensors are the state tree's, which change at every capture."""

    def take_tree(self, tensors: Sequence[torch.Tensor]) -> None:
        """This capture's state-tree tensors (the same shapes and dtypes as the plan's)."""
        if len(tensors) != self.tree_count:
            raise ValueError(f"{len(tensors)} state-tree tensors for a plan of {self.tree_count}")
        if self.tree_count:
            self.early_tensors[-self.tree_count :] = tensors


@dataclass(frozen=True)
class StateTree:
    """One capture's state tree: its bytes and its tensors (see the module docstring)."""

    data: bytes
    tensors: list[torch.Tensor]

    @property
    def signature(self) -> tuple[tuple[tuple[int, ...], torch.dtype, torch.device], ...]:
        return tuple((tuple(t.shape), t.dtype, t.device) for t in self.tensors)


def capture_tree(module: nn.Module, optimizer: torch.optim.Optimizer | None, user: Mapping[str, Any]) -> StateTree:
    """Read the state tree now: param groups, the optimizer state that is not a top-level tensor, and
    each registered object's `state_dict()`. Raises `TreeError` naming a value it cannot hold."""
    groups: list[dict[str, Any]] = []
    optim: dict[int, dict[str, Any]] = {}
    if optimizer is not None:
        groups = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
        index = {id(p): i for i, p in enumerate(module.parameters())}
        local = local_optimizer(optimizer)
        for param, state in local.state.items():
            rest = {k: v for k, v in state.items() if not isinstance(v, torch.Tensor)}
            if rest:
                optim[index[id(param)]] = rest
    tree = {"groups": groups, "optim": optim, "user": {name: obj.state_dict() for name, obj in user.items()}}
    data, tensors = encode_tree(tree)
    return StateTree(data, tensors)


def tensor_state_ids(optimizer: torch.optim.Optimizer | None) -> tuple[int, ...]:
    """The identity of every top-level optimizer state tensor: a plan made for other tensors (an
    optimizer that replaces its state tensors, as LBFGS does, or state that appeared) is stale."""
    if optimizer is None:
        return ()
    local = local_optimizer(optimizer)
    tensors = (v for state in local.state.values() for v in state.values() if isinstance(v, torch.Tensor))
    return (id(local), *(id(t) for t in tensors))


def collect_sources(
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    partition: Partition = WHOLE,
    tree: StateTree | None = None,
) -> SnapshotSources:
    """The tensors of this rank's snapshot. With a partition of world_size > 1 the parameters (and an
    unsharded optimizer's state) are taken as replicated across ranks and only this rank's share is
    included; pass `WHOLE` unless the model is data-parallel. The state tree's tensors come last."""
    src = SnapshotSources(names=[], partition=partition)
    params = list(module.parameters())
    owners = replica_owners([_nbytes(local_tensor(p)) for p in params], partition.world_size)
    sharded = optimizer is not None and local_optimizer(optimizer) is not optimizer
    shared: list[tuple[str, torch.Tensor]] = []
    unique: list[tuple[str, torch.Tensor, bool]] = []
    for i, p in enumerate(params):
        src.whole_bytes += _nbytes(local_tensor(p))
        if owners[i] == partition.rank:
            shared.append((f"param.{i}", local_tensor(p)))
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
                        value = local_tensor(value)
                        src.whole_bytes += _nbytes(value)
                        if sharded:
                            unique.append((f"optim.{name}", value, False))
                        elif owners[index[id(p)]] == partition.rank:
                            shared.append((f"optim.{name}", value))
    for i, t in enumerate(tree.tensors if tree is not None else []):
        unique.append((f"{TREE_PREFIX}{i}", t, True))
    src.tree_count = len(tree.tensors) if tree is not None else 0
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


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of `tensor`: a DTensor's local shard (FSDP2 parameters and their optimizer
    state), a view of the same storage; any other tensor is its own part."""
    if isinstance(tensor, DTensor):
        local: torch.Tensor = tensor.to_local()
        return local
    return tensor


def _like_param(state: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """Optimizer state of a sharded (DTensor) parameter is a DTensor sharded as the parameter is."""
    if not isinstance(param, DTensor) or state.dim() == 0:
        return state
    return DTensor.from_local(state, param.device_mesh, param.placements, shape=param.shape, stride=param.stride())


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


@dataclass
class SnapshotMeta:
    step: int
    layout: SnapshotLayout
    rng: dict[str, Any]
    tree: bytes
    """The state tree (`capture_tree`); its tensors are the layout's `state.<i>` entries."""
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
        tree: StateTree,
        sources: SnapshotSources,
        extra: dict[str, Any],
    ) -> SnapshotMeta:
        return cls(step, layout, rng_state(), tree.data, dict(extra), sources.partition, sources.shared_count)

    def tree_tensor(self, snapshot: FlatBuffer, index: int) -> torch.Tensor:
        """The state tree's tensor `index`, copied out of `snapshot` (this rank's own)."""
        return snapshot.by_name[f"{TREE_PREFIX}{index}"].clone()

    def tree_count(self) -> int:
        return sum(spec.name.startswith(TREE_PREFIX) for spec in self.layout.specs)

    def decode_tree(self, snapshot: FlatBuffer) -> dict[str, Any]:
        """The state tree, its tensors copied out of `snapshot`. Raises ValueError if it is malformed."""
        tree = decode_tree(self.tree, lambda i: self.tree_tensor(snapshot, i), self.tree_count())
        if not isinstance(tree, dict) or not {"groups", "optim", "user"} <= tree.keys():
            raise ValueError("malformed state tree: not the map a capture writes")
        return tree

    def encode(self) -> bytes:
        data: bytes = msgpack.packb(
            {
                "step": self.step,
                "layout": self.layout.packed,
                "rng": self.rng,
                "tree": self.tree,
                "extra": self.extra,
                "partition": [self.partition.rank, self.partition.world_size, self.partition.within_shard],
                "shared_count": self.shared_count,
            },
            use_bin_type=True,
        )
        return data

    @classmethod
    def decode(cls, data: bytes) -> SnapshotMeta:
        try:
            m = msgpack.unpackb(data, raw=False, strict_map_key=False)
            rank, world_size, *flag = m["partition"]  # [rank, world] before HSDP's
            if len(flag) > 1 or not all(isinstance(f, bool) for f in flag):
                raise ValueError(f"partition {m['partition']!r}")
            meta = cls(
                step=int(m["step"]),
                layout=SnapshotLayout.unpack(m["layout"]),
                rng=dict(m["rng"]),
                tree=bytes(m["tree"]),
                extra=dict(m["extra"]),
                partition=Partition(int(rank), int(world_size), bool(flag) and flag[0]),
                shared_count=int(m["shared_count"]),
            )
        except (KeyError, TypeError, ValueError, msgpack.UnpackException) as exc:
            raise ValueError(f"malformed snapshot metadata: {exc}") from None
        if not 0 <= meta.shared_count <= len(meta.layout.specs):
            raise ValueError("malformed snapshot metadata: shared_count outside the layout")
        return meta


def snapshot_bytes_max(module: nn.Module) -> int:
    """The most bytes a rank's snapshot of `module` may hold: `SNAPSHOT_MODEL_MULTIPLE_MAX` times its
    parameters and buffers (each as it is laid out, aligned), and `SNAPSHOT_SLACK_BYTES`."""
    tensors = [*module.parameters(), *module.buffers()]
    own = sum(aligned_bytes(t.numel() * t.element_size()) for t in tensors)  # a DTensor's numel is the whole
    return SNAPSHOT_MODEL_MULTIPLE_MAX * own + SNAPSHOT_SLACK_BYTES


def check_fits(module: nn.Module, layout: SnapshotLayout, sharded: bool = False) -> None:
    """Raise ValueError, saying why, unless `layout` can be a snapshot of `module`. Checked on a fetched
    snapshot's layout before its buffer is allocated or a byte of it received, so a snapshot of another
    model, a mangled layout or one larger than this model's is never loaded:
    - every parameter and buffer it holds is one of `module`'s, with its shape and dtype (`sharded`, a
      model sharded with fully_shard: a local shard, of at most the whole tensor's elements);
    - every optimizer state tensor belongs to one of `module`'s parameters and holds at most as many
      elements as all of them together (LBFGS's flat vectors, the largest torch.optim keeps);
    - every other entry is one of the state tree's;
    - it holds `snapshot_bytes_max(module)` bytes at most.
    The layout's own consistency (each entry's bytes from its shape and dtype, the total from its
    entries) is checked when it is decoded (`SnapshotLayout.from_fields`)."""
    params = list(module.parameters())
    tensors: dict[str, torch.Tensor] = {f"param.{i}": p for i, p in enumerate(params)}
    tensors |= {f"buffer.{i}": t for i, t in enumerate(module.buffers())}
    param_elements = sum(p.numel() for p in params)
    for spec in layout.specs:
        kind, _, rest = spec.name.partition(".")
        elements = math.prod(spec.shape)
        if kind == "optim":
            index, _, key = rest.partition(".")
            if f"param.{index}" not in tensors or not key:
                raise ValueError(f"snapshot holds {spec.name}, optimizer state of no parameter of the model")
            if elements > param_elements:
                raise ValueError(
                    f"snapshot's {spec.name} holds {elements} elements, the model's parameters {param_elements}"
                )
        elif kind in ("param", "buffer"):
            own = tensors.get(spec.name)
            if own is None:
                raise ValueError(f"snapshot holds {spec.name}, which the model does not have")
            if sharded:
                if elements > own.numel():
                    raise ValueError(f"snapshot's {spec.name} holds {elements} elements, the model's {own.numel()}")
                continue
            own = local_tensor(own)
            dtype = str(own.dtype).removeprefix("torch.")
            if tuple(own.shape) != spec.shape or dtype != spec.dtype:
                raise ValueError(
                    f"snapshot's {spec.name} is {spec.shape}/{spec.dtype}, the model's {tuple(own.shape)}/{dtype}"
                )
        elif f"{kind}." != TREE_PREFIX or not rest.isdigit():
            raise ValueError(f"snapshot holds {spec.name}, an entry no capture writes")
    if layout.total_bytes > snapshot_bytes_max(module):
        raise ValueError(
            f"snapshot of {layout.total_bytes} bytes is larger than this model's can be "
            f"({snapshot_bytes_max(module)}: {SNAPSHOT_MODEL_MULTIPLE_MAX} times its parameters and buffers "
            f"and {SNAPSHOT_SLACK_BYTES} bytes)"
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
    dst = [local_tensor(p) for p in params] + buffers
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
    tree: Mapping[str, Any],
    take_buffers: bool = False,
) -> None:
    """Give an optimizer the state held by `parts` (its top-level state tensors) and by the decoded
    state `tree` (`SnapshotMeta.decode_tree`: param groups, non-tensor and nested state). Whatever
    state it held before is dropped.

    State tensors are copied out of the parts, into the tensors the optimizer held before where they
    fit (`_copied_into_held`), unless `take_buffers`: then CPU state tensors are views into them (no
    allocation, no copy: a spare restoring from a store owns the buffer it fetched into, and keeps it
    alive this way). Never take buffers that will be reused (the snapshot ping-pong slots).
    """
    params = list(module.parameters())
    local = local_optimizer(optimizer)
    group_of = {id(p): group for group in local.param_groups for p in group["params"]}
    held = {id(param): dict(state) for param, state in local.state.items()}
    local.state.clear()
    for part in parts:
        for name, view in part.by_name.items():
            kind, _, rest = name.partition(".")
            if kind != "optim":
                continue
            index, _, key = rest.partition(".")
            param = params[int(index)]
            if id(param) not in group_of:
                raise ValueError(
                    f"snapshot holds optimizer state for parameter {index}, which this rank's optimizer does not "
                    "own (the optimizer's partition differs from the snapshot's rank)"
                )
            device = state_device(key, view, param, group_of[id(param)])
            if device != view.device:
                value = view.to(device)
            elif take_buffers:
                value = view
            else:
                value = _copied_into_held(held.get(id(param), {}).get(key), view)
            local.state[param][key] = _like_param(value, param)
    for index, state in tree["optim"].items():
        if not isinstance(index, int) or not 0 <= index < len(params) or not isinstance(state, dict):
            raise ValueError(f"malformed state tree: optimizer state of parameter {index!r}")
        param = params[index]
        if id(param) not in group_of:
            raise ValueError(f"snapshot holds optimizer state for parameter {index}, not this rank's optimizer's")
        local.state[param].update(state)
    groups = tree["groups"]
    if not isinstance(groups, list) or len(groups) != len(optimizer.param_groups):
        raise ValueError("snapshot and optimizer have different numbers of param groups")
    for group, saved in zip(optimizer.param_groups, groups, strict=True):
        if not isinstance(saved, dict):
            raise ValueError("malformed state tree: a param group that is not a map")
        for key, value in saved.items():
            _set_hyperparameter(group, key, value)


def _copied_into_held(held: object, view: torch.Tensor) -> torch.Tensor:
    """`view`'s values in the state tensor the optimizer held before (`held`), when it is a plain
    tensor of the same shape, dtype and device: memory the optimizer has touched already. Else a clone,
    in fresh memory: a survivor's restore from its own buffers spent 1.2 s of a 1 GB rank's rebuild
    allocating and faulting in 0.67 GB of AdamW moments it already had."""
    fits = (
        type(held) is torch.Tensor
        and held.shape == view.shape
        and held.dtype == view.dtype
        and held.device == view.device
        and held.is_contiguous()
        and held.data_ptr() != view.data_ptr()
    )
    if not fits:
        return view.clone()
    assert isinstance(held, torch.Tensor)
    with torch.no_grad():
        held.copy_(view)
    return held


def state_device(key: str, value: torch.Tensor, param: torch.Tensor, group: Mapping[str, Any]) -> torch.device:
    """Where a restored optimizer state tensor lives, by torch's own rule (`Optimizer.load_state_dict`):
    a step count stays where it is (the CPU) unless the group is fused or capturable, whose kernels read
    it on the parameter's device; any other state is on the parameter's device. (A fused CUDA AdamW
    refuses a step count on the CPU: the first GPU run of `bench/scale.py` met it after a swap.)"""
    if key == "step" and value.dim() == 0 and not (group.get("fused") or group.get("capturable")):
        return value.device
    return param.device


def _set_hyperparameter(group: dict[str, Any], key: str, value: Any) -> None:
    """A tensor hyper-parameter (Adam's tensor `lr`) is copied into the group's own tensor, which
    compiled or capturable steps may hold on to; anything else is set."""
    current = group.get(key)
    if (
        isinstance(current, torch.Tensor)
        and isinstance(value, torch.Tensor)
        and current.shape == value.shape
        and current.dtype == value.dtype
    ):
        with torch.no_grad():
            current.copy_(value)
    else:
        group[key] = value


def load_user_state(objects: Mapping[str, Any], tree: Mapping[str, Any]) -> None:
    """Give every registered object its state from a decoded state tree (`load_state_dict`). A
    snapshot that holds other objects than those registered is refused: another script took it."""
    user = tree["user"]
    if not isinstance(user, dict) or set(user) != set(objects):
        known = sorted(user) if isinstance(user, dict) else user
        raise ValueError(f"snapshot holds state of {known}, the job registered {sorted(objects)}")
    for name, obj in objects.items():
        obj.load_state_dict(user[name])
        if isinstance(obj, torch.amp.GradScaler):  # a step abandoned between unscale_() and update()
            obj._per_optimizer_states.clear()


def snapshot_now(
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    step: int,
    partition: Partition = WHOLE,
    user: Mapping[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
) -> tuple[FlatBuffer, SnapshotMeta]:
    """A snapshot taken on the spot, in a buffer of its own, with its decoded metadata: what the job's
    capture stores, without the background copy (tests, benchmarks, tools)."""
    tree = capture_tree(module, optimizer, user or {})
    sources = collect_sources(module, optimizer, partition, tree)
    layout = plan_layout(list(zip(sources.names, sources.tensors, strict=True)))
    buffer = FlatBuffer(layout)
    with torch.no_grad():
        torch._foreach_copy_(buffer.views, sources.tensors)
    meta = SnapshotMeta.capture(step, layout, tree, sources, extra or {})
    return buffer, SnapshotMeta.decode(meta.encode())
