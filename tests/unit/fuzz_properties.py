"""What the fuzzers check, shared by the CI tests (`test_fuzz_protocol.py`, a few thousand cases) and
`bench/fuzz.py` (a hundred thousand and more).

Each property takes one input and either returns (the input was refused with the protocol's own
error, or accepted and is sound) or raises: `Forgery` when an input that must be refused was
accepted, anything else is a crash. Inputs are drawn two ways: raw bytes, and maps shaped like the
real messages and frames (the right kind and field names, values of the right type or not, edge
numbers, names that are not names), which get much deeper into validation than random bytes.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import types
import typing
from collections.abc import Iterator
from typing import Any

import msgpack
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from deadpool_protocol import ProtocolError, decode_any, encode
from deadpool_protocol.bounds import Bound, bound_of
from deadpool_protocol.codec import _KINDS, PROTOCOL_VERSION, shown
from deadpool_protocol.dataplane import (
    _OPS,
    CHUNK_BYTES_MAX,
    DATAPLANE_VERSION,
    SNAPSHOT_BYTES_MAX,
    Fetch,
    FetchReply,
    PutChunk,
    Seal,
    chunk_checksum,
    chunk_spans,
    decode_frame_header,
    encode_frame,
    job_token,
)
from deadpool_store.dataplane_server import DataPlaneServer
from deadpool_store.memory import SnapshotMemory, StoreError

__all__ = [
    "Forgery",
    "StoreProtocol",
    "bounds_broken",
    "check_forged_publication",
    "check_forged_read",
    "check_frame_bytes",
    "check_message_bytes",
    "check_oversized_message",
    "check_token_frame",
    "forged_publications",
    "forged_reads",
    "frame_bodies",
    "message_bodies",
    "oversized",
    "oversized_messages",
    "token_frames",
]


class Forgery(AssertionError):
    """An input that must be refused was accepted."""


EDGE_INTS = [-1, 2**31, 2**53 + 1, 2**62, 2**63 - 1, -(2**63), 2**64 - 1]
VALID_NAMES = ["j", "m0", "m1", "store-1", "l0", "127.0.0.1"]
BAD_NAMES = ["a.b", "", "*", ">", "x" * 129, "sp ace"]

wire_values: st.SearchStrategy[Any] = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=12)
    | st.binary(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=10,
)
"""Anything msgpack can carry."""


@functools.cache
def _plausible(hint: Any) -> st.SearchStrategy[Any]:
    """Values a real sender might put in a field of this type."""
    origin = typing.get_origin(hint)
    if hint is bool:
        return st.booleans()
    if hint is int:
        return st.integers(0, 64)
    if hint is float:
        return st.floats(0.0, 2e9)
    if hint is str:
        return st.sampled_from(VALID_NAMES)
    if hint is bytes:
        return st.binary(max_size=16)
    if isinstance(hint, type) and issubclass(hint, enum.StrEnum):
        return st.sampled_from(list(hint))
    if origin is list:
        (item,) = typing.get_args(hint)
        return st.lists(_plausible(item), max_size=4)
    if origin is dict:
        key, value = typing.get_args(hint)
        return st.dictionaries(_plausible(key), _plausible(value), max_size=3)
    if origin in (typing.Union, types.UnionType):
        return st.one_of(*[st.none() if a is type(None) else _plausible(a) for a in typing.get_args(hint)])
    if dataclasses.is_dataclass(hint):
        return _plausible_fields(typing.cast(type, hint))
    return wire_values


@functools.cache
def _hostile(hint: Any) -> st.SearchStrategy[Any]:
    """Values no honest sender puts there: edge numbers, NaN, names that are not names, deep or
    oversized structures, or a value of another type altogether."""
    origin = typing.get_origin(hint)
    edge: st.SearchStrategy[Any]
    if hint is int:
        edge = st.sampled_from(EDGE_INTS) | st.integers(-(2**63), 2**64 - 1)
    elif hint is float:
        edge = st.one_of(st.sampled_from([math.nan, math.inf, -math.inf, -1.0, 1e308]), st.floats())
    elif hint is str:
        edge = st.one_of(st.sampled_from(BAD_NAMES), st.text(max_size=40))
    elif origin is list:
        (item,) = typing.get_args(hint)
        edge = st.lists(_hostile(item) | _plausible(item), max_size=6)
    elif origin is dict:
        key, value = typing.get_args(hint)
        edge = st.dictionaries(_plausible(key), _hostile(value), max_size=3)
    elif dataclasses.is_dataclass(hint):
        edge = st.fixed_dictionaries({}, optional=_field_values(typing.cast(type, hint), _hostile))
    else:
        edge = st.nothing()
    return edge | wire_values


def _field_values(cls: type, of: Any) -> dict[str, st.SearchStrategy[Any]]:
    hints = typing.get_type_hints(cls)
    return {f.name: of(hints[f.name]) for f in dataclasses.fields(cls)}


@functools.cache
def _plausible_fields(cls: type) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries(_field_values(cls, _plausible))


@functools.cache
def _shaped(cls: type, envelope_items: tuple[tuple[str, Any], ...]) -> st.SearchStrategy[bytes]:
    """A plausible map of `cls`'s fields and its envelope, with a few fields (often none) replaced by
    hostile values, removed, or added."""
    hints = typing.get_type_hints(cls)
    envelope = dict(envelope_items)
    targets = [*hints, *envelope, "unknown"]

    def mutation(name: str) -> st.SearchStrategy[tuple[str, Any]]:
        hostile = _hostile(hints[name]) if name in hints else wire_values
        return st.tuples(st.just(name), hostile | st.just(_REMOVE))

    def build(fields: dict[str, Any], changes: list[tuple[str, Any]]) -> bytes:
        body = {**fields, **envelope}
        for name, value in changes:
            if value is _REMOVE:
                body.pop(name, None)
            else:
                body[name] = value
        return bytes(msgpack.packb(body, use_bin_type=True))

    changes = st.lists(st.sampled_from(targets).flatmap(mutation), max_size=3)
    return st.builds(build, _plausible_fields(cls), changes)


_REMOVE = object()
"""A mutation that takes the field out."""


def message_bodies() -> st.SearchStrategy[bytes]:
    """msgpack maps shaped like control messages (see `_shaped`)."""
    return st.sampled_from(sorted(_KINDS)).flatmap(
        lambda kind: _shaped(typing.cast(type, _KINDS[kind]), (("v", PROTOCOL_VERSION), ("kind", kind)))
    )


def frame_bodies() -> st.SearchStrategy[bytes]:
    """msgpack maps shaped like data-plane frame headers (see `_shaped`)."""
    return st.sampled_from(sorted(_OPS)).flatmap(
        lambda op: _shaped(typing.cast(type, _OPS[op]), (("v", DATAPLANE_VERSION), ("op", op)))
    )


def _finite(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return all(_finite(getattr(value, f.name)) for f in dataclasses.fields(value))
    if isinstance(value, list | tuple):
        return all(_finite(v) for v in value)
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    return True


def _too_big(base: Any, bound: Bound) -> Any:
    """A value of type `base` one unit over `bound` (a list's or map's items need not be valid: the
    count is checked first)."""
    origin = typing.get_origin(base) or base
    if origin is str:
        return "x" * (bound.most + 1)
    if origin is bytes:
        return b"x" * (bound.most + 1)
    if origin is list:
        return [None] * (bound.most + 1)
    return {f"k{i}": None for i in range(bound.most + 1)}


def oversized(hint: Any, value: Any, where: str) -> Iterator[tuple[str, Bound, Any]]:
    """Every way to put one value over its bound in `value` (the wire form of type `hint`): the place
    a refusal names, the bound broken, and the whole of `value` with that one change. Nested values
    are reached through the first item of a list and the first entry of a map."""
    base, bound = bound_of(hint)
    if bound is not None:
        yield where, bound, _too_big(base, bound)
    origin = typing.get_origin(base)
    if origin is list and value:
        (item,) = typing.get_args(base)
        for at, broken, bad in oversized(item, value[0], f"{where}[0]"):
            yield at, broken, [bad, *value[1:]]
    elif origin is dict and value:
        key_t, value_t = typing.get_args(base)
        first = next(iter(value))
        rest = {k: v for k, v in value.items() if k != first}
        for at, broken, bad in oversized(key_t, first, f"{where}.<key>"):
            yield at, broken, {bad: value[first], **rest}
        for at, broken, bad in oversized(value_t, value[first], f"{where}[{shown(first)}]"):
            yield at, broken, {**value, first: bad}
    elif dataclasses.is_dataclass(base) and isinstance(value, dict):
        hints = typing.get_type_hints(base, include_extras=True)
        for f in dataclasses.fields(base):
            if f.name in value:
                for at, broken, bad in oversized(hints[f.name], value[f.name], f"{where}.{f.name}"):
                    yield at, broken, {**value, f.name: bad}


def bounds_broken(value: Any, hint: Any, where: str) -> list[str]:
    """Where an accepted `value` (of type `hint`) holds more than its bound allows."""
    base, bound = bound_of(hint)
    if bound is not None and isinstance(value, str | bytes | list | dict) and bound.excess(value):
        return [f"{where}: {bound.excess(value)}"]
    origin = typing.get_origin(base)
    if origin is list:
        (item,) = typing.get_args(base)
        return [b for i, v in enumerate(value) for b in bounds_broken(v, item, f"{where}[{i}]")]
    if origin is dict:
        key_t, value_t = typing.get_args(base)
        return [b for k, v in value.items() for b in bounds_broken(k, key_t, where) + bounds_broken(v, value_t, where)]
    if dataclasses.is_dataclass(base):
        hints = typing.get_type_hints(base, include_extras=True)
        return [
            b for f in dataclasses.fields(base) for b in bounds_broken(getattr(value, f.name), hints[f.name], where)
        ]
    return []


@st.composite
def oversized_messages(draw: st.DrawFn) -> tuple[bytes, str, str]:
    """A control message shaped like a real one, with one value somewhere over its bound: (its bytes,
    the place the refusal must name, the bound's name)."""
    kind = draw(st.sampled_from(sorted(_KINDS)))
    cls = typing.cast(type, _KINDS[kind])
    fields = draw(_plausible_fields(cls))
    variants = list(oversized(cls, fields, kind))
    where, bound, body = draw(st.sampled_from(variants))
    data = bytes(msgpack.packb({**body, "v": PROTOCOL_VERSION, "kind": kind}, use_bin_type=True))
    return data, where, bound.name


def check_oversized_message(data: bytes, where: str, bound: str) -> None:
    """An oversized value is refused, and the reason names where it is and the bound it broke."""
    try:
        message = decode_any(data)
    except ProtocolError as exc:
        if f"{where}: " not in str(exc) or bound not in str(exc):
            raise AssertionError(f"refused, but not for {where} over {bound}: {exc}") from None
        return
    raise Forgery(f"a {message.KIND} with {where} over {bound} was accepted")


def check_message_bytes(data: bytes) -> bool:
    """Decode a control message: refused with ProtocolError (False), or accepted (True), finite,
    within every bound, and stable under a second encoding."""
    try:
        message = decode_any(data)
    except ProtocolError:
        return False
    if not _finite(message):
        raise Forgery(f"a {message.KIND} with a number that is not finite was accepted")
    broken = bounds_broken(message, type(message), message.KIND)
    if broken:
        raise Forgery(f"a {message.KIND} over its bounds was accepted: {broken}")
    if decode_any(encode(message)) != message:
        raise Forgery(f"a {message.KIND} changed when encoded again")
    return True


def check_frame_bytes(data: bytes) -> bool:
    """Decode a frame header: refused, or accepted within the data plane's bounds."""
    try:
        frame = decode_frame_header(data)
    except ProtocolError:
        return False
    broken = bounds_broken(frame, type(frame), frame.OP)
    if broken:
        raise Forgery(f"a {frame.OP} frame over its bounds was accepted: {broken}")
    if isinstance(frame, Seal) or (isinstance(frame, FetchReply) and frame.ok):
        if not (0 <= frame.total_bytes <= SNAPSHOT_BYTES_MAX and 0 < frame.chunk_bytes <= CHUNK_BYTES_MAX):
            raise Forgery(f"a {frame.OP} of {frame.total_bytes} bytes in chunks of {frame.chunk_bytes} was accepted")
        if len(frame.checksums) != len(chunk_spans(frame.total_bytes, frame.chunk_bytes)):
            raise Forgery(f"a {frame.OP} with a checksum count that does not fit its chunks was accepted")
    if isinstance(frame, PutChunk) and frame.offset + frame.nbytes > frame.total_bytes:
        raise Forgery("a chunk outside its snapshot was accepted")
    if decode_frame_header(encode_frame(frame)[4:]) != frame:
        raise Forgery(f"a {frame.OP} frame changed when encoded again")
    return True


TOKEN_KEY = bytes(range(32))
_KEYED_STORE = DataPlaneServer(SnapshotMemory(1), lambda _snap: None, None, key=TOKEN_KEY)  # type: ignore[arg-type,return-value]


@st.composite
def token_frames(draw: st.DrawFn) -> bytes:
    """An upload or fetch frame header of some job carrying a token that is that job's, another job's,
    the job's with a bit flipped or cut short, empty, or random bytes."""
    job = draw(st.sampled_from(["j", "m0", "job-a", "job-b", "x" * 128]))
    right = job_token(TOKEN_KEY, job)
    kind = draw(st.sampled_from(["right", "other", "flipped", "short", "empty", "random", "other-key"]))
    if kind == "right":
        token = right
    elif kind == "other":
        token = job_token(TOKEN_KEY, draw(st.sampled_from(["j", "m0", "job-a", "job-b"]).filter(lambda o: o != job)))
    elif kind == "flipped":
        bit = draw(st.integers(0, 8 * len(right) - 1))
        token = bytes(b ^ (1 << (bit % 8)) if i == bit // 8 else b for i, b in enumerate(right))
    elif kind == "short":
        token = right[: draw(st.integers(0, len(right) - 1))]
    elif kind == "empty":
        token = b""
    elif kind == "other-key":
        token = job_token(bytes(32), job)
    else:
        token = draw(st.binary(min_size=0, max_size=64))
    op = draw(st.sampled_from(["fetch", "seal", "put_chunk"]))
    frame: Fetch | Seal | PutChunk
    if op == "fetch":
        frame = Fetch(job, 0, 1, token)
    elif op == "seal":
        frame = Seal(job, 1, 0, "m0", 1, 8, 8, [0], b"", token)
    else:
        frame = PutChunk(job, 1, 0, "m0", 1, 0, 8, 8, token)
    body = dataclasses.asdict(frame) | {"v": DATAPLANE_VERSION, "op": frame.OP}
    return bytes(msgpack.packb(body, use_bin_type=True))


def check_token_frame(data: bytes) -> bool:
    """A keyed store lets a frame through only with its job's own token."""
    try:
        frame = decode_frame_header(data)
    except ProtocolError:
        return False
    assert isinstance(frame, Fetch | Seal | PutChunk)
    refused = _KEYED_STORE.refusal(frame.job, frame.token)
    if not refused and frame.token != job_token(TOKEN_KEY, frame.job):
        raise Forgery(f"a {frame.OP} of job {frame.job} with a token not its own was let through")
    if refused and frame.token == job_token(TOKEN_KEY, frame.job):
        raise AssertionError(f"a {frame.OP} with its job's own token was refused: {refused}")
    return not refused


class StoreProtocol(RuleBasedStateMachine):
    """The store's snapshot memory driven by any sequence of chunks, seals (honest, or with checksums
    that do not match the bytes), fetches, commits and expiries, from two uploaders, one of them
    hostile. Invariants: memory accounting never goes wrong or past capacity; a snapshot that is
    served matches its manifest; nothing but StoreError is raised."""

    CAPACITY = 4096

    def __init__(self) -> None:
        super().__init__()
        self.memory = SnapshotMemory(self.CAPACITY, keep_committed=2, uncommitted_max=2)
        self.sent: dict[tuple[int, int, int, str], bytearray] = {}
        """(rank, step, generation, member) -> the bytes that member sent for it."""
        self.now = 0.0

    @rule(
        rank=st.integers(0, 2),
        step=st.integers(0, 6),
        generation=st.integers(1, 3),
        member=st.sampled_from(["m0", "evil"]),
        total=st.sampled_from([1, 8, 64, 100, 3000, 5000]),
        offset=st.integers(0, 5000),
        nbytes=st.integers(1, 64),
        fill=st.integers(0, 255),
    )
    def chunk(
        self, rank: int, step: int, generation: int, member: str, total: int, offset: int, nbytes: int, fill: int
    ) -> None:
        frame = PutChunk("j", generation, rank, member, step, offset, nbytes, total)
        try:
            frame.check()
        except ProtocolError:
            return  # the server drops the connection before the memory sees it
        try:
            target = self.memory.chunk_target(frame)
        except StoreError:
            return
        target[:] = bytes([fill]) * nbytes
        self.memory.chunk_received(frame)
        key = (rank, step, generation, member)
        sent = self.sent.setdefault(key, bytearray(total))
        if len(sent) == total:
            sent[offset : offset + nbytes] = bytes([fill]) * nbytes

    @rule(
        rank=st.integers(0, 2),
        step=st.integers(0, 6),
        generation=st.integers(1, 3),
        member=st.sampled_from(["m0", "evil"]),
        chunk_bytes=st.sampled_from([1, 8, 64, 4096]),
        honest=st.booleans(),
    )
    def seal(self, rank: int, step: int, generation: int, member: str, chunk_bytes: int, honest: bool) -> None:
        sent = self.sent.get((rank, step, generation, member))
        total = len(sent) if sent is not None else 8
        data = bytes(sent) if sent is not None else bytes(total)
        checksums = [chunk_checksum(data[o : o + n]) for o, n in chunk_spans(total, chunk_bytes)]
        if not honest and checksums:
            checksums[0] ^= 1  # the manifest does not describe the bytes
        try:
            self.memory.seal(Seal("j", generation, rank, member, step, total, chunk_bytes, checksums, b""))
        except StoreError:
            return
        if not honest:
            raise Forgery("a seal whose checksums do not match the bytes was accepted")

    @rule(step=st.integers(0, 6))
    def commit(self, step: int) -> None:
        self.memory.commit("j", step)

    @rule(advance_s=st.floats(0.0, 100.0))
    def expire(self, advance_s: float) -> None:
        self.now += advance_s
        self.memory.expire_unsealed(self.now + 1e6 if advance_s > 90 else -1.0, 60.0)

    @rule(rank=st.integers(0, 2), step=st.integers(0, 6))
    def fetch(self, rank: int, step: int) -> None:
        try:
            snap = self.memory.get("j", rank, step)
        except StoreError:
            return
        data = memoryview(snap.data)[: snap.total_bytes]
        for (offset, nbytes), want in zip(chunk_spans(snap.total_bytes, snap.chunk_bytes), snap.checksums, strict=True):
            if chunk_checksum(data[offset : offset + nbytes]) != want:
                raise Forgery(f"snapshot rank {rank} step {step} served bytes its manifest does not describe")

    @invariant()
    def accounting(self) -> None:
        snapshots = self.memory._snapshots.values()
        held = sum(s.total_bytes if s.sealed else s.charged for s in snapshots)  # an upload: what it sent
        if any(s.charged > s.total_bytes for s in snapshots):
            raise AssertionError("an upload counts more bytes than it announced")
        if self.memory.used_bytes != held or held > self.CAPACITY:
            raise AssertionError(f"used_bytes {self.memory.used_bytes}, held {held}, capacity {self.CAPACITY}")
        if self.memory.used_bytes + self.memory.pooled_bytes > self.CAPACITY:
            raise AssertionError("stored plus pooled bytes exceed the capacity")
        unsealed = sum(s.charged for s in snapshots if not s.sealed)
        if sum(self.memory.unsealed_bytes.values()) != unsealed or unsealed > self.memory.job_unsealed_max_bytes:
            raise AssertionError(f"unsealed bytes {dict(self.memory.unsealed_bytes)}, held {unsealed}")

    @precondition(lambda self: len(self.sent) > 64)
    @rule()
    def forget_sent(self) -> None:
        self.sent.clear()


# ---------------------------------------------------------------- forgeries: each key, well-formed lies

FORGER_JOB, VICTIM_JOB = "job-a", "job-b"
FORGER_STORE, VICTIM_STORE = "store-0", "store-1"
JOB_KINDS = frozenset(
    {"member_hello", "heartbeat", "heartbeat_batch", "member_error", "member_done", "rebuild_ack"}
    | {"step_resumed", "snapshot_interval", "run_start", "child_exit", "rebuild_ack_batch", "step_resumed_batch"}
)
"""What a job's launchers and members say, each about their own job."""
STORE_KINDS = frozenset({"store_status", "snapshot_complete"})
"""What a store says, each about itself."""


def key_permissions(key: str) -> dict[str, list[str]]:
    """The permissions the NATS servers give the forger's key: job A's own, or store 0's own."""
    from deadpool_cli.nats_auth import job_permissions, store_permissions

    return job_permissions(FORGER_JOB) if key == "job" else store_permissions(FORGER_STORE)


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: `*` is one token, `>` one or more to the end."""
    want, have = pattern.split("."), subject.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return len(have) > i
        if i >= len(have) or token not in ("*", have[i]):
            return False
    return len(want) == len(have)


@functools.cache
def _listened_subjects() -> tuple[str, ...]:
    """Every subject a DeadPool service or member takes messages on, for both jobs and both stores."""
    from deadpool_protocol.subjects import Subjects, store_announce, store_replicate

    subjects: list[str] = []
    for job in (FORGER_JOB, VICTIM_JOB):
        s = Subjects.for_job(job)
        subjects += [s.hello, s.heartbeat, s.member_error, s.member_done, s.rebuild_ack, s.step_resumed]
        subjects += [s.snapshot_interval, s.run_start, s.child_exit, s.heartbeat_batch, s.failure, s.straggler]
        subjects += [s.group_broken, s.rebuild, s.rebuild_delta, s.void, s.placement, s.placement_delta]
        subjects += [s.commit, s.finished, s.incident]
        subjects += [s.launcher_heartbeat("l0"), s.fence("l0"), s.launcher_ack("l0"), s.launcher_step_resumed("l0")]
        subjects += [s.rebuild_ack_batch, s.step_resumed_batch]
        subjects += [s.snapshot_complete_by(store) for store in (FORGER_STORE, VICTIM_STORE)]
    for store in (FORGER_STORE, VICTIM_STORE):
        subjects += [store_announce(store), store_replicate(store)]
    return tuple(subjects)


@st.composite
def forged_publications(draw: st.DrawFn) -> tuple[str, str, bytes]:
    """(the forger's key, a subject, a well-formed message): any kind, plausible fields, naming the
    forger's own job or store or its victim's, sent on any subject a part of DeadPool listens on."""
    key = draw(st.sampled_from(["job", "store"]))
    kind = draw(st.sampled_from(sorted(_KINDS)))
    cls = typing.cast(type, _KINDS[kind])
    fields = draw(_plausible_fields(cls))
    if "job" in fields:
        fields["job"] = draw(st.sampled_from([FORGER_JOB, VICTIM_JOB]))
    if "store" in fields:
        fields["store"] = draw(st.sampled_from([FORGER_STORE, VICTIM_STORE]))
    batched = {"heartbeat_batch": "beats", "rebuild_ack_batch": "acks", "step_resumed_batch": "resumed"}.get(kind)
    if batched:  # a batch's items name its job
        fields[batched] = [{**item, "job": fields["job"]} for item in fields[batched]]
    body = {**fields, "v": PROTOCOL_VERSION, "kind": kind}
    return key, draw(st.sampled_from(_listened_subjects())), bytes(msgpack.packb(body, use_bin_type=True))


def check_forged_publication(case: tuple[str, str, bytes]) -> bool:
    """Whether the message reaches a part of DeadPool that takes it (the server lets the key publish
    there, it decodes, and the subject may carry it: `subject_refusal`). Taken, it must be the key's own
    to say: a job's key speaking for its own job, a store's for itself; anything else is a forgery."""
    from deadpool_protocol import subject_refusal

    key, subject, data = case
    if not any(subject_matches(p, subject) for p in key_permissions(key)["publish"]):
        return False  # the server refuses it: it reaches nobody
    try:
        message = decode_any(data)
    except ProtocolError:
        return False
    if subject_refusal(subject, message):
        return False
    own = (
        message.KIND in JOB_KINDS and getattr(message, "job", None) == FORGER_JOB
        if key == "job"
        else message.KIND in STORE_KINDS and getattr(message, "store", None) == FORGER_STORE
    )
    if not own:
        raise Forgery(f"{key} key: a {message.KIND} on {subject} was taken: {shown(message)}")
    return True


def check_forged_read(case: tuple[str, str]) -> bool:
    """Whether the key may read `subject`. Reading any reply inbox but its own (a job's replies carry its
    token and seal key), another job's subjects, or another store's requests is a forgery. (A store's
    announcement, its address and memory use, is every service's to read: stores find a chain's next
    store by it.)"""
    from deadpool_protocol.subjects import store_announce

    key, subject = case
    readable = any(subject_matches(p, subject) for p in key_permissions(key)["subscribe"])
    own_inbox = f"_INBOX.deadpool.{FORGER_JOB}." if key == "job" else f"_INBOX.deadpool-store.{FORGER_STORE}."
    others = f".{VICTIM_JOB}." if key == "job" else f"deadpool.store.{VICTIM_STORE}."
    secret = subject.startswith("_INBOX.") and not subject.startswith(own_inbox)
    announcement = key == "store" and subject == store_announce(VICTIM_STORE)
    if readable and (secret or (others in subject and not announcement)):
        raise Forgery(f"{key} key may read {subject}")
    return readable


def forged_reads() -> st.SearchStrategy[tuple[str, str]]:
    from deadpool_protocol.subjects import service_inbox

    inboxes = [f"_INBOX.deadpool.{job}.x" for job in (FORGER_JOB, VICTIM_JOB)]
    inboxes += [f"{service_inbox(role)}.x" for role in ("swapper", "detector")]
    inboxes += [f"{service_inbox('store', store)}.x" for store in (FORGER_STORE, VICTIM_STORE)]
    return st.tuples(st.sampled_from(["job", "store"]), st.sampled_from([*inboxes, *_listened_subjects()]))
