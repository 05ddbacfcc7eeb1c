"""Launchers name a member whose beat says nothing new instead of repeating it; the detector takes the
name as the member alive in the state it last said, and refuses it where it would refuse the beat."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack
import pytest

from deadpool.beat_compaction import BeatCompaction
from deadpool_detector.core import DetectorConfig
from deadpool_protocol import Heartbeat, HeartbeatBatch, MemberPhase, ProtocolError, RebuildState, decode, encode
from deadpool_protocol.bounds import BEAT_AGE_MS_MAX
from tests.unit.test_detector_core import beat, detector, formed

pytestmark = pytest.mark.unit


def sent(member: str, t: float, step: int = 3) -> Heartbeat:
    """A beat sent at `t` by a member in `step` (which started at 0)."""
    return dataclasses.replace(beat(member, 0.0, step=step), t=t)


def split(compaction: BeatCompaction, beats: list[Heartbeat], now: float) -> tuple[list[Heartbeat], list[str]]:
    """The beats sent whole, and the names of those sent as names."""
    whole, named = compaction.split(beats, now)
    return whole, [hb.member for hb in named]


def test_a_beat_that_repeats_the_last_one_sent_is_named_and_a_change_or_the_refresh_sends_it_whole() -> None:
    compaction = BeatCompaction(refresh_s=1.0)
    first = [sent("m0", 0.0), sent("m1", 0.0)]
    assert split(compaction, first, 0.0) == (first, [])
    assert split(compaction, [sent("m0", 0.1), sent("m1", 0.1)], 0.1) == ([], ["m0", "m1"])  # only `t` moved
    stepped = sent("m1", 0.2, step=4)
    assert split(compaction, [sent("m0", 0.2), stepped], 0.2) == ([stepped], ["m0"])
    refreshed = sent("m0", 1.05)
    assert split(compaction, [refreshed, sent("m1", 1.05, step=4)], 1.05) == ([refreshed], ["m1"])
    assert split(compaction, [sent("m1", 1.1, step=4)], 1.1) == ([], ["m1"])
    back = sent("m0", 1.2)  # m0 sent nothing in the last period: forgotten, so whole again
    assert split(compaction, [back], 1.2) == ([back], [])


ANOTHER_VALUE: dict[str, Any] = {
    "job": "k", "generation": 2, "rank": 1, "pid": 101, "step": 4, "in_step": False, "step_started_t": 0.5,
    "t": 0.1, "snapshots_skipped": 1, "waiting": True, "where": "a.py:1 f", "section": "evaluation",
    "host": "h1", "awaiting_rebuild": True, "rebuilding": True, "step_completed_t": 0.5,
    "phase": MemberPhase.TRAINING, "rebuild_state": RebuildState.RESTORE, "local_step": 2, "snapshot_every": 2,
}  # fmt: skip
"""A value for each field of a beat (its member aside: the key it is compared under) other than `sent`'s."""


@pytest.mark.parametrize("field", sorted(ANOTHER_VALUE))
def test_every_field_but_the_moment_makes_a_beat_whole(field: str) -> None:
    """A beat is named only when every field but its send time, frame and waiting flag is what the last
    whole one said: a change in any other, one at a time, sends it whole."""
    first = sent("m0", 0.0)
    changed = dataclasses.replace(first, **{field: ANOTHER_VALUE[field]})
    assert getattr(changed, field) != getattr(first, field)
    compaction = BeatCompaction(refresh_s=1.0)
    compaction.split([first], 0.0)
    whole, named = split(compaction, [changed], 0.1)
    assert (whole, named) == (([], ["m0"]) if field in {"t", "where", "waiting"} else ([changed], []))


def test_a_beat_names_every_field_the_test_above_changes() -> None:
    assert set(ANOTHER_VALUE) | {"member"} == {f.name for f in dataclasses.fields(Heartbeat)}


def test_where_and_waiting_changing_within_a_step_leave_a_beat_named_with_its_waiting_bit() -> None:
    """A real member's frame and its waiting flag change many times a step: its beat goes whole once a
    step (and at the refresh), with its newest frame; in between it is named, its `waiting` beside it."""
    compaction = BeatCompaction(refresh_s=1.0)
    first = sent("m0", 0.0)
    compaction.batch("j", 1, "l0", {"m0": (first, 0.0)}, 0.0)
    in_backward = dataclasses.replace(sent("m0", 0.25), waiting=True, where="train.py:40 loss.backward")
    batch = compaction.batch("j", 1, "l0", {"m0": (in_backward, 0.25)}, 0.25)
    assert (batch.beats, batch.alive, batch.alive_waiting) == ([], ["m0"], [True])
    in_forward = dataclasses.replace(sent("m0", 0.5), waiting=False, where="model.py:12 forward")
    batch = compaction.batch("j", 1, "l0", {"m0": (in_forward, 0.5)}, 0.5)
    assert (batch.beats, batch.alive, batch.alive_waiting) == ([], ["m0"], [False])
    refreshed = dataclasses.replace(sent("m0", 1.0), waiting=True, where="train.py:40 loss.backward")
    assert compaction.batch("j", 1, "l0", {"m0": (refreshed, 1.0)}, 1.0).beats == [refreshed]
    assert decode(encode(batch), HeartbeatBatch) == batch


def test_a_names_waiting_bit_is_what_the_straggler_rule_samples_and_a_rebuild_keeps_it_waiting() -> None:
    core = detector(DetectorConfig())
    formed(core, 0.0, ranks=("m0",), spares=())
    core.on_batch(HeartbeatBatch("j", 1, "l0", [beat("m0", 0.0)], [], [0]), 0.0)
    watched = core.jobs["j"].members["m0"]
    assert watched.in_step and not watched.waiting
    core.on_batch(HeartbeatBatch("j", 1, "l0", [], ["m0"], [0], [True]), 0.25)
    assert watched.waiting and watched.busy_share(1) == 0, "in a step but waiting on its peers: not busy"
    core.on_batch(HeartbeatBatch("j", 1, "l0", [], ["m0"], [0], [False]), 0.5)
    assert not watched.waiting and watched.busy_share(1) == 1
    core.on_batch(HeartbeatBatch("j", 1, "l0", [], ["m0"], [0]), 0.75)  # no bits: as last heard
    assert not watched.waiting
    rebuilding = dataclasses.replace(beat("m0", 1.0), rebuilding=True)
    core.on_batch(HeartbeatBatch("j", 1, "l0", [rebuilding], [], [0]), 1.0)
    core.on_batch(HeartbeatBatch("j", 1, "l0", [], ["m0"], [0], [False]), 1.25)
    assert watched.waiting, "a member carrying out a rebuild waits on the control plane, whatever its bit"


def test_a_batch_whose_waiting_bits_do_not_match_its_names_is_refused() -> None:
    batch = HeartbeatBatch("j", 1, "l0", [], ["m0", "m1"], [], [True])
    with pytest.raises(Exception, match="alive_waiting does not match"):
        decode(encode(batch), HeartbeatBatch)


def test_a_batch_with_names_round_trips_and_a_bad_name_is_refused() -> None:
    batch = HeartbeatBatch("j", 1, "l0", [beat("m0", 0.0)], ["m1", "m2"])
    assert decode(encode(batch), HeartbeatBatch) == batch
    with pytest.raises(Exception, match="not a valid name"):
        decode(encode(dataclasses.replace(batch, alive=["bad name!"])), HeartbeatBatch)


@pytest.mark.parametrize(
    ("field", "value", "why"),
    [
        ("alive", ["m1", "bad name!", "m2"], "member 'bad name!' is not a valid name"),
        ("alive_waiting", [True, 1, False], r"alive_waiting\[1\]: expected bool"),
        ("ages_ms", [0, 40, -1, 0], "age past"),
        ("ages_ms", [0, 40, BEAT_AGE_MS_MAX + 1, 0], "age past"),
    ],
)
def test_a_names_batchs_one_pass_checks_refuse_what_the_checks_item_by_item_did(
    field: str, value: list[object], why: str
) -> None:
    """Names, waiting bits and ages are checked in one pass each (a batch decoded per host four times a
    second): one bad item among good ones is still refused, and named."""
    body = msgpack.unpackb(encode(HeartbeatBatch("j", 1, "l0", [beat("m0", 0.0)], ["m1", "m2", "m3"])))
    body |= {"ages_ms": [0, 10, 20, 30], "alive_waiting": [True, False, True], field: value}
    with pytest.raises(ProtocolError, match=why):
        decode(msgpack.packb(body), HeartbeatBatch)


def batch(alive: list[str], launcher: str = "l0", beats: list[Heartbeat] | None = None) -> HeartbeatBatch:
    return HeartbeatBatch("j", 1, launcher, beats or [], alive)


def test_a_member_named_alive_is_not_declared_silent_and_one_not_named_is() -> None:
    core = detector(DetectorConfig(heartbeat_timeout_s=2))
    formed(core, 0.0, ranks=("m0", "m1"), spares=())
    for member, rank in (("m0", 0), ("m1", 1)):
        core.on_heartbeat(beat(member, 0.0, rank=rank), 0.0, "l0")
    for t in (1.0, 2.0, 3.0):
        assert core.on_alive(batch(["m0"]), "m0", t) == ""
    (failure,) = core.check(3.5)
    assert failure.member == "m1" and failure.evidence["last_step"] == "3"
    assert core.check(4.5) == []  # m0 heard at 3.0


def test_a_name_is_refused_where_the_beat_would_be() -> None:
    core = detector(DetectorConfig(heartbeat_timeout_s=2))
    assert "before any whole beat" in core.on_alive(batch(["m0"]), "m0", 0.0)
    formed(core, 0.0, ranks=("m0",), spares=())
    core.on_heartbeat(beat("m0", 0.0), 0.0, "l0")
    assert "run by launcher l0" in core.on_alive(batch(["m0"], launcher="l9"), "m0", 1.0)
    far = dataclasses.replace(batch(["m0"]), generation=10_000)
    assert "far ahead" in core.on_alive(far, "m0", 1.0)
    assert core.on_alive(batch(["stranger"]), "stranger", 1.0) == ""  # noted as unnamed, not watched
    assert [f.member for f in core.check(2.5)] == ["m0"]  # neither refused name kept m0 alive


def test_a_batch_dates_each_beat_by_its_age_so_a_silence_is_timed_from_the_last_beat() -> None:
    """A launcher gathers beats for a quarter second: a member's last beat came 240 ms before the batch
    went. The verdict comes a timeout after that beat, not after the batch arrived."""
    core = detector(DetectorConfig(heartbeat_timeout_s=1.0))
    formed(core, 0.0, ranks=("m0", "m1"), spares=())
    first = HeartbeatBatch("j", 1, "l0", [beat("m0", 0.0), beat("m1", 0.0, rank=1)], [], [0, 0])
    assert core.on_batch(first, 0.0) == []
    assert core.on_batch(HeartbeatBatch("j", 1, "l0", [], ["m0", "m1"], [240, 10]), 2.0) == []
    assert core.check(2.759) == []  # m0's last beat was at 1.76: a timeout has not passed
    (failure,) = core.check(2.77)
    assert failure.member == "m0" and failure.t_detected - failure.t_fault == pytest.approx(1.01, abs=1e-6)
    assert core.check(2.9) == []  # m1 beat at 1.99


def test_an_older_beat_never_moves_a_members_last_beat_back() -> None:
    core = detector(DetectorConfig(heartbeat_timeout_s=1.0))
    formed(core, 0.0, ranks=("m0",), spares=())
    assert core.on_batch(HeartbeatBatch("j", 1, "l0", [beat("m0", 0.0)], [], [0]), 5.0) == []
    assert core.on_batch(HeartbeatBatch("j", 1, "l0", [], ["m0"], [3000]), 5.1) == []  # dated 2.1
    assert core.check(5.9) == []


@pytest.mark.parametrize(
    ("ages", "why"),
    [([0], "ages_ms does not match"), ([0, 0, 0], "ages_ms does not match"), ([0, -1], "past"), ([0, 60_001], "past")],
)
def test_a_batch_whose_ages_do_not_fit_is_refused(ages: list[int], why: str) -> None:
    batch = HeartbeatBatch("j", 1, "l0", [beat("m0", 0.0)], ["m1"], ages)
    with pytest.raises(Exception, match=why):
        decode(encode(batch), HeartbeatBatch)
    assert decode(encode(dataclasses.replace(batch, ages_ms=[5, 7])), HeartbeatBatch).age_s(1) == 0.007


def test_a_straggler_window_spans_the_same_time_whether_beats_come_one_by_one_or_in_batches() -> None:
    """A member's newest beat of a quarter-second batch stands for the beats before it: 10 seconds of
    batches fill as many busy samples as 10 seconds of beats at 10 Hz."""
    direct, batched = detector(DetectorConfig()), detector(DetectorConfig())
    for core in (direct, batched):
        formed(core, 0.0, ranks=("m0",), spares=())
    for i in range(1, 101):
        direct.on_heartbeat(beat("m0", i * 0.1), i * 0.1)
    for i in range(1, 41):
        batched.on_batch(HeartbeatBatch("j", 1, "l0", [beat("m0", i * 0.25)], [], [0]), i * 0.25)
    assert len(direct.jobs["j"].members["m0"].busy) == 100
    assert len(batched.jobs["j"].members["m0"].busy) in range(98, 103)


def test_a_launchers_batch_gives_each_beat_its_age_in_the_order_of_beats_then_names() -> None:
    compaction = BeatCompaction(refresh_s=1.0)
    compaction.split([sent("m0", 0.0), sent("m1", 0.0)], 0.0)
    stepped = sent("m1", 0.2, step=4)
    received = {"m0": (sent("m0", 0.2), 0.21), "m1": (stepped, 0.13)}
    batch = compaction.batch("j", 1, "l0", received, 0.25)
    assert (batch.beats, batch.alive, batch.ages_ms, batch.alive_waiting) == ([stepped], ["m0"], [120, 40], [False])
    assert decode(encode(batch), HeartbeatBatch) == batch


def test_a_beat_dated_before_the_last_sample_adds_none_and_moves_nothing_back() -> None:
    core = detector(DetectorConfig())
    formed(core, 0.0, ranks=("m0",), spares=())
    core.on_batch(HeartbeatBatch("j", 1, "l0", [beat("m0", 1.0)], [], [0]), 1.0)
    watched = core.jobs["j"].members["m0"]
    before = (len(watched.busy), watched.sampled_t)
    core.on_batch(HeartbeatBatch("j", 1, "l0", [], ["m0"], [500]), 1.2)  # dated 0.7
    assert (len(watched.busy), watched.sampled_t) == before
