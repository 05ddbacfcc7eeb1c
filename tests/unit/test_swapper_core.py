"""The swapper's decisions as pure functions: formation, swaps, commits, incidents, completion."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from deadpool_protocol import (
    Commit,
    Failure,
    FailureReason,
    GenerationVoid,
    GroupBroken,
    Incident,
    JobFinished,
    MemberDone,
    MemberErrorCause,
    MemberHello,
    Rebuild,
    RebuildAck,
    RebuildMarks,
    RestoreSource,
    SnapshotComplete,
    StepResumed,
    StoreStatus,
)
from deadpool_protocol.messages import members_digest
from deadpool_swapper.core import Decision, Fence, Publish, SwapperConfig, SwapperCore

W = 2


def hello(member: str, hint: int, host: str = "h0", world_size: int = W) -> MemberHello:
    return MemberHello("j", 0, member, host, 100, f"l-{host}", hint, world_size, "127.0.0.1", 4000, 0.0)


def published(decision: Decision, kind: type[Any]) -> list[Any]:
    return [a.message for a in decision.actions if isinstance(a, Publish) and isinstance(a.message, kind)]


def ack(
    rebuild: Rebuild, member: str, t: float, source: RestoreSource = RestoreSource.LOCAL, last: int = -1
) -> RebuildAck:
    out = t - 0.35 if source is RestoreSource.LOCAL else None
    marks = RebuildMarks(received=t - 0.3, out=out, begin=t - 0.3, restored=t - 0.2, rendezvous=t - 0.1, ready=t)
    return RebuildAck(
        "j", rebuild.generation, member, rebuild.rank_of(member), rebuild.restore_step, last, source, marks, t
    )


LAST_CALL_S = SwapperConfig().last_call_s


def first_steps(core: SwapperCore, rebuild: Rebuild, t: float) -> Decision:
    """Every rank of `rebuild` completes its first step at `t`: the recovery ends as a user feels it."""
    actions: list[Any] = []
    for rank, member in enumerate(rebuild.ranks):
        resumed = StepResumed("j", rebuild.generation, member, rank, rebuild.restore_step + 1, t)
        actions += core.on_step_resumed(resumed, t).actions
    return Decision(actions, "first steps")


def fail(core: SwapperCore, failure: Failure, now: float) -> Decision:
    """A failure, then the end of its last call: what the swapper has published by then."""
    first = core.on_failure(failure, now)
    later = core.tick(now + LAST_CALL_S)
    return Decision(first.actions + later.actions, first.reason)


def formed_core(stores: int = 2, spares: tuple[str, ...] = ("s",)) -> tuple[SwapperCore, Rebuild]:
    core = SwapperCore(SwapperConfig(replication=2, store_timeout_s=1e9))
    for i in range(stores):
        core.on_store_status(StoreStatus(f"store{i}", "127.0.0.1", 5000 + i, 0, 100, 0, 0.0), 0.0)
    decisions = [core.on_hello(hello(f"r{r}", r), 0.1)[1] for r in range(W)]
    decisions += [core.on_hello(hello(s, -1, host="h1"), 0.2)[1] for s in spares]
    (formation,) = [r for d in decisions for r in published(d, Rebuild)]
    for member in formation.ranks:
        core.on_ack(ack(formation, member, 1.0, source=RestoreSource.FRESH), 1.0)
    return core, formation


def test_formation_waits_for_every_rank_and_a_store_then_starts_fresh() -> None:
    core = SwapperCore(SwapperConfig())
    _, first = core.on_hello(hello("r0", 0), 0.0)
    assert "waiting for members" in first.reason
    _, second = core.on_hello(hello("r1", 1), 0.0)
    assert "waiting for a snapshot store" in second.reason
    core.on_store_status(StoreStatus("store0", "127.0.0.1", 5000, 0, 100, 0, 0.0), 0.0)
    (rebuild,) = published(core.tick(0.1), Rebuild)
    assert rebuild.generation == 1 and rebuild.ranks == ["r0", "r1"] and rebuild.restore_step == -1
    assert rebuild.placement == [["store0"], ["store0"]]  # one store: replication falls back to 1


def test_a_spare_that_registers_first_stays_a_spare_while_ranks_are_claimed() -> None:
    core = SwapperCore(SwapperConfig(formation_grace_s=2.0))
    core.on_store_status(StoreStatus("store0", "127.0.0.1", 5000, 0, 100, 0, 0.0), 0.0)
    core.on_hello(hello("spare", -1), 0.0)
    _, waiting = core.on_hello(hello("r1", 1), 0.1)
    assert "claimed" in waiting.reason
    _, decision = core.on_hello(hello("r0", 0), 0.2)
    (rebuild,) = published(decision, Rebuild)
    assert rebuild.ranks == ["r0", "r1"] and rebuild.spares == ["spare"]


def test_without_rank_claims_formation_proceeds_after_the_grace_period() -> None:
    core = SwapperCore(SwapperConfig(formation_grace_s=2.0))
    core.on_store_status(StoreStatus("store0", "127.0.0.1", 5000, 0, 100, 0, 0.0), 0.0)
    core.on_hello(hello("a", -1), 0.0)
    core.on_hello(hello("b", -1), 0.5)
    assert published(core.tick(1.0), Rebuild) == []
    core.on_store_status(StoreStatus("store0", "127.0.0.1", 5000, 0, 100, 0, 2.5), 2.5)  # still announcing
    (rebuild,) = published(core.tick(2.6), Rebuild)
    assert rebuild.ranks == ["a", "b"]


def test_a_hello_with_another_world_size_is_refused() -> None:
    core, _ = formed_core()
    reply, _ = core.on_hello(hello("x", -1, world_size=8), 2.0)
    assert not reply.accepted and "world size 8" in reply.reason


def test_a_dead_rank_goes_to_a_spare_on_another_host_and_the_job_restores_the_committed_step() -> None:
    core, _formation = formed_core(spares=("same-host", "other-host"))
    members = core.jobs["j"].membership.members
    members["same-host"] = dataclasses.replace(members["same-host"], host="h0")
    for rank in range(W):
        for store in ("store0", "store1"):
            core.on_snapshot_complete(SnapshotComplete("j", 1, store, 4, [rank], [10]), 2.0)
    decision = fail(core, Failure("j", 1, "r1", 1, FailureReason.EXIT, {}, 5.0, 5.01), 5.02)
    (rebuild,) = published(decision, Rebuild)
    assert rebuild.generation == 2
    assert rebuild.ranks == ["r0", "other-host"]
    assert rebuild.restore_step == 4
    assert rebuild.rendezvous_member == "r0"  # a survivor hosts the rendezvous
    assert not [a for a in decision.actions if isinstance(a, Fence)]  # a process that exited needs no fence


def crash_copy_core() -> SwapperCore:
    """Ranks r0, r1 on host h0 (launcher l-h0), step 4 committed on both stores; spares "here" on h0
    and "there" on h1."""
    core, _formation = formed_core(spares=("there",))
    core.on_hello(hello("here", -1, host="h0"), 0.3)
    for rank in range(W):
        for store in ("store0", "store1"):
            core.on_snapshot_complete(SnapshotComplete("j", 1, store, 4, [rank], [10]), 2.0)
    return core


def test_a_crashed_process_goes_to_a_spare_of_its_launcher_which_restores_from_the_crash_copy_left_there() -> None:
    core = crash_copy_core()
    (rebuild,) = published(fail(core, Failure("j", 1, "r1", 1, FailureReason.EXIT, {}, 5.0, 5.01), 5.02), Rebuild)
    assert rebuild.ranks == ["r0", "here"]
    # No step named: the ranks agree on the newest one they all hold (survivors in their buffers, the
    # newcomer in the crash copy), at or past the committed step 4.
    assert rebuild.local and rebuild.restore_step == -1
    for rank, member in enumerate(rebuild.ranks):
        source = RestoreSource.LOCAL if member == "r0" else RestoreSource.HOST_COPY
        marks = RebuildMarks()
        core.on_ack(
            RebuildAck("j", rebuild.generation, member, rank, 4, 5 if member == "r0" else -1, source, marks, 6.0), 6.0
        )
    incident = core.jobs["j"].incident_log.incidents[-1]
    assert incident.restore_step == 4 and incident.lost_steps == 1, "the step the ranks agreed on, not 'none'"
    assert incident.evidence["restore_link"] == "local"
    state = core.jobs["j"]
    assert state.ledger.committed_step == 4 and state.ledger.committed_holders, (
        "the stores' copies of step 4 stay known"
    )


def test_a_newer_agreed_step_sealed_partly_before_the_acks_and_partly_after_is_committed_with_every_copy() -> None:
    """Training goes on as the ranks store the step they agreed on: the copies that come in before the
    last ack and those after it all count, so a lost host then restores that step from the stores."""
    core = crash_copy_core()
    (rebuild,) = published(fail(core, Failure("j", 1, "r1", 1, FailureReason.EXIT, {}, 5.0, 5.01), 5.02), Rebuild)
    assert rebuild.local
    g = rebuild.generation
    for store in ("store0", "store1"):
        core.on_snapshot_complete(SnapshotComplete("j", g, store, 5, [0], [10]), 5.5)
    for rank, member in enumerate(rebuild.ranks):
        source = RestoreSource.LOCAL if member == "r0" else RestoreSource.HOST_COPY
        core.on_ack(RebuildAck("j", g, member, rank, 5, 5 if member == "r0" else -1, source, RebuildMarks(), 6.0), 6.0)
    state = core.jobs["j"]
    assert state.ledger.committed_step == 5 and state.ledger.previous_committed.step == 4
    assert state.ledger.committed_holders == {0: {"store0", "store1"}}, "the copies sealed before the acks count"
    for store in ("store0", "store1"):
        core.on_snapshot_complete(SnapshotComplete("j", g, store, 5, [1], [10]), 6.5)
    assert state.ledger.committed_holders == {0: {"store0", "store1"}, 1: {"store0", "store1"}}
    first_steps(core, rebuild, 6.6)
    core.on_hello(hello("s3", -1, host="h2"), 7.0)
    failures = [
        Failure("j", g, m, r, FailureReason.HEARTBEAT, {}, 8.0, 8.01, lost_host="h0", lost_host_members=2)
        for r, m in enumerate(rebuild.ranks)
    ]
    decisions = [core.on_failure(failure, 8.02) for failure in failures] + [core.tick(8.02 + LAST_CALL_S * 4)]
    (after,) = [r for d in decisions for r in published(d, Rebuild)]
    assert set(after.ranks) == {"there", "s3"} and not after.local and after.restore_step == 5, after


def test_a_crash_copy_that_cannot_be_had_moves_the_rebuild_to_the_committed_step_on_the_stores() -> None:
    core = crash_copy_core()
    (first,) = published(fail(core, Failure("j", 1, "r1", 1, FailureReason.EXIT, {}, 5.0, 5.01), 5.02), Rebuild)
    gone = RebuildAck("j", first.generation, "here", 1, -1, -1, RestoreSource.UNAVAILABLE, RebuildMarks(), 6.0)
    (second,) = published(core.on_ack(gone, 6.0), Rebuild)
    assert second.generation == first.generation + 1 and not second.local and second.restore_step == 4


def test_a_lost_host_goes_to_a_spare_elsewhere_and_restores_from_the_stores() -> None:
    core = crash_copy_core()
    failures = [
        Failure("j", 1, f"r{r}", r, FailureReason.HEARTBEAT, {}, 5.0, 5.01, lost_host="h0", lost_host_members=3)
        for r in range(W)
    ]
    core.on_failure(failures[0], 5.02)
    core.on_failure(failures[1], 5.02)
    core.on_hello(hello("s3", -1, host="h2"), 5.03)
    decision = core.on_failure(
        Failure("j", 1, "here", -1, FailureReason.HEARTBEAT, {}, 5.0, 5.01, lost_host="h0", lost_host_members=3), 5.04
    )
    rebuild = (published(decision, Rebuild) or published(core.tick(5.5), Rebuild))[0]
    assert set(rebuild.ranks) == {"there", "s3"} and not rebuild.local and rebuild.restore_step == 4


def test_a_member_that_may_still_run_is_fenced_and_its_generation_voided_before_the_rebuild() -> None:
    core, _ = formed_core()
    decision = fail(core, Failure("j", 1, "r0", 0, FailureReason.HANG, {}, 5.0, 6.0), 6.0)
    kinds = [type(a).__name__ for a in decision.actions if type(a).__name__ != "Persist"]
    assert kinds == ["Fence", "Publish", "Publish", "Publish"]
    (void,) = published(decision, GenerationVoid)
    (rebuild,) = published(decision, Rebuild)
    assert void.generation == 1 and rebuild.generation == 2


def two_hosts_core() -> SwapperCore:
    """Ranks 0, 1 on host a; ranks 2, 3 on host b; spares s0, s1 on host b."""
    core = SwapperCore(SwapperConfig(replication=1, store_timeout_s=1e9, host_loss_window_s=0.3))
    core.on_store_status(StoreStatus("store0", "127.0.0.1", 5000, 0, 100, 0, 0.0), 0.0)
    decisions = [core.on_hello(hello(f"r{r}", r, host="a" if r < 2 else "b", world_size=4), 0.1)[1] for r in range(4)]
    decisions += [core.on_hello(hello(s, -1, host="b", world_size=4), 0.2)[1] for s in ("s0", "s1")]
    (formation,) = [r for d in decisions for r in published(d, Rebuild)]
    for member in formation.ranks:
        core.on_ack(ack(formation, member, 1.0, source=RestoreSource.FRESH), 1.0)
    return core


def test_a_lost_host_is_swapped_in_one_generation() -> None:
    core = two_hosts_core()

    def lost(member: str, rank: int, t_fault: float, t: float) -> Failure:  # the detector saw host a go silent
        silent = FailureReason.HEARTBEAT
        return Failure("j", 1, member, rank, silent, {}, t_fault, t, lost_host="a", lost_host_members=2)

    first = core.on_failure(lost("r0", 0, 5.0, 6.0), 6.0)
    assert published(first, Rebuild) == [] and "waiting for its other failures" in first.reason
    second = core.on_failure(lost("r1", 1, 5.05, 6.001), 6.001)
    (rebuild,) = published(second, Rebuild)  # every announced member is in: no need to wait any longer
    assert published(first, GenerationVoid)  # the survivors were released at the first failure
    assert rebuild.generation == 2 and rebuild.ranks[:2] == ["s0", "s1"] and rebuild.ranks[2:] == ["r2", "r3"]
    shown = [i.evidence for i in core.jobs["j"].incident_log.open_incidents]  # for people: the host lost, as before
    assert [(e["host"], e["host_members_silent"]) for e in shown] == [("a", "2"), ("a", "2")]
    # Each is fenced, but its launcher went with the host: the rebuild does not wait for the answer.
    fences = [a for d in (first, second) for a in d.actions if isinstance(a, Fence)]
    assert [(f.member, f.holds_rebuild) for f in fences] == [("r0", False), ("r1", False)]


def test_a_single_silent_member_is_swapped_at_once() -> None:
    core = two_hosts_core()
    decision = fail(core, Failure("j", 1, "r0", 0, FailureReason.HEARTBEAT, {}, 5.0, 6.0), 6.0)
    (rebuild,) = published(decision, Rebuild)
    assert rebuild.ranks == ["s0", "r1", "r2", "r3"]
    (fence,) = [a for a in decision.actions if isinstance(a, Fence)]
    assert fence.holds_rebuild  # it may still run, its launcher beside it: killed before its spare goes


def test_a_lost_host_whose_second_failure_is_lost_is_swapped_after_the_window() -> None:
    core = two_hosts_core()
    first = Failure("j", 1, "r0", 0, FailureReason.HEARTBEAT, {}, 5.0, 6.0, lost_host="a", lost_host_members=2)
    assert published(core.on_failure(first, 6.0), Rebuild) == []
    assert published(core.tick(6.2), Rebuild) == []
    (rebuild,) = published(core.tick(6.31), Rebuild)
    assert rebuild.ranks == ["s0", "r1", "r2", "r3"]


def test_an_exit_is_swapped_after_the_last_call_even_with_other_members_on_its_host() -> None:
    core = two_hosts_core()
    first = core.on_failure(Failure("j", 1, "r0", 0, FailureReason.EXIT, {}, 5.0, 5.0), 5.0)
    assert published(first, Rebuild) == [] and "last call" in first.reason
    assert published(core.tick(5.0 + LAST_CALL_S / 2), Rebuild) == []
    (rebuild,) = published(core.tick(5.0 + LAST_CALL_S), Rebuild)
    assert rebuild.ranks[0] == "s0"


def test_two_failures_within_the_last_call_are_swapped_in_one_generation() -> None:
    core = two_hosts_core()
    core.on_failure(Failure("j", 1, "r0", 0, FailureReason.EXIT, {}, 5.0, 5.0), 5.0)
    second = core.on_failure(Failure("j", 1, "r2", 2, FailureReason.EXIT, {}, 5.015, 5.016), 5.016)  # 15 ms later
    assert published(second, Rebuild) == [] and published(second, GenerationVoid) == []  # already void
    (rebuild,) = published(core.tick(5.0 + LAST_CALL_S), Rebuild)
    assert rebuild.generation == 2 and rebuild.ranks == ["s0", "r1", "s1", "r3"]
    for member in rebuild.ranks:
        decision = core.on_ack(ack(rebuild, member, 5.5), 5.5)
    assert published(decision, Incident) == []  # they end at the first step every rank completes
    assert sorted(i.rank for i in published(first_steps(core, rebuild, 5.9), Incident)) == [0, 2]


def test_a_stale_or_repeated_failure_changes_nothing() -> None:
    core, _ = formed_core()
    fail(core, Failure("j", 1, "r1", 1, FailureReason.EXIT, {}, 5.0, 5.0), 5.0)
    generation = core.jobs["j"].generation
    again = core.on_failure(Failure("j", 1, "r1", 1, FailureReason.ERROR, {}, 5.0, 5.1), 5.1)
    assert again.actions == [] and "not a live member" in again.reason
    assert core.jobs["j"].generation == generation


def test_losing_a_spare_shrinks_the_pool_without_a_new_generation() -> None:
    core, _ = formed_core()
    decision = core.on_failure(Failure("j", 1, "s", -1, FailureReason.EXIT, {}, 5.0, 5.0), 5.0)
    assert published(decision, Rebuild) == [] and core.jobs["j"].membership.spares == []
    assert core.jobs["j"].generation == 1


def test_without_a_spare_the_generation_stays_void_until_one_registers() -> None:
    core, _ = formed_core(spares=())
    decision = fail(core, Failure("j", 1, "r0", 0, FailureReason.EXIT, {}, 5.0, 5.0), 5.0)
    assert published(decision, Rebuild) == [] and published(decision, GenerationVoid)
    assert "waiting for a spare" in core.tick(5.2).reason or core.jobs["j"].membership.vacant_ranks() == [0]
    (again,) = published(core.tick(6.1), GenerationVoid)  # retransmitted while nothing replaces it
    assert again.generation == 1
    _, joined = core.on_hello(hello("late", -1), 9.0)
    (rebuild,) = published(joined, Rebuild)
    assert rebuild.ranks == ["late", "r1"] and rebuild.generation == 2


def test_an_incident_ends_at_every_ranks_first_step_with_its_phases_and_lost_steps() -> None:
    core, _formation = formed_core()
    for rank in range(W):
        for store in ("store0", "store1"):
            core.on_snapshot_complete(SnapshotComplete("j", 1, store, 3, [rank], [10]), 2.0)
    (rebuild,) = published(fail(core, Failure("j", 1, "r1", 1, FailureReason.EXIT, {}, 5.0, 5.01), 5.02), Rebuild)
    early = StepResumed("j", rebuild.generation, "r0", 0, 4, 5.9)  # may be stored before the last ack
    assert published(core.on_step_resumed(early, 5.65), Incident) == []
    assert published(core.on_ack(ack(rebuild, "r0", 5.6, last=4), 5.6), Incident) == []
    assert published(core.on_ack(ack(rebuild, "s", 5.7, source=RestoreSource.STORE), 5.7), Incident) == []
    assert published(core.on_step_resumed(early, 5.91), Incident) == []  # delivered again: counted once
    (incident,) = published(first_steps(core, rebuild, 6.0), Incident)
    assert incident.rank == 1 and incident.replacement == "s" and incident.restore_step == 3
    assert incident.lost_steps == 1  # r0 had completed step 4
    assert incident.t_resumed == pytest.approx(5.7) and incident.t_first_step == pytest.approx(6.0)
    assert incident.downtime_s == pytest.approx(1.0)  # fault to every rank's first step after it
    assert incident.phases["first_step"] == pytest.approx(0.3)
    assert incident.phases["detect"] == pytest.approx(0.01)
    assert incident.phases["decide"] == pytest.approx(LAST_CALL_S + 0.01)
    assert incident.phases["abort"] == pytest.approx(0.25)  # r0 left its collective at 5.25
    assert core.jobs["j"].recovery.pending is None


def test_lost_steps_count_a_survivor_that_restored_from_a_store() -> None:
    """A survivor whose own buffers no longer hold the restore step fetches it: its completed steps
    are lost all the same (this once reported 0 lost steps for a recovery that went back 6)."""
    core, _formation = formed_core()
    for rank in range(W):
        for store in ("store0", "store1"):
            core.on_snapshot_complete(SnapshotComplete("j", 1, store, 1, [rank], [10]), 2.0)
    (rebuild,) = published(fail(core, Failure("j", 1, "r1", 1, FailureReason.EXIT, {}, 5.0, 5.01), 5.02), Rebuild)
    core.on_ack(ack(rebuild, "r0", 5.6, source=RestoreSource.STORE, last=7), 5.6)
    core.on_ack(ack(rebuild, "s", 5.7, source=RestoreSource.STORE), 5.7)
    (incident,) = published(first_steps(core, rebuild, 5.8), Incident)
    assert incident.restore_step == 1 and incident.lost_steps == 6


def test_a_broken_group_with_every_rank_alive_is_regrouped_without_a_spare() -> None:
    core, formation = formed_core()
    for rank in range(W):
        for store in ("store0", "store1"):
            core.on_snapshot_complete(SnapshotComplete("j", 1, store, 5, [rank], [10]), 2.0)
    broken = GroupBroken("j", 1, 2, members_digest(["r1", "r0"]), {"first_to_leave": "r1"}, 5.0, 7.0)
    (rebuild,) = published(core.on_group_broken(broken, 7.0), Rebuild)
    assert rebuild.generation == 2 and rebuild.ranks == formation.ranks and rebuild.spares == ["s"]
    assert rebuild.restore_step == 5
    assert published(core.on_group_broken(broken, 7.1), Rebuild) == []  # stale: generation 1 is gone
    core.on_ack(ack(rebuild, "r0", 7.3, last=6), 7.3)
    core.on_ack(ack(rebuild, "r1", 7.4, last=6), 7.4)
    (incident,) = published(first_steps(core, rebuild, 7.5), Incident)
    assert (incident.reason, incident.rank, incident.member, incident.replacement) == ("group", 1, "r1", "r1")
    assert incident.lost_steps == 1 and incident.detect_s == pytest.approx(2.0)


def test_a_broken_group_waits_for_a_failure_rebuild_that_is_coming() -> None:
    core, _ = formed_core(spares=())
    fail(core, Failure("j", 1, "r1", 1, FailureReason.EXIT, {}, 5.0, 5.0), 5.0)  # no spare: rank 1 stays vacant
    late = GroupBroken("j", 1, 1, members_digest(["r0"]), {}, 5.0, 7.0)
    decision = core.on_group_broken(late, 7.0)
    assert decision.actions == [] and "under way" in decision.reason


def test_a_rebuild_whose_members_all_gave_up_forming_it_is_superseded_by_a_regroup() -> None:
    core, _ = formed_core()
    (first,) = published(fail(core, Failure("j", 1, "r1", 1, FailureReason.EXIT, {}, 5.0, 5.0), 5.0), Rebuild)
    broken = GroupBroken("j", 2, 2, members_digest(first.ranks), {"first_to_leave": first.ranks[0]}, 6.0, 8.0)
    (regroup,) = published(core.on_group_broken(broken, 8.0), Rebuild)
    assert regroup.generation == 3 and regroup.ranks == first.ranks
    assert regroup.rendezvous_member != first.rendezvous_member or len(set(first.ranks) - {"s"}) == 1


def test_a_second_failure_during_a_rebuild_supersedes_it_at_once() -> None:
    core, _ = formed_core(spares=("s1", "s2"))
    (first,) = published(fail(core, Failure("j", 1, "r1", 1, FailureReason.EXIT, {}, 5.0, 5.0), 5.0), Rebuild)
    superseding = core.on_failure(Failure("j", 2, first.ranks[1], 1, FailureReason.EXIT, {}, 5.2, 5.2), 5.2)
    (void,) = published(superseding, GenerationVoid)
    (second,) = published(superseding, Rebuild)  # no last call: the rebuild under way cannot form
    assert void.generation == first.generation
    assert second.generation == first.generation + 1 and second.ranks[1] not in first.ranks
    assert published(core.on_ack(ack(first, "r0", 6.0), 6.0), Incident) == []  # stale generation
    assert published(first_steps(core, first, 6.05), Incident) == []  # first steps of a superseded generation
    core.on_ack(ack(second, "r0", 6.1), 6.1)
    core.on_ack(ack(second, second.ranks[1], 6.2, source=RestoreSource.STORE), 6.2)
    incidents = published(first_steps(core, second, 6.4), Incident)
    assert len(incidents) == 2 and {i.t_first_step for i in incidents} == {6.4}


def test_an_incident_whose_first_steps_never_come_is_published_after_the_bound_without_them() -> None:
    core, _ = formed_core()
    wait_s = core.config.first_step_wait_s
    (rebuild,) = published(fail(core, Failure("j", 1, "r1", 1, FailureReason.EXIT, {}, 5.0, 5.0), 5.0), Rebuild)
    for member in rebuild.ranks:
        core.on_ack(
            ack(rebuild, member, 5.5, source=RestoreSource.STORE if member == "s" else RestoreSource.LOCAL), 5.5
        )
    assert published(core.tick(5.5 + wait_s / 2), Incident) == []
    assert core.tick_job("j", 5.5 + wait_s - 0.5).next_at == 5.5 + wait_s  # the tick lands on the bound
    (incident,) = published(core.tick(5.5 + wait_s), Incident)
    assert incident.t_first_step == 0.0 and incident.downtime_s == pytest.approx(0.5)  # to the acks
    assert "first_step" in incident.evidence


def test_a_step_commits_when_every_rank_is_complete_on_all_its_stores() -> None:
    core, _formation = formed_core()
    events = [(r, s) for r in range(W) for s in ("store0", "store1")]
    for rank, store in events[:-1]:
        decision = core.on_snapshot_complete(SnapshotComplete("j", 1, store, 6, [rank], [10]), 2.0)
        assert published(decision, Commit) == []
    rank, store = events[-1]
    decision = core.on_snapshot_complete(SnapshotComplete("j", 1, store, 6, [rank], [10]), 2.0)
    (commit,) = published(decision, Commit)
    assert commit.step == 6 and core.jobs["j"].ledger.committed_step == 6
    assert commit.t_decided == 2.0  # the decision's instant on the wall clock (this core's offset is 0)


def test_snapshots_of_an_abandoned_timeline_do_not_commit() -> None:
    core, _formation = formed_core()
    fail(core, Failure("j", 1, "r1", 1, FailureReason.EXIT, {}, 5.0, 5.0), 5.0)  # restore step 0
    for rank in range(W):
        for store in ("store0", "store1"):
            late = SnapshotComplete("j", 1, store, 3, [rank], [10])
            assert "stale" in core.on_snapshot_complete(late, 5.5).reason
    assert core.jobs["j"].ledger.committed_step == -1


def test_the_job_finishes_when_every_rank_of_the_generation_is_done() -> None:
    core, _ = formed_core()
    assert published(core.on_done(MemberDone("j", 1, "r0", 0, 10), 9.0), JobFinished) == []
    (finished,) = published(core.on_done(MemberDone("j", 1, "r1", 1, 10), 9.1), JobFinished)
    assert finished.step == 10 and core.jobs["j"].finished
    reply, _ = core.on_hello(hello("late", -1), 10.0)
    assert not reply.accepted
    (again,) = published(core.on_done(MemberDone("j", 1, "r1", 1, 10), 11.0), JobFinished)  # a retransmitted done
    assert again.step == 10 and not again.failed


def test_a_done_counts_only_from_the_ranks_own_member_at_the_jobs_last_step() -> None:
    """Forged dones once ended a job at step 5 of 40, its final save run and every exit code 0: a done
    for a rank its sender does not hold, or below the committed step, is refused; ranks done at different
    steps finish nothing, until each says the step the others did (a member's later done replaces its
    earlier one)."""
    core, _formation = formed_core()
    for rank in range(W):
        for store in ("store0", "store1"):
            core.on_snapshot_complete(SnapshotComplete("j", 1, store, 6, [rank], [10]), 2.0)
    assert core.jobs["j"].ledger.committed_step == 6
    assert "does not hold" in core.on_done(MemberDone("j", 1, "r0", 1, 40), 3.0).reason
    assert "below the committed step" in core.on_done(MemberDone("j", 1, "r1", 1, 5), 3.0).reason
    assert core.jobs["j"].membership.done == {}
    assert published(core.on_done(MemberDone("j", 1, "r0", 0, 7), 3.0), JobFinished) == []  # forged, for r0
    assert "different steps" in core.on_done(MemberDone("j", 1, "r1", 1, 40), 3.1).reason
    assert not core.jobs["j"].finished
    (finished,) = published(core.on_done(MemberDone("j", 1, "r0", 0, 40), 3.2), JobFinished)  # r0's own
    assert finished.step == 40 and core.jobs["j"].finished


def test_a_silent_store_is_left_out_of_new_placements() -> None:
    core = SwapperCore(SwapperConfig(replication=2, store_timeout_s=5.0))
    core.on_store_status(StoreStatus("old", "127.0.0.1", 5000, 0, 100, 0, 0.0), 0.0)
    core.on_store_status(StoreStatus("fresh", "127.0.0.1", 5001, 0, 100, 0, 9.0), 9.0)
    core.on_hello(hello("r0", 0), 9.0)
    _, decision = core.on_hello(hello("r1", 1), 9.0)
    (rebuild,) = published(decision, Rebuild)
    assert [s.store for s in rebuild.stores] == ["fresh"]


def test_a_spare_that_registers_fills_a_vacant_rank_even_while_a_rebuild_is_pending() -> None:
    core, _ = formed_core()
    (first,) = published(fail(core, Failure("j", 1, "r1", 1, FailureReason.EXIT, {}, 5.0, 5.0), 5.0), Rebuild)
    core.on_failure(
        Failure("j", 2, first.ranks[1], 1, FailureReason.EXIT, {}, 5.3, 5.3), 5.3
    )  # the only spare dies too
    assert core.jobs["j"].membership.vacant_ranks() == [1] and core.jobs["j"].recovery.pending is not None
    _, joined = core.on_hello(hello("respawned", -1), 8.0)
    (rebuild,) = published(joined, Rebuild)
    assert rebuild.generation == first.generation + 1 and rebuild.ranks == ["r0", "respawned"]


@pytest.mark.parametrize(
    "cause", [MemberErrorCause.USER_CODE, MemberErrorCause.SNAPSHOT_UNAVAILABLE, MemberErrorCause.REPLICAS_DISAGREE]
)
def test_a_member_that_cannot_go_on_for_a_reason_a_spare_shares_ends_the_job_with_it(cause: MemberErrorCause) -> None:
    core, _ = formed_core()
    evidence = {"error": "TypeError: boom"}
    decision = core.on_failure(Failure("j", 1, "r1", 1, FailureReason.ERROR, evidence, 5.0, 5.0, cause=cause), 5.0)
    (ended,) = published(decision, JobFinished)
    assert ended.failed and cause in ended.reason and "TypeError: boom" in ended.reason and "rank 1" in ended.reason
    assert published(decision, Rebuild) == [] and core.jobs["j"].finished
    assert "the job has ended" in core.on_hello(hello("late", -1), 6.0)[0].reason
    (told,) = published(core.on_done(MemberDone("j", 1, "r0", 0, 3), 7.0), JobFinished)
    assert told.failed and told.reason == ended.reason


@pytest.mark.parametrize("cause", [MemberErrorCause.STEP, MemberErrorCause.STUCK_COLLECTIVE])
def test_an_exception_in_a_step_or_a_collective_gloo_cannot_release_is_swapped_not_fatal(
    cause: MemberErrorCause,
) -> None:
    core, _ = formed_core()
    evidence = {"error": "InjectedFaultError"}
    failure = Failure("j", 1, "r1", 1, FailureReason.ERROR, evidence, 5.0, 5.0, cause=cause)
    (rebuild,) = published(fail(core, failure, 5.0), Rebuild)
    assert rebuild.ranks == ["r0", "s"] and not core.jobs["j"].finished


def test_no_decision_reads_a_verdicts_evidence() -> None:
    """Evidence is for people: text that claims a job-ending cause or a lost host changes nothing."""
    core, _ = formed_core()
    evidence = {"cause": "user_code", "host": "a", "host_members_silent": "2", "lost_host": "a"}
    decision = fail(core, Failure("j", 1, "r1", 1, FailureReason.ERROR, evidence, 5.0, 5.0), 5.0)
    (rebuild,) = published(decision, Rebuild)  # swapped at once: not ended, and no wait for a host
    assert rebuild.ranks == ["r0", "s"] and not core.jobs["j"].finished and not core.jobs["j"].recovery.silent_hosts


def test_generations_that_never_form_end_the_job_after_the_bound() -> None:
    core = SwapperCore(SwapperConfig(replication=1, store_timeout_s=1e9, rebuild_attempts_max=3))
    core.on_store_status(StoreStatus("store0", "127.0.0.1", 5000, 0, 100, 0, 0.0), 0.0)
    core.on_hello(hello("r0", 0), 0.0)
    (formation,) = published(core.on_hello(hello("r1", 1), 0.0)[1], Rebuild)
    generation, ended = formation.generation, []
    for t in range(1, 10):  # every attempt breaks before it forms, every rank alive
        broken = GroupBroken("j", generation, 2, members_digest(["r0", "r1"]), {}, float(t), float(t))
        decision = core.on_group_broken(broken, float(t))
        ended = published(decision, JobFinished)
        if ended:
            break
        (rebuild,) = published(decision, Rebuild)
        generation = rebuild.generation
    assert ended and ended[0].failed and "3 generations in a row did not form" in ended[0].reason
    assert generation == 3


def test_a_rendezvous_host_is_not_named_twice_in_a_row_when_generations_fail() -> None:
    core, _ = formed_core(spares=("s1", "s2"))
    (first,) = published(fail(core, Failure("j", 1, "r1", 1, FailureReason.EXIT, {}, 5.0, 5.0), 5.0), Rebuild)
    broken = GroupBroken("j", first.generation, 2, members_digest(first.ranks), {}, 6.0, 8.0)
    (second,) = published(core.on_group_broken(broken, 8.0), Rebuild)
    assert first.rendezvous_member == "r0" and second.rendezvous_member == first.ranks[1]


def test_a_host_whose_rendezvous_address_fails_is_left_for_another_host_before_its_next_member() -> None:
    """Hosts a and b hold two ranks each. Generation 1's rendezvous, on a's address, never forms (the
    others cannot reach it): the next attempt goes to b's address, not to a's second member, whose
    address is the same (a host of 8 ranks was once tried 8 times in a row)."""
    core = SwapperCore(SwapperConfig(replication=1, store_timeout_s=1e9))
    core.on_store_status(StoreStatus("store0", "127.0.0.1", 5000, 0, 100, 0, 0.0), 0.0)
    addresses = {"a0": "10.0.0.1", "a1": "10.0.0.1", "b0": "10.0.0.2", "b1": "10.0.0.2"}
    decisions = [
        core.on_hello(MemberHello("j", 0, m, m[0], 100, f"l-{m[0]}", r, 4, addresses[m], 4000 + r, 0.0), 0.1)[1]
        for r, m in enumerate(addresses)
    ]
    (formation,) = [r for d in decisions for r in published(d, Rebuild)]
    named = [formation.rendezvous_member]
    generation = formation.generation
    for t in (30.0, 60.0):  # each generation's group breaks before it forms
        broken = GroupBroken("j", generation, 2, members_digest(formation.ranks), {}, t, t)
        (rebuild,) = published(core.on_group_broken(broken, t), Rebuild)
        named.append(rebuild.rendezvous_member)
        generation = rebuild.generation
    assert named == ["a0", "b0", "a1"], named


def test_generations_only_grow_and_each_is_announced_once_in_a_storm_of_failures() -> None:
    core, _ = formed_core(spares=("s1", "s2", "s3", "s4"))
    seen: list[int] = []
    t = 5.0
    for _ in range(4):
        state = core.jobs["j"]
        victim = state.membership.ranks[1]
        decision = core.on_failure(Failure("j", state.generation, victim, 1, FailureReason.EXIT, {}, t, t), t)
        decision = Decision(decision.actions + core.tick(t + LAST_CALL_S).actions, "")
        seen += [r.generation for r in published(decision, Rebuild)]
        t += 0.2
    assert seen == sorted(set(seen)) and len(seen) == 4


def test_a_rank_lost_during_formation_starts_the_next_generation_fresh_again() -> None:
    """Nobody may have stored step 0 yet: restoring it would end the job for want of a snapshot."""
    core = SwapperCore(SwapperConfig(replication=1, store_timeout_s=1e9))
    core.on_store_status(StoreStatus("store0", "127.0.0.1", 5000, 0, 100, 0, 0.0), 0.0)
    core.on_hello(hello("r0", 0), 0.0)
    core.on_hello(hello("s", -1), 0.0)
    (formation,) = published(core.on_hello(hello("r1", 1), 0.0)[1], Rebuild)
    core.on_ack(ack(formation, "r0", 1.0, source=RestoreSource.FRESH), 1.0)  # r1 dies before it acks
    (again,) = published(fail(core, Failure("j", 1, "r1", 1, FailureReason.EXIT, {}, 1.5, 1.5), 1.5), Rebuild)
    assert again.generation == 2 and again.ranks == ["r0", "s"] and again.restore_step == -1
    for member in again.ranks:
        core.on_ack(ack(again, member, 3.0, source=RestoreSource.FRESH), 3.0)
    core.on_hello(hello("s2", -1, host="h1"), 4.0)  # on another host: no crash copy of rank 1 there
    (later,) = published(fail(core, Failure("j", 2, "s", 1, FailureReason.EXIT, {}, 5.0, 5.0), 5.0), Rebuild)
    assert later.restore_step == 0  # formed now: a committed step (at least step 0) is restored


def test_a_snapshot_report_from_a_store_the_rank_is_not_placed_on_counts_for_nothing() -> None:
    """Forged completions once committed step 5,000 while the job was at step 48: a report counts only
    from a store the rank's placement names."""
    core, _formation = formed_core()
    for rank in range(W):
        for store in ("rogue-0", "rogue-1"):
            decision = core.on_snapshot_complete(SnapshotComplete("j", 1, store, 50, [rank], [10]), 2.0)
            assert "not placed there" in decision.reason
    assert core.jobs["j"].ledger.committed_step == -1 and core.jobs["j"].ledger.completes == {}
