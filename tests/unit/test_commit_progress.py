"""Commits at O(stores) per step: stores report a step's seals in batches, and the swapper counts them
incrementally. The counts must say what a scan of every rank says, whatever happens between reports."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deadpool_protocol import MemberHello, ProtocolError, RebuildAck, RebuildMarks, RestoreSource, SnapshotComplete
from deadpool_protocol.bounds import SEALED_PER_REPORT_MAX
from deadpool_protocol.codec import decode, encode
from deadpool_store.sealed_reports import SealedReports
from deadpool_swapper.commit_progress import CommitProgress, StepTable
from deadpool_swapper.core import SwapperConfig, SwapperCore
from tests.unit.test_store_loss import announce, published

pytestmark = pytest.mark.unit

STORES = ["store0", "store1", "store2"]


def scanned(table: StepTable, live: frozenset[str], placement: list[list[str]], world: int) -> list[int]:
    """The definition: every rank sealed on as many live stores as its placement names."""

    def enough(step: int, rank: int) -> bool:
        needed = max(1, len(placement[rank]) if rank < len(placement) else 1)
        return len(table.get(step, {}).get(rank, set()) & live) >= needed

    return sorted(s for s in table if all(enough(s, r) for r in range(world)))


placements = st.lists(st.lists(st.sampled_from(STORES), min_size=1, max_size=2, unique=True), min_size=4, max_size=4)
operations = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(0, 3), st.lists(st.integers(0, 5), max_size=8), st.sampled_from(STORES)),
        st.tuples(st.just("live"), st.frozensets(st.sampled_from(STORES))),
        st.tuples(st.just("place"), placements),
        st.tuples(st.just("drop"), st.integers(0, 3)),
        st.tuples(st.just("restart"), st.sampled_from(STORES)),
        st.tuples(
            st.just("check"),
        ),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(placements, operations)
def test_the_counts_say_what_a_scan_of_every_rank_says(first: list[list[str]], ops: list[tuple]) -> None:  # type: ignore[type-arg]
    progress, table = CommitProgress(), {}  # type: ignore[var-annotated]
    placement, live, world = first, frozenset(STORES), 4
    for op in ops:
        if op[0] == "add":
            _, step, ranks, store = op  # a report: ranks repeated, or 4 and 5, past the world
            progress.add(table, step, ranks, store, live, placement, world)
        elif op[0] == "live":
            live = op[1]
        elif op[0] == "place":
            placement = op[1]
        elif op[0] == "drop":
            progress.drop_through(table, op[1])
        elif op[0] == "restart":  # a store that restarted holds nothing: its copies go, in place
            for by_rank in table.values():
                for stores in by_rank.values():
                    stores.discard(op[1])
            progress.invalidate()
        assert progress.complete_steps(table, live, placement, world) == scanned(table, live, placement, world)


def test_a_report_costs_the_ranks_it_names_not_a_recount_of_the_job() -> None:
    """16,384 ranks reported by 4 stores: the counts are made once, not once per report."""
    world, stores = 16_384, [f"store{i}" for i in range(4)]
    placement = [[stores[r % 4], stores[(r + 1) % 4]] for r in range(world)]
    progress, table, live = CommitProgress(), {}, frozenset(stores)  # type: ignore[var-annotated]
    for store_index, store in enumerate(stores):
        progress.add(table, 7, [r for r in range(world) if store in placement[r]], store, live, placement, world)
        done = progress.complete_steps(table, live, placement, world)
        assert done == ([7] if store_index == 3 else [])
    assert progress.recounts == 1


def one_report(store: str, step: int, ranks: list[int]) -> SnapshotComplete:
    return SnapshotComplete("j", 1, store, step, ranks, [1000] * len(ranks))


def formed(world: int) -> SwapperCore:
    core = SwapperCore(SwapperConfig(replication=2, store_timeout_s=1.5))
    announce(core, 0.0)
    for rank in range(world):
        hello = MemberHello("j", 0, f"r{rank}", f"h{rank // 8}", 100, f"l{rank // 8}", rank, world, "127.0.0.1", 1, 0.0)
        _, _decision = core.on_hello(hello, 0.0)
    marks = RebuildMarks(begin=0.0, restored=0.0, rendezvous=0.0, ready=0.0)
    for member in core.jobs["j"].membership.ranks:
        rank = core.jobs["j"].membership.ranks.index(member)
        core.on_ack(RebuildAck("j", 1, member, rank, -1, -1, RestoreSource.FRESH, marks, 0.0), 0.0)
    assert core.jobs["j"].recovery.formed
    return core


def test_one_report_per_store_commits_a_step_and_a_rank_placed_elsewhere_is_refused_alone() -> None:
    world = 64
    core = formed(world)
    placement = core.jobs["j"].stores.placement
    by_store = {s: [r for r in range(world) if s in placement[r]] for s in {s for p in placement for s in p}}
    reports = sorted(by_store.items())
    for store, ranks in reports[:-1]:
        assert not published(core.on_snapshot_complete(one_report(store, 4, ranks), 0.5), object)
    last_store, last_ranks = reports[-1]
    stranger = next(r for r in range(world) if last_store not in placement[r])
    decision = core.on_snapshot_complete(one_report(last_store, 4, sorted([*last_ranks, stranger])), 0.5)
    assert f"rank {stranger}: not placed there" in decision.reason
    (commit,) = [m for m in published(decision, object) if m.KIND == "commit"]
    assert commit.step == 4
    assert core.jobs["j"].ledger.committed_holders[stranger] == set(placement[stranger])


def test_a_report_is_checked_before_it_is_believed() -> None:
    with pytest.raises(ProtocolError, match="once"):
        SnapshotComplete("j", 1, "s0", 3, [1, 1], [10, 10]).check()
    with pytest.raises(ProtocolError, match="one size per rank"):
        SnapshotComplete("j", 1, "s0", 3, [1, 2], [10]).check()
    with pytest.raises(ProtocolError, match="names a rank"):
        SnapshotComplete("j", 1, "s0", 3, [], []).check()
    too_many = list(range(SEALED_PER_REPORT_MAX + 1))
    with pytest.raises(ProtocolError, match="SEALED_PER_REPORT_MAX"):
        decode(encode(SnapshotComplete("j", 1, "s0", 3, too_many, too_many)), SnapshotComplete)


def test_a_store_reports_a_steps_seals_together_and_a_full_batch_at_once() -> None:
    async def run() -> list[tuple[str, SnapshotComplete]]:
        sent: list[tuple[str, SnapshotComplete]] = []
        windowed = asyncio.Event()

        def publish(subject: str, report: SnapshotComplete) -> None:
            sent.append((subject, report))
            if report.job == "j":
                windowed.set()

        reports = SealedReports("s0", publish, window_s=0.05)
        for rank in (3, 1, 2):
            reports.sealed("j", 1, 5, rank, 100 + rank)
        reports.sealed("j", 1, 6, 0, 7)
        assert not sent  # within the window
        for rank in range(SEALED_PER_REPORT_MAX):
            reports.sealed("k", 2, 9, rank, 1)
        assert [r.job for _, r in sent] == ["k"]  # full: out at once
        await asyncio.wait_for(windowed.wait(), 5)
        return sent

    sent = asyncio.run(run())
    assert [(r.job, r.step, r.ranks, r.nbytes) for _, r in sent[1:]] == [
        ("j", 5, [1, 2, 3], [101, 102, 103]),
        ("j", 6, [0], [7]),
    ]
    assert all(subject.endswith(".s0") for subject, _ in sent)
