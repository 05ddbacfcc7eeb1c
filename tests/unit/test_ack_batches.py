"""A launcher stores its members' rebuild acks, and their first steps of a generation, as one event
each: the swapper takes each ack or first step as it would alone, once however often it comes, and
refuses one for a member another launcher runs."""

from __future__ import annotations

import pytest

from deadpool_protocol import (
    Failure,
    FailureReason,
    Incident,
    MemberHello,
    Rebuild,
    RebuildAckBatch,
    RestoreSource,
    StepResumed,
    StepResumedBatch,
    StoreStatus,
)
from deadpool_swapper.core import SwapperConfig, SwapperCore
from tests.unit.test_swapper_core import ack, fail, published

pytestmark = pytest.mark.unit


def unformed(ranks: int = 4) -> tuple[SwapperCore, Rebuild]:
    """A formation of `ranks` ranks, two per host, each host's members run by its own launcher."""
    core = SwapperCore(SwapperConfig(replication=1, store_timeout_s=1e9))
    core.on_store_status(StoreStatus("store0", "127.0.0.1", 5000, 0, 100, 0, 0.0), 0.0)
    decisions = [
        core.on_hello(
            MemberHello("j", 0, f"r{r}", f"h{r // 2}", 100, f"l-h{r // 2}", r, ranks, "127.0.0.1", 4000, 0.0), 0.1
        )[1]
        for r in range(ranks)
    ]
    (formation,) = [r for d in decisions for r in published(d, Rebuild)]
    return core, formation


def batch(formation: Rebuild, launcher: str, members: list[str]) -> RebuildAckBatch:
    acks = [ack(formation, m, 1.0, source=RestoreSource.FRESH) for m in members]
    return RebuildAckBatch("j", formation.generation, launcher, acks)


def test_a_batch_per_host_forms_the_generation_as_acks_one_by_one_would() -> None:
    core, formation = unformed()
    first = core.on_ack_batch(batch(formation, "l-h0", ["r0", "r1"]), 1.0)
    assert first.routine and core.jobs["j"].recovery.pending is not None
    assert core.on_ack_batch(batch(formation, "l-h0", ["r0", "r1"]), 1.1).routine  # again: nothing new
    pending = core.jobs["j"].recovery.pending
    assert pending is not None and len(pending.acks) == 2
    formed = core.on_ack_batch(batch(formation, "l-h1", ["r2", "r3"]), 1.2)
    assert core.jobs["j"].recovery.pending is None and core.jobs["j"].recovery.formed
    assert "every rank acked" in formed.reason


def test_an_ack_for_a_member_another_launcher_runs_is_refused_and_not_counted() -> None:
    core, formation = unformed()
    decision = core.on_ack_batch(batch(formation, "l-h0", ["r0", "r2"]), 1.0)
    assert "ack of r2 from launcher l-h0, which does not run it: refused" in decision.reason
    pending = core.jobs["j"].recovery.pending
    assert pending is not None and set(pending.acks) == {"r0"}


def resumed_batch(rebuild: Rebuild, launcher: str, members: list[str], t: float) -> StepResumedBatch:
    steps = [StepResumed("j", rebuild.generation, m, rebuild.rank_of(m), rebuild.restore_step + 1, t) for m in members]
    return StepResumedBatch("j", rebuild.generation, launcher, steps)


def swapped() -> tuple[SwapperCore, Rebuild]:
    """`unformed`'s job formed, then rank 1 (host 0's) failed and the spare of host 1 took its place."""
    core, formation = unformed()
    core.on_hello(MemberHello("j", 0, "s", "h1", 100, "l-h1", -1, 4, "127.0.0.1", 4000, 0.0), 0.2)
    core.on_ack_batch(batch(formation, "l-h0", ["r0", "r1"]), 1.0)
    core.on_ack_batch(batch(formation, "l-h1", ["r2", "r3"]), 1.0)
    (rebuild,) = published(fail(core, Failure("j", 1, "r1", 1, FailureReason.EXIT, {}, 5.0, 5.01), 5.02), Rebuild)
    assert rebuild.ranks == ["r0", "s", "r2", "r3"]
    core.on_ack_batch(RebuildAckBatch("j", rebuild.generation, "l-h0", [ack(rebuild, "r0", 5.6)]), 5.6)
    core.on_ack_batch(
        RebuildAckBatch("j", rebuild.generation, "l-h1", [ack(rebuild, m, 5.7) for m in ["s", "r2", "r3"]]), 5.7
    )
    assert core.jobs["j"].recovery.pending is None
    return core, rebuild


def test_a_batch_of_first_steps_per_host_ends_the_incident_as_first_steps_one_by_one_would() -> None:
    core, rebuild = swapped()
    first = core.on_step_resumed_batch(resumed_batch(rebuild, "l-h0", ["r0"], 6.0), 6.0)
    assert first.routine and published(first, Incident) == []
    again = core.on_step_resumed_batch(resumed_batch(rebuild, "l-h0", ["r0"], 6.0), 6.01)  # stored twice
    assert again.routine and again.actions == [] and published(again, Incident) == []
    (incident,) = published(
        core.on_step_resumed_batch(resumed_batch(rebuild, "l-h1", ["s", "r2", "r3"], 6.2), 6.2), Incident
    )
    assert incident.rank == 1 and incident.replacement == "s" and incident.t_first_step == pytest.approx(6.2)
    assert core.jobs["j"].incident_log.awaiting_first_step == []


def test_a_first_step_for_a_member_another_launcher_runs_is_refused_and_not_counted() -> None:
    core, rebuild = swapped()
    decision = core.on_step_resumed_batch(resumed_batch(rebuild, "l-h0", ["r0", "s", "r2", "r3"], 6.0), 6.0)
    assert "first step of s from launcher l-h0, which does not run it" in decision.reason
    assert core.jobs["j"].incident_log.first_step_ranks == {0} and published(decision, Incident) == []
