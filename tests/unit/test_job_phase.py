"""A job's phases, named in one place, and every decision checked against the legal changes of phase."""

from __future__ import annotations

import pytest

from deadpool_protocol import Failure, FailureReason, MemberDone, Rebuild, SnapshotComplete
from deadpool_swapper.core import SwapperCore, _phased
from deadpool_swapper.job_phase import LEGAL, IllegalTransitionError, JobPhase, phase_of
from tests.unit.test_swapper_core import LAST_CALL_S, W, ack, formed_core, hello, published

pytestmark = pytest.mark.unit


def test_a_job_goes_through_its_phases_from_gathering_to_finished() -> None:
    core, formation = formed_core()
    seen = [phase_of(core.jobs["j"])]
    for rank in range(W):
        for store in ("store0", "store1"):
            core.on_snapshot_complete(SnapshotComplete("j", 1, store, 4, [rank], [10]), 2.0)
    core.on_failure(Failure("j", 1, "r1", 1, FailureReason.EXIT, {}, 5.0, 5.0), 5.0)
    seen.append(phase_of(core.jobs["j"]))
    (rebuild,) = published(core.tick(5.0 + LAST_CALL_S), Rebuild)
    seen.append(phase_of(core.jobs["j"]))
    for member in rebuild.ranks:
        core.on_ack(ack(rebuild, member, 6.0), 6.0)
    seen.append(phase_of(core.jobs["j"]))
    for rank, member in enumerate(rebuild.ranks):
        core.on_done(MemberDone("j", 2, member, rank, 9), 7.0)
    seen.append(phase_of(core.jobs["j"]))
    P = JobPhase
    assert seen == [P.TRAINING, P.VOIDED, P.REBUILDING, P.TRAINING, P.FINISHED]
    assert formation.generation == 1


def test_gathering_members_then_forming() -> None:
    core = SwapperCore(formed_core()[0].config)
    assert phase_of(core.jobs.get("j")) is JobPhase.ABSENT
    core.on_hello(hello("r0", 0), 0.0)
    assert phase_of(core.jobs["j"]) is JobPhase.UNFORMED


def test_a_decision_that_takes_a_job_somewhere_no_rule_allows_stops_at_the_check() -> None:
    core, _ = formed_core()

    @_phased
    def revive(core: SwapperCore, job: str, now: float) -> None:  # a bug: a finished job trains again
        core.jobs[job].finished = False

    core.jobs["j"].finished = True
    with pytest.raises(IllegalTransitionError, match="finished -> training"):
        revive(core, "j", 1.0)
    assert (JobPhase.FINISHED, JobPhase.TRAINING) not in LEGAL
    assert (JobPhase.TRAINING, JobPhase.UNFORMED) not in LEGAL
