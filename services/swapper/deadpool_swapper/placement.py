"""Pure choices the swapper makes: which spare replaces a rank, which stores hold a rank's snapshots,
and who hosts the rendezvous. Each is deterministic for the same inputs, so a restarted or standby
swapper decides the same way."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "SNAPSHOTS_PER_RANK",
    "MemberInfo",
    "StoreInfo",
    "pick_rendezvous",
    "pick_spare",
    "place_snapshots",
    "under_placed",
]


@dataclass(frozen=True)
class MemberInfo:
    """A registered member. Never changed in place (a new hello makes a new one): a record's save
    knows the membership unchanged when the same infos are there (`section_memo.SectionMemo`)."""

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
    node: str = ""
    """The host the store runs on, by the members' naming ('' : its address stands for it)."""
    snapshots: int = 0
    unsealed: int = 0
    incarnation: str = ""

    @property
    def node_name(self) -> str:
        return self.node or self.host


SNAPSHOTS_PER_RANK = 3
"""How many snapshots of one rank a store holds at once, at most, in steady state: the committed step,
the next candidate and the one streaming in. Placement reserves that much room per rank placed."""


def pick_spare(
    spares: Sequence[str], members: Mapping[str, MemberInfo], avoid_hosts: set[str], launcher: str = ""
) -> str | None:
    """The spare to promote. `launcher`: the failed member's, when its host is up (a process crashed):
    a spare of that launcher takes the rank from the crash copy left there (`deadpool.host_copy`).
    Otherwise one on another host than the failed ranks' if any; then the earliest registered."""
    if not spares:
        return None

    def preference(member: str) -> tuple[bool, bool, float, str]:
        info = members[member]
        return (bool(launcher) and info.launcher != launcher, info.host in avoid_hosts, info.registered_at, member)

    return min(spares, key=preference)


def pick_rendezvous(
    ranks: Sequence[str], newcomers: set[str], attempt: int = 0, address_of: Mapping[str, str] | None = None
) -> str:
    """The rendezvous host: a rank that survived (it is already up and reachable), the lowest one on a
    first attempt. Each attempt in a row that failed to form moves to the next survivor at another
    address (`address_of`: a member's rendezvous address), visiting every address before a second
    member of any, so that one host that cannot serve the rendezvous (an address the other hosts cannot
    reach) does not sink every attempt, however many ranks it holds. Moving member by member tried a
    host of 8 ranks 8 times in a row, a collective timeout each, and a host of 16 or more until the job
    ended (`rebuild_attempts_max`)."""
    if attempt == 0:  # the lowest survivor, found without ordering every one (thousands, at scale)
        return next((member for member in ranks if member not in newcomers), ranks[0])
    survivors = [member for member in ranks if member not in newcomers] or list(ranks)
    address = address_of or {}
    taken: dict[str, int] = {}
    order: list[tuple[int, int, str]] = []  # (its address's how-manieth, its place among survivors, member)
    for place, member in enumerate(survivors):
        key = address.get(member, member)
        nth = taken.get(key, 0)
        taken[key] = nth + 1
        order.append((nth, place, member))
    order.sort()
    return order[attempt % len(order)][2]


def place_snapshots(
    ranks: Sequence[str],
    members: Mapping[str, MemberInfo],
    stores: Sequence[StoreInfo],
    replication: int,
    rank_bytes: Mapping[int, int] | None = None,
    previous: Sequence[Sequence[str]] = (),
) -> list[list[str]]:
    """For each rank, the stores its snapshots go to: `replication` of them (all, if fewer exist).

    Deterministic for the same inputs (a standby swapper decides alike). Rules, in order:
    - a store of `previous[rank]` that is still in `stores` keeps the rank (a placement change moves
      only what the lost store held, so no other replica has to be made again); a rank that keeps
      every store keeps its list itself (nothing else mutates a placement's lists);
    - a store on the rank's own host is taken only when no store elsewhere has room: losing the host
      would lose the copy with the member;
    - a store without room for `SNAPSHOTS_PER_RANK` snapshots of the rank (`rank_bytes`, when known)
      on top of what it holds and what this placement gave it already is taken last;
    - among equals, the store given the fewest ranks so far (spreading ranks), then the one with the
      most free room, then by name.
    """
    sizes = rank_bytes or {}
    count = min(replication, len(stores))
    by_name = {s.store: s for s in stores}
    live = frozenset(by_name)
    if _kept_whole(previous, len(ranks), count, live):
        return list(previous)  # type: ignore[arg-type]  # lists, as `_kept_whole` checked
    planned: dict[str, int] = {s.store: 0 for s in stores}
    """Bytes this placement reserves on each store so far."""
    given: dict[str, int] = {s.store: 0 for s in stores}
    """Ranks this placement gave each store so far."""
    placement: list[list[str]] = []
    for rank, member in enumerate(ranks):
        old = previous[rank] if rank < len(previous) else ()
        if len(old) == count and live.issuperset(old) and isinstance(old, list):
            for name in old:  # kept whole (most ranks, after a swap): the same list, nothing sorted
                given[name] += 1
            placement.append(old)
            continue
        host = members[member].host if member in members else ""
        need = SNAPSHOTS_PER_RANK * sizes.get(rank, 0)
        kept = [name for name in old if name in by_name][:count]
        chosen = list(kept)
        if len(chosen) < count:  # a rank its previous stores still hold (most, after a swap) sorts nothing

            def preference(store: StoreInfo, host: str = host, need: int = need) -> tuple[bool, bool, int, int, str]:
                room = _free(store, planned)
                return (store.node_name == host, room < need, given[store.store], -room, store.store)

            for store in sorted((s for s in stores if s.store not in kept), key=preference):
                if len(chosen) >= count:
                    break
                chosen.append(store.store)
        for name in chosen:
            given[name] += 1
            if name not in kept:
                planned[name] += need
        placement.append(chosen)
    return placement


def _kept_whole(previous: Sequence[Sequence[str]], ranks: int, count: int, live: frozenset[str]) -> bool:
    """Whether every rank keeps every store of `previous` (a swap with no store lost or added: the
    usual rebuild), checked in C over all of them at once: 16,384 ranks in about a millisecond."""
    return (
        len(previous) == ranks
        and set(map(len, previous)) <= {count}
        and set(map(type, previous)) <= {list}
        and live.issuperset(itertools.chain.from_iterable(previous))
    )


def _free(store: StoreInfo, planned: Mapping[str, int]) -> int:
    """What `store` has left once this placement's reservations (`planned`) are counted."""
    if store.capacity_bytes <= 0:
        return 0
    return store.capacity_bytes - store.used_bytes - planned[store.store]


def under_placed(placement: Sequence[Sequence[str]], live: set[str], replication: int) -> bool:
    """Whether a placement names a store that is gone, or gives a rank fewer stores than it could have."""
    want = min(replication, len(live))  # checked in C, as `_kept_whole`: the shell asks at every tick
    return (
        not live.issuperset(itertools.chain.from_iterable(placement)) or min(map(len, placement), default=want) < want
    )
