"""The swapper core when DeadPool's own parts fail: every store lost, a stale view of the stores, a
store back on a new address, clocks that step, a job flooded with members; and its tick, which must
never ask to run again in the past (the worker would spin and stop reading events)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from deadpool_protocol import (
    Failure,
    FailureReason,
    GenerationVoid,
    JobFinished,
    MemberHello,
    Placement,
    Rebuild,
    RebuildAck,
    RebuildMarks,
    RestoreSource,
    StoreStatus,
)
from deadpool_swapper.core import SwapperConfig, SwapperCore
from tests.unit.test_store_loss import STORES, announce, complete, formed, published

W = 2


def spare(core: SwapperCore, now: float, name: str = "spare") -> None:
    core.on_hello(MemberHello("j", 0, name, "h9", 100, "l-h9", -1, W, "127.0.0.1", 4000, now), now)


def test_a_failure_handled_while_the_stores_view_is_stale_becomes_a_rebuild_once_they_are_heard() -> None:
    """After a NATS hiccup, a paused loop or a takeover no store status is fresh: the failure's rebuild
    was dropped ("no snapshot store is alive") and nothing retried it (0 rebuilds in 600 s)."""
    core, formation = formed()
    complete(core, 4, formation.placement, 0.5)
    spare(core, 0.6)
    core.reset_store_view(10.0)  # the swapper heard nothing from 0.6 s to 10 s
    core.on_failure(Failure("j", 1, "r1", 1, FailureReason.EXIT, {}, 10.0, 10.0), 10.0)
    waiting = core.tick(10.1)
    assert published(waiting, Rebuild) == [] and waiting.next_at <= 10.0 + core.config.store_timeout_s
    announce(core, 10.4)  # the stores speak again: alive all along, holding step 4
    (rebuild,) = published(core.tick(10.4), Rebuild)
    assert rebuild.restore_step == 4 and not rebuild.durable and rebuild.ranks[1] == "spare"


def test_after_a_pause_a_failure_restores_the_newest_step_complete_on_stores_heard_again() -> None:
    """The loop paused 2.8 s (both swappers SIGSTOPped in `bench/chaos.py`'s `stale_stores`) while the
    ranks trained on. On waking, the completes stored meanwhile came in while every store's status was
    older than `store_timeout_s`, so none counted and no step committed; then one store's status made
    the view count as known, and the failure restored the step committed before the pause: 3 and 4
    steps lost in two chaos runs, where the promise is at most one."""
    core, formation = formed()
    complete(core, 4, formation.placement, 0.5)
    spare(core, 0.6)
    announce(core, 0.9)
    core.reset_store_view(3.7, heard_until=0.9)  # paused from 0.9 s to 3.7 s
    for step in (5, 6, 7):  # stored during the pause, read on waking
        assert complete(core, step, formation.placement, 3.7) == []
    core.on_failure(Failure("j", 1, "r1", 1, FailureReason.EXIT, {}, 3.7, 3.7), 3.7)
    first = next(s for s in STORES if s not in formation.placement[1])
    announce(core, 3.8, (first,))  # the first store heard again holds none of rank 1's copies
    assert published(core.tick(3.9), Rebuild) == []  # the others have not had a timeout to be heard
    announce(core, 4.0)
    (rebuild,) = published(core.tick(4.0), Rebuild)
    assert rebuild.restore_step == 7 and not rebuild.durable, rebuild
    assert core.jobs["j"].ledger.committed_step == 7


def test_after_a_pause_a_store_that_stays_silent_counts_as_lost_once_the_view_has_had_its_timeout() -> None:
    core, formation = formed()
    complete(core, 4, formation.placement, 0.5)
    spare(core, 0.6)
    announce(core, 0.9)
    core.reset_store_view(3.7, heard_until=0.9)
    lost = formation.placement[1][0]
    others = tuple(s for s in STORES if s != lost)
    core.on_failure(Failure("j", 1, "r1", 1, FailureReason.EXIT, {}, 3.7, 3.7), 3.7)
    announce(core, 3.8, others)
    assert published(core.tick(3.9), Rebuild) == []  # `lost` may just be unheard
    announce(core, 5.2, others)
    (rebuild,) = published(core.tick(5.2), Rebuild)  # 3.7 + 1.5 s: silent for a whole timeout, lost
    assert rebuild.restore_step == 4 and all(lost not in names for names in rebuild.placement), rebuild


def test_a_vacant_rank_is_rebuilt_when_its_rebuild_could_not_go_out_at_once() -> None:
    core, formation = formed()
    complete(core, 4, formation.placement, 0.5)
    core.reset_store_view(2.0)  # nothing heard from the stores since 0 s, nor by this process since 2 s
    core.on_failure(Failure("j", 1, "r1", 1, FailureReason.EXIT, {}, 2.0, 2.0), 2.0)
    core.tick(2.1)  # the last call ends: no spare yet
    spare(core, 2.2)  # the spare comes while the view is still stale: nothing goes out yet
    assert core.jobs["j"].recovery.pending is None
    for t in (2.5, 3.0, 3.4):
        assert published(core.tick(t), Rebuild) == []
    (rebuild,) = published(core.tick(3.6), Rebuild)  # the view is fresh: every store is lost for real
    assert rebuild.ranks == ["r0", "spare"] and rebuild.placement == [[], []]


def test_with_every_store_lost_a_swap_restores_from_the_durable_tier_or_the_job_ends_saying_why() -> None:
    core, formation = formed()
    complete(core, 4, formation.placement, 0.5)
    spare(core, 0.6)
    core.on_failure(Failure("j", 1, "r1", 1, FailureReason.EXIT, {}, 5.0, 5.0), 5.0)
    (rebuild,) = published(core.tick(5.1), Rebuild)
    assert (
        rebuild.durable
        and rebuild.stores == []
        and "durable" in core.jobs["j"].incident_log.open_incidents[0].evidence.values()
    )
    marks = RebuildMarks(received=5.2)
    no_tier = RebuildAck("j", rebuild.generation, "spare", 1, -1, -1, RestoreSource.UNAVAILABLE, marks, 5.3)
    (ended,) = published(core.on_ack(no_tier, 5.3), JobFinished)
    assert ended.failed and "durable" in ended.reason


def test_every_store_lost_is_told_to_the_members_and_kept_as_unprotected_until_one_returns() -> None:
    core, formation = formed()
    complete(core, 4, formation.placement, 0.5)
    assert core.jobs["j"].protection.unprotected_since is None
    (empty,) = published(core.tick(2.0), Placement)  # nobody heard since 0 s: every store lost
    assert empty.placement == [[], []] and empty.stores == [] and "unprotected" in empty.reason
    state = core.jobs["j"]
    assert state.protection.unprotected_since == 2.0 and state.protection.unprotected_step == 4
    announce(core, 9.0, ("store2",))  # a store comes back
    (back,) = published(core.tick(9.0), Placement)
    assert back.placement == [["store2"], ["store2"]] and [s.store for s in back.stores] == ["store2"]
    assert state.protection.unprotected_since is None


def test_a_store_restarted_on_a_new_address_is_announced_whenever_in_its_loss_window_it_returns() -> None:
    for back_after_s in (0.2, 1.4, 1.6, 5.0):
        core, formation = formed()
        complete(core, 4, formation.placement, 0.5)
        victim = formation.placement[0][0]
        others = tuple(s for s in STORES if s != victim)
        t_kill = 1.0
        announce(core, t_kill)
        t = t_kill
        while t < t_kill + back_after_s:  # the others go on announcing; the tick runs as it asks
            t = min(core.tick(t).next_at, t_kill + back_after_s)
            announce(core, t, others)
        moved = StoreStatus(victim, "10.0.0.42", 7777, 0, 10**9, 0, t, node="node9", incarnation="again")
        core.on_store_status(moved, t)
        placements = published(core.tick(t), Placement)
        named = [p for p in placements if any(s.store == victim and s.port == 7777 for s in p.stores)]
        if victim in {n for names in core.jobs["j"].stores.placement for n in names}:
            assert named, f"back after {back_after_s} s: no placement with its new address"
            assert named[-1].stores == sorted(named[-1].stores, key=lambda s: s.store)
        else:  # its ranks had moved to the other stores: it is not needed, so not named
            assert placements == [] or all(victim not in names for p in placements for names in p.placement)


def test_timers_follow_the_monotonic_clock_and_stamps_the_wall_clock_however_it_steps() -> None:
    wall = [1_000_000.0]
    core = SwapperCore(SwapperConfig(replication=2, store_timeout_s=1e9), wall_offset=lambda: wall[0])
    announce(core, 0.0)
    for rank in range(W):
        core.on_hello(MemberHello("j", 0, f"r{rank}", "h0", 1, "l-h0", rank, W, "127.0.0.1", 4000, 0.0), 0.0)
    formation = core.jobs["j"].recovery.pending
    assert formation is not None and formation.command.t_decided == 1_000_000.0
    for member in formation.command.ranks:
        core.on_ack(
            RebuildAck(
                "j", 1, member, formation.command.rank_of(member), -1, -1, RestoreSource.FRESH, RebuildMarks(), 0.0
            ),
            0.1,
        )
    spare(core, 0.2)
    core.on_failure(Failure("j", 1, "r1", 1, FailureReason.EXIT, {}, 1.0, 1.0), 1.0)
    wall[0] -= 3600.0  # the wall clock steps back an hour during the last call
    (rebuild,) = published(core.tick(1.0 + core.config.last_call_s), Rebuild)
    assert rebuild.t_decided == 1.0 + core.config.last_call_s + wall[0]
    wall[0] += 7200.0  # and forward two
    voids = published(core.tick(1.2), GenerationVoid)
    assert voids == [] and published(core.tick(1.0 + core.config.last_call_s + 1.0), Rebuild) == [rebuild]


def test_a_hello_past_the_members_a_job_may_have_is_refused_saying_so() -> None:
    core = SwapperCore(SwapperConfig(members_max=3))
    announce(core, 0.0)
    replies = [
        core.on_hello(MemberHello("j", 0, f"m{i}", "h", 1, "l0", -1, 100, "127.0.0.1", 4000, 0.0), 0.0)[0]
        for i in range(4)
    ]
    assert [r.accepted for r in replies] == [True, True, True, False]
    assert "members_max" in replies[3].reason


EVENTS = st.lists(
    st.tuples(
        st.sampled_from(["tick", "fail_r0", "fail_r1", "fail_spare", "spare", "stores", "some_stores", "view", "ack"]),
        st.floats(min_value=0.0, max_value=5.0),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(EVENTS)
def test_a_tick_never_asks_to_run_again_in_the_past_and_a_second_tick_at_once_has_nothing_to_do(
    events: list[tuple[str, float]],
) -> None:
    core, _ = formed()
    now = 0.0
    spares = 0
    for kind, gap in events:
        now += gap
        state = core.jobs.get("j")
        generation = state.generation if state else 1
        if kind == "fail_r0" or kind == "fail_r1":
            member = state.membership.ranks[int(kind[-1])] if state and state.membership.ranks else "r0"
            core.on_failure(Failure("j", generation, member, 0, FailureReason.EXIT, {}, now, now), now)
        elif kind == "fail_spare" and state and state.membership.spares:
            core.on_failure(
                Failure("j", generation, state.membership.spares[0], -1, FailureReason.EXIT, {}, now, now), now
            )
        elif kind == "spare":
            spares += 1
            spare(core, now, f"spare{spares}")
        elif kind == "stores":
            announce(core, now)
        elif kind == "some_stores":
            announce(core, now, STORES[:1])
        elif kind == "view":
            core.reset_store_view(now, heard_until=now - gap)  # a pause as long as the gap
        elif kind == "ack" and state and state.recovery.pending:
            command = state.recovery.pending.command
            for member in command.ranks:
                ack = RebuildAck(
                    "j",
                    command.generation,
                    member,
                    command.rank_of(member),
                    -1,
                    -1,
                    RestoreSource.LOCAL,
                    RebuildMarks(),
                    now,
                )
                core.on_ack(ack, now)
        decision = core.tick_job("j", now)
        assert decision.next_at > now, f"{kind}: the next tick asked for {decision.next_at} at {now}"
        again = core.tick_job("j", now)
        assert again.actions == [], f"{kind}: a second tick at the same moment acted: {again.reason}"
