"""What a snapshot holds, and how it is taken from and put back into a model and its optimizer.

Tensors: the unwrapped module's parameters and buffers, and this rank's optimizer state (for a
`ZeroRedundancyOptimizer`, the local shard's state, which exists nowhere else). Metadata (msgpack):
the step, the RNG states (torch, CUDA, Python, NumPy), the optimizer's param-group hyper-parameters
and non-tensor state, and the user's `extra` dict. Parameters are referred to by their index in
`module.parameters()`, which is the same on every rank and across restarts of the same script.
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from deadpool.snapshot_layout import FlatBuffer, SnapshotLayout

__all__ = [
    "SnapshotMeta",
    "SnapshotSources",
    "collect_sources",
    "load_module",
    "load_optimizer",
    "local_optimizer",
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


def collect_sources(module: nn.Module, optimizer: torch.optim.Optimizer | None) -> SnapshotSources:
    src = SnapshotSources(names=[])

    def add(name: str, tensor: torch.Tensor, early: bool) -> None:
        (src.early if early else src.late).append(len(src.tensors))
        src.names.append(name)
        src.tensors.append(tensor.detach())

    params = list(module.parameters())
    for i, p in enumerate(params):
        add(f"param.{i}", p, early=False)
    for i, b in enumerate(module.buffers()):
        add(f"buffer.{i}", b, early=True)
    if optimizer is not None:
        index = {id(p): i for i, p in enumerate(params)}
        local = local_optimizer(optimizer)
        for group in local.param_groups:
            for p in group["params"]:
                for key, value in sorted(local.state.get(p, {}).items()):
                    name = f"{index[id(p)]}.{key}"
                    if isinstance(value, torch.Tensor):
                        add(f"optim.{name}", value, early=False)
                    elif isinstance(value, _SCALARS):
                        src.scalars[name] = value
    return src


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": bytes(torch.get_rng_state().tolist())}
    version, internal, gauss = random.getstate()
    state["python"] = [version, list(internal), gauss]
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = [bytes(s.tolist()) for s in torch.cuda.get_rng_state_all()]
    np = sys.modules.get("numpy")
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = [kind, keys.tobytes(), int(pos), int(has_gauss), float(cached)]
    return state


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(torch.tensor(list(state["torch"]), dtype=torch.uint8))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(list(s), dtype=torch.uint8) for s in state["cuda"]])
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
        return cls(step, layout, rng_state(), groups, dict(sources.scalars), dict(extra))

    def encode(self) -> bytes:
        data: bytes = msgpack.packb(
            {
                "step": self.step,
                "layout": self.layout.to_fields(),
                "rng": self.rng,
                "param_groups": self.param_groups,
                "optim_scalars": self.optim_scalars,
                "extra": self.extra,
            },
            use_bin_type=True,
        )
        return data

    @classmethod
    def decode(cls, data: bytes) -> SnapshotMeta:
        try:
            m = msgpack.unpackb(data, raw=False, strict_map_key=False)
            return cls(
                step=int(m["step"]),
                layout=SnapshotLayout.from_fields(m["layout"]),
                rng=dict(m["rng"]),
                param_groups=list(m["param_groups"]),
                optim_scalars=dict(m["optim_scalars"]),
                extra=dict(m["extra"]),
            )
        except (KeyError, TypeError, ValueError, msgpack.UnpackException) as exc:
            raise ValueError(f"malformed snapshot metadata: {exc}") from None


def load_module(module: nn.Module, snapshot: FlatBuffer) -> None:
    """Copy the snapshot's parameters and buffers into `module` (and clear gradients)."""
    params = list(module.parameters())
    buffers = list(module.buffers())
    dst: list[torch.Tensor] = []
    src: list[torch.Tensor] = []
    for name, view in snapshot.by_name.items():
        kind, _, index = name.partition(".")
        if kind == "param":
            dst.append(params[int(index)])
        elif kind == "buffer":
            dst.append(buffers[int(index)])
        else:
            continue
        src.append(view)
    expected = len(params) + len(buffers)
    if len(dst) != expected:
        raise ValueError(f"snapshot holds {len(dst)} parameters and buffers, the model has {expected}")
    with torch.no_grad():
        for d, s in zip(dst, src, strict=True):
            if d.shape != s.shape or d.dtype != s.dtype:
                raise ValueError(f"snapshot tensor {tuple(s.shape)}/{s.dtype} does not fit {tuple(d.shape)}/{d.dtype}")
        torch._foreach_copy_(dst, src)
    for p in params:
        p.grad = None


def load_optimizer(
    module: nn.Module, optimizer: torch.optim.Optimizer, snapshot: FlatBuffer, meta: SnapshotMeta
) -> None:
    """Give a freshly built optimizer the snapshot's state: tensors (cloned) and hyper-parameters."""
    params = list(module.parameters())
    local = local_optimizer(optimizer)
    owned = {id(p) for group in local.param_groups for p in group["params"]}
    local.state.clear()
    for name, view in snapshot.by_name.items():
        kind, _, rest = name.partition(".")
        if kind != "optim":
            continue
        index, _, key = rest.partition(".")
        param = params[int(index)]
        if id(param) not in owned:
            raise ValueError(
                f"snapshot holds optimizer state for parameter {index}, which this rank's optimizer does not own "
                "(the optimizer's partition differs from the snapshot's rank)"
            )
        local.state[param][key] = view.clone().to(param.device if view.dim() > 0 else view.device)
    for name, value in meta.optim_scalars.items():
        index, _, key = name.partition(".")
        local.state[params[int(index)]][key] = value
    if len(meta.param_groups) != len(optimizer.param_groups):
        raise ValueError("snapshot and optimizer have different numbers of param groups")
    for group, saved in zip(optimizer.param_groups, meta.param_groups, strict=True):
        for key, value in saved.items():
            group[key] = tuple(value) if isinstance(group.get(key), tuple) else value
