"""Which state a rebuild restores: the fallback chain, as a pure choice.

    1. committed       the committed step: survivors hold it in their own buffers, and every rank
                       given to a newcomer has a live store holding it;
    2. older_committed the committed step before it, which stores keep too: every rank needs a live
                       store holding it (survivors' buffers have moved on);
    3. durable         the durable tier's files: the ranks agree on the newest step they all have
                       intact (`Rebuild.durable`); members without a durable tier end the job, saying so.

A link is skipped when the swapper knows no live copy for some rank, and when a member reported it
could not get that copy (`RebuildAck` with source 'unavailable': the swapper's view of the stores lags
by up to their timeout). The choice and its reason go into every incident it closes. Survivors' own
copies of replicated state are not a link of their own: a rank's snapshot holds its unique state
(an optimizer shard) that no survivor has, so a rank is restored whole or not at all.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["CommittedCopies", "RestoreChoice", "RestoreLink", "choose_restore"]

NO_STEP = -1


@dataclass
class CommittedCopies:
    """A committed step, the generation that made it, and which stores hold each rank's snapshot of it."""

    step: int = NO_STEP
    generation: int = 0
    holders: dict[int, set[str]] = field(default_factory=dict)


class RestoreLink(enum.StrEnum):
    """Where a rebuild's state comes from (its value names it in incidents and logs)."""

    FRESH = "fresh"
    """The job has not formed yet: a fresh start."""
    COMMITTED = "committed"
    OLDER_COMMITTED = "older_committed"
    LOCAL = "local"
    """The ranks agree on the newest step they all hold in their own buffers (no store holds it)."""
    DURABLE = "durable"

    @property
    def survivors_hold_it(self) -> bool:
        """A survivor still holds this link's step in its own buffers (they have moved on past an
        older one), so only the ranks given to newcomers need a live store holding it."""
        return self is RestoreLink.COMMITTED


@dataclass(frozen=True)
class RestoreChoice:
    step: int
    generation: int
    link: RestoreLink
    reason: str

    @property
    def durable(self) -> bool:
        return self.link is RestoreLink.DURABLE

    @property
    def local(self) -> bool:
        return self.link is RestoreLink.LOCAL


def _suspects(
    step: int,
    survivors_hold_it: bool,
    ranks: Sequence[str],
    newcomers: set[str],
    unavailable: set[tuple[int, int]],
    world_size: int,
) -> list[int]:
    """The ranks that may lack a copy of `step`, in order: every rank, or, where survivors restore
    from their own buffers, only those a member reported unavailable, the ranks no member holds and
    the newcomers' (a scan of every rank's holders was half of a swap's decision at 16,384 ranks)."""
    if not survivors_hold_it:
        return list(range(world_size))
    suspects = {rank for rank, at in unavailable if at == step}
    suspects.update(range(len(ranks), world_size))
    suspects.update(ranks.index(member) for member in newcomers if member in ranks)
    return sorted(rank for rank in suspects if 0 <= rank < world_size)


def choose_restore(
    formed: bool,
    candidates: Sequence[tuple[RestoreLink, CommittedCopies]],
    ranks: Sequence[str],
    newcomers: set[str],
    live: set[str],
    unavailable: set[tuple[int, int]],
    durable_failed: bool,
    world_size: int,
) -> RestoreChoice | None:
    """The first link of the chain that can work; None when none can (the job must end)."""
    if not formed:
        return RestoreChoice(NO_STEP, 0, RestoreLink.FRESH, "the job has not formed yet: a fresh start")
    skipped: list[str] = []
    for link, copies in candidates:
        if copies.step == NO_STEP:
            continue
        holders, step, survivors_hold_it = copies.holders, copies.step, link.survivors_hold_it
        missing = [
            rank
            for rank in _suspects(step, survivors_hold_it, ranks, newcomers, unavailable, world_size)
            if (unavailable and (rank, step) in unavailable)
            or (
                live.isdisjoint(holders.get(rank, ()))
                and (not survivors_hold_it or rank >= len(ranks) or ranks[rank] in newcomers)
            )
        ]
        if not missing:
            why = f"step {copies.step}" + (f" ({'; '.join(skipped)})" if skipped else "")
            return RestoreChoice(copies.step, copies.generation, link, why)
        skipped.append(f"{link} step {copies.step}: no copy of rank(s) {missing} to be had")
    if durable_failed:
        return None
    return RestoreChoice(NO_STEP, 0, RestoreLink.DURABLE, "; ".join(skipped) or "no committed step in RAM")
