"""Refusing DDP settings that would make results after a swap differ from an uninterrupted run."""

from __future__ import annotations

from torch import nn
from torch.nn.parallel import DistributedDataParallel

__all__ = ["BucketRebuildError", "check_wrapped"]


class BucketRebuildError(ValueError):
    """A DDP wrapper that rebuilds its gradient buckets would break bit-identical recovery."""


def check_wrapped(model: nn.Module) -> None:
    """Refuse DDP settings that make results after a swap differ from an uninterrupted run.

    DDP rebuilds its gradient buckets after the first iteration, in gradient-ready order. After a swap
    every rank re-wraps (its process group changed), and a fresh wrapper starts from the initial
    layout: the first step after the swap then reduces gradients grouped differently from the
    uninterrupted run, and floating-point sums come out different in the last bits.
    `find_unused_parameters=True` (without `static_graph`) keeps the initial layout for the whole run,
    on every rank and in every generation, so every run reduces the same way.
    """
    if isinstance(model, DistributedDataParallel) and (not model.find_unused_parameters or model.static_graph):
        raise BucketRebuildError(
            "DistributedDataParallel rebuilds its gradient buckets after the first iteration, so a rank "
            "re-wrapped after a swap would reduce gradients in a different order and the weights would "
            "no longer be bit-identical to an uninterrupted run. Wrap with "
            "DDP(module, process_group=pg, find_unused_parameters=True) (and without static_graph): it "
            "keeps one bucket layout for the whole run, at the cost of one autograd-graph traversal per step."
        )
