"""The detector's verdicts, driven by a fake clock: one failure per member, with reason and evidence."""

from __future__ import annotations

from deadpool_detector.core import DECLARED_KEPT, UNNAMED_KEPT_MAX, DetectorConfig, DetectorCore, Watched
from deadpool_protocol import (
    FIRST_STEP_SECTION,
    ChildExit,
    Failure,
    GroupBroken,
    Heartbeat,
    HeartbeatBatch,
    JobFinished,
    MemberDone,
    MemberError,
    MemberErrorCause,
    StoreAddress,
)
from deadpool_protocol import Rebuild as RebuildMessage
from deadpool_protocol.job_record import JobSummary
from deadpool_protocol.messages import members_digest


def beat(member: str, t: float, step: int = 3, rank: int = 0, generation: int = 1) -> Heartbeat:
    return Heartbeat("j", generation, member, rank, 100, step, True, t, t)


def detector(config: DetectorConfig, wall_offset_s: float = 0.0) -> DetectorCore:
    """A core whose reported stamps are its monotonic instants plus `wall_offset_s` (0: the test's `now`)."""
    return DetectorCore(config, wall_offset=lambda: wall_offset_s)


def formed(
    core: DetectorCore,
    now: float,
    generation: int = 1,
    ranks: tuple[str, ...] = ("m0", "m1"),
    spares: tuple[str, ...] = ("m2",),
) -> None:
    core.on_rebuild(
        RebuildMessage(
            "j",
            generation,
            len(ranks),
            list(ranks),
            list(spares),
            ranks[0],
            "127.0.0.1",
            4000,
            -1,
            [StoreAddress("s0", "127.0.0.1", 5000)],
            [["s0"] for _ in ranks],
            "",
            now,
        ),
        now,
    )


def test_a_process_exit_is_one_failure_with_its_signal_as_evidence() -> None:
    core = detector(DetectorConfig(heartbeat_timeout_s=5))
    formed(core, 0.0)
    failures = core.on_exit(ChildExit("j", 1, "l0", "m1", 4242, -9, 10.0), 10.002)
    assert len(failures) == 1
    failure = failures[0]
    assert (failure.member, failure.rank, failure.reason, failure.generation) == ("m1", 1, "exit", 1)
    assert failure.evidence["signal"] == "9"
    assert failure.t_fault == 10.0 and failure.t_detected == 10.002


def test_a_member_is_declared_failed_only_once_whatever_the_signals() -> None:
    core = detector(DetectorConfig(heartbeat_timeout_s=1))
    formed(core, 0.0)
    assert len(core.on_error(MemberError("j", 1, "m1", 1, "CUDA error", 5.0), 5.0)) == 1
    assert core.on_exit(ChildExit("j", 1, "l0", "m1", 4242, 1, 5.1), 5.1) == []
    core.on_heartbeat(beat("m1", 5.2, rank=1), 5.2)  # last words from a dying member
    assert [f.member for f in core.check(100.0)] == ["m0", "m2"]  # m1 is not reported again


def test_silence_longer_than_the_timeout_is_a_heartbeat_failure() -> None:
    core = detector(DetectorConfig(heartbeat_timeout_s=2))
    formed(core, 10.0, ranks=("m0",), spares=())
    core.on_heartbeat(beat("m0", 10.0, step=7), 10.0)
    assert core.check(11.9) == []
    core.on_heartbeat(beat("m0", 11.9, step=8), 11.9)
    assert core.check(13.8) == []
    (failure,) = core.check(14.0)
    assert failure.reason == "heartbeat"
    assert failure.evidence["last_step"] == "8"
    assert failure.t_fault == 11.9


def test_overdue_says_whether_the_check_would_declare_a_silence() -> None:
    """The service asks `overdue` before reading the beats on their way, and checks for silences only
    when it says so: it must find exactly the silences `check` declares, a member done excepted."""
    config = DetectorConfig(heartbeat_timeout_s=2, hang_floor_s=1000, first_step_s=1000)
    for now in (11.0, 12.9, 13.1, 13.9, 14.1, 20.0):
        core = detector(config)
        formed(core, 10.0, ranks=("m0", "m1"), spares=("m2",))
        core.on_heartbeat(beat("m0", 11.0), 11.0)
        core.on_heartbeat(beat("m1", 12.0, rank=1), 12.0)
        core.on_heartbeat(beat("m2", 11.5, rank=-1), 11.5)
        core.on_done(MemberDone("j", 1, "m0", 0, 10))
        overdue = core.overdue(now)
        declared = [f for f in core.check(now, hang_rules=False) if f.reason == "heartbeat"]
        assert overdue == bool(declared), now
        assert core.check(now, hang_rules=False, timeouts=False) == []


def test_members_named_in_a_rebuild_are_watched_before_their_first_heartbeat() -> None:
    core = detector(DetectorConfig(heartbeat_timeout_s=2))
    formed(core, 0.0)
    assert sorted(f.member for f in core.check(2.5)) == ["m0", "m1", "m2"]


def test_a_clean_exit_after_the_job_finished_is_not_a_failure() -> None:
    core = detector(DetectorConfig())
    formed(core, 0.0)
    core.on_done(MemberDone("j", 1, "m0", 0, 10))
    assert core.on_exit(ChildExit("j", 1, "l0", "m0", 1, 0, 1.0), 1.0) == []  # m0 said it was done
    assert len(core.on_exit(ChildExit("j", 1, "l0", "m1", 2, 0, 1.0), 1.0)) == 1  # m1 left early
    core.on_finished(JobFinished("j", 1, 10), 10.0)
    assert core.on_exit(ChildExit("j", 1, "l0", "m2", 3, 0, 2.0), 2.0) == []  # a spare leaving at the end
    assert core.check(1000.0) == []


def test_an_exit_of_a_member_named_only_by_the_job_record_is_reported() -> None:
    """A member that exits before any rebuild named it (a spare accepted since the last one) is found in
    the job record, where the swapper lists every member it accepted."""
    core = detector(DetectorConfig())
    formed(core, 0.0)
    early = ChildExit("j", 1, "l0", "early", 9, 1, 1.0)
    assert core.on_exit(early, 1.0) == [] and "named by no rebuild" in core.exit_refusal(early)
    assert core.records_wanted(1.0) == ["j"] and core.records_wanted(1.5) == []  # one read per period
    record = JobSummary("j", 2, 1, ["m0", "m1"], ["m2", "early"], {"early": "host-b"}, [], 0, False)
    assert core.name_from_record(record, 1.6) == ["early"]
    (failure,) = core.on_exit(early, 1.7)
    assert failure.rank == -1 and failure.member == "early"


def test_members_nobody_named_are_not_watched_and_leave_no_verdict() -> None:
    """5,000 forged heartbeats of invented members once became 5,000 stored failure events: a member is
    watched only once a rebuild or the job record names it. Unnamed ones are remembered (bounded) only
    so the record is read again for them, for `NAMING_WAIT_S`, once per period."""
    core = detector(DetectorConfig(heartbeat_timeout_s=1))
    formed(core, 0.0, ranks=("m0",), spares=())
    for n in range(UNNAMED_KEPT_MAX + 100):
        assert core.on_heartbeat(beat(f"invented-{n}", 0.5, rank=-1), 0.5) == ""
    assert core.on_error(MemberError("j", 1, "invented-0", -1, "forged", 0.5), 0.5) == []
    assert core.on_exit(ChildExit("j", 1, "l0", "invented-1", 9, -9, 0.5), 0.5) == []
    view = core.jobs["j"]
    assert list(view.members) == ["m0"] and len(view.unnamed) == UNNAMED_KEPT_MAX
    assert core.records_wanted(0.5) == ["j"]
    record = JobSummary("j", 1, 1, ["m0"], [], {"m0": "host-a"}, [], 0, False)
    assert core.name_from_record(record, 0.6) == []  # the record lists none of them
    assert [f.member for f in core.check(100.0)] == ["m0"]  # only the named rank's silence is a verdict
    assert core.records_wanted(100.0) == []  # heard of long ago: no more reads for them
    core.prune(100.0)
    assert view.unnamed == {}


HB_S = 0.1


def train(
    core: DetectorCore,
    t0: float,
    t1: float,
    step_s: float,
    stuck: dict[str, float] | None = None,
    waiting: dict[str, bool] | None = None,
    busy: dict[str, bool] | None = None,
    step0: int = 0,
) -> list[str]:
    """Heartbeats of ranks m0 and m1 (and spare m2) every 0.1 s from t0 to t1, a step every `step_s`, running the
    detector's check after each; `stuck[m]` = when m's step counter stops. Returns the declared members."""
    declared: list[str] = []
    t = t0
    while t < t1:
        for rank, member in enumerate(("m0", "m1")):
            if member in declared:
                continue
            frozen_at = (stuck or {}).get(member, float("inf"))
            step = step0 + int((min(t, frozen_at) - t0) / step_s)
            is_waiting = (waiting or {}).get(member, False) if t >= frozen_at else False
            in_compute = (busy or {}).get(member, True)
            hb = Heartbeat("j", 1, member, rank, 100, step, True, t, t, waiting=is_waiting or not in_compute)
            core.on_heartbeat(hb, t)
        core.on_heartbeat(Heartbeat("j", 1, "m2", -1, 100, -1, False, 0.0, t), t)  # the spare
        declared += [f.member for f in core.check(t)]
        t = round(t + HB_S, 6)
    return declared


def test_a_rank_that_stops_stepping_while_its_peer_waits_on_it_is_declared_hung() -> None:
    core = detector(DetectorConfig(heartbeat_timeout_s=1, hang_factor=10, hang_floor_s=3))
    formed(core, 0.0)
    assert train(core, 0.0, 20.0, step_s=0.5) == []  # steady training: no verdict
    assert core.hang_threshold_s(core.jobs["j"]) == 5.0  # 10 x the 0.5 s median step
    # m1 gets stuck in its own code at t=20; m0 blocks in the collective waiting for it.
    declared = train(core, 20.0, 30.0, step_s=0.5, stuck={"m1": 20.0, "m0": 20.0}, waiting={"m0": True}, step0=40)
    assert declared == ["m1"]
    view = core.jobs["j"]
    assert "m1" in view.declared and "m0" not in view.declared


def test_the_hang_verdict_carries_its_threshold_and_where_the_thread_is() -> None:
    core = detector(DetectorConfig(heartbeat_timeout_s=1, hang_factor=10, hang_floor_s=3))
    formed(core, 0.0)
    train(core, 0.0, 10.0, step_s=0.2)
    for t in (10.0, 10.9, 11.8, 12.7):  # m0 stepped at t=10 and then no more, heartbeats going on
        core.on_heartbeat(Heartbeat("j", 1, "m0", 0, 100, 50, True, 10.0, t, where="train.py:88 load"), t)
        core.on_heartbeat(Heartbeat("j", 1, "m1", 1, 100, 50, True, 10.0, t, waiting=True), t)
        core.on_heartbeat(Heartbeat("j", 1, "m2", -1, 100, -1, False, 0.0, t), t)
        assert core.check(t) == []
    core.on_heartbeat(Heartbeat("j", 1, "m0", 0, 100, 50, True, 10.0, 13.2, where="train.py:88 load"), 13.2)
    core.on_heartbeat(Heartbeat("j", 1, "m1", 1, 100, 50, True, 10.0, 13.2, waiting=True), 13.2)
    core.on_heartbeat(Heartbeat("j", 1, "m2", -1, 100, -1, False, 0.0, 13.2), 13.2)
    assert core.check(13.2, hang_rules=False) == []  # a pass of the heartbeat timeout alone
    (failure,) = core.check(13.2)  # 3 s floor (10 x 0.2 s = 2 s is below it)
    assert (failure.member, failure.reason) == ("m0", "hang")
    assert failure.evidence["hang_threshold_s"] == "3.000" and failure.evidence["where"] == "train.py:88 load"


def test_a_stall_where_every_rank_waits_on_a_peer_names_no_culprit() -> None:
    core = detector(DetectorConfig(heartbeat_timeout_s=1, hang_factor=10, hang_floor_s=3))
    formed(core, 0.0)
    train(core, 0.0, 10.0, step_s=0.5)
    stuck = {"m0": 10.0, "m1": 10.0}
    assert train(core, 10.0, 30.0, step_s=0.5, stuck=stuck, waiting={"m0": True, "m1": True}, step0=20) == []
    assert core.stalls(30.0) == {"j": ["m0", "m1"]}


def test_no_step_times_yet_means_the_generous_first_step_threshold() -> None:
    core = detector(DetectorConfig(heartbeat_timeout_s=1, hang_floor_s=3, first_step_s=60))
    formed(core, 0.0)
    # The first step takes 50 s (compilation, data loading): heartbeats, no step, no verdict.
    assert train(core, 0.0, 50.0, step_s=1000.0) == []


def test_a_long_evaluation_within_the_threshold_is_not_a_hang() -> None:
    core = detector(DetectorConfig(heartbeat_timeout_s=1, hang_factor=10, hang_floor_s=3))
    formed(core, 0.0)
    train(core, 0.0, 20.0, step_s=0.5)
    # An evaluation of 4 s (8 steps' time) on both ranks, outside collectives: under the 5 s threshold.
    assert train(core, 20.0, 24.0, step_s=0.5, stuck={"m0": 20.0, "m1": 20.0}, step0=40) == []
    assert train(core, 24.0, 30.0, step_s=0.5, step0=41) == []


def test_after_the_detector_missed_time_nobody_is_declared_for_the_gap() -> None:
    core = detector(DetectorConfig(heartbeat_timeout_s=1, hang_factor=10, hang_floor_s=3))
    formed(core, 0.0)
    train(core, 0.0, 5.0, step_s=0.5)
    core.grace(65.0)  # e.g. NATS restarted and the detector was cut off for a minute
    assert core.check(65.05) == []
    assert train(core, 65.1, 70.0, step_s=0.5, step0=200) == []


def test_a_rank_busy_while_the_others_wait_is_reported_as_a_straggler_once() -> None:
    core = detector(DetectorConfig(heartbeat_timeout_s=1, straggler_window=20))
    formed(core, 0.0)
    assert core.stragglers(0.0) == []
    train(core, 0.0, 5.0, step_s=0.5, busy={"m0": True, "m1": False})  # m1 mostly waits on m0
    (event,) = core.stragglers(5.0)
    assert (event.member, event.rank) == ("m0", 0)
    assert float(event.evidence["busy_share"]) > float(event.evidence["others_median_busy_share"])
    assert core.stragglers(5.1) == []  # once per generation


def test_a_long_evaluation_in_a_named_section_is_not_a_hang_but_silence_still_is() -> None:
    core = detector(DetectorConfig(heartbeat_timeout_s=1, hang_factor=10, hang_floor_s=3))
    formed(core, 0.0)
    train(core, 0.0, 10.0, step_s=0.5)
    t = 10.0
    while t < 40.0:  # a 30 s evaluation, both ranks in the section, no step
        for rank, member in enumerate(("m0", "m1")):
            core.on_heartbeat(Heartbeat("j", 1, member, rank, 100, 20, False, 9.5, t, section="evaluation"), t)
        core.on_heartbeat(Heartbeat("j", 1, "m2", -1, 100, -1, False, 0.0, t), t)
        assert core.check(t) == []
        t = round(t + HB_S, 6)
    assert train(core, 40.0, 42.0, step_s=0.5, step0=20) == []  # back to steps: the clock restarted
    # In a section, a frozen process is still caught by heartbeat silence.
    core.on_heartbeat(Heartbeat("j", 1, "m1", 1, 100, 24, False, 41.0, 42.0, section="checkpoint"), 42.0)
    for t in (42.5, 43.2):
        core.on_heartbeat(Heartbeat("j", 1, "m0", 0, 100, 24, True, 42.0, t, waiting=True), t)
        core.on_heartbeat(Heartbeat("j", 1, "m2", -1, 100, -1, False, 0.0, t), t)
    (failure,) = core.check(43.2)
    assert (failure.member, failure.reason) == ("m1", "heartbeat")


def test_a_silent_host_is_declared_whole_in_one_pass() -> None:
    core = detector(DetectorConfig(heartbeat_timeout_s=1.0))
    formed(core, 0.0)
    for t in (0.0, 0.1, 0.2):
        core.on_heartbeat(Heartbeat("j", 1, "m0", 0, 100, 3, True, t, t, host="a"), t)
    core.on_heartbeat(Heartbeat("j", 1, "m1", 1, 100, 3, True, 0.25, 0.25, host="a"), 0.25)  # a beat later
    for t in (0.2, 0.7, 1.2, 1.25):
        core.on_heartbeat(Heartbeat("j", 1, "m2", -1, 100, -1, False, 0.0, t, host="b"), t)
    failures = core.check(1.25)  # m0 silent for 1.05 s, m1 for 1.0 s: both, together
    assert sorted(f.member for f in failures) == ["m0", "m1"]
    assert all(f.lost_host == "a" and f.lost_host_members == 2 for f in failures)


def test_hosts_lost_together_are_each_declared_whole_with_their_own_count() -> None:
    """A rack lost: every silent host in one pass, each verdict counting its own host's members; a
    host with a member still beating is not lost (its silent member is declared alone)."""
    core = detector(DetectorConfig(heartbeat_timeout_s=1.0))
    hosts = {"m0": "a", "m1": "a", "m2": "b", "m3": "b", "m4": "b", "m5": "c", "m6": "c"}
    last_beat = {"m0": 0.1, "m1": 0.2, "m2": 0.1, "m3": 0.2, "m4": 0.6, "m5": 0.2, "m6": 1.2}
    formed(core, 0.0, ranks=tuple(hosts), spares=())
    for member, t in last_beat.items():
        rank = int(member[1:])
        core.on_heartbeat(Heartbeat("j", 1, member, rank, 100, 3, True, t, t, host=hosts[member]), t)
    failures = {f.member: f for f in core.check(1.25)}
    assert sorted(failures) == ["m0", "m1", "m2", "m3", "m4", "m5"]  # m4: silent half the timeout, with b
    assert {m: (f.lost_host, f.lost_host_members) for m, f in failures.items()} == {
        "m0": ("a", 2),
        "m1": ("a", 2),
        "m2": ("b", 3),
        "m3": ("b", 3),
        "m4": ("b", 3),
        "m5": ("", 0),
    }


def beats_of(core: DetectorCore, launcher: str, members: dict[str, str], t: float) -> None:
    """Launcher `launcher`'s batch at `t`: the whole beat of each of `members` (member -> host)."""
    beats = [Heartbeat("j", 1, m, int(m[1:]), 100, 3, True, t, t, host=host) for m, host in members.items()]
    core.on_batch(HeartbeatBatch("j", 1, launcher, beats, [], [0] * len(beats)), t)


def test_a_member_alone_on_its_host_whose_launcher_went_silent_too_is_its_host_lost() -> None:
    """A host that vanishes takes its launcher: a fence sent there is never answered (its connection
    still looks open to the server), so the swapper must not wait for it. A member alone on its host
    has no mates to show the host gone; its launcher's silence does."""
    core = detector(DetectorConfig(heartbeat_timeout_s=1.0))
    formed(core, 0.0, ranks=("m0", "m1"), spares=())
    for t in (0.0, 0.25, 0.5):
        beats_of(core, "l-a", {"m0": "a"}, t)
        beats_of(core, "l-b", {"m1": "b"}, t)
    for t in (0.75, 1.0, 1.25, 1.5):  # host a gone: nothing from l-a; host b's launcher goes on
        beats_of(core, "l-b", {"m1": "b"}, t)
    (failure,) = core.check(1.55)
    assert (failure.member, failure.lost_host, failure.lost_host_members) == ("m0", "a", 1)


def test_a_member_alone_on_its_host_whose_launcher_still_sends_is_a_member_lost() -> None:
    """Its launcher sends an empty batch every period (`deadpool.launcher`): alive, it can kill the
    member, and the swapper waits for that before the member's spare takes its rank."""
    core = detector(DetectorConfig(heartbeat_timeout_s=1.0))
    formed(core, 0.0, ranks=("m0", "m1"), spares=())
    for t in (0.0, 0.25, 0.5):
        beats_of(core, "l-a", {"m0": "a"}, t)
        beats_of(core, "l-b", {"m1": "b"}, t)
    for t in (0.75, 1.0, 1.25, 1.5):  # m0 silent (stopped, hung), its launcher alive and sending
        beats_of(core, "l-a", {}, t)
        beats_of(core, "l-b", {"m1": "b"}, t)
    (failure,) = core.check(1.55)
    assert (failure.member, failure.lost_host, failure.lost_host_members) == ("m0", "", 0)


def test_members_of_a_host_frozen_beside_a_launcher_that_still_sends_are_members_lost() -> None:
    """Two of a host's members stopped together (SIGSTOP, a hung driver), its launcher alive: not a
    lost host, however many. The launcher can kill them, so their spares wait for that (a lost host's
    do not: `Fence.holds_rebuild`); and each is declared at its own timeout, not pulled in with the
    other as a lost host's mates are."""
    core = detector(DetectorConfig(heartbeat_timeout_s=1.0))
    formed(core, 0.0, ranks=("m0", "m1", "m2"), spares=())
    beats_of(core, "l-a", {"m0": "a", "m1": "a"}, 0.0)
    beats_of(core, "l-b", {"m2": "b"}, 0.0)
    beats_of(core, "l-a", {"m1": "a"}, 0.5)  # m1 beats once more before it stops
    beats_of(core, "l-b", {"m2": "b"}, 0.5)
    for t in (0.75, 1.0, 1.25):  # both silent now, their launcher sending its empty batches
        beats_of(core, "l-a", {}, t)
        beats_of(core, "l-b", {"m2": "b"}, t)
    (first,) = core.check(1.25)  # m0 past the timeout; m1, silent for half of it, is not its mate
    assert (first.member, first.lost_host, first.lost_host_members) == ("m0", "", 0)
    for t in (1.5, 1.75):
        beats_of(core, "l-a", {}, t)
        beats_of(core, "l-b", {"m2": "b"}, t)
    (second,) = core.check(1.75)
    assert (second.member, second.lost_host, second.lost_host_members) == ("m1", "", 0)


def test_a_host_whose_launcher_went_silent_with_its_members_is_lost_whole() -> None:
    core = detector(DetectorConfig(heartbeat_timeout_s=1.0))
    formed(core, 0.0, ranks=("m0", "m1", "m2"), spares=())
    beats_of(core, "l-a", {"m0": "a", "m1": "a"}, 0.0)
    beats_of(core, "l-a", {"m1": "a"}, 0.25)
    for t in (0.0, 0.25, 0.5, 0.75, 1.0, 1.25):  # host a gone after 0.25 s, launcher and all
        beats_of(core, "l-b", {"m2": "b"}, t)
    failures = core.check(1.1)  # m0 past the timeout, m1 its mate: one pass
    assert {(f.member, f.lost_host, f.lost_host_members) for f in failures} == {("m0", "a", 2), ("m1", "a", 2)}


def test_every_rank_busy_in_its_own_code_at_once_is_a_pause_not_a_hang() -> None:
    core = detector(DetectorConfig(heartbeat_timeout_s=1, hang_factor=10, hang_floor_s=3))
    formed(core, 0.0)
    train(core, 0.0, 10.0, step_s=0.5)
    # A 6 s stretch where both ranks sit in their own code (a collective GC pause, an evaluation
    # without a section): no waiting peer names a culprit, so nobody is declared.
    assert train(core, 10.0, 16.0, step_s=0.5, stuck={"m0": 10.0, "m1": 10.0}, step0=20) == []


def awaiting_beats(
    core: DetectorCore,
    t0: float,
    t1: float,
    awaiting: dict[str, float],
    generation: int = 1,
    rebuilding: tuple[str, ...] = (),
) -> list[object]:
    """m0 and m1 stuck at step 40; `awaiting[m]` = when m left its step to await a rebuild (beating
    `generation`; the members in `rebuilding` carry one out instead). Returns the failures and
    broken-group verdicts of each check, in order."""
    verdicts: list[object] = []
    t = t0
    while t < t1:
        for rank, member in enumerate(("m0", "m1")):
            left = t >= awaiting.get(member, float("inf"))
            busy = member in rebuilding
            hb = Heartbeat(
                "j",
                generation,
                member,
                rank,
                100,
                40,
                not left,
                1.0,
                t,
                waiting=not left,
                awaiting_rebuild=left,
                rebuilding=busy,
            )
            core.on_heartbeat(hb, t)
        core.on_heartbeat(Heartbeat("j", 1, "m2", -1, 100, -1, False, 0.0, t), t)
        verdicts += [*core.check(t), *core.broken_groups(t)]
        t = round(t + HB_S, 6)
    return verdicts


def test_a_group_every_rank_left_with_nobody_failed_is_reported_broken_and_again_while_it_stays_so() -> None:
    core = detector(DetectorConfig(heartbeat_timeout_s=1, hang_factor=10, hang_floor_s=3))
    formed(core, 0.0)
    train(core, 0.0, 20.0, step_s=0.5)
    # m1's connections reset at t=20.05: both leave the collective, m1 first, and await a rebuild.
    verdicts = awaiting_beats(core, 20.0, 23.0, awaiting={"m1": 20.05, "m0": 20.25})
    broken, again = verdicts  # no hang verdict however long they await: they wait on the control plane
    assert isinstance(broken, GroupBroken) and isinstance(again, GroupBroken)
    assert again.generation == 1 and 1.0 <= again.t_detected - broken.t_detected <= 1.1  # one lost report heals
    assert broken.members == 2 and broken.members_digest == members_digest(["m0", "m1"])
    assert broken.evidence["first_to_leave"] == "m1"
    assert broken.t_broken == 20.1  # m1's first heartbeat awaiting
    assert 21.3 <= broken.t_detected <= 21.4  # the last to leave, m0 (20.3), plus the 1 s heartbeat timeout


def test_a_rank_left_behind_in_its_step_when_every_other_rank_gave_up_is_the_culprit() -> None:
    """m0 is stuck inside torch (it looks like it waits); m1's collective timed out and it awaits a
    rebuild. m1, stalled and not in torch's code, was once declared hung here instead."""
    core = detector(DetectorConfig(heartbeat_timeout_s=1, hang_factor=10, hang_floor_s=3))
    formed(core, 0.0)
    train(core, 0.0, 20.0, step_s=0.5)
    verdicts = awaiting_beats(core, 20.0, 40.0, awaiting={"m1": 20.05})
    (failure,) = verdicts  # no broken group either: m0 never left
    assert isinstance(failure, Failure) and (failure.member, failure.reason) == ("m0", "hang")
    assert "left_behind" in failure.evidence
    assert 25.0 <= failure.t_detected <= 25.2  # the 5 s hang threshold (10 x 0.5 s) from m0's last step


def test_a_rank_still_leaving_its_old_group_during_a_rebuild_is_not_left_behind() -> None:
    core = detector(DetectorConfig(heartbeat_timeout_s=1, hang_factor=10, hang_floor_s=3))
    formed(core, 0.0)
    train(core, 0.0, 20.0, step_s=0.5)
    formed(core, 20.0, generation=2)  # a swap's rebuild; m0 is still blocked in generation 1's collective
    assert awaiting_beats(core, 20.0, 40.0, awaiting={"m1": 20.05}) == []


def test_after_a_declared_failure_a_survivor_slow_to_leave_is_not_left_behind() -> None:
    """A third rank died; m1 awaits its replacement (no spare yet); m0 is still blocked in a send to
    the dead rank (gloo's one uninterruptible case, ended by the collective timeout)."""
    core = detector(DetectorConfig(heartbeat_timeout_s=1, hang_factor=10, hang_floor_s=3))
    formed(core, 0.0)
    train(core, 0.0, 20.0, step_s=0.5)
    core.jobs["j"].members["m3"] = Watched("m3", 2, 20.0)  # a third rank, which dies
    (failure,) = core.on_exit(ChildExit("j", 1, "l0", "m3", 103, -9, 20.0), 20.0)
    assert failure.rank == 2
    assert awaiting_beats(core, 20.0, 40.0, awaiting={"m1": 20.05}) == []


def test_a_new_generation_restarts_the_regroup_clock() -> None:
    core = detector(DetectorConfig(heartbeat_timeout_s=1, hang_factor=10, hang_floor_s=3, regroup_after_s=2))
    formed(core, 0.0)
    train(core, 0.0, 20.0, step_s=0.5)
    assert awaiting_beats(core, 20.0, 21.5, awaiting={"m0": 20.0, "m1": 20.0}) == []  # 2 s not reached
    formed(core, 21.5, generation=2)  # a rebuild under way: awaiting in generation 1 counts no more
    assert awaiting_beats(core, 21.5, 30.0, awaiting={"m0": 20.0, "m1": 20.0}) == []
    # They give up forming generation 2 (its rendezvous cannot be reached) and await in it.
    assert awaiting_beats(core, 30.0, 31.9, awaiting={"m0": 30.0, "m1": 30.0}, generation=2) == []
    (broken,) = awaiting_beats(core, 31.9, 32.2, awaiting={"m0": 30.0, "m1": 30.0}, generation=2)
    assert isinstance(broken, GroupBroken) and broken.generation == 2


def test_members_carrying_out_a_long_rebuild_are_never_a_broken_group() -> None:
    """Formation took 3.2 s under load once (warm-up, step-0 snapshot): every rank beat 'awaiting' for
    longer than the timeout, the group was reported broken before it existed, and the one report per
    generation was spent, so the real reset later was never regrouped."""
    core = detector(DetectorConfig(heartbeat_timeout_s=1, hang_factor=10, hang_floor_s=3))
    formed(core, 0.0)
    busy = ("m0", "m1")
    assert awaiting_beats(core, 0.0, 10.0, awaiting={"m0": 0.0, "m1": 0.0}, rebuilding=busy) == []
    assert awaiting_beats(core, 10.0, 20.0, awaiting={"m0": 10.0, "m1": 10.0}, generation=0) == []


def test_a_restarted_detector_declares_a_rank_from_the_job_record_whose_heartbeat_never_comes() -> None:
    core = detector(DetectorConfig(heartbeat_timeout_s=1, hang_factor=10, hang_floor_s=3))
    summary = JobSummary("j", 2, 3, ["m0", "m1"], ["m2"], {"m0": "a", "m1": "b", "m2": "b"}, ["old"], 7, False)
    core.load_job(summary, 100.0)
    t = 100.0
    failures: list[Failure] = []
    while t < 102.0:
        for rank, member in ((0, "m0"), (-1, "m2")):  # m1 died while the detector was down
            core.on_heartbeat(Heartbeat("j", 3, member, rank, 100, 40, False, 0.0, t), t)
        failures += core.check(t)
        t = round(t + HB_S, 6)
    (failure,) = failures
    assert (failure.member, failure.rank, failure.reason) == ("m1", 1, "heartbeat")
    assert core.on_exit(ChildExit("j", 3, "l0", "old", 1, -9, 101.0), 101.0) == []  # declared before the restart


def test_a_rank_compiling_its_first_step_of_a_generation_has_the_first_step_threshold() -> None:
    """After a rebuild a re-wrapped, compiled model recompiles: far longer than the recent steps."""
    core = detector(DetectorConfig(heartbeat_timeout_s=1, hang_factor=10, hang_floor_s=3, first_step_s=60))
    formed(core, 0.0)
    train(core, 0.0, 20.0, step_s=0.5)  # the hang threshold is now 5 s
    declared: list[str] = []
    t = 20.0
    while t < 70.0:  # m1 compiles for 50 s in its first step of the generation; m0 waits for it
        core.on_heartbeat(Heartbeat("j", 1, "m0", 0, 100, 40, True, 20.0, t, waiting=True), t)
        core.on_heartbeat(Heartbeat("j", 1, "m1", 1, 100, 40, True, 20.0, t, section=FIRST_STEP_SECTION), t)
        core.on_heartbeat(Heartbeat("j", 1, "m2", -1, 100, -1, False, 0.0, t), t)
        declared += [f.member for f in core.check(t)]
        t = round(t + HB_S, 6)
    assert declared == []
    while t < 85.0 and not declared:  # but a first step stuck beyond the first-step threshold is a hang
        core.on_heartbeat(Heartbeat("j", 1, "m0", 0, 100, 40, True, 20.0, t, waiting=True), t)
        core.on_heartbeat(Heartbeat("j", 1, "m1", 1, 100, 40, True, 20.0, t, section=FIRST_STEP_SECTION), t)
        core.on_heartbeat(Heartbeat("j", 1, "m2", -1, 100, -1, False, 0.0, t), t)
        declared += [f.member for f in core.check(t)]
        t = round(t + HB_S, 6)
    assert declared == ["m1"] and 80.0 <= t < 81.0  # 60 s after its last step


# ------------------------------------------------------------------ verdicts repeated until answered


def repeated_at(core: DetectorCore, t0: float, t1: float, step_s: float = 0.05) -> list[float]:
    """Run `repeats` every `step_s` from t0 to t1; when each verdict was published again."""
    times: list[float] = []
    t = t0
    while t < t1:
        times += [t for _ in core.repeats(t)]
        t = round(t + step_s, 6)
    return times


def test_a_verdict_is_published_again_at_a_capped_back_off_until_a_newer_rebuild_answers_it() -> None:
    """JetStream away for minutes once lost a verdict for good: published once, never again, and the
    survivors waited until their own bound ended the job."""
    core = detector(DetectorConfig(heartbeat_timeout_s=1, hang_floor_s=3, redeclare_after_s=1, redeclare_max_s=8))
    formed(core, 0.0)
    (failure,) = core.on_exit(ChildExit("j", 1, "l0", "m1", 101, -9, 5.0), 5.0)
    again: list[Failure] = []
    times: list[float] = []
    t = 5.0
    while t < 60.0:
        for f in core.repeats(t):
            again.append(f)
            times.append(t)
        t = round(t + 0.05, 6)
    assert all(f == failure for f in again)  # the same verdict, with its own times
    assert times == [6.0, 8.0, 12.0, 20.0, 28.0, 36.0, 44.0, 52.0]  # doubling, capped, for as long as it takes
    formed(core, 60.0, generation=2, ranks=("m0", "m2"), spares=())  # the swap: m1 replaced
    assert repeated_at(core, 60.0, 200.0) == []


def test_a_rebuild_that_still_names_the_member_brings_the_next_repeat_back_to_the_short_interval() -> None:
    core = detector(DetectorConfig(heartbeat_timeout_s=1, hang_floor_s=3, redeclare_after_s=1, redeclare_max_s=30))
    formed(core, 0.0)
    core.on_exit(ChildExit("j", 1, "l0", "m1", 101, -9, 5.0), 5.0)
    assert repeated_at(core, 5.0, 20.0) == [6.0, 8.0, 12.0]  # the next one would be at 20
    formed(core, 12.5)  # a retransmission of generation 1, which still names m1: the swapper missed it
    assert repeated_at(core, 12.5, 16.0) == [13.0, 15.0]
    formed(core, 16.0, generation=2)  # a newer generation (say, another rank's swap) that still names m1
    assert repeated_at(core, 16.0, 17.1) == [16.0]
    formed(core, 17.1, generation=3, ranks=("m0", "m2"), spares=())
    assert repeated_at(core, 17.1, 100.0) == []


def test_a_verdict_on_a_spare_is_answered_by_a_later_generation_whose_spares_no_longer_name_it() -> None:
    core = detector(DetectorConfig(heartbeat_timeout_s=1, hang_floor_s=3))
    formed(core, 0.0)
    (failure,) = core.on_exit(ChildExit("j", 1, "l0", "m2", 102, -9, 5.0), 5.0)
    assert failure.rank == -1
    formed(core, 5.5, spares=())  # generation 1 again (a retransmission): it answers nothing
    assert repeated_at(core, 5.5, 6.1) == [6.0]
    formed(core, 6.1, generation=2, spares=())
    assert repeated_at(core, 6.1, 100.0) == []


def test_the_jobs_end_answers_every_verdict() -> None:
    core = detector(DetectorConfig(heartbeat_timeout_s=1, hang_floor_s=3))
    formed(core, 0.0)
    core.on_exit(ChildExit("j", 1, "l0", "m1", 101, -9, 5.0), 5.0)
    core.on_finished(JobFinished("j", 1, 10), 5.5)
    assert repeated_at(core, 5.5, 100.0) == []


def test_the_unanswered_verdicts_of_a_job_are_bounded() -> None:
    core = detector(DetectorConfig(heartbeat_timeout_s=1, hang_floor_s=3))
    spares = tuple(f"early-{n}" for n in range(DECLARED_KEPT + 10))
    formed(core, 0.0, generation=0, ranks=("m0",), spares=spares)
    for n in range(DECLARED_KEPT + 10):
        core.on_exit(ChildExit("j", 0, "l0", f"early-{n}", n + 1, 1, 1.0), 1.0)
    view = core.jobs["j"]
    assert len(view.unanswered) == len(view.declared) == DECLARED_KEPT
    assert "early-0" not in view.unanswered and f"early-{DECLARED_KEPT + 9}" in view.unanswered


# ------------------------------------------------------------------ clocks


def test_wall_clock_steps_of_an_hour_neither_fire_nor_delay_a_verdict_and_the_stamps_follow_the_wall() -> None:
    """The heartbeat and hang clocks ran on the wall clock: after a 1 h step back, no verdict for an hour.
    `now` is monotonic; the wall clock only stamps what is reported, read when it is reported."""
    wall = [0.0]
    core = DetectorCore(DetectorConfig(heartbeat_timeout_s=1, hang_factor=10, hang_floor_s=3), lambda: wall[0])
    formed(core, 0.0)
    assert train(core, 0.0, 10.0, step_s=0.5) == []
    wall[0] = 3600.0  # the wall clock jumps an hour forward: nobody is declared for it
    assert train(core, 10.0, 20.0, step_s=0.5, step0=20) == []
    wall[0] = -3600.0  # and an hour back
    assert train(core, 20.0, 30.0, step_s=0.5, step0=40) == []
    # m1 goes silent at 30 (the last beat at 29.9): declared one heartbeat timeout later, as always.
    declared: list[Failure] = []
    t = 30.0
    while not declared and t < 40.0:
        core.on_heartbeat(Heartbeat("j", 1, "m0", 0, 100, 60, True, t, t, waiting=True), t)
        core.on_heartbeat(Heartbeat("j", 1, "m2", -1, 100, -1, False, 0.0, t), t)
        declared = core.check(t)
        t = round(t + HB_S, 6)
    (failure,) = declared
    assert (failure.member, failure.reason) == ("m1", "heartbeat")
    assert failure.evidence["silence_s"] == "1.100"  # the first check past the 1 s timeout
    assert abs(failure.t_detected - (31.0 - 3600.0)) < 1e-6  # stamped by the stepped wall clock
    assert abs(failure.t_fault - (29.9 - 3600.0)) < 1e-6


# ------------------------------------------------------------------ a rank that stays in its rebuild


def rebuild_beats(
    core: DetectorCore, t0: float, t1: float, state: dict[str, list[tuple[float, str]]], generation: int = 1
) -> list[object]:
    """Heartbeats of m0 and m1 (and spare m2) in `generation`; `state[m]` lists (from when, what): 'rebuilding',
    'training' or 'awaiting'. Returns the failures and broken-group reports of each check, in order."""
    verdicts: list[object] = []
    t = t0
    while t < t1:
        for rank, member in enumerate(("m0", "m1")):
            what = [s for since, s in state[member] if since <= t][-1]
            hb = Heartbeat(
                "j",
                generation,
                member,
                rank,
                100,
                40,
                what == "training",
                1.0,
                t,
                waiting=what == "training",  # its first collective waits for the missing peer
                awaiting_rebuild=what == "awaiting",
                rebuilding=what == "rebuilding",
            )
            if member not in core.jobs["j"].declared:
                core.on_heartbeat(hb, t)
        core.on_heartbeat(Heartbeat("j", generation, "m2", -1, 100, -1, False, 0.0, t), t)
        verdicts += [*core.check(t), *core.broken_groups(t)]
        t = round(t + HB_S, 6)
    return verdicts


def stuck_config(rebuild_max_s: float = 600.0) -> DetectorConfig:
    return DetectorConfig(
        heartbeat_timeout_s=1, hang_factor=10, hang_floor_s=3, rebuild_lag_s=10, rebuild_max_s=rebuild_max_s
    )


def test_a_rank_still_rebuilding_long_after_its_peer_finished_is_declared_hung() -> None:
    """Seen: rank 1 logged 'rendezvous' and never 'rebuild done'; rank 0 finished, its first collective
    timed out and it awaited a rebuild; nobody acted for 4 minutes (a rebuilding rank was only ever
    'waiting', and a broken group needs every rank awaiting)."""
    core = detector(stuck_config())
    formed(core, 0.0)
    state = {"m0": [(0.0, "rebuilding"), (2.0, "training"), (7.0, "awaiting")], "m1": [(0.0, "rebuilding")]}
    assert rebuild_beats(core, 0.0, 11.9, state) == []  # m0 finished at 2: 10 s not passed yet
    (failure,) = rebuild_beats(core, 11.9, 20.0, state)
    assert isinstance(failure, Failure) and (failure.member, failure.rank, failure.reason) == ("m1", 1, "hang")
    assert 12.0 <= failure.t_detected <= 12.15 and failure.t_fault == 2.0
    assert failure.evidence["finished_first"] == "m0"
    assert "after rank 0 (m0) finished its rebuild" in failure.evidence["stuck_in_rebuild"]
    assert float(failure.evidence["rebuilding_s"]) >= 12.0


def test_ranks_rebuilding_together_are_declared_only_past_the_backstop() -> None:
    """Restores of a large model take long on every rank; nobody finished, so nobody lags. Only a rebuild
    longer than `rebuild_max_s` is stuck whatever the others do."""
    core = detector(stuck_config(rebuild_max_s=60))
    formed(core, 0.0)
    state = {"m0": [(0.0, "rebuilding")], "m1": [(0.0, "rebuilding")]}
    assert rebuild_beats(core, 0.0, 60.0, state) == []
    failures = rebuild_beats(core, 60.0, 60.3, state)
    assert sorted(f.member for f in failures if isinstance(f, Failure)) == ["m0", "m1"]
    assert all(isinstance(f, Failure) and f.evidence["rebuild_max_s"] == "60.000" for f in failures)


def test_a_peer_that_gave_up_forming_the_group_has_not_finished_its_rebuild() -> None:
    """m0's rendezvous failed and it awaits the next command in generation 1: not a finished rebuild
    (m1 may still be in its own rendezvous attempts), so m1 does not lag it."""
    core = detector(stuck_config())
    formed(core, 0.0)
    state = {"m0": [(0.0, "rebuilding"), (2.0, "awaiting")], "m1": [(0.0, "rebuilding")]}
    assert rebuild_beats(core, 0.0, 40.0, state) == []


def test_a_new_generation_restarts_the_rebuild_clocks() -> None:
    core = detector(stuck_config(rebuild_max_s=30))
    formed(core, 0.0)
    state = {"m0": [(0.0, "rebuilding"), (2.0, "training")], "m1": [(0.0, "rebuilding")]}
    assert rebuild_beats(core, 0.0, 11.0, state) == []
    formed(core, 11.0, generation=2)  # another rank's failure supersedes generation 1
    # m1 still beats "rebuilding generation 1" a moment, then both carry generation 2 out.
    assert rebuild_beats(core, 11.0, 11.5, state) == []
    state = {"m0": [(0.0, "rebuilding")], "m1": [(0.0, "rebuilding")]}
    assert rebuild_beats(core, 11.5, 41.0, state, generation=2) == []  # 29.5 s into generation 2's rebuild


def test_a_rank_still_carrying_out_a_superseded_rebuild_is_declared_hung() -> None:
    """Generation 2 (another rank's swap) names m1, which is still inside generation 1's rebuild (in user
    code: every wait of a superseded rebuild is broken at once). Generation 2 cannot form without it."""
    core = detector(stuck_config())
    formed(core, 0.0)
    state = {"m0": [(0.0, "rebuilding")], "m1": [(0.0, "rebuilding")]}
    assert rebuild_beats(core, 0.0, 5.0, state) == []
    formed(core, 5.0, generation=2)
    verdicts: list[object] = []
    t = 5.0
    while t < 20.0:  # m0 carries out generation 2 (and gives up forming it); m1 still beats generation 1
        core.on_heartbeat(Heartbeat("j", 2, "m0", 0, 100, 40, False, 1.0, t, awaiting_rebuild=t >= 6.0), t)
        if "m1" not in core.jobs["j"].declared:
            core.on_heartbeat(Heartbeat("j", 1, "m1", 1, 100, 40, False, 1.0, t, rebuilding=True), t)
        core.on_heartbeat(Heartbeat("j", 2, "m2", -1, 100, -1, False, 0.0, t), t)
        verdicts += [*core.check(t), *core.broken_groups(t)]
        t = round(t + HB_S, 6)
    (failure,) = verdicts
    assert isinstance(failure, Failure) and (failure.member, failure.rank, failure.generation) == ("m1", 1, 2)
    assert failure.reason == "hang" and 15.0 <= failure.t_detected <= 15.15 and failure.t_fault == 5.0
    assert "generation 2 superseded it" in failure.evidence["stuck_in_rebuild"]


def test_a_finished_job_name_that_runs_again_is_watched_afresh_and_an_old_end_is_ignored() -> None:
    """A job name can be launched again once it finished: the new run's generations go on from the old
    run's, and the detector, which kept the name as finished, must watch the new run's members."""
    core = detector(DetectorConfig(heartbeat_timeout_s=2))
    formed(core, 0.0)
    core.on_finished(JobFinished("j", 1, 50), 1.0)
    assert core.check(100.0) == [], "a finished job is not watched"
    formed(core, 200.0, generation=2, ranks=("b0", "b1"), spares=())  # the name's next run forms
    core.on_heartbeat(beat("b0", 201.0, generation=2), 201.0)
    core.on_heartbeat(beat("b1", 201.0, rank=1, generation=2), 201.0)
    core.on_heartbeat(beat("b0", 202.9, generation=2), 202.9)
    (failure,) = core.check(203.1)
    assert failure.member == "b1" and failure.reason == "heartbeat"
    core.on_finished(JobFinished("j", 1, 50), 210.0)  # the old run's end, again: ignored
    assert not core.jobs["j"].finished


def test_an_exit_is_taken_only_from_the_launcher_that_runs_the_member() -> None:
    """The launcher that forwards a member's beats runs it; another launcher of the job reporting its exit
    (a forged exit once swapped a live rank without a fence) is refused, and so are its beats of it."""
    core = detector(DetectorConfig(heartbeat_timeout_s=5))
    formed(core, 0.0)
    assert core.on_heartbeat(beat("m1", 1.0, rank=1), 1.0, launcher="l0") == ""
    assert "run by launcher l0" in core.on_heartbeat(beat("m1", 1.1, rank=1), 1.1, launcher="l1")
    forged = ChildExit("j", 1, "l1", "m1", 4242, -9, 2.0)
    assert "run by launcher l0" in core.exit_refusal(forged)
    assert core.on_exit(forged, 2.0) == []
    assert core.check(3.0) == []  # still watched, still beating within the timeout
    [failure] = core.on_exit(ChildExit("j", 1, "l0", "m1", 4242, -9, 4.0), 4.0)
    assert (failure.member, failure.rank, failure.evidence["launcher"]) == ("m1", 1, "l0")


def test_a_report_that_would_end_the_job_counts_only_for_the_reporters_own_rank_in_its_generation() -> None:
    """A `user_code` report ends the job only for the reporter's own place: from the member the current
    generation named to that rank, or from a spare as a spare. From a spare claiming a rank, for another
    rank, of an older generation, or from a member nobody named, it is the reporter's own failure,
    declared in the rank the detector knows it by (a forged one once ended any job). From a member nobody
    named, it is nothing at all."""
    core = detector(DetectorConfig(heartbeat_timeout_s=5))
    formed(core, 0.0, generation=2)
    cases = [
        ("m2", 0, 2, MemberErrorCause.STEP, -1),  # a spare claiming rank 0
        ("m1", 0, 2, MemberErrorCause.STEP, 1),  # rank 1 claiming rank 0
        ("m0", 0, 1, MemberErrorCause.STEP, 0),  # an older generation
    ]
    for member, rank, generation, cause, declared_rank in cases:
        error = MemberError("j", generation, member, rank, "forged", 1.0, MemberErrorCause.USER_CODE)
        assert core.error_cause(error) == cause
        [failure] = core.on_error(error, 1.0)
        assert (failure.member, failure.rank, failure.cause) == (member, declared_rank, cause)
    stranger = MemberError("j", 2, "stranger", -1, "forged", 1.0, MemberErrorCause.USER_CODE)
    assert core.error_cause(stranger) == MemberErrorCause.STEP and core.on_error(stranger, 1.0) == []
    core = detector(DetectorConfig(heartbeat_timeout_s=5))
    formed(core, 0.0, generation=2)
    own = MemberError("j", 2, "m1", 1, "the optimizer factory raised", 1.0, MemberErrorCause.USER_CODE)
    [failure] = core.on_error(own, 1.0)
    assert (failure.rank, failure.cause) == (1, MemberErrorCause.USER_CODE)
    core = detector(DetectorConfig(heartbeat_timeout_s=5))
    formed(core, 0.0, generation=2)  # the rebuild of generation 3, which names m2 to rank 1, not read yet
    ahead = MemberError("j", 3, "m2", 1, "the optimizer factory raised", 1.0, MemberErrorCause.USER_CODE)
    assert core.error_cause(ahead) == MemberErrorCause.USER_CODE
    spare = MemberError("j", 0, "m2", -1, "the factory raised while a spare warmed up", 1.0, MemberErrorCause.USER_CODE)
    [failure] = core.on_error(spare, 1.0)
    assert (failure.rank, failure.cause) == (-1, MemberErrorCause.USER_CODE)


def test_a_spare_promoted_while_it_still_warmed_up_ends_the_job_with_its_factorys_error() -> None:
    """Seen in CI: a spare slow to start (torch importing on two busy cores) was promoted to rank 1 in
    generation 3 and its factory raised while it warmed up, before it took that rebuild. Its report, as
    a spare, was taken as its own failure: the job waited for a spare it no longer had, not ended."""
    core = detector(DetectorConfig(heartbeat_timeout_s=5))
    formed(core, 0.0, generation=2)
    formed(core, 1.0, generation=3, ranks=("m0", "m2"), spares=())  # m1 lost; m2 promoted
    warming = MemberError(
        "j", 2, "m2", -1, "the factory raised while a spare warmed up", 1.5, MemberErrorCause.USER_CODE
    )
    assert core.error_cause(warming) == MemberErrorCause.USER_CODE
    [failure] = core.on_error(warming, 1.5)
    assert (failure.member, failure.rank, failure.cause) == ("m2", 1, MemberErrorCause.USER_CODE)
    core = detector(DetectorConfig(heartbeat_timeout_s=5))
    formed(core, 0.0, generation=2)
    formed(core, 1.0, generation=3, ranks=("m0", "m2"), spares=())
    late = MemberError(
        "j", 3, "m2", -1, "a spare's report, in the generation that made it rank 1", 1.5, MemberErrorCause.USER_CODE
    )
    assert core.error_cause(late) == MemberErrorCause.STEP, "in that generation it knew its rank"
    ranked = MemberError("j", 2, "m0", -1, "rank 0, claiming to be a spare", 1.5, MemberErrorCause.USER_CODE)
    assert core.error_cause(ranked) == MemberErrorCause.STEP, "named rank 0 in generation 2, its report's"
