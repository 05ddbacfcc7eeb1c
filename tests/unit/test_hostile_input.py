"""Hostile input never crashes or wedges a service: each input once seen to do so, and what it gets now.

Every case here was found by reading the code (issue "Secured and hardened"): a frame that made the
store allocate without bound, times that poisoned arithmetic, generations and steps far beyond any
real one, a repeated hello that moved a live member, and jobs made up on the bus that were never
forgotten. The data-plane server's own bounds (connections, headers, stalls) are in
`tests/integration/test_store_dataplane_limits.py`.
"""

from __future__ import annotations

import math
import time

import msgpack
import pytest

from deadpool_detector.core import DetectorConfig, DetectorCore
from deadpool_protocol import (
    ChildExit,
    Failure,
    FailureReason,
    Heartbeat,
    JobFinished,
    ProtocolError,
    SnapshotComplete,
    decode_any,
    encode,
)
from deadpool_protocol.dataplane import (
    DATAPLANE_VERSION,
    FetchReply,
    PutChunk,
    Seal,
    decode_frame_header,
    encode_frame,
)
from deadpool_swapper.core import SwapperConfig, SwapperCore
from tests.unit.test_detector_core import formed
from tests.unit.test_swapper_core import formed_core, hello

HUGE = 2**62


def raw_frame(op: str, **fields: object) -> bytes:
    """A frame header as an attacker writes it: no constructor, no check()."""
    return bytes(msgpack.packb({"v": DATAPLANE_VERSION, "op": op, **fields}, use_bin_type=True))


def test_a_seal_of_a_terabyte_in_one_byte_chunks_is_refused_before_anything_is_allocated() -> None:
    started = time.process_time()
    header = raw_frame(
        "seal",
        job="j",
        generation=1,
        rank=0,
        member="m",
        step=1,
        total_bytes=2**40,
        chunk_bytes=1,
        checksums=[],
        meta=b"",
    )
    with pytest.raises(ProtocolError, match="one checksum per chunk"):
        decode_frame_header(header)
    assert time.process_time() - started < 1.0  # 2**40 spans used to be built (and never finished)
    beyond = raw_frame(
        "seal", job="j", generation=1, rank=0, member="m", step=1, total_bytes=2**50, chunk_bytes=2**20, checksums=[]
    )
    with pytest.raises(ProtocolError):
        decode_frame_header(beyond)


def test_a_hostile_fetch_reply_is_refused_before_the_member_allocates_for_it() -> None:
    reply = FetchReply(True, "", 1, "m", 2**40, 1, [], b"")
    with pytest.raises(ProtocolError, match="one checksum per chunk"):
        decode_frame_header(encode_frame(reply)[4:])
    with pytest.raises(ProtocolError, match="a snapshot of"):
        decode_frame_header(encode_frame(FetchReply(True, "", 1, "m", 2**41, 2**28, [0] * 8192, b""))[4:])
    refused = FetchReply(False, "no such snapshot", 0, "", 0, 0, [], b"")  # a refusal carries no sizes
    assert decode_frame_header(encode_frame(refused)[4:]) == refused


def test_chunks_and_manifests_outside_their_bounds_are_refused() -> None:
    for chunk in (
        PutChunk("j", 1, 0, "m", 1, 0, 2**29, 2**30),  # a chunk larger than any sender makes
        PutChunk("j", -1, 0, "m", 1, 0, 10, 10),  # a negative generation
        PutChunk("j", 1, 0, "m.x", 1, 0, 10, 10),  # a member that is not a name
        PutChunk("j", 1, 0, "m", 1, 0, 10, 2**41),  # a snapshot beyond the largest
    ):
        with pytest.raises(ProtocolError):
            decode_frame_header(encode_frame(chunk)[4:])
    with pytest.raises(ProtocolError, match="64-bit"):
        decode_frame_header(encode_frame(Seal("j", 1, 0, "m", 1, 10, 10, [-1], b""))[4:])


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_times_that_are_not_finite_are_refused_at_decoding(bad: float) -> None:
    failure = Failure("j", 1, "m0", 0, FailureReason.EXIT, {}, bad, 1.0)
    with pytest.raises(ProtocolError, match="not a finite number"):
        decode_any(encode(failure))
    beat = Heartbeat("j", 1, "m0", 0, 100, 3, True, 1.0, bad)
    with pytest.raises(ProtocolError, match="not a finite number"):
        decode_any(encode(beat))
    assert decode_any(encode(Failure("j", 1, "m0", 0, FailureReason.EXIT, {}, 1.0, 1.0))).KIND == "failure"


def test_a_heartbeat_from_a_far_generation_is_refused_and_real_rebuilds_still_count() -> None:
    core = DetectorCore(DetectorConfig(heartbeat_timeout_s=1.0, hang_floor_s=3.0))
    formed(core, 0.0)
    forged = Heartbeat("j", HUGE, "m0", 0, 100, 3, True, 1.0, 1.0)
    assert "far ahead" in core.on_heartbeat(forged, 1.0)
    assert core.jobs["j"].generation == 1
    formed(core, 2.0, generation=2)  # the next real rebuild is not taken for a stale one
    assert core.jobs["j"].generation == 2
    assert core.on_heartbeat(Heartbeat("j", 3, "m0", 0, 100, 3, True, 2.1, 2.1), 2.1) == ""  # a beat just ahead


def test_the_detector_forgets_finished_and_silent_jobs_and_watches_a_bounded_number() -> None:
    core = DetectorCore(DetectorConfig(heartbeat_timeout_s=1.0, hang_floor_s=3.0, jobs_max=3, finished_kept_s=10.0))
    for i in range(3):
        assert core.on_heartbeat(Heartbeat(f"made-up-{i}", 0, "m", -1, 1, -1, False, 0.0, 0.0), 0.0) == ""
    assert "jobs_max" in core.on_heartbeat(Heartbeat("one-more", 0, "m", -1, 1, -1, False, 0.0, 0.0), 0.0)
    core.on_finished(JobFinished("made-up-0", 1, 5), 1.0)
    assert core.prune(5.0) == []
    assert core.prune(12.0) == ["made-up-0"]
    assert sorted(core.prune(4000.0)) == ["made-up-1", "made-up-2"]  # nothing heard for idle_job_s
    assert core.on_heartbeat(Heartbeat("one-more", 0, "m", -1, 1, -1, False, 0.0, 0.0), 4000.0) == ""
    assert core.on_exit(ChildExit("exited-first", 0, "l0", "m", 7, -9, 4001.0), 4001.0) == []  # nobody named m
    assert core.prune(4002.0) == [] and "exited-first" not in core.jobs


def test_a_snapshot_of_a_step_far_beyond_the_committed_one_never_commits() -> None:
    core, _formation = formed_core(stores=1)
    state = core.jobs["j"]
    for rank in range(2):
        core.on_snapshot_complete(SnapshotComplete("j", 1, "store0", 0, [rank], [10]), 2.0)
    assert state.ledger.committed_step == 0
    for rank in range(2):
        decision = core.on_snapshot_complete(SnapshotComplete("j", 1, "store0", HUGE, [rank], [10]), 2.1)
        assert "beyond the committed step" in decision.reason
    assert state.ledger.committed_step == 0
    for rank in range(2):  # real steps still commit
        core.on_snapshot_complete(SnapshotComplete("j", 1, "store0", 1, [rank], [10]), 2.2)
    assert state.ledger.committed_step == 1


def test_a_repeated_hello_cannot_move_a_live_member() -> None:
    core, formation = formed_core()
    member = formation.ranks[0]
    moved = hello(member, 0, host="elsewhere")
    reply, _ = core.on_hello(moved, 3.0)
    assert not reply.accepted and "identity never changes" in reply.reason
    assert core.jobs["j"].membership.members[member].host == "h0"
    again, _ = core.on_hello(hello(member, 0), 3.1)  # the same process asking again is harmless
    assert again.accepted


def test_a_job_made_up_by_a_hello_is_forgotten_if_it_never_forms() -> None:
    core = SwapperCore(SwapperConfig(unformed_kept_s=60.0))
    core.on_hello(hello("r0", 0), 0.0)  # one rank of two, no store: the job cannot form
    core.tick(30.0)
    assert "j" in core.jobs
    core.tick(61.0)
    assert "j" not in core.jobs
