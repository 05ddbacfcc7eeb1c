"""Where each tensor of a snapshot lives inside one flat byte buffer.

A snapshot is a single contiguous byte buffer: every tensor at an aligned offset, so capture is one
`torch._foreach_copy_` into views of the buffer, streaming is slicing it into chunks, and restore is one
`_foreach_copy_` back. The layout travels in the snapshot's manifest, so the restoring side needs no
knowledge of the sender beyond the tensor names.
"""

from __future__ import annotations

import ctypes
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import torch

from deadpool.pinned_memory import pinned_bytes

__all__ = ["ALIGN_BYTES", "FlatBuffer", "SnapshotLayout", "TensorSpec", "aligned_bytes", "plan_layout"]

ALIGN_BYTES = 64

_DTYPES: dict[str, torch.dtype] = {
    str(dt).removeprefix("torch."): dt
    for dt in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class SnapshotLayout:
    specs: tuple[TensorSpec, ...]
    total_bytes: int

    def to_fields(self) -> dict[str, Any]:
        return {
            "total_bytes": self.total_bytes,
            "specs": [[s.name, s.dtype, list(s.shape), s.offset, s.nbytes] for s in self.specs],
        }

    @classmethod
    def from_fields(cls, fields: dict[str, Any]) -> SnapshotLayout:
        try:
            specs = tuple(
                TensorSpec(str(name), str(dtype), tuple(int(d) for d in shape), int(offset), int(nbytes))
                for name, dtype, shape, offset, nbytes in fields["specs"]
            )
            layout = cls(specs, int(fields["total_bytes"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed snapshot layout: {exc}") from None
        layout._check_planned()
        return layout

    def _check_planned(self) -> None:
        """Raise ValueError unless this is the layout `plan_layout` makes of its own entries: each
        entry's bytes are its shape times its dtype's size, at the next aligned offset, and the total
        ends with the last one. So the same names, dtypes and shapes mean the same bytes, and a
        received layout claims no byte its entries do not hold (the total is what gets allocated)."""
        offset = 0
        for s in self.specs:
            if s.dtype not in _DTYPES or any(d < 0 for d in s.shape):
                raise ValueError(f"malformed snapshot layout entry {s.name}: {s.shape}/{s.dtype}")
            nbytes = math.prod(s.shape) * _DTYPES[s.dtype].itemsize
            if (s.offset, s.nbytes) != (offset, nbytes):
                raise ValueError(
                    f"malformed snapshot layout entry {s.name}: {s.nbytes} bytes at {s.offset}, where "
                    f"{s.shape}/{s.dtype} takes {nbytes} at {offset}"
                )
            offset += aligned_bytes(nbytes)
        if self.total_bytes != offset:
            raise ValueError(f"malformed snapshot layout: {self.total_bytes} bytes, its entries end at {offset}")

    @functools.cached_property
    def packed(self) -> bytes:
        """The layout as msgpack, encoded once: every snapshot's manifest carries it."""
        data: bytes = msgpack.packb(self.to_fields(), use_bin_type=True)
        return data

    @classmethod
    def unpack(cls, packed: bytes) -> SnapshotLayout:
        try:
            fields = msgpack.unpackb(packed, raw=False)
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
            raise ValueError(f"malformed snapshot layout: {exc}") from None
        if not isinstance(fields, dict):
            raise ValueError("malformed snapshot layout: not a map")
        return cls.from_fields(fields)

    def names(self) -> list[str]:
        return [s.name for s in self.specs]


def plan_layout(named: Sequence[tuple[str, torch.Tensor]]) -> SnapshotLayout:
    specs = []
    offset = 0
    for name, tensor in named:
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype not in _DTYPES:
            raise TypeError(f"cannot snapshot tensor {name} of dtype {tensor.dtype}")
        nbytes = tensor.numel() * tensor.element_size()
        specs.append(TensorSpec(name, dtype, tuple(tensor.shape), offset, nbytes))
        offset += aligned_bytes(nbytes)
    return SnapshotLayout(tuple(specs), offset)


def aligned_bytes(nbytes: int) -> int:
    """`nbytes` rounded up to the next `ALIGN_BYTES`: what an entry of that size takes in a buffer."""
    return (nbytes + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


class FlatBuffer:
    """A host buffer for one layout, with a typed view per tensor (pinned when CUDA is in use)."""

    def __init__(self, layout: SnapshotLayout, pin: bool = False, data: torch.Tensor | None = None) -> None:
        """A new host buffer for `layout`, or views over `data` (a uint8 tensor of at least its size,
        on any device)."""
        self.layout = layout
        size = max(layout.total_bytes, 1)
        if data is None:  # pinned: exactly sized (`pinned_memory`), not rounded up to a power of two
            data = pinned_bytes(size) if pin else torch.empty(size, dtype=torch.uint8)
        elif data.dtype != torch.uint8 or data.dim() != 1 or data.numel() < layout.total_bytes:
            raise ValueError(f"a buffer for {layout.total_bytes} bytes needs a 1-D uint8 tensor at least that long")
        self.data = data
        self.views: list[torch.Tensor] = [
            self.data[s.offset : s.offset + s.nbytes].view(_DTYPES[s.dtype]).view(s.shape) for s in layout.specs
        ]
        self.by_name = dict(zip(layout.names(), self.views, strict=True))

    def bytes_view(self) -> memoryview:
        """The buffer's bytes, zero-copy (valid while this object lives; host buffers only)."""
        if self.data.device.type != "cpu":
            raise ValueError("bytes_view() needs a host buffer")
        n = self.layout.total_bytes
        if n == 0:
            return memoryview(b"")
        raw = (ctypes.c_ubyte * n).from_address(self.data.data_ptr())
        return memoryview(raw).cast("B")
