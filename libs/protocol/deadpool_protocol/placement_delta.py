"""A placement as the changes from the one before, and back (`PlacementDelta`).

A `Placement` names every rank's stores: 313 kB at 16,384 ranks, and every member hears it, so a store
lost (or one back) put 5 GB through the server per placement and again per retransmission, where about
a sixteenth of the ranks changed stores. A member that holds the placement before has all the rest,
so the swapper sends the changes beside the whole placement (`placement_delta_of`), and a member takes
the whole one only when its own does not match (`placement_applied` checks the result's digest), as
with rebuilds (`rebuild_delta`).
"""

from __future__ import annotations

from deadpool_protocol.messages import Placement, PlacementDelta, Rebuild
from deadpool_protocol.rebuild_delta import changed_ranks, placement_digest

__all__ = ["placement_applied", "placement_delta_of", "placement_notice"]


def placement_notice(placement: Placement) -> PlacementDelta:
    """`placement` with no base: it says that the placement is out, whole, on the placement subject."""
    return _delta(placement, placement.version - 1, "", [], [])


def placement_delta_of(placement: Placement, base_version: int, base: list[list[str]] | None) -> PlacementDelta:
    """`placement` as its changes from placement `base_version` of its generation, which said `base`;
    a notice where there is no base (None: a leader that took over) or another world. Every store lost
    is a delta too, every rank's stores none: 3 bytes a rank more than the whole."""
    if base is None or len(base) != len(placement.placement) or not 0 <= base_version < placement.version:
        return placement_notice(placement)
    replaced = changed_ranks(placement.placement, base)
    replacements = [list(placement.placement[r]) for r in replaced]
    return _delta(placement, base_version, placement_digest(placement.placement), replaced, replacements)


def placement_applied(
    delta: PlacementDelta, held: Rebuild | None, base_version: int, base: list[list[str]]
) -> Placement | None:
    """The whole placement `delta` stands for, made from the one a member holds (of the command `held`,
    its version `base_version` saying `base`: `rebuild_delta.base_of`); None where it cannot be made from
    it: a notice, another generation or version, or a result other than the swapper's (its digest)."""
    if (
        held is None
        or not delta.digest
        or (delta.job, delta.generation, delta.base_version) != (held.job, held.generation, base_version)
        or delta.world_size != len(base)
    ):
        return None
    placement = list(base)
    for rank, stores in zip(delta.replaced, delta.replacements, strict=True):
        placement[rank] = stores
    if placement_digest(placement) != delta.digest:
        return None
    return Placement(delta.job, delta.generation, delta.version, list(delta.stores), placement, delta.reason)


def _delta(
    placement: Placement, base_version: int, digest: str, replaced: list[int], replacements: list[list[str]]
) -> PlacementDelta:
    return PlacementDelta(
        job=placement.job,
        generation=placement.generation,
        version=placement.version,
        base_version=base_version,
        world_size=len(placement.placement),
        digest=digest,
        replaced=replaced,
        replacements=replacements,
        stores=list(placement.stores),
        reason=placement.reason,
    )
