"""The fallback chain's choice is the one a scan of every rank's holders makes, whatever the job: the
committed link checks only the ranks that may lack a copy (survivors restore from their own buffers)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deadpool_swapper.restore_chain import CommittedCopies, RestoreChoice, RestoreLink, choose_restore

pytestmark = pytest.mark.unit

STORES = ["s0", "s1", "s2"]
Job = tuple[list[tuple[RestoreLink, CommittedCopies]], list[str], set[str], set[str], set[tuple[int, int]], int]
"""The chain's candidates, the rank map, the newcomers, the live stores, the unavailable copies, the
world size."""


def every_rank_scanned(
    candidates: Sequence[tuple[RestoreLink, CommittedCopies]],
    ranks: Sequence[str],
    newcomers: set[str],
    live: set[str],
    unavailable: set[tuple[int, int]],
    world_size: int,
) -> list[tuple[RestoreLink, list[int]]]:
    """The oracle: each link's ranks without a copy to be had, from a scan of every rank."""
    found = []
    for link, copies in candidates:
        missing = [
            rank
            for rank in range(world_size)
            if (rank, copies.step) in unavailable
            or (
                live.isdisjoint(copies.holders.get(rank, ()))
                and (not link.survivors_hold_it or rank >= len(ranks) or ranks[rank] in newcomers)
            )
        ]
        found.append((link, missing))
    return found


@st.composite
def jobs(
    draw: st.DrawFn,
) -> tuple[list[tuple[RestoreLink, CommittedCopies]], list[str], set[str], set[str], set[tuple[int, int]], int]:
    world_size = draw(st.integers(1, 12))
    ranks = [f"m{i}" for i in range(draw(st.integers(0, world_size)))]
    newcomers = draw(st.sets(st.sampled_from([*ranks, "stranger"])))
    holders = st.dictionaries(st.integers(0, world_size + 2), st.sets(st.sampled_from(STORES)), max_size=world_size + 3)
    candidates = [
        (RestoreLink.COMMITTED, CommittedCopies(7, 2, draw(holders))),
        (RestoreLink.OLDER_COMMITTED, CommittedCopies(5, 2, draw(holders))),
    ]
    unavailable = draw(st.sets(st.tuples(st.integers(-1, world_size + 2), st.sampled_from([5, 7, 9]))))
    live = draw(st.sets(st.sampled_from(STORES)))
    return candidates, ranks, newcomers, live, unavailable, world_size


@settings(deadline=None)  # a timing bound flakes on a busy machine; this tests what, not how fast
@given(jobs())
def test_the_choice_is_the_one_a_scan_of_every_rank_makes(job: Job) -> None:
    candidates, ranks, newcomers, live, unavailable, world_size = job
    choice = choose_restore(True, candidates, ranks, newcomers, live, unavailable, False, world_size)
    scanned = every_rank_scanned(candidates, ranks, newcomers, live, unavailable, world_size)
    first = next(
        ((link, copies) for (link, copies), (_, missing) in zip(candidates, scanned, strict=True) if not missing), None
    )
    if first is None:
        assert choice is not None and choice.link is RestoreLink.DURABLE
        for link, missing in scanned:
            assert f"{link} step" in choice.reason and f"no copy of rank(s) {missing}" in choice.reason
    else:
        assert choice is not None and choice == RestoreChoice(
            first[1].step, first[1].generation, first[0], choice.reason
        )
