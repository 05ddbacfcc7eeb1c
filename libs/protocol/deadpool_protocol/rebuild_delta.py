"""A rebuild command as the changes from the one before, and back (`RebuildDelta`).

Every member subscribes to its job's commands. A whole rebuild names every rank's member and stores,
about 57 bytes a rank: at 16,384 ranks 937 kB, which the server sends to each of 16,384 members and
2,048 launchers, 17 GB per rebuild (and again with each retransmission) for a swap that changed one
rank. A member that holds the generation before has all but the change, so the swapper sends the
change beside the whole command (`delta_of`), and a member takes the whole command only when it
holds no base (a spare that registered since, a member that missed a generation or a placement):
`applied` refuses a delta whose result is not, by its digest, the command the swapper made.

The digest covers the rank map and the placement, the only fields a delta leaves out; the others
travel in the delta itself, checked by its own `check`. A delta that applies is the swapper's
command, which it checked whole (`Rebuild.check`) before sending it: a member does not check the
whole again (10-20 ms at 16,384 ranks, every member, every rebuild).

A delta goes wherever there is a base, however much changed: a member hears the whole subject only
once a delta fails it, so a notice in its place (a store lost beside a failure moves a quarter of the
ranks on 8 stores) would have every member take the whole command anyway, a retransmission (1 s)
later. At its largest (every rank changed) a delta is the whole command and its rank numbers.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

from deadpool_protocol.messages import Placement, Rebuild, RebuildDelta
from deadpool_protocol.names import content_digest

__all__ = [
    "applied",
    "base_of",
    "changed_ranks",
    "delta_of",
    "maps_digest",
    "notice_of",
    "placement_digest",
]

_RANKS_END = b"\x1e"
"""Between the rank map and the placement in what `maps_digest` digests (between two ranks' stores too;
`\x1f` between two names): no name holds either (`names.is_valid_name`)."""


def maps_digest(ranks: Sequence[str], placement: Sequence[Sequence[str]]) -> str:
    """The digest of a command's rank map and placement (3-4 ms at 16,384 ranks here: the joins, then
    SHA-256, which this machine's CPU does in hardware, twice as fast as BLAKE2 here)."""
    return content_digest("\x1f".join(ranks).encode() + _RANKS_END + _joined(placement))


def placement_digest(placement: Sequence[Sequence[str]]) -> str:
    """The digest of a placement alone (`PlacementDelta`)."""
    return content_digest(_joined(placement))


def _joined(placement: Sequence[Sequence[str]]) -> bytes:
    return "\x1e".join(map("\x1f".join, placement)).encode()


def changed_ranks(placement: list[list[str]], base: list[list[str]]) -> list[int]:
    """The ranks whose stores differ between two placements of one world (one pass in C: a store lost
    moves a sixteenth of the ranks at most, a swap one or two)."""
    return list(itertools.compress(range(len(placement)), map(list.__ne__, placement, base)))


def notice_of(command: Rebuild) -> RebuildDelta:
    """The command with no base: it says that `command.generation` is out, whole, on the rebuild
    subject (those who hold no base take it there)."""
    return _delta(command, 0, 0, "", [], [], [], [])


def delta_of(
    command: Rebuild,
    base_generation: int,
    base_version: int,
    base_ranks: list[str],
    base_placement: list[list[str]],
) -> RebuildDelta:
    """`command` as its changes from generation `base_generation` (its rank map `base_ranks`, its
    placement as version `base_version` said `base_placement`); a notice (`notice_of`) where there is
    no base: a formation, a world size that changed."""
    size = command.world_size
    if not 0 < base_generation < command.generation or len(base_ranks) != size or len(base_placement) != size:
        return notice_of(command)
    ranks, placement = command.ranks, command.placement
    # One pass each in C: a swap changes a rank or two of 16,384.
    moved = list(itertools.compress(range(size), map(str.__ne__, ranks, base_ranks)))
    replaced = changed_ranks(placement, base_placement)
    return _delta(
        command,
        base_generation,
        base_version,
        maps_digest(ranks, placement),
        moved,
        [ranks[r] for r in moved],
        replaced,
        [list(placement[r]) for r in replaced],
    )


def base_of(held: Rebuild | None, newest: Placement | None) -> tuple[int, list[list[str]]]:
    """What a delta goes from, for a member that holds the command `held` and heard the placement
    `newest` last: the placement's version and its maps where it is of `held`'s generation, else the
    command's own (version 0)."""
    if held is not None and newest is not None and newest.generation == held.generation:
        return newest.version, newest.placement
    return 0, [] if held is None else held.placement


def applied(
    delta: RebuildDelta, base: Rebuild | None, base_version: int, base_placement: list[list[str]]
) -> Rebuild | None:
    """The whole command `delta` stands for, made from `base` (the command this member holds, its
    placement as version `base_version` said `base_placement`); None where it cannot be made from it:
    no base, another one, or a result other than the swapper's (its digest)."""
    if (
        base is None
        or delta.base_generation == 0
        or (delta.job, delta.base_generation, delta.base_version) != (base.job, base.generation, base_version)
        or (delta.world_size, len(base_placement)) != (base.world_size, base.world_size)
    ):
        return None
    ranks = list(base.ranks)
    for rank, member in zip(delta.moved, delta.movers, strict=True):
        ranks[rank] = member
    placement = list(base_placement)
    for rank, stores in zip(delta.replaced, delta.replacements, strict=True):
        placement[rank] = stores
    if maps_digest(ranks, placement) != delta.digest:
        return None
    return Rebuild(ranks=ranks, placement=placement, **_shared(delta))


def _delta(
    command: Rebuild,
    base_generation: int,
    base_version: int,
    digest: str,
    moved: list[int],
    movers: list[str],
    replaced: list[int],
    replacements: list[list[str]],
) -> RebuildDelta:
    return RebuildDelta(
        base_generation=base_generation,
        base_version=base_version,
        digest=digest,
        moved=moved,
        movers=movers,
        replaced=replaced,
        replacements=replacements,
        **_shared(command),
    )


_SHARED = tuple(f.name for f in dataclasses.fields(Rebuild) if f.name not in ("ranks", "placement"))
"""The fields a rebuild and its delta both have, by the same names: all of the rebuild's but its maps."""


def _shared(message: Rebuild | RebuildDelta) -> dict[str, Any]:
    """`message`'s fields of `_SHARED`, its lists copied."""
    return {name: _copied(getattr(message, name)) for name in _SHARED}


def _copied(value: Any) -> Any:
    return list(value) if isinstance(value, list) else value
