"""The ranks of a new group agree on one step they all have: the newest that every one of them holds.

Used where no store can say which step is whole everywhere: a job resumed from the durable tier (the
newest step each rank has persisted and intact), and a job whose training was held while every store
was lost (the newest step each rank holds in its own ping-pong buffers). Each round every rank proposes
its newest step at or below the bound; the minimum becomes the bound; when every rank proposes the same
step, that is the one. A rank with nothing at or below the bound proposes NO_STEP, and then so does the
answer: there is no step they all have.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["NO_STEP", "agree_on_newest"]

NO_STEP = -1


def agree_on_newest(
    steps: Sequence[int], group: Any, device: torch.device, usable: Callable[[int], bool] = lambda _step: True
) -> int:
    """With every rank of `group`: the newest step that each rank has among its `steps` (and finds
    `usable`, tried newest first); NO_STEP if they have none in common. Collective: every rank calls it."""
    candidates = sorted(set(steps), reverse=True)
    refused: set[int] = set()
    bound = candidates[0] if candidates else NO_STEP
    while True:
        mine = NO_STEP
        for step in (s for s in candidates if s <= bound and s not in refused):
            if usable(step):
                mine = step
                break
            refused.add(step)
        low = torch.tensor([mine], dtype=torch.int64, device=device)
        high = low.clone()
        dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
        dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
        agreed, top = int(low.item()), int(high.item())
        if agreed in (NO_STEP, top):
            return agreed
        bound = agreed
