"""A lost store heals without a rebuild: new placement, the committed step copied again, commits resume.

Pure decisions of the swapper core and of the placement function; the integration test
`test_store_loss.py` runs the same story with real stores in network namespaces.
"""

from __future__ import annotations

from typing import Any

from deadpool_protocol import (
    Commit,
    Failure,
    FailureReason,
    Incident,
    JobFinished,
    MemberHello,
    Placement,
    PlacementDelta,
    Rebuild,
    RebuildAck,
    RebuildMarks,
    Replicate,
    Reserve,
    RestoreSource,
    SnapshotComplete,
    StoreStatus,
)
from deadpool_protocol.placement_delta import placement_applied, placement_notice
from deadpool_swapper.core import Decision, Publish, SwapperConfig, SwapperCore
from deadpool_swapper.job_records import state_from_record, state_to_record
from deadpool_swapper.placement import MemberInfo, StoreInfo, place_snapshots
from tests.unit.test_swapper_core import first_steps

W = 2
STORES = ("store0", "store1", "store2")


def published(decision: Decision, kind: type[Any]) -> list[Any]:
    return [a.message for a in decision.actions if isinstance(a, Publish) and isinstance(a.message, kind)]


def announce(core: SwapperCore, now: float, stores: tuple[str, ...] = STORES) -> None:
    for i, name in enumerate(stores):
        port = 5000 + STORES.index(name)
        core.on_store_status(StoreStatus(name, "10.0.0.9", port, 0, 10**9, 0, now, node=f"node{i}"), now)


def formed(now: float = 0.0) -> tuple[SwapperCore, Rebuild]:
    core = SwapperCore(SwapperConfig(replication=2, store_timeout_s=1.5))
    announce(core, now)
    for rank in range(W):
        hello = MemberHello("j", 0, f"r{rank}", f"h{rank}", 100, f"l-h{rank}", rank, W, "127.0.0.1", 4000, now)
        _, decision = core.on_hello(hello, now)
    (formation,) = published(decision, Rebuild)
    for member in formation.ranks:
        marks = RebuildMarks(begin=now, restored=now, rendezvous=now, ready=now)
        core.on_ack(RebuildAck("j", 1, member, formation.rank_of(member), -1, -1, RestoreSource.FRESH, marks, now), now)
    return core, formation


def complete(core: SwapperCore, step: int, stores_of: list[list[str]], now: float) -> list[Commit]:
    commits: list[Commit] = []
    for rank, stores in enumerate(stores_of):
        for store in stores:
            sc = SnapshotComplete("j", core.jobs["j"].generation, store, step, [rank], [1000])
            commits += published(core.on_snapshot_complete(sc, now), Commit)
    return commits


def test_a_lost_store_gets_a_new_placement_and_its_committed_copies_are_made_again_without_a_rebuild() -> None:
    core, formation = formed()
    placement = formation.placement
    assert all(len(names) == 2 for names in placement)
    (commit,) = complete(core, 4, placement, 0.5)
    assert commit.step == 4
    lost = placement[0][0]
    survivors = tuple(s for s in STORES if s != lost)
    announce(core, 1.0, survivors)
    assert published(core.tick(1.2), Placement) == []  # 1.2 s since `lost` spoke: not lost yet
    announce(core, 1.6, survivors)
    decision = core.tick(1.6)
    assert published(decision, Rebuild) == [] and core.jobs["j"].generation == 1
    (new,) = published(decision, Placement)
    assert new.version == 1 and new.generation == 1 and "stores lost" in new.reason
    assert all(lost not in names and len(names) == 2 for names in new.placement)
    for old, names in zip(placement, new.placement, strict=True):
        assert set(old) - {lost} <= set(names), "a surviving replica keeps its rank"
    replicas = published(decision, Replicate)
    short = [rank for rank, names in enumerate(placement) if lost in names]
    assert sorted(r.rank for r in replicas) == short
    for replica in replicas:
        assert replica.step == 4 and replica.source != lost and replica.target.store != lost
        assert replica.source in placement[replica.rank] and replica.target.store in new.placement[replica.rank]
    assert core.replicas_short("j", 1.6) == len(short)

    for replica in replicas:  # the target seals the copy and says so
        sc = SnapshotComplete("j", 1, replica.target.store, 4, [replica.rank], [1000])
        assert published(core.on_snapshot_complete(sc, 1.8), Commit) == []
    assert core.replicas_short("j", 1.8) == 0
    announce(core, 3.0, survivors)
    assert published(core.tick(3.0), Replicate) == []  # nothing more to copy

    # Commits go on under the new placement; copies on the lost store would not count.
    assert complete(core, 5, placement, 3.1) == []
    (resumed,) = complete(core, 6, new.placement, 3.2)
    assert resumed.step == 6 and core.jobs["j"].stores.placement_confirmed


def test_a_store_given_ranks_of_known_size_by_a_new_placement_is_told_so_to_fault_in_their_buffers() -> None:
    """After a loss each store that gets a rank it did not hold is sent that rank's size (`Reserve`),
    again with each retransmission of the placement until a step commits under it (a reservation is
    delivered at least once, and a store takes it once), and a rebuild that keeps every rank where it
    was reserves nothing."""
    core, formation = formed()
    complete(core, 4, formation.placement, 0.5)
    lost = formation.placement[0][0]
    survivors = tuple(s for s in STORES if s != lost)
    announce(core, 1.6, survivors)
    decision = core.tick(1.6)
    (new,) = published(decision, Placement)
    gained = {
        (store, rank)
        for rank, names in enumerate(new.placement)
        for store in names
        if store not in formation.placement[rank]
    }
    reservations = published(decision, Reserve)
    reserved = {(r.store, rank): n for r in reservations for rank, n in zip(r.ranks, r.nbytes, strict=True)}
    assert gained and set(reserved) == gained, (reserved, gained)
    assert set(reserved.values()) == {1000}, "each rank's size, from its snapshots' reports"
    announce(core, 2.7, survivors)
    again = core.tick(2.7)
    assert published(again, Placement) and published(again, Reserve) == reservations
    complete(core, 5, new.placement, 2.8)
    announce(core, 3.9, survivors)
    assert published(core.tick(3.9), Reserve) == [], "a step committed under it: every rank has uploaded"
    failure = Failure("j", 1, "r1", 1, FailureReason.EXIT, {}, 4.1, 4.11)
    core.on_hello(MemberHello("j", 0, "s9", "h9", 100, "l-h9", -1, W, "127.0.0.1", 4000, 4.0), 4.0)
    core.on_failure(failure, 4.11)
    announce(core, 5.0, survivors)
    rebuilds = core.tick(5.0)
    (rebuild,) = published(rebuilds, Rebuild)
    assert rebuild.placement == new.placement and published(rebuilds, Reserve) == []


def test_a_rebuild_that_moves_ranks_sends_its_reservations_again_with_itself_until_they_ack() -> None:
    """A store lost while a rank fails: the rebuild places that store's ranks elsewhere and reserves them
    there, and each retransmission of the rebuild (members that missed it) carries them again."""
    core, formation = formed()
    complete(core, 4, formation.placement, 0.5)
    core.on_hello(MemberHello("j", 0, "s9", "h9", 100, "l-h9", -1, W, "127.0.0.1", 4000, 0.6), 0.6)
    lost = formation.placement[0][0]
    survivors = tuple(s for s in STORES if s != lost)
    core.on_failure(Failure("j", 1, "r1", 1, FailureReason.EXIT, {}, 1.5, 1.5), 1.5)
    announce(core, 1.6, survivors)
    first = core.tick(1.6)
    (rebuild,) = published(first, Rebuild)
    reservations = published(first, Reserve)
    assert reservations and all(r.store != lost for r in reservations)
    announce(core, 2.7, survivors)
    again = core.tick(2.7)
    assert published(again, Rebuild) == [rebuild] and published(again, Reserve) == reservations


def test_the_new_placement_is_sent_again_until_a_step_commits_under_it() -> None:
    core, formation = formed()
    complete(core, 2, formation.placement, 0.5)
    lost = formation.placement[1][0]
    survivors = tuple(s for s in STORES if s != lost)
    announce(core, 1.6, survivors)
    (first,) = published(core.tick(1.6), Placement)
    announce(core, 2.7, survivors)
    (again,) = published(core.tick(2.7), Placement)
    assert again.version == first.version and again.placement == first.placement
    complete(core, 3, first.placement, 2.8)
    announce(core, 3.9, survivors)
    assert published(core.tick(3.9), Placement) == []


def test_a_new_placement_goes_first_as_its_delta_from_the_one_before_and_a_new_leader_sends_it_too() -> None:
    """Members hold the rebuild's placement: the delta from it, applied there, is the new placement
    (what a member takes), and goes before the whole one, at the decision and with each retransmission.
    A leader that loaded the placement from the record sends the same delta; from a record that holds
    none (one from before), a notice says the placement is out whole."""
    core, formation = formed()
    complete(core, 2, formation.placement, 0.5)
    lost = formation.placement[1][0]
    survivors = tuple(s for s in STORES if s != lost)
    announce(core, 1.6, survivors)
    decision = core.tick(1.6)
    (delta,) = published(decision, PlacementDelta)
    (whole,) = published(decision, Placement)
    kinds = [type(a.message) for a in decision.actions if isinstance(a, Publish)]
    assert kinds.index(PlacementDelta) < kinds.index(Placement), "the delta goes first"
    assert (delta.base_version, delta.version) == (0, whole.version) == (0, 1)
    assert delta.replaced == [r for r, names in enumerate(formation.placement) if lost in names]
    assert placement_applied(delta, formation, 0, formation.placement) == whole
    announce(core, 2.7, survivors)
    assert published(core.tick(2.7), PlacementDelta) == [delta], "sent again beside the whole one"

    for kept_delta in (True, False):
        successor, _ = formed()
        successor.jobs["j"] = state_from_record(state_to_record(core.jobs["j"], 2.8), 2.8)
        if not kept_delta:
            successor.jobs["j"].stores.delta = None
        announce(successor, 3.9, survivors)
        retransmitted = successor.tick(3.9)
        (again,) = published(retransmitted, Placement)
        assert published(retransmitted, PlacementDelta) == [delta if kept_delta else placement_notice(again)]
        assert (again.version, again.placement) == (whole.version, whole.placement)


def test_a_store_lost_while_a_rebuild_is_pending_is_left_to_the_rebuild() -> None:
    core = SwapperCore(SwapperConfig(replication=2, store_timeout_s=1.5))
    announce(core, 0.0)
    for rank in range(W):
        core.on_hello(
            MemberHello("j", 0, f"r{rank}", f"h{rank}", 1, f"l-h{rank}", rank, W, "127.0.0.1", 4000, 0.0), 0.0
        )
    assert core.jobs["j"].recovery.pending is not None
    announce(core, 1.6, STORES[1:])
    assert published(core.tick(1.6), Placement) == []


def test_a_rebuild_names_the_generation_whose_copies_of_the_committed_step_are_valid() -> None:
    core, formation = formed()
    complete(core, 4, formation.placement, 0.5)
    core.on_hello(MemberHello("j", 0, "spare", "h9", 1, "l-h9", -1, W, "127.0.0.1", 4000, 0.6), 0.6)
    core.on_failure(Failure("j", 1, "r1", 1, FailureReason.EXIT, {}, 0.7, 0.7), 0.7)
    announce(core, 0.8)
    (rebuild,) = published(core.tick(0.8), Rebuild)
    assert rebuild.restore_step == 4 and rebuild.restore_generation == 1


def stores(*specs: tuple[str, str, int, int]) -> list[StoreInfo]:
    return [
        StoreInfo(name, "10.0.0.1", 5000 + i, 0.0, used, cap, node) for i, (name, node, used, cap) in enumerate(specs)
    ]


def members(*hosts: str) -> dict[str, MemberInfo]:
    return {f"r{i}": MemberInfo(f"r{i}", h, 1, "l", i, "127.0.0.1", 1, 0.0) for i, h in enumerate(hosts)}


def test_placement_keeps_snapshots_off_the_owners_host_while_another_host_has_room() -> None:
    placed = place_snapshots(
        ["r0", "r1"], members("a", "b"), stores(("sa", "a", 0, 100), ("sb", "b", 0, 100), ("sc", "c", 0, 100)), 2
    )
    assert "sa" not in placed[0] and "sb" not in placed[1]
    alone = place_snapshots(["r0"], members("a"), stores(("sa", "a", 0, 100)), 2)
    assert alone == [["sa"]], "with no other host the only store is used (and the lack is visible)"


def test_placement_honours_store_capacity_and_spreads_ranks() -> None:
    infos = stores(("full", "x", 90, 100), ("roomy", "y", 0, 100), ("roomy2", "z", 0, 100))
    placed = place_snapshots(["r0", "r1"], members("a", "b"), infos, 1, rank_bytes={0: 10, 1: 10})
    assert "full" not in {n for names in placed for n in names}, "3 snapshots of 10 bytes do not fit in 10 free"
    assert placed[0] != placed[1], "ranks are spread over the stores with room"


def test_placement_keeps_surviving_stores_of_the_previous_placement() -> None:
    infos = stores(("s0", "x", 0, 100), ("s2", "z", 0, 100), ("s3", "w", 0, 100))
    placed = place_snapshots(["r0", "r1"], members("a", "b"), infos, 2, previous=[["s0", "s1"], ["s1", "s2"]])
    assert "s0" in placed[0] and "s2" in placed[1]
    assert all("s1" not in names and len(names) == 2 for names in placed)


def test_a_store_restarted_under_its_name_is_known_empty_and_the_committed_step_is_copied_again() -> None:
    core, formation = formed()
    complete(core, 4, formation.placement, 0.5)
    restarted = formation.placement[0][0]
    announce(core, 1.0)
    assert core.replicas_short("j", 1.0) == 0
    status = StoreStatus(restarted, "10.0.0.9", 5000 + STORES.index(restarted), 0, 10**9, 0, 1.1, incarnation="new")
    core.on_store_status(status, 1.1)
    assert core.replicas_short("j", 1.1) >= 1
    replicas = published(core.tick(2.2), Replicate)
    assert replicas and all(r.target.store == restarted and r.source != restarted for r in replicas)


def kill_rank(core: SwapperCore, member: str, rank: int, now: float) -> Rebuild:
    core.on_failure(Failure("j", core.jobs["j"].generation, member, rank, FailureReason.EXIT, {}, now, now), now)
    (rebuild,) = published(core.tick(now + 0.1), Rebuild)
    assert isinstance(rebuild, Rebuild)
    return rebuild


def ack_all(core: SwapperCore, rebuild: Rebuild, source: RestoreSource, restored: int, now: float) -> Decision:
    decision = Decision([], "")
    for member in rebuild.ranks:
        marks = RebuildMarks(begin=now, restored=now, rendezvous=now, ready=now)
        ack = RebuildAck("j", rebuild.generation, member, rebuild.rank_of(member), restored, 5, source, marks, now)
        decision = core.on_ack(ack, now)
    return decision


def test_with_every_copy_of_a_rank_lost_the_chain_goes_to_the_durable_tier_and_its_step_is_committed() -> None:
    core, formation = formed()
    complete(core, 4, formation.placement, 0.3)
    complete(core, 5, formation.placement, 0.4)
    core.on_hello(MemberHello("j", 0, "spare", "h9", 1, "l-h9", -1, W, "127.0.0.1", 4000, 0.5), 0.5)
    lost = tuple(formation.placement[1])  # both stores holding rank 1's snapshots
    announce(core, 2.0, tuple(s for s in STORES if s not in lost))
    rebuild = kill_rank(core, "r1", 1, 2.0)
    assert rebuild.durable and rebuild.restore_step == -1
    assert core.jobs["j"].incident_log.open_incidents[0].evidence["restore_link"] == "durable"
    assert (
        "no copy of rank(s) [1] to be had" in core.jobs["j"].incident_log.open_incidents[0].evidence["restore_reason"]
    )

    sc = SnapshotComplete("j", rebuild.generation, rebuild.placement[0][0], 3, [0], [1000])
    core.on_snapshot_complete(sc, 2.2)  # the resumed step, sealed before the acks
    ack_all(core, rebuild, RestoreSource.DURABLE, 3, 2.3)
    (incident,) = published(first_steps(core, rebuild, 2.5), Incident)
    state = core.jobs["j"]
    assert state.ledger.committed_step == 3 and state.ledger.committed_generation == rebuild.generation
    assert incident.restore_step == 3 and incident.evidence["lost_committed_steps"] == "2"
    assert state.ledger.committed_holders == {0: {rebuild.placement[0][0]}}


def unavailable(core: SwapperCore, rebuild: Rebuild, rank: int, now: float) -> Decision:
    member = rebuild.ranks[rank]
    marks = RebuildMarks(begin=now, ready=now)
    ack = RebuildAck(
        "j", rebuild.generation, member, rank, rebuild.restore_step, -1, RestoreSource.UNAVAILABLE, marks, now
    )
    return core.on_ack(ack, now)


def test_a_member_that_finds_no_copy_moves_the_rebuild_down_the_chain_until_the_job_ends_saying_why() -> None:
    core, formation = formed()
    complete(core, 4, formation.placement, 0.3)
    complete(core, 5, formation.placement, 0.4)
    core.on_hello(MemberHello("j", 0, "spare", "h9", 1, "l-h9", -1, W, "127.0.0.1", 4000, 0.5), 0.5)
    announce(core, 1.0)
    first = kill_rank(core, "r1", 1, 1.0)
    assert (first.restore_step, first.durable) == (5, False)
    (second,) = published(unavailable(core, first, 1, 1.2), Rebuild)  # the stores' copies were gone after all
    assert (second.restore_step, second.durable, second.generation) == (4, False, first.generation + 1)
    assert core.jobs["j"].incident_log.open_incidents[0].evidence["restore_link"] == "older_committed"
    (third,) = published(unavailable(core, second, 1, 1.3), Rebuild)
    assert third.durable
    assert published(unavailable(core, first, 1, 1.35), Rebuild) == [], "a repeated old ack: no-op"
    (ended,) = published(unavailable(core, third, 0, 1.4), JobFinished)
    assert ended.failed and "every copy of the committed step is gone" in ended.reason
