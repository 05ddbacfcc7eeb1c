"""What a rebuild reads of the member, and what it gives back: two frozen records, so that the rebuild
(`member_rebuild`) never writes the job's fields itself; the job applies a result in one place."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from deadpool_protocol import StoreAddress

__all__ = ["MemberState", "RebuildResult"]


@dataclass(frozen=True)
class MemberState:
    """Where the member stood when a rebuild began."""

    rank: int | None
    """None while a spare."""
    generation: int
    completed_step: int
    """The newest step it completed (NO_STEP if none)."""


@dataclass(frozen=True)
class RebuildResult:
    """A rank of a new generation, ready to train: what the job adopts before the rebuild's last states."""

    rank: int
    world_size: int
    generation: int
    step: int
    """The step training goes on from (the restored one, or where a formation starts)."""
    placement: tuple[StoreAddress, ...]
    """The stores this rank's snapshots go to, in order."""
    model: Any
    """The wrapped model (typed Any: whatever the wrapper returned)."""
    optimizer: torch.optim.Optimizer
    extra_state: dict[str, Any] | None
    """The restored `Job.extra_state`, or None if nothing was restored (a formation from scratch)."""
