"""Pure choices the swapper makes: which spare replaces a rank, which stores hold a rank's snapshots,
and who hosts the rendezvous. Each is deterministic for the same inputs, so a restarted or standby
swapper decides the same way."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["MemberInfo", "StoreInfo", "pick_rendezvous", "pick_spare", "place_snapshots"]


@dataclass
class MemberInfo:
    member: str
    host: str
    pid: int
    launcher: str
    rank_hint: int
    rendezvous_host: str
    rendezvous_port: int
    registered_at: float


@dataclass
class StoreInfo:
    store: str
    host: str
    port: int
    last_seen: float
    used_bytes: int = 0
    capacity_bytes: int = 0


def pick_spare(spares: Sequence[str], members: Mapping[str, MemberInfo], avoid_hosts: set[str]) -> str | None:
    """The spare to promote: one on another host than the failed rank if any, else the earliest registered."""
    if not spares:
        return None

    def preference(member: str) -> tuple[bool, float, str]:
        info = members[member]
        return (info.host in avoid_hosts, info.registered_at, member)

    return min(spares, key=preference)


def pick_rendezvous(ranks: Sequence[str], newcomers: set[str], attempt: int = 0) -> str:
    """The rendezvous host: a rank that survived (it is already up and reachable), the lowest one on a
    first attempt; each attempt in a row that failed to form moves to the next survivor, so one host
    that cannot serve the rendezvous does not sink every attempt."""
    survivors = [member for member in ranks if member not in newcomers] or list(ranks)
    return survivors[attempt % len(survivors)]


def place_snapshots(
    ranks: Sequence[str], members: Mapping[str, MemberInfo], stores: Sequence[StoreInfo], replication: int
) -> list[list[str]]:
    """For each rank, the stores its snapshots go to: `replication` of them (or all, if fewer exist),
    stores on other hosts than the member first, spread round-robin by rank."""
    ordered = sorted(stores, key=lambda s: s.store)
    count = min(replication, len(ordered))
    placement: list[list[str]] = []
    for rank, member in enumerate(ranks):
        host = members[member].host if member in members else ""
        rotated = ordered[rank % len(ordered) :] + ordered[: rank % len(ordered)] if ordered else []
        rotated.sort(key=lambda s: s.host == host)  # stable: keeps the rotation among equals
        placement.append([s.store for s in rotated[:count]])
    return placement
