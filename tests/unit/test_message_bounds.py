"""Every string, bytes, list and map a peer sends has a bound: over it, the message is refused with a
reason naming the field and the bound; at it, an honest message goes through.

One hello with a 600 kB host name was once accepted: it went into its job's record, which could no
longer be saved, and the job stopped (issue 21).
"""

from __future__ import annotations

import dataclasses
import enum
import re
import types
import typing
from typing import Any

import msgpack
import pytest

from deadpool_protocol import (
    ChildExit,
    Commit,
    Failure,
    FailureReason,
    FenceReply,
    FenceRequest,
    GenerationVoid,
    GroupBroken,
    Heartbeat,
    HeartbeatBatch,
    HelloReply,
    Incident,
    JobFinished,
    MemberDone,
    MemberError,
    MemberErrorCause,
    MemberHello,
    Message,
    Placement,
    PlacementDelta,
    ProtocolError,
    Rebuild,
    RebuildAck,
    RebuildAckBatch,
    RebuildDelta,
    RebuildMarks,
    Replicate,
    Reserve,
    RestoreSource,
    RunReply,
    RunStart,
    SnapshotComplete,
    SnapshotInterval,
    StepResumed,
    StepResumedBatch,
    StoreAddress,
    StoreStatus,
    Straggler,
    decode,
    decode_any,
    encode,
)
from deadpool_protocol.bounds import (
    EVIDENCE_ENTRIES_MAX,
    HOST_NAME_BYTES_MAX,
    MEMBERS_PER_JOB_MAX,
    SECTION_CHARS_MAX,
    TAG_CHARS_MAX,
    TEXT_CHARS_MAX,
    TIME_MARKS_MAX,
    WHERE_CHARS_MAX,
    bound_of,
    clip_text,
)
from deadpool_protocol.codec import _KINDS, PROTOCOL_VERSION, to_fields
from deadpool_protocol.dataplane import (
    DATAPLANE_VERSION,
    Fetch,
    FetchReply,
    Frame,
    PutChunk,
    Reply,
    Seal,
    decode_frame_header,
)
from deadpool_protocol.job_record import JobSummary, pack_record, unpack_record
from deadpool_protocol.messages import members_digest
from deadpool_protocol.names import NAME_MAX_CHARS
from tests.unit.fuzz_properties import oversized

STORE = StoreAddress("s0", "127.0.0.1", 5000)
BEAT = Heartbeat("j", 1, "m0", 0, 42, 10, True, 2.0, 3.0, 1, False, "train.py:12 step", "eval", "h0")

EXAMPLES: list[Message] = [
    MemberHello("j", 0, "m0", "host", 42, "l0", 0, 4, "127.0.0.1", 4000, 1.0, "run-1"),
    RunStart("j", 0, "run-1", 4, "l0", 1.0),
    RunReply("j", 0, "run-1", False, "job j is running as run run-0"),
    HelloReply("j", 1, "m0", True, "registered", False, "", bytes(32)),
    BEAT,
    HeartbeatBatch("j", 1, "l0", [BEAT]),
    MemberError("j", 1, "m0", 0, "boom", 1.0),
    MemberDone("j", 1, "m0", 0, 100),
    StepResumed("j", 2, "m0", 0, 8, 2.0),
    StepResumedBatch("j", 2, "l0", [StepResumed("j", 2, "m0", 0, 8, 2.0)]),
    SnapshotInterval("j", 2, "m0", 0, 4, 2.0),
    Straggler("j", 1, "m0", 0, {"busy_share": "0.9"}, 1.0),
    ChildExit("j", 1, "l0", "m0", 42, -9, 1.0),
    Failure("j", 1, "m0", 0, FailureReason.EXIT, {"returncode": "-9"}, 1.0, 1.1),
    GroupBroken("j", 1, 2, members_digest(["m0", "m1"]), {"first_to_leave": "m0"}, 1.0, 3.0),
    Rebuild("j", 2, 2, ["m0", "m1"], ["m2"], "m0", "127.0.0.1", 4000, 7, [STORE], [["s0"], ["s0"]], "j-1", 12.5),
    RebuildDelta(
        "j", 2, 1, 0, "0" * 32, 2, [1], ["m1"], [1], [["s0"]], ["m2"], "m0", "127.0.0.1", 4000, 7, [STORE], "j-1", 12.5
    ),
    Placement("j", 2, 1, [STORE], [["s0"], ["s0"]], "stores lost: ['s1']"),
    PlacementDelta("j", 2, 1, 0, 2, "0" * 32, [1], [["s0"]], [STORE], "stores lost: ['s1']"),
    Replicate("j", 2, 0, 7, "s1", STORE),
    Reserve("j", 2, "s1", [0, 3], [1024, 1024]),
    RebuildAck("j", 2, "m0", 0, 7, 8, RestoreSource.LOCAL, RebuildMarks(out=1.0, ready=2.0), 2.0),
    RebuildAckBatch(
        "j", 2, "l0", [RebuildAck("j", 2, "m0", 0, 7, 8, RestoreSource.LOCAL, RebuildMarks(out=1.0, ready=2.0), 2.0)]
    ),
    FenceRequest("j", 1, "m0", "heartbeat"),
    FenceReply("j", 1, "m0", True, "killed", 1.0),
    GenerationVoid("j", 1, "rank 0 failed", 1.0),
    SnapshotComplete("j", 1, "s0", 5, [0], [1024]),
    Commit("j", 1, 5),
    JobFinished("j", 1, 100, True, "the swapper ended it"),
    Incident("j", 2, "j-1", 0, "m0", "m2", "exit", 1.0, 1.1, 1.2, 2.0, 7, 0, {"detect": 0.1}, {"pid": "1"}),
    StoreStatus("s0", "127.0.0.1", 5000, 10, 100, 1, 1.0, "node0", 0, "a1b2c3"),
]
FRAMES: list[Frame] = [
    PutChunk("j", 1, 0, "m0", 5, 0, 100, 100, bytes(32)),
    Seal("j", 1, 0, "m0", 5, 100, 64, [1, 2], b"meta", bytes(32)),
    Fetch("j", 0, 5, bytes(32), "00-abc-def-01"),
    Reply(False, "refused"),
    FetchReply(True, "", 1, "m0", 100, 64, [1, 2], b"meta"),
]


def test_the_examples_cover_every_message_kind() -> None:
    assert {m.KIND for m in EXAMPLES} == set(_KINDS)


def test_a_hello_with_a_600_kB_host_is_refused_naming_the_field_and_its_bound() -> None:
    hello = MemberHello("j", 0, "m0", "h" * 600_000, 42, "l0", 0, 4, "127.0.0.1", 4000, 1.0)
    with pytest.raises(ProtocolError) as refused:
        decode(encode(hello), MemberHello)
    reason = str(refused.value)
    assert reason == "member_hello.host: 600000 bytes exceeds HOST_NAME_BYTES_MAX (253)"


def _every_oversized_case(examples: list[Any], kind_of: Any) -> list[Any]:
    cases = []
    for example in examples:
        kind = kind_of(example)
        for where, bound, body in oversized(type(example), to_fields(example), kind):
            cases.append(pytest.param(example, body, where, bound.name, id=f"{where}>{bound.name}"))
    return cases


@pytest.mark.parametrize(("example", "body", "where", "bound"), _every_oversized_case(EXAMPLES, lambda m: m.KIND))
def test_every_message_refuses_each_string_list_and_map_over_its_bound(
    example: Message, body: dict[str, Any], where: str, bound: str
) -> None:
    data = msgpack.packb({**body, "v": PROTOCOL_VERSION, "kind": example.KIND}, use_bin_type=True)
    with pytest.raises(ProtocolError, match=rf"^{re.escape(where)}: \d+ \w+ exceeds {bound} \(\d+\)$"):
        decode_any(data)


@pytest.mark.parametrize(("example", "body", "where", "bound"), _every_oversized_case(FRAMES, lambda f: f.OP))
def test_every_frame_refuses_each_string_list_and_bytes_over_its_bound(
    example: Frame, body: dict[str, Any], where: str, bound: str
) -> None:
    data = msgpack.packb({**body, "v": DATAPLANE_VERSION, "op": example.OP}, use_bin_type=True)
    with pytest.raises(ProtocolError, match=rf"^{re.escape(where)}: \d+ \w+ exceeds {bound} \(\d+\)$"):
        decode_frame_header(data)


def test_a_job_record_over_its_bounds_is_refused() -> None:
    summary = JobSummary("j", 2, 1, ["m0", "m1"], ["m2"], {"m0": "h0"}, [], 5, False)
    cases = list(oversized(JobSummary, to_fields(summary), "job_record.summary"))
    assert {where for where, _, _ in cases} >= {"job_record.summary.ranks", "job_record.summary.hosts.<key>"}
    for where, bound, body in cases:
        data = msgpack.packb({"v": 1, "summary": body, "swapper": {}}, use_bin_type=True)
        with pytest.raises(ProtocolError, match=rf"^{re.escape(where)}: .* exceeds {bound.name}"):
            unpack_record(data)


def test_a_refusal_never_quotes_more_than_a_few_characters_of_what_was_sent() -> None:
    for body in (
        {"v": PROTOCOL_VERSION, "kind": "k" * 500_000},
        {"v": "v" * 500_000, "kind": "commit"},
        {**to_fields(Commit("j", 1, 5)), "v": PROTOCOL_VERSION, "kind": "commit", "x" * 500_000: 1},
    ):
        with pytest.raises(ProtocolError) as refused:
            decode_any(msgpack.packb(body))
        assert len(str(refused.value)) < 200


def round_trips(message: Message) -> bool:
    return decode(encode(message), type(message)) == message


def test_honest_messages_at_every_bound_are_accepted() -> None:
    name = "n" * NAME_MAX_CHARS
    host = "h" * HOST_NAME_BYTES_MAX
    text = "t" * TEXT_CHARS_MAX
    evidence = {f"{i:0{TAG_CHARS_MAX}d}": text for i in range(EVIDENCE_ENTRIES_MAX)}
    marks = {f"{i:0{TAG_CHARS_MAX}d}": 1.0 for i in range(TIME_MARKS_MAX)}
    assert round_trips(MemberHello(name, 0, name, host, 42, name, 0, 4, host, 4000, 1.0))
    assert round_trips(MemberHello("j", 0, "m0", "é" * (HOST_NAME_BYTES_MAX // 2), 42, "l0", 0, 4, "::1", 4000, 1.0))
    beat = Heartbeat(name, 1, name, 0, 42, 10, True, 2.0, 3.0, 1, True, "w" * WHERE_CHARS_MAX, "s" * SECTION_CHARS_MAX)
    assert round_trips(HeartbeatBatch(name, 1, name, [beat] * 100))
    assert round_trips(MemberError("j", 1, "m0", 0, text, 1.0))
    assert round_trips(Failure("j", 1, "m0", 0, FailureReason.ERROR, evidence, 1.0, 1.1))
    every_mark = RebuildMarks(1.0, 1.0, 1.0, 1.0, 1.0, 1.0)
    assert round_trips(RebuildAck("j", 2, "m0", 0, 7, 8, RestoreSource.LOCAL, every_mark, 2.0))
    lost = Failure(
        "j", 1, "m0", 0, FailureReason.HEARTBEAT, {}, 1.0, 1.1, "", MemberErrorCause.STEP, host, MEMBERS_PER_JOB_MAX
    )
    assert round_trips(lost)
    assert round_trips(Incident("j", 2, "j-1", 0, "m0", "m2", text, 1.0, 1.1, 1.2, 2.0, 7, 0, marks, evidence))
    assert round_trips(JobFinished("j", 3, 100, True, text))
    assert round_trips(StoreStatus(name, host, 5000, 10, 100, 1, 1.0, host, 0, "a1b2c3"))


def test_a_host_name_is_measured_in_utf8_bytes() -> None:
    over = MemberHello("j", 0, "m0", "é" * (HOST_NAME_BYTES_MAX // 2 + 1), 42, "l0", 0, 4, "::1", 4000, 1.0)
    with pytest.raises(ProtocolError, match=r"member_hello\.host: 254 bytes exceeds HOST_NAME_BYTES_MAX"):
        decode_any(encode(over))


def test_a_job_of_16384_ranks_with_spares_fits_the_members_cap() -> None:
    ranks = 16_384
    spares = MEMBERS_PER_JOB_MAX - ranks
    members = [f"m{i}" for i in range(ranks + spares)]
    rebuild = Rebuild(
        "j", 2, ranks, members[:ranks], members[ranks:], "m0", "10.0.0.1", 4000, 7,
        [STORE, StoreAddress("s1", "10.0.0.2", 5000)], [["s0", "s1"]] * ranks, "j-1", 12.5,
    )  # fmt: skip
    assert round_trips(rebuild)
    summary = JobSummary("j", ranks, 2, members[:ranks], members[ranks:], {m: "h0" for m in members}, [], 5, False)
    assert unpack_record(pack_record(summary, {}))[0] == summary
    one_more = {**to_fields(rebuild), "spares": [*members[ranks:], "one-more"]}
    with pytest.raises(ProtocolError, match="MEMBERS_PER_JOB_MAX"):
        decode_any(msgpack.packb({**one_more, "v": PROTOCOL_VERSION, "kind": "rebuild"}))


def test_clipped_text_keeps_to_its_bound_and_says_it_was_cut() -> None:
    long = "".join(chr(ord("a") + i % 26) for i in range(10 * TEXT_CHARS_MAX))
    clipped = clip_text(long)
    assert len(clipped) == TEXT_CHARS_MAX and clipped.endswith(" [cut]") and long.startswith(clipped[:-6])
    assert clip_text("short") == "short"
    assert round_trips(MemberError("j", 1, "m0", 0, clip_text(long), 1.0))
    assert round_trips(GenerationVoid("j", 1, clip_text(long), 1.0))


def test_every_field_of_every_message_has_a_bound_or_is_a_number() -> None:
    """A new field without its own bound gets its type's default; one of a type the bounds do not know
    (a set, a tuple) would be unchecked, so it is refused here."""

    def unbounded(hint: Any, where: str) -> list[str]:
        base, bound = bound_of(hint)
        origin = typing.get_origin(base)
        if base in (int, float, bool):
            return []
        options = typing.get_args(base) if origin in (typing.Union, types.UnionType) else (base,)
        if all(o is type(None) or o in (int, float, bool) for o in options):
            return []  # a number or None
        if all(o is type(None) or (isinstance(o, type) and issubclass(o, enum.StrEnum)) for o in options):
            return []  # one of a few short words (or None): the codec looks it up among them
        if bound is None and not dataclasses.is_dataclass(base):
            return [where]
        if origin is list:
            return unbounded(typing.get_args(base)[0], f"{where}[]")
        if origin is dict:
            key_t, value_t = typing.get_args(base)
            return unbounded(key_t, f"{where}.<key>") + unbounded(value_t, f"{where}[]")
        if dataclasses.is_dataclass(base):
            hints = typing.get_type_hints(base, include_extras=True)
            return [u for f in dataclasses.fields(base) for u in unbounded(hints[f.name], f"{where}.{f.name}")]
        return []

    found = [u for cls in [*_KINDS.values(), *(type(f) for f in FRAMES), JobSummary] for u in unbounded(cls, "")]
    assert found == []


def test_a_heartbeat_names_a_forced_interval_of_any_length_and_refuses_none() -> None:
    """`--snapshot-every 100` is the member's interval, past the adaptive one's 64: a heartbeat refused
    for it would make the member look dead. An interval below 1 step is no interval."""
    decoded = decode(encode(dataclasses.replace(BEAT, snapshot_every=100)), Heartbeat)
    assert decoded.snapshot_every == 100
    with pytest.raises(ProtocolError):
        dataclasses.replace(BEAT, snapshot_every=0).check()
