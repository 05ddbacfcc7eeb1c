"""A job name holds one run at a time: a finished job's name can be launched again (its record archived,
its generations going on), a name that runs refuses a second run saying which holds it, and members
that no launcher started cannot take a name."""

from __future__ import annotations

from deadpool_protocol import (
    Failure,
    FailureReason,
    GenerationVoid,
    GroupBroken,
    JobFinished,
    MemberDone,
    MemberHello,
    Placement,
    Rebuild,
    RebuildAck,
    RebuildMarks,
    RestoreSource,
    RunStart,
    SnapshotComplete,
    StoreStatus,
)
from deadpool_protocol.messages import members_digest
from deadpool_swapper.core import Archive, Persist, SwapperConfig, SwapperCore
from tests.unit.test_swapper_core import published

W = 2


def core_with_store(runs_required: bool = True) -> SwapperCore:
    core = SwapperCore(SwapperConfig(replication=1, store_timeout_s=1e9, runs_required=runs_required))
    core.on_store_status(StoreStatus("s0", "127.0.0.1", 5000, 0, 10**9, 0, 0.0), 0.0)
    return core


def hello(member: str, hint: int, run: str, world_size: int = W) -> MemberHello:
    return MemberHello("j", 0, member, "h0", 1, "l0", hint, world_size, "127.0.0.1", 4000, 0.0, run=run)


def run_to_the_end(core: SwapperCore, run: str, now: float) -> Rebuild:
    """Start `run`, form it with two members, and finish it."""
    reply, _ = core.on_run_start(RunStart("j", 0, run, W, "l0", now), now)
    assert reply.accepted, reply.reason
    decisions = [core.on_hello(hello(f"{run}-m{r}", r, run), now)[1] for r in range(W)]
    (formation,) = [m for d in decisions for m in published(d, Rebuild)]
    for rank, member in enumerate(formation.ranks):
        core.on_ack(
            RebuildAck("j", formation.generation, member, rank, -1, -1, RestoreSource.FRESH, RebuildMarks(), now), now
        )
    for rank, member in enumerate(formation.ranks):
        decision = core.on_done(MemberDone("j", formation.generation, member, rank, 10), now)
    assert published(decision, JobFinished) and core.jobs["j"].finished
    assert isinstance(formation, Rebuild)
    return formation


def test_a_finished_job_name_is_launched_again_as_a_new_run_with_generations_going_on() -> None:
    core = core_with_store()
    first = run_to_the_end(core, "first", 1.0)
    late, _ = core.on_hello(hello("first-spare", -1, "first"), 2.0)
    assert not late.accepted and late.finished  # a late member of the ended run is told it ended
    reply, decision = core.on_run_start(RunStart("j", 0, "second", W, "l1", 3.0), 3.0)
    assert reply.accepted
    (archived,) = [a.state for a in decision.actions if isinstance(a, Archive)]
    assert archived.run == "first" and archived.finished and Persist("j") in decision.actions
    stale, _ = core.on_hello(hello("first-spare", -1, "first"), 3.1)
    assert not stale.accepted and "run" in stale.reason
    decisions = [core.on_hello(hello(f"second-m{r}", r, "second"), 4.0)[1] for r in range(W)]
    (formation,) = [m for d in decisions for m in published(d, Rebuild)]
    assert formation.generation == first.generation + 1, "generations only grow, across runs too"
    assert formation.restore_step == -1 and formation.ranks == ["second-m0", "second-m1"]


def test_a_second_run_of_a_running_job_is_refused_saying_which_run_holds_the_name() -> None:
    core = core_with_store()
    core.on_run_start(RunStart("j", 0, "real", W, "l0", 1.0), 1.0)
    for r in range(W):
        core.on_hello(hello(f"m{r}", r, "real"), 1.0)
    refused, decision = core.on_run_start(RunStart("j", 0, "other", 1, "l9", 2.0), 2.0)
    assert not refused.accepted and "real" in refused.reason and decision.actions == []
    again, _ = core.on_run_start(RunStart("j", 0, "real", W, "l1", 2.0), 2.0)  # another launcher of it
    assert again.accepted
    wrong, _ = core.on_run_start(RunStart("j", 0, "real", W + 1, "l2", 2.0), 2.0)
    assert not wrong.accepted and "world size" in wrong.reason


def test_members_no_launcher_started_cannot_take_a_name() -> None:
    """The first hello used to fix a name's world size for good: one hello squatted it."""
    core = core_with_store()
    squat, _ = core.on_hello(hello("squatter", 0, "", world_size=1), 1.0)
    assert not squat.accepted and "deadpool launch" in squat.reason and "j" not in core.jobs
    reply, _ = core.on_run_start(RunStart("j", 0, "real", W, "l0", 2.0), 2.0)
    assert reply.accepted and core.jobs["j"].membership.world_size == W


def test_undeclared_members_gathering_make_way_for_a_started_run() -> None:
    core = core_with_store(runs_required=False)
    core.on_hello(hello("loose", 0, "", world_size=8), 1.0)  # a name taken by a hello alone, not formed
    reply, _ = core.on_run_start(RunStart("j", 0, "real", W, "l0", 2.0), 2.0)
    assert (
        reply.accepted
        and core.jobs["j"].membership.world_size == W
        and "loose" not in core.jobs["j"].membership.members
    )


def held_job(hold_s: float) -> tuple[SwapperCore, Rebuild]:
    """A formed job whose run holds training when every store is lost, its step 4 committed."""
    core = SwapperCore(SwapperConfig(replication=1, store_timeout_s=1.5))
    core.on_store_status(StoreStatus("s0", "127.0.0.1", 5000, 0, 10**9, 0, 0.0), 0.0)
    core.on_run_start(RunStart("j", 0, "r", W, "l0", 0.0, hold_without_stores_s=hold_s), 0.0)
    decisions = [core.on_hello(hello(f"m{r}", r, "r"), 0.0)[1] for r in range(W)]
    (formation,) = [m for d in decisions for m in published(d, Rebuild)]
    for rank, member in enumerate(formation.ranks):
        core.on_ack(RebuildAck("j", 1, member, rank, -1, -1, RestoreSource.FRESH, RebuildMarks(), 0.0), 0.0)
    core.on_snapshot_complete(SnapshotComplete("j", 1, "s0", 4, list(range(W)), [100] * W), 0.5)
    assert core.jobs["j"].ledger.committed_step == 4
    return core, formation


def test_a_run_that_holds_training_without_stores_stops_every_rank_and_resumes_from_their_own_buffers() -> None:
    core, formation = held_job(hold_s=60.0)
    lost = core.tick(2.0)  # the store's 1.5 s are over: every store is lost
    (void,) = published(lost, GenerationVoid)
    assert void.generation == 1 and "held" in void.reason and core.jobs["j"].protection.held_since == 2.0
    broken = GroupBroken("j", 1, len(formation.ranks), members_digest(formation.ranks), {}, 3.0, 7.0)
    assert core.on_group_broken(broken, 7.0).actions == []  # awaiting, as held: no regroup yet
    assert published(core.tick(30.0), Rebuild) == []
    core.on_store_status(StoreStatus("s1", "127.0.0.1", 5001, 0, 10**9, 0, 31.0), 31.0)  # a store is back
    (resume,) = published(core.tick(31.0), Rebuild)
    assert resume.local and not resume.durable and resume.restore_step == -1
    assert resume.ranks == formation.ranks and resume.placement == [["s1"], ["s1"]]
    for rank, member in enumerate(resume.ranks):  # the ranks agreed on step 9, beyond the last commit
        core.on_ack(
            RebuildAck("j", resume.generation, member, rank, 9, 10, RestoreSource.LOCAL, RebuildMarks(), 32.0), 32.0
        )
    state = core.jobs["j"]
    assert state.ledger.committed_step == 9 and state.protection.held_since is None and state.recovery.pending is None


def test_a_hold_past_its_bound_ends_the_job_saying_why() -> None:
    core, _ = held_job(hold_s=60.0)
    core.tick(2.0)
    assert published(core.tick(61.9), JobFinished) == []
    (ended,) = published(core.tick(62.0), JobFinished)
    assert ended.failed and "none came back within 60 s" in ended.reason


def test_without_the_hold_policy_training_goes_on_unprotected() -> None:
    core, _ = held_job(hold_s=0.0)
    decision = core.tick(2.0)
    assert published(decision, GenerationVoid) == [] and core.jobs["j"].protection.held_since is None
    (placement,) = published(decision, Placement)
    assert "unprotected" in placement.reason


def test_a_rank_lost_while_training_is_held_is_swapped_and_the_new_generation_held_too() -> None:
    core, formation = held_job(hold_s=60.0)
    core.on_hello(hello("spare", -1, "r"), 0.1)
    core.tick(2.0)  # every store lost: held
    core.on_failure(Failure("j", 1, formation.ranks[1], 1, FailureReason.EXIT, {}, 3.0, 3.0), 3.0)
    (swap,) = published(core.tick(3.1), Rebuild)  # the vacant rank's rebuild goes out, held or not
    # The spare is on the dead member's launcher: it restores from the crash copy left there, no store needed.
    assert swap.ranks[1] == "spare" and swap.local
    for rank, member in enumerate(swap.ranks):
        source = RestoreSource.LOCAL if rank == 0 else RestoreSource.HOST_COPY
        core.on_ack(RebuildAck("j", swap.generation, member, rank, 4, 5, source, RebuildMarks(), 4.0), 4.0)
    (void,) = published(core.tick(4.1), GenerationVoid)  # still no store: the new generation is held too
    assert void.generation == swap.generation and core.jobs["j"].protection.held_since == 2.0


def test_a_launcher_of_spares_only_joins_the_started_run_and_learns_its_world_size() -> None:
    core = core_with_store()
    early, decision = core.on_run_start(RunStart("j", 0, "r", 0, "spares", 1.0), 1.0)
    assert not early.accepted and early.not_yet and decision.actions == [] and "j" not in core.jobs
    started, _ = core.on_run_start(RunStart("j", 0, "r", W, "l0", 2.0), 2.0)
    assert started.accepted and started.world_size == W
    joined, decision = core.on_run_start(RunStart("j", 0, "r", 0, "spares", 3.0), 3.0)
    assert joined.accepted and joined.world_size == W and decision.actions == []
    other, _ = core.on_run_start(RunStart("j", 0, "other", 0, "spares", 3.0), 3.0)
    assert not other.accepted and other.not_yet, "another run is not joined"


def test_a_finished_run_is_neither_joined_nor_started_again() -> None:
    """The run id defaults to the job name over several hosts: launching that name again must not be
    taken as a late launcher of the ended run, whose members would be told it ended and exit 0."""
    core = core_with_store()
    run_to_the_end(core, "first", 1.0)
    for world in (W, 0):
        again, decision = core.on_run_start(RunStart("j", 0, "first", world, "l5", 2.0), 2.0)
        assert not again.accepted and not again.not_yet and "new --run-id" in again.reason
        assert decision.actions == []
