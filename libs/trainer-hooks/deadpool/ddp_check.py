"""Refusing DDP settings that would make results after a swap differ from an uninterrupted run."""

from __future__ import annotations

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from deadpool_protocol.errors import DeadPoolError

__all__ = ["BucketRebuildError", "check_wrapped", "find_ddp"]

WRAPPERS_MAX = 8
"""How many wrappers deep a DDP is looked for (torch.compile's, and the like)."""


class BucketRebuildError(DeadPoolError, ValueError):
    """A DDP wrapper that rebuilds its gradient buckets would break bit-identical recovery."""


def find_ddp(model: nn.Module) -> DistributedDataParallel | None:
    """The DDP inside `model`, through the wrappers that keep the wrapped module as an attribute:
    `torch.compile`'s (`_orig_mod`) and any that follows the `module` convention of DDP itself."""
    current: object = model
    for _ in range(WRAPPERS_MAX):
        if isinstance(current, DistributedDataParallel):
            return current
        inner = getattr(current, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            inner = getattr(current, "module", None)
        if not isinstance(inner, nn.Module):
            return None
        current = inner
    return None


def check_wrapped(model: nn.Module) -> None:
    """Refuse DDP settings that make results after a swap differ from an uninterrupted run.

    DDP rebuilds its gradient buckets after the first iteration, in gradient-ready order. After a swap
    every rank re-wraps (its process group changed), and a fresh wrapper starts from the initial
    layout: the first step after the swap then reduces gradients grouped differently from the
    uninterrupted run, and floating-point sums come out different in the last bits.
    `find_unused_parameters=True` (without `static_graph`) keeps the initial layout for the whole run,
    on every rank and in every generation, so every run reduces the same way.
    """
    ddp = find_ddp(model)  # wrapped too: torch.compile(DDP(...))
    if ddp is not None and (not ddp.find_unused_parameters or ddp.static_graph):
        raise BucketRebuildError(
            "DistributedDataParallel rebuilds its gradient buckets after the first iteration, so a rank "
            "re-wrapped after a swap would reduce gradients in a different order and the weights would "
            "no longer be bit-identical to an uninterrupted run. Wrap with "
            "DDP(module, process_group=pg, find_unused_parameters=True) (and without static_graph): it "
            "keeps one bucket layout for the whole run, at the cost of one autograd-graph traversal per step."
        )
