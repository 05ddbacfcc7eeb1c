"""The detector's verdicts, driven by a fake clock: one failure per member, with reason and evidence."""

from __future__ import annotations

from deadpool_detector.core import DetectorConfig, DetectorCore
from deadpool_protocol import ChildExit, Heartbeat, JobFinished, MemberDone, MemberError, StoreAddress
from deadpool_protocol import Rebuild as RebuildMessage


def beat(member: str, t: float, step: int = 3, rank: int = 0, generation: int = 1) -> Heartbeat:
    return Heartbeat("j", generation, member, rank, 100, step, True, t, t)


def formed(core: DetectorCore, now: float) -> None:
    core.on_rebuild(
        RebuildMessage(
            "j",
            1,
            2,
            ["m0", "m1"],
            ["m2"],
            "m0",
            "127.0.0.1",
            4000,
            -1,
            [StoreAddress("s0", "127.0.0.1", 5000)],
            [["s0"], ["s0"]],
            "",
            now,
        ),
        now,
    )


def test_a_process_exit_is_one_failure_with_its_signal_as_evidence() -> None:
    core = DetectorCore(DetectorConfig(heartbeat_timeout_s=5))
    formed(core, 0.0)
    failures = core.on_exit(ChildExit("j", 1, "l0", "m1", 4242, -9, 10.0), 10.002)
    assert len(failures) == 1
    failure = failures[0]
    assert (failure.member, failure.rank, failure.reason, failure.generation) == ("m1", 1, "exit", 1)
    assert failure.evidence["signal"] == "9"
    assert failure.t_fault == 10.0 and failure.t_detected == 10.002


def test_a_member_is_declared_failed_only_once_whatever_the_signals() -> None:
    core = DetectorCore(DetectorConfig(heartbeat_timeout_s=1))
    formed(core, 0.0)
    assert len(core.on_error(MemberError("j", 1, "m1", 1, "CUDA error", 5.0), 5.0)) == 1
    assert core.on_exit(ChildExit("j", 1, "l0", "m1", 4242, 1, 5.1), 5.1) == []
    core.on_heartbeat(beat("m1", 5.2, rank=1), 5.2)  # last words from a dying member
    assert [f.member for f in core.check(100.0)] == ["m0", "m2"]  # m1 is not reported again


def test_silence_longer_than_the_timeout_is_a_heartbeat_failure() -> None:
    core = DetectorCore(DetectorConfig(heartbeat_timeout_s=2))
    core.on_heartbeat(beat("m0", 10.0, step=7), 10.0)
    assert core.check(11.9) == []
    core.on_heartbeat(beat("m0", 11.9, step=8), 11.9)
    assert core.check(13.8) == []
    (failure,) = core.check(14.0)
    assert failure.reason == "heartbeat"
    assert failure.evidence["last_step"] == "8"
    assert failure.t_fault == 11.9


def test_members_named_in_a_rebuild_are_watched_before_their_first_heartbeat() -> None:
    core = DetectorCore(DetectorConfig(heartbeat_timeout_s=2))
    formed(core, 0.0)
    assert sorted(f.member for f in core.check(2.5)) == ["m0", "m1", "m2"]


def test_a_clean_exit_after_the_job_finished_is_not_a_failure() -> None:
    core = DetectorCore(DetectorConfig())
    formed(core, 0.0)
    core.on_done(MemberDone("j", 1, "m0", 0, 10))
    assert core.on_exit(ChildExit("j", 1, "l0", "m0", 1, 0, 1.0), 1.0) == []  # m0 said it was done
    assert len(core.on_exit(ChildExit("j", 1, "l0", "m1", 2, 0, 1.0), 1.0)) == 1  # m1 left early
    core.on_finished(JobFinished("j", 1, 10))
    assert core.on_exit(ChildExit("j", 1, "l0", "m2", 3, 0, 2.0), 2.0) == []  # a spare leaving at the end
    assert core.check(1000.0) == []


def test_an_exit_of_a_member_the_detector_never_saw_is_still_reported() -> None:
    core = DetectorCore(DetectorConfig())
    (failure,) = core.on_exit(ChildExit("j", 0, "l0", "early", 9, 1, 1.0), 1.0)
    assert failure.rank == -1 and failure.member == "early"
