"""The snapshot data plane: frames between a trainer hook and a snapshot store over direct TCP.

A frame is a 4-byte big-endian length, a msgpack header, and for `PutChunk` (and the chunks that
follow a `FetchReply`) raw tensor bytes. Bulk bytes never go through msgpack or NATS; the Seal lists an
XXH3-64 checksum per chunk, which the store compares with what it received and the restoring member
checks before it applies anything. A chunk's header does not carry its checksum, so either end
computes it after the bytes have gone into (or come out of) the socket, overlapping with the transfer.
(XXH3 runs at ~24 GB/s here, CRC-32 at ~4 GB/s: with CRC-32 on both ends the checksums alone held
loopback ingest to about half the raw socket rate.)

    hook -> store: PutChunk+bytes ... PutChunk+bytes, Seal        store -> hook: Reply
    hook -> store: Fetch                                          store -> hook: FetchReply, bytes...

**Who may read and write.** A store given a data-plane key accepts an upload or a fetch only with the
job's token, `job_token(key, job)`: an HMAC of the job's name under the key that only the stores and
the swapper hold. The swapper hands a job's token to the job's members in its answer to their hello,
over the authenticated bus; so a member can read and write its own job's snapshots and no other's, and
a stranger none. The token is compared in constant time and never logged.

**Who wrote a snapshot.** A token lets its holder write, and every store holds every job's: so a
restoring member trusts a copy only if its seal is signed. The uploading member signs the Seal's
fields (job, generation, rank, member, step, sizes, checksums, layout) with the job's seal key,
`seal_key(signing_key, job)`, which the swapper derives from a key that stores never see and hands to
the job's members with their token; stores keep the signature with the copy, pass it on when they
replicate, and return it with a fetch, and the member checks it before it takes a byte. (The chunk
checksums it covers are XXH3, chosen for speed: a store that could craft an XXH3 second preimage of a
4 MiB chunk could still change bytes under a valid signature.)

**Each byte leaves the member once.** A rank's snapshot goes to R stores; the member uploads it to
the first only, naming the others in each chunk's `forward`. That store passes each chunk on to the
next as it arrives (the chunk's `forward` then names the rest), so the copies are made in a pipeline,
store to store, and its `Reply` to the Seal waits for the chain's and lists the stores downstream that
sealed their copy (`forwarded`). Each store verifies every chunk against the member's signed manifest
itself, and reports its own copy complete, so a commit still means R verified copies. A store missing
from `forwarded` (it failed, or the one before it could not reach it) gets the member's own upload, as
before chains.

This module only encodes and decodes; the I/O lives with the hooks and the store.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from dataclasses import dataclass, field
from typing import Annotated, ClassVar, TypeVar

import msgpack
import xxhash

from deadpool_protocol.bounds import TOKEN_BYTES, Bound, Name, Text, Token, Traceparent
from deadpool_protocol.codec import from_fields, shown, to_fields
from deadpool_protocol.messages import ProtocolError
from deadpool_protocol.names import is_valid_name

__all__ = [
    "CHECKSUMS_MAX",
    "CHUNK_BYTES_DEFAULT",
    "CHUNK_BYTES_MAX",
    "DATAPLANE_VERSION",
    "FORWARD_MAX",
    "FRAME_LENGTH",
    "HEADER_BYTES_MAX",
    "SIGNATURE_BYTES",
    "SNAPSHOT_BYTES_MAX",
    "Fetch",
    "FetchReply",
    "Frame",
    "PutChunk",
    "Reply",
    "Seal",
    "chunk_checksum",
    "chunk_count",
    "chunk_spans",
    "decode_frame_header",
    "encode_frame",
    "job_token",
    "seal_key",
    "seal_signature",
    "token_matches",
]

FRAME_LENGTH = struct.Struct("!I")
HEADER_BYTES_MAX = 16 * 1024 * 1024
"""A Seal carries the snapshot's layout; a model with 10^5 tensors still fits."""
CHUNK_BYTES_DEFAULT = 4 * 1024 * 1024
CHUNK_BYTES_MAX = 256 * 1024 * 1024
"""The largest chunk either end accepts."""
SNAPSHOT_BYTES_MAX = 1 << 40
"""The largest snapshot either end accepts (1 TiB: one rank's state; a store's capacity bounds it further)."""
CHECKSUMS_MAX = HEADER_BYTES_MAX // 8
"""A manifest's checksums: about as many as a frame header holds (a 1 TiB snapshot in the default
chunks has 2**18)."""
Checksums = Annotated[list[int], Bound(CHECKSUMS_MAX, "CHECKSUMS_MAX", "items")]
Layout = Annotated[bytes, Bound(HEADER_BYTES_MAX, "HEADER_BYTES_MAX", "bytes")]
"""A snapshot's layout (`meta`), carried in a frame header."""
DATAPLANE_KEY_BYTES_MIN = 32
DATAPLANE_VERSION = 4
"""1: CRC-32 checksums; 2: XXH3-64; 3: signed seals; 4: chained uploads (`PutChunk.forward`). A peer
speaking another version is refused at its first frame."""
FORWARD_MAX = 7
"""Stores a chunk may be forwarded to, down its chain (R - 1 of them: R is at most 8)."""
Forward = Annotated[list[Name], Bound(FORWARD_MAX, "FORWARD_MAX", "items")]
SIGNATURE_BYTES = 32


def job_token(key: bytes, job: str) -> bytes:
    """The token that lets a holder read and write job `job`'s snapshots on stores keyed with `key`."""
    if len(key) < DATAPLANE_KEY_BYTES_MIN:
        raise ValueError(f"a data-plane key of {len(key)} bytes (at least {DATAPLANE_KEY_BYTES_MIN})")
    return hmac.new(key, b"deadpool-job-token\0" + job.encode(), hashlib.sha256).digest()


def token_matches(key: bytes, job: str, token: bytes) -> bool:
    """Whether `token` is job `job`'s under `key` (constant time)."""
    return hmac.compare_digest(job_token(key, job), token)


def seal_key(signing_key: bytes, job: str) -> bytes:
    """The key job `job`'s members sign and check their snapshots' seals with."""
    if len(signing_key) < DATAPLANE_KEY_BYTES_MIN:
        raise ValueError(f"a signing key of {len(signing_key)} bytes (at least {DATAPLANE_KEY_BYTES_MIN})")
    return hmac.new(signing_key, b"deadpool-seal-key\0" + job.encode(), hashlib.sha256).digest()


def seal_signature(
    key: bytes,
    job: str,
    generation: int,
    rank: int,
    member: str,
    step: int,
    total_bytes: int,
    chunk_bytes: int,
    checksums: list[int],
    meta: bytes,
) -> bytes:
    """The signature of a snapshot's seal under its job's seal key (b'' without a key: unsigned)."""
    if not key:
        return b""
    fields = [job, generation, rank, member, step, total_bytes, chunk_bytes, checksums, meta]
    return hmac.new(key, msgpack.packb(fields, use_bin_type=True), hashlib.sha256).digest()


def _check_signature(signature: bytes) -> None:
    if len(signature) not in (0, SIGNATURE_BYTES):
        raise ProtocolError(f"a signature of {len(signature)} bytes (a seal's has {SIGNATURE_BYTES})")


def _check_forward(forward: list[str]) -> None:
    if any(not is_valid_name(name) for name in forward):
        raise ProtocolError("a store named down a chain is not a valid name")
    if len(set(forward)) != len(forward):
        raise ProtocolError("a chain names a store twice")


def _check_token(token: bytes) -> None:
    if len(token) not in (0, TOKEN_BYTES):
        raise ProtocolError(f"a token of {len(token)} bytes (a job token has {TOKEN_BYTES})")


def chunk_checksum(data: memoryview | bytes | bytearray) -> int:
    """XXH3-64 of one chunk (an unsigned 64-bit integer)."""
    return int(xxhash.xxh3_64_intdigest(data))


def chunk_hasher() -> xxhash.xxh3_64:
    """`chunk_checksum`, fed a piece at a time (`update`, then `intdigest`): a chunk checksummed as its
    bytes arrive, while they are still in the cache."""
    return xxhash.xxh3_64()


def chunk_count(total_bytes: int, chunk_bytes: int) -> int:
    """How many chunks a snapshot of `total_bytes` has: arithmetic, so a hostile size costs nothing."""
    if chunk_bytes <= 0:
        raise ValueError("chunk_bytes must be positive")
    return -(-total_bytes // chunk_bytes)


def chunk_spans(total_bytes: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """(offset, nbytes) of each chunk of a snapshot of `total_bytes` (check `chunk_count` first: the
    list is as long as that)."""
    if chunk_bytes <= 0:
        raise ValueError("chunk_bytes must be positive")
    return [(off, min(chunk_bytes, total_bytes - off)) for off in range(0, total_bytes, chunk_bytes)]


def _check_manifest(total_bytes: int, chunk_bytes: int, checksums: list[int]) -> None:
    """A manifest's sizes are within bounds and it lists one checksum per chunk; the chunk count is
    computed, never the chunks (a seal of 2**40 bytes in 1-byte chunks allocated them all)."""
    if not 0 <= total_bytes <= SNAPSHOT_BYTES_MAX:
        raise ProtocolError(f"a snapshot of {total_bytes} bytes (allowed: 0 to {SNAPSHOT_BYTES_MAX})")
    if not 0 < chunk_bytes <= CHUNK_BYTES_MAX:
        raise ProtocolError(f"chunks of {chunk_bytes} bytes (allowed: 1 to {CHUNK_BYTES_MAX})")
    if len(checksums) != chunk_count(total_bytes, chunk_bytes):
        raise ProtocolError(
            f"{len(checksums)} checksums for {chunk_count(total_bytes, chunk_bytes)} chunks of {chunk_bytes} "
            "bytes: the manifest needs one checksum per chunk"
        )
    if any(not 0 <= c < 1 << 64 for c in checksums):
        raise ProtocolError("a checksum is not an unsigned 64-bit integer")


def _check_key(job: str, rank: int, step: int) -> None:
    if not is_valid_name(job):
        raise ProtocolError(f"job {job!r} is not a valid name")
    if rank < 0:
        raise ProtocolError(f"rank {rank} is negative")
    if step < 0:
        raise ProtocolError(f"step {step} is negative")


def _check_upload(generation: int, member: str) -> None:
    if generation < 0:
        raise ProtocolError(f"generation {generation} is negative")
    if not is_valid_name(member):
        raise ProtocolError(f"member {member!r} is not a valid name")


@dataclass(frozen=True, slots=True)
class Frame:
    OP: ClassVar[str] = ""

    def check(self) -> None:
        pass


@dataclass(frozen=True, slots=True)
class PutChunk(Frame):
    """One chunk of snapshot (job, rank, step); `nbytes` raw bytes follow the header (its checksum is in the Seal)."""

    OP: ClassVar[str] = "put_chunk"
    job: Name
    generation: int
    rank: int
    member: Name
    step: int
    offset: int
    nbytes: int
    total_bytes: int
    token: Token = b""
    forward: Forward = field(default_factory=list)
    """The stores, in order, this chunk goes on to from the store receiving it (by name: the store
    resolves each from the stores' own announcements, never from an address a client gives)."""

    def check(self) -> None:
        _check_key(self.job, self.rank, self.step)
        _check_upload(self.generation, self.member)
        _check_token(self.token)
        _check_forward(self.forward)
        if not 0 < self.total_bytes <= SNAPSHOT_BYTES_MAX:
            raise ProtocolError(f"a snapshot of {self.total_bytes} bytes (allowed: 1 to {SNAPSHOT_BYTES_MAX})")
        if self.nbytes > CHUNK_BYTES_MAX:
            raise ProtocolError(f"a chunk of {self.nbytes} bytes (allowed: up to {CHUNK_BYTES_MAX})")
        if not (self.offset >= 0 and self.nbytes > 0 and self.offset + self.nbytes <= self.total_bytes):
            raise ProtocolError(
                f"chunk [{self.offset}, {self.offset + self.nbytes}) lies outside {self.total_bytes} bytes"
            )


@dataclass(frozen=True, slots=True)
class Seal(Frame):
    """The manifest: every chunk was sent; `checksums[i]` is chunk i's, `meta` the snapshot's layout."""

    OP: ClassVar[str] = "seal"
    job: Name
    generation: int
    rank: int
    member: Name
    step: int
    total_bytes: int
    chunk_bytes: int
    checksums: Checksums
    meta: Layout
    token: Token = b""
    signature: Token = b""
    """`seal_signature` of the fields above under the job's seal key (b'': unsigned)."""

    def check(self) -> None:
        _check_key(self.job, self.rank, self.step)
        _check_upload(self.generation, self.member)
        _check_token(self.token)
        _check_signature(self.signature)
        _check_manifest(self.total_bytes, self.chunk_bytes, self.checksums)


@dataclass(frozen=True, slots=True)
class Fetch(Frame):
    OP: ClassVar[str] = "fetch"
    job: Name
    rank: int
    step: int
    token: Token = b""
    traceparent: Traceparent = ""
    """The restoring member's trace context: the store's `serve_restore` span goes under it."""

    def check(self) -> None:
        _check_key(self.job, self.rank, self.step)
        _check_token(self.token)


@dataclass(frozen=True, slots=True)
class Reply(Frame):
    OP: ClassVar[str] = "reply"
    ok: bool
    error: Text
    forwarded: Forward = field(default_factory=list)
    """Answering a Seal of a chained upload: the stores down the chain that sealed their copy."""
    forward_error: Text = ""
    """Why the chain stopped short of the stores the upload named ('' if it did not)."""

    def check(self) -> None:
        _check_forward(self.forwarded)


@dataclass(frozen=True, slots=True)
class FetchReply(Frame):
    """Answer to Fetch; when `ok`, the snapshot's `total_bytes` follow as raw bytes, chunk by chunk."""

    OP: ClassVar[str] = "fetch_reply"
    ok: bool
    error: Text
    generation: int
    member: Name
    total_bytes: int
    chunk_bytes: int
    checksums: Checksums
    meta: Layout
    signature: Token = b""
    """The uploader's seal signature, as the store received it."""

    def check(self) -> None:
        if self.ok:  # the member allocates total_bytes and reads chunk by chunk: bound both first
            _check_upload(self.generation, self.member)
            _check_signature(self.signature)
            _check_manifest(self.total_bytes, self.chunk_bytes, self.checksums)


_OPS: dict[str, type[Frame]] = {cls.OP: cls for cls in (PutChunk, Seal, Fetch, Reply, FetchReply)}
F = TypeVar("F", bound=Frame)


def encode_frame(frame: Frame) -> bytes:
    """Length prefix and msgpack header of `frame` (the raw bytes, if any, are sent after it)."""
    body = to_fields(frame)
    body["v"] = DATAPLANE_VERSION
    body["op"] = frame.OP
    header: bytes = msgpack.packb(body, use_bin_type=True)
    return FRAME_LENGTH.pack(len(header)) + header


def decode_frame_header(header: bytes, expected: type[F] | None = None) -> Frame:
    """Decode a header (without its length prefix) and validate it."""
    try:
        body = msgpack.unpackb(header, raw=False)
    except Exception as exc:
        raise ProtocolError(f"frame header is not msgpack: {exc}") from None
    if not isinstance(body, dict):
        raise ProtocolError("frame header is not a map")
    version = body.pop("v", None)
    if version != DATAPLANE_VERSION:
        raise ProtocolError(f"data-plane protocol version {shown(version)} is not the supported {DATAPLANE_VERSION}")
    op = body.pop("op", None)
    cls = _OPS.get(op) if isinstance(op, str) else None
    if cls is None:
        raise ProtocolError(f"unknown frame op {shown(op)}")
    if expected is not None and cls is not expected:
        raise ProtocolError(f"expected a {expected.OP} frame, got {op}")
    frame = from_fields(cls, body, op)
    frame.check()
    return frame
