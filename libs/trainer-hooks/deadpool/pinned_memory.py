"""Host memory page-locked for CUDA copies, exactly as large as asked.

torch's `pin_memory=True` allocates through its caching host allocator, which rounds each block up to
a power of two: a 1.65 GB snapshot slot took 2 GiB of page-locked memory, and three slots per rank
took 6 GiB for 5 GB of snapshots. Here a buffer is one anonymous mapping of exactly its size,
registered with CUDA (`cudaHostRegister`, as the crash copy's shared-memory files already are: it
locks, and so faults in, every page) and unregistered when its tensor is freed. No `MAP_POPULATE`:
`mmap` holds the GIL for the whole populate, seconds per GB on a cold VM, and the member's control
thread (its heartbeats) would wait that long. CUDA only: nothing here
runs without a GPU, and the callers ask for it only when the model's tensors are on one.
"""

from __future__ import annotations

import mmap
import weakref
from typing import Any

import torch

__all__ = ["pinned_bytes", "register_with_cuda"]


def pinned_bytes(nbytes: int) -> torch.Tensor:
    """A 1-D uint8 host tensor of exactly `nbytes` (at least 1), page-locked for CUDA copies."""
    mapped = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    data = torch.frombuffer(mapped, dtype=torch.uint8)  # the tensor keeps the mapping alive
    register_with_cuda(data)
    return data


def register_with_cuda(data: torch.Tensor) -> None:
    """Page-lock `data`'s memory (as `pin_memory` does for an allocation), so that copies between it
    and the device run at pinned speed; unregistered when the tensor is freed."""
    cudart: Any = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    pointer, size = data.data_ptr(), data.numel()
    error = cudart.cudaHostRegister(pointer, size, 0)
    if int(error) != 0:
        raise OSError(f"cudaHostRegister of {size} bytes failed ({error})")
    weakref.finalize(data, cudart.cudaHostUnregister, pointer)
