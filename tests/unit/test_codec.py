"""The wire contract: every message survives a round trip, and bad input is refused with a reason."""

from __future__ import annotations

import msgpack
import pytest

from deadpool_protocol import (
    ChildExit,
    Commit,
    Failure,
    FailureReason,
    FenceReply,
    FenceRequest,
    GroupBroken,
    Heartbeat,
    HelloReply,
    Incident,
    JobFinished,
    MemberDone,
    MemberError,
    MemberErrorCause,
    MemberHello,
    MemberPhase,
    Message,
    ProtocolError,
    Rebuild,
    RebuildAck,
    RebuildAckBatch,
    RebuildMarks,
    RebuildState,
    RestoreSource,
    SnapshotComplete,
    StepResumed,
    StepResumedBatch,
    StoreAddress,
    StoreStatus,
    Subjects,
    decode,
    decode_any,
    encode,
)
from deadpool_protocol.bounds import MEMBERS_PER_JOB_MAX
from deadpool_protocol.dataplane import Fetch, PutChunk, Seal, decode_frame_header, encode_frame
from deadpool_protocol.messages import members_digest


def rebuild(**overrides: object) -> Rebuild:
    fields: dict[str, object] = {
        "job": "j",
        "generation": 2,
        "world_size": 2,
        "ranks": ["m0", "m1"],
        "spares": ["m2"],
        "rendezvous_member": "m0",
        "rendezvous_host": "127.0.0.1",
        "rendezvous_port": 4000,
        "restore_step": 7,
        "stores": [StoreAddress("s0", "127.0.0.1", 5000)],
        "placement": [["s0"], ["s0"]],
        "incident": "j-1",
        "t_decided": 12.5,
    }
    fields.update(overrides)
    return Rebuild(**fields)  # type: ignore[arg-type]


EXAMPLES: list[Message] = [
    MemberHello("j", 0, "m0", "host", 42, "l0", 0, 4, "127.0.0.1", 4000, 1.0),
    HelloReply("j", 1, "m0", True, "registered"),
    Heartbeat("j", 1, "m0", 0, 42, 10, True, 2.0, 3.0, 1),
    Heartbeat("j", 1, "m0", 0, 42, 10, False, 2.0, 3.0, phase=MemberPhase.REBUILDING, rebuild_state=RebuildState.FORM),
    MemberError("j", 1, "m0", 0, "boom", 1.0),
    MemberDone("j", 1, "m0", 0, 100),
    ChildExit("j", 1, "l0", "m0", 42, -9, 1.0),
    Failure("j", 1, "m0", 0, FailureReason.EXIT, {"returncode": "-9"}, 1.0, 1.1),
    rebuild(),
    RebuildAck("j", 2, "m0", 0, 7, 8, RestoreSource.LOCAL, RebuildMarks(out=1.0, ready=2.0), 2.0),
    StepResumedBatch("j", 2, "l0", [StepResumed("j", 2, "m0", 0, 8, 2.0)]),
    RebuildAckBatch(
        "j", 2, "l0", [RebuildAck("j", 2, "m0", 0, 7, 8, RestoreSource.LOCAL, RebuildMarks(out=1.0, ready=2.0), 2.0)]
    ),
    FenceRequest("j", 1, "m0", "heartbeat"),
    FenceReply("j", 1, "m0", True, "killed", 1.0),
    SnapshotComplete("j", 1, "s0", 5, [0], [1024]),
    Commit("j", 1, 5),
    JobFinished("j", 1, 100),
    Incident("j", 2, "j-1", 0, "m0", "m2", "exit", 1.0, 1.1, 1.2, 2.0, 7, 0, {"detect": 0.1}, {"pid": "1"}),
    StoreStatus("s0", "127.0.0.1", 5000, 10, 100, 1, 1.0),
    GroupBroken("j", 1, 2, members_digest(["m0", "m1"]), {"first_to_leave": "m0"}, 1.0, 3.0),
]


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: m.KIND)
def test_every_message_survives_a_round_trip(message: Message) -> None:
    assert decode(encode(message), type(message)) == message


def test_decode_refuses_garbage_bytes() -> None:
    with pytest.raises(ProtocolError, match="not msgpack"):
        decode_any(b"\xc1\xff\x00garbage")


def test_decode_refuses_a_message_that_is_not_a_map() -> None:
    with pytest.raises(ProtocolError, match="not a map"):
        decode_any(msgpack.packb([1, 2, 3]))


def test_decode_refuses_an_unknown_protocol_version() -> None:
    body = msgpack.unpackb(encode(Commit("j", 1, 5)))
    body["v"] = 99
    with pytest.raises(ProtocolError, match="unsupported protocol version 99"):
        decode_any(msgpack.packb(body))


def test_decode_refuses_an_unknown_kind() -> None:
    with pytest.raises(ProtocolError, match="unknown message kind 'teleport'"):
        decode_any(msgpack.packb({"v": 1, "kind": "teleport"}))


def test_decode_refuses_the_wrong_kind_for_the_subject() -> None:
    with pytest.raises(ProtocolError, match="expected a failure message, got commit"):
        decode(encode(Commit("j", 1, 5)), Failure)


def test_decode_refuses_a_missing_field() -> None:
    body = msgpack.unpackb(encode(Commit("j", 1, 5)))
    del body["step"]
    with pytest.raises(ProtocolError, match="missing field 'step'"):
        decode_any(msgpack.packb(body))


def test_decode_refuses_an_unknown_field() -> None:
    body = msgpack.unpackb(encode(Commit("j", 1, 5)))
    body["extra"] = 1
    with pytest.raises(ProtocolError, match="unknown fields"):
        decode_any(msgpack.packb(body))


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("generation", "2", "expected int, got str"),
        ("generation", True, "expected an int, got a bool"),
        ("ranks", "m0", "expected a list"),
        ("stores", [{"store": "s0"}], "missing field 'host'"),
        ("t_decided", "soon", "expected a number"),
    ],
)
def test_decode_refuses_wrong_types(field: str, value: object, reason: str) -> None:
    body = msgpack.unpackb(encode(rebuild()))
    body[field] = value
    with pytest.raises(ProtocolError, match=reason):
        decode_any(msgpack.packb(body))


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"generation": -1}, "generation -1 is negative"),
        ({"job": "bad job"}, "not a valid name"),
        ({"job": "job\n"}, "not a valid name"),  # `$` matched before a trailing newline
        ({"spares": ["s\n"]}, r"member 's\\n' is not a valid name"),
        ({"ranks": ["m0", "m0"]}, "more than one rank"),
        ({"spares": ["m1"]}, "both rank and spare"),
        ({"rendezvous_member": "m2"}, "holds no rank"),
        ({"placement": [["s0"], ["nowhere"]]}, "unknown store"),
        ({"world_size": 3}, "does not hold world_size"),
    ],
)
def test_decode_refuses_a_rebuild_that_breaks_the_rules(overrides: dict[str, object], reason: str) -> None:
    body = msgpack.unpackb(encode(rebuild()))
    body.update(overrides)
    with pytest.raises(ProtocolError, match=reason):
        decode_any(msgpack.packb(body))


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("sleeping", "'sleeping' is not a MemberPhase"),
        ("TRAINING", "is not a MemberPhase"),  # a value, never a name
        (3, "expected a MemberPhase, got int"),
        (None, "expected a MemberPhase, got NoneType"),  # the phase is never None
        (["training"], "expected a MemberPhase, got list"),
        ("x" * 100_000, "is not a MemberPhase"),
    ],
)
def test_a_phase_must_be_one_of_the_member_phases(value: object, reason: str) -> None:
    body = msgpack.unpackb(encode(Heartbeat("j", 1, "m0", 0, 42, 10, True, 2.0, 3.0)))
    body["phase"] = value
    with pytest.raises(ProtocolError, match=reason):
        decode_any(msgpack.packb(body))


def test_a_phase_and_a_rebuild_state_decode_as_their_enums() -> None:
    body = msgpack.unpackb(encode(Heartbeat("j", 1, "m0", 0, 42, 10, True, 2.0, 3.0)))
    body |= {"phase": "rebuilding", "rebuild_state": "exchange"}
    beat = decode(msgpack.packb(body), Heartbeat)
    assert beat.phase is MemberPhase.REBUILDING and beat.rebuild_state is RebuildState.EXCHANGE
    body["rebuild_state"] = None
    assert decode(msgpack.packb(body), Heartbeat).rebuild_state is None
    body["rebuild_state"] = "training"  # a phase is not a rebuild state
    with pytest.raises(ProtocolError, match="matches none of"):
        decode_any(msgpack.packb(body))


LOST_HOST = Failure("j", 1, "m0", 0, FailureReason.HEARTBEAT, {}, 1.0, 1.1, lost_host="a", lost_host_members=2)


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("reason", "crash", "'crash' is not a FailureReason"),
        ("reason", "EXIT", "is not a FailureReason"),
        ("cause", "user code", "is not a MemberErrorCause"),
        ("cause", None, "expected a MemberErrorCause, got NoneType"),
        ("lost_host_members", "2", "expected int, got str"),  # no longer text parsed back
        ("lost_host_members", -1, "out of range"),
        ("lost_host_members", MEMBERS_PER_JOB_MAX + 1, "out of range"),
        ("lost_host_members", 0, "a lost host comes with its members lost"),
        ("lost_host", "", "a lost host comes with its members lost"),
    ],
)
def test_a_verdicts_typed_fields_are_checked(field: str, value: object, reason: str) -> None:
    body = msgpack.unpackb(encode(LOST_HOST))
    body[field] = value
    with pytest.raises(ProtocolError, match=reason):
        decode_any(msgpack.packb(body))


def test_a_verdicts_cause_and_lost_host_decode_typed() -> None:
    body = msgpack.unpackb(encode(LOST_HOST)) | {"reason": "error", "cause": "user_code"}
    failure = decode(msgpack.packb(body), Failure)
    assert failure.reason is FailureReason.ERROR and failure.cause is MemberErrorCause.USER_CODE
    assert failure.lost_host == "a" and failure.lost_host_members == 2
    assert failure.reason.needs_fence and failure.cause.ends_job
    assert not FailureReason.EXIT.needs_fence and not MemberErrorCause.STEP.ends_job


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("restore_source", "elsewhere", "'elsewhere' is not a RestoreSource"),
        ("marks", {"begun": 1.0}, "unknown fields"),  # a mark is a field, never a free key
        ("marks", {"ready": -1.0}, "a time mark is negative"),
        ("marks", {"ready": "soon"}, "matches none of"),
        ("marks", [1.0, 2.0], "expected a map"),
    ],
)
def test_an_acks_source_and_marks_are_checked(field: str, value: object, reason: str) -> None:
    body = msgpack.unpackb(encode(RebuildAck("j", 2, "m0", 0, 7, 8, RestoreSource.LOCAL, RebuildMarks(), 2.0)))
    body[field] = value
    with pytest.raises(ProtocolError, match=reason):
        decode_any(msgpack.packb(body))


def test_marks_of_an_older_record_decode_as_the_typed_record() -> None:
    """A job record saved before the marks were typed holds them as a map of the same names."""
    body = msgpack.unpackb(encode(RebuildAck("j", 2, "m0", 0, 7, 8, RestoreSource.STORE, RebuildMarks(), 2.0)))
    body["marks"] = {"received": 1.0, "begin": 1.5, "ready": 2.0}
    ack = decode(msgpack.packb(body), RebuildAck)
    assert ack.marks == RebuildMarks(received=1.0, begin=1.5, ready=2.0) and ack.restore_source is RestoreSource.STORE


def test_decode_refuses_an_oversized_message() -> None:
    with pytest.raises(ProtocolError, match="exceeds"):
        decode_any(b"\x00" * (1024 * 1024 + 1))


def test_subjects_are_scoped_by_job_and_refuse_bad_names() -> None:
    s = Subjects.for_job("train-1")
    assert s.rebuild == "deadpool.train-1.rebuild"
    assert s.fence("launcher_7") == "deadpool.train-1.launcher.launcher_7.fence"
    assert Subjects.any_job().heartbeat == "deadpool.*.member.heartbeat"
    with pytest.raises(ValueError, match="not a valid name"):
        Subjects.for_job("a.b")


def test_data_plane_frames_round_trip_and_refuse_chunks_outside_the_snapshot() -> None:
    chunk = PutChunk("j", 1, 0, "m0", 5, 0, 100, 100)
    frame = encode_frame(chunk)
    assert decode_frame_header(frame[4:], PutChunk) == chunk
    seal = Seal("j", 1, 0, "m0", 5, 100, 64, [1, 2], b"meta")
    assert decode_frame_header(encode_frame(seal)[4:]) == seal
    bad = PutChunk("j", 1, 0, "m0", 5, 90, 20, 100)
    with pytest.raises(ProtocolError, match="outside"):
        decode_frame_header(encode_frame(bad)[4:])
    with pytest.raises(ProtocolError, match="expected a fetch frame"):
        decode_frame_header(encode_frame(seal)[4:], Fetch)
    with pytest.raises(ProtocolError, match="one checksum per chunk"):
        decode_frame_header(encode_frame(Seal("j", 1, 0, "m0", 5, 100, 64, [1], b""))[4:])


def test_timeouts_out_of_order_are_refused_naming_each_problem() -> None:
    from deadpool_protocol.timeouts import TimeoutHierarchy

    TimeoutHierarchy(0.1, 5.0, 10.0, 60.0).check()
    with pytest.raises(ValueError, match=r"hang floor 5\.0 s must exceed the heartbeat timeout 5\.0 s"):
        TimeoutHierarchy(0.1, 5.0, 5.0, 60.0).check()
    with pytest.raises(ValueError, match=r"at least 3 heartbeat periods.*collective timeout 8\.0 s must exceed"):
        TimeoutHierarchy(1.0, 2.0, 10.0, 8.0).check()
