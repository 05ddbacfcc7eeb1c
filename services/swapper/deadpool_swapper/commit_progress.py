"""Which steps every rank has sealed, kept as counts, so a store's report costs what it names.

A step commits when every rank's snapshot of it is sealed on as many live stores as its placement
names. Checking that by a scan of every rank at each report cost the swapper O(ranks) per report and
O(ranks²) per step (32,768 reports of one rank each at 16,384 ranks and R = 2, each a scan of 16,384
ranks). Here each step in flight keeps how many ranks are satisfied: a report updates the ranks it
names (O(R) each), and asking which steps are complete costs O(steps in flight).

The counts hold for one view: the live stores, the placement, the world size and the step table they
were counted against. When any of these is replaced (a store lost or heard again, a new placement, a
restore that drops the table) they are counted again, O(ranks * steps in flight), which happens at
incidents, not per report. A table changed in place by anything but `add` and `drop_through` must
say so (`invalidate`): a store that restarted loses its copies that way.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["CommitProgress", "StepTable"]

StepTable = dict[int, dict[int, set[str]]]
"""step -> rank -> the stores holding that rank's snapshot of the step, sealed."""


class CommitProgress:
    def __init__(self) -> None:
        self._live: frozenset[str] | None = None
        self._placement: Sequence[Sequence[str]] | None = None
        self._table: StepTable | None = None
        self._world_size = -1
        self._satisfied: dict[int, int] = {}
        """step -> ranks whose copies of it are enough, in the view above."""
        self.recounts = 0
        """Times the counts were made again from the whole table (a figure for tests)."""

    def invalidate(self) -> None:
        self._table = None

    def add(
        self,
        table: StepTable,
        step: int,
        ranks: Sequence[int],
        store: str,
        live: frozenset[str],
        placement: Sequence[Sequence[str]],
        world_size: int,
    ) -> None:
        """Note that `store` holds each of `ranks`' snapshots of `step` (idempotent): a store's report,
        its view checked once."""
        if not ranks:
            return
        self._sync(table, live, placement, world_size)
        by_rank = table.setdefault(step, {})
        satisfied = 0
        counts = store in live  # a copy on a store not live satisfies no rank more than before
        placed = len(placement)
        for rank in ranks:
            stores = by_rank.get(rank)
            if stores is None:
                stores = by_rank[rank] = set()
            elif store in stores:
                continue
            if counts and rank < world_size:
                # satisfied by this copy: one live copy short of its placement's count (at least one) before
                # it; the count `_enough` asks for, inline here (per rank of every report)
                needed = (len(placement[rank]) or 1) if rank < placed else 1
                if len(stores & live) + 1 == needed:
                    satisfied += 1
            stores.add(store)
        if satisfied:
            self._satisfied[step] = self._satisfied.get(step, 0) + satisfied

    def complete_steps(
        self, table: StepTable, live: frozenset[str], placement: Sequence[Sequence[str]], world_size: int
    ) -> list[int]:
        """The steps of `table` that every rank has sealed on enough live stores, oldest first."""
        self._sync(table, live, placement, world_size)
        return sorted(s for s in table if self._satisfied.get(s, 0) >= world_size)

    def drop_through(self, table: StepTable, step: int) -> None:
        """Forget the steps up to `step` (committed), in place: the others' counts stay valid."""
        for s in [s for s in table if s <= step]:
            del table[s]
            self._satisfied.pop(s, None)

    def _sync(
        self, table: StepTable, live: frozenset[str], placement: Sequence[Sequence[str]], world_size: int
    ) -> None:
        if (
            table is self._table
            and placement is self._placement
            and world_size == self._world_size
            and live == self._live
        ):
            return
        self._table, self._placement, self._world_size, self._live = table, placement, world_size, live
        self.recounts += 1
        self._satisfied = {
            step: sum(
                1 for rank, stores in by_rank.items() if rank < world_size and _enough(stores, live, placement, rank)
            )
            for step, by_rank in table.items()
        }


def _enough(stores: set[str], live: frozenset[str], placement: Sequence[Sequence[str]], rank: int) -> bool:
    """Whether `stores` holds as many live copies as the rank's placement names (at least one)."""
    needed = len(placement[rank]) if rank < len(placement) else 1
    return len(stores & live) >= max(1, needed)
