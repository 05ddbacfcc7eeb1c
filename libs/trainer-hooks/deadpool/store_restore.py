"""A rank's snapshot fetched from the stores: each copy checked before anything is allocated for it,
verified before it is used, and the next copy tried when one is refused.

A store's copy is refused, with its reason logged, and the next store tried, when:
- the store has none, fails, or does not finish within the fetch's deadline (`FetchDeadline`);
- it is of another generation than the one that committed the step;
- its layout does not fit this member's model (`check_fits`): another model's, a mangled one, or
  larger than a snapshot of this model can be. This is checked before its buffer is allocated;
- its buffer cannot be allocated all the same (the allocator raises: the host is short of memory);
- a chunk fails its checksum.
The generation's supersession ends the fetch in progress at once (`breakable`).

A warm spare's fetch lands in the buffer it faulted in while it waited (`landing`,
`deadpool.spare_landing`), so that its restore does not pay the first touch of fresh memory; the
stores tried after a refused copy reuse that buffer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from deadpool.snapshot_layout import FlatBuffer
from deadpool.store_client import FetchDeadline, StoreClientError, StoreConnection
from deadpool.training_state import SnapshotMeta, check_fits
from deadpool_protocol import StoreAddress
from deadpool_protocol.errors import DeadPoolError

__all__ = ["Breakable", "Landing", "NoStoreCopyError", "SnapshotWanted", "fetch_from_stores", "stores_in_order"]

Breakable = Callable[[Callable[[], None]], AbstractContextManager[None]]
"""Runs a fetch as a wait of the generation, given the fetch's abort (`GenerationWaits.breakable`)."""
Landing = Callable[[int], torch.Tensor | None]
"""A buffer of exactly the given bytes to fetch into, or None (`SpareLanding.take`)."""


class NoStoreCopyError(DeadPoolError):
    """No store provided a copy that could be used; the text gives each store's reason."""


@dataclass(frozen=True)
class SnapshotWanted:
    job: str
    rank: int
    step: int
    generation: int = 0
    """The generation that committed `step`: another's copy is refused (0: any)."""
    traceparent: str = ""


def stores_in_order(stores: Sequence[StoreAddress], preferred: Sequence[str]) -> list[StoreAddress]:
    """`stores`, those named in `preferred` (a rank's placement) first, in its order."""
    return sorted(stores, key=lambda s: preferred.index(s.store) if s.store in preferred else len(preferred))


def fetch_from_stores(
    wanted: SnapshotWanted,
    stores: Sequence[StoreAddress],
    module: nn.Module,
    log: Any,
    *,
    token: bytes = b"",
    seal_key: bytes = b"",
    pin: bool = False,
    sharded: bool = False,
    breakable: Breakable = lambda _abort: contextlib.nullcontext(),
    deadline: FetchDeadline | None = None,
    landing: Landing | None = None,
) -> tuple[FlatBuffer, SnapshotMeta, str]:
    """The first copy of `wanted` that a store in `stores` (in that order) provides and that fits
    `module`: its buffer (pinned if `pin`, or `landing`'s), its metadata, and the store's name.
    `sharded`: `module` is sharded with fully_shard, and a snapshot holds its local shards. Raises
    NoStoreCopyError."""
    errors: list[str] = []
    landed: list[torch.Tensor] = []
    """`landing`'s buffer once taken, for every store's copy (they have the same size)."""

    def data_for(nbytes: int) -> torch.Tensor | None:
        if not landed and landing is not None and (got := landing(nbytes)) is not None:
            landed.append(got)
        return next((t for t in landed if t.numel() == nbytes), None)

    for address in stores:
        landing_of = _Landing(wanted.step, module, pin, sharded, data_for)
        connection = StoreConnection(address, token=token, seal_key=seal_key)
        try:
            with breakable(connection.abort):
                connection.fetch(
                    wanted.job, wanted.rank, wanted.step, landing_of, wanted.generation, wanted.traceparent, deadline
                )
        except (StoreClientError, ValueError) as exc:
            log.warning("store's copy refused; trying the next", store=address.store, reason=str(exc))
            errors.append(str(exc))
            continue
        finally:
            connection.close()
        assert landing_of.buffer is not None and landing_of.meta is not None
        log.info("snapshot fetched", store=address.store, step=wanted.step, skipped=errors)
        return landing_of.buffer, landing_of.meta, address.store
    raise NoStoreCopyError(f"no store could provide rank {wanted.rank} step {wanted.step}: {'; '.join(errors)}")


class _Landing:
    """The `destination` of one store's fetch: checks the copy's metadata against the model, and only
    then allocates its buffer (or takes the landing's: `data_for`)."""

    def __init__(
        self, step: int, module: nn.Module, pin: bool, sharded: bool, data_for: Callable[[int], torch.Tensor | None]
    ) -> None:
        self.step = step
        self.module = module
        self.pin = pin
        self.sharded = sharded
        self.data_for = data_for
        self.buffer: FlatBuffer | None = None
        self.meta: SnapshotMeta | None = None

    def __call__(self, meta_bytes: bytes, total_bytes: int) -> memoryview:
        try:
            meta = SnapshotMeta.decode(meta_bytes)
            if meta.step != self.step or meta.layout.total_bytes != total_bytes:
                raise StoreClientError(f"store sent step {meta.step} of {total_bytes} bytes, not step {self.step}")
            check_fits(self.module, meta.layout, self.sharded)
        except ValueError as exc:
            raise StoreClientError(f"store's snapshot does not fit this model: {exc}") from exc
        try:
            buffer = FlatBuffer(meta.layout, pin=self.pin, data=self.data_for(total_bytes))
        except (MemoryError, RuntimeError) as exc:  # torch's allocator raises RuntimeError
            raise StoreClientError(f"no memory for the store's snapshot of {total_bytes} bytes: {exc}") from exc
        self.buffer, self.meta = buffer, meta
        return buffer.bytes_view()
