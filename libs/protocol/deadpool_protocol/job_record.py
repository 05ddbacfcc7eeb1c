"""The job record in JetStream KV: what every service may read about a job.

The swapper leader writes one record per job (key: the job name) into the `deadpool-jobs` bucket,
with a revision check. Its private part (the rebuild in flight, incidents, commit bookkeeping) is the
swapper's own; the `summary` part is the contract other services read, e.g. a detector that restarts
loads each job's ranks from it. Readers validate it like any message off the bus.

How it is stored (`encode_stored`, `decode_stored`): the record is compressed; when it still does not
fit in one NATS message (the server's max payload: a record grows with the job's members, and passes
1 MiB near 3,000 ranks uncompressed), it is split into parts under keys of their own
(`part_key(job, tag, i)`), written before the head that names them (its `tag`, count and digest), so a
reader that reads the head finds parts that match it or none (then it reads again). The head is the
key under the revision check. A record larger than `RECORD_BYTES_MAX` is refused, never retried.
"""

from __future__ import annotations

import hashlib
import zlib
from dataclasses import dataclass
from typing import Annotated, Any

import msgpack

from deadpool_protocol.bounds import MEMBER_ENTRIES, Host, Members, Name, Text
from deadpool_protocol.codec import from_fields, to_fields
from deadpool_protocol.messages import ProtocolError
from deadpool_protocol.names import is_valid_name

__all__ = [
    "JOBS_BUCKET",
    "RECORD_BYTES_MAX",
    "RECORD_VERSION",
    "JobSummary",
    "StoredRecord",
    "archive_key",
    "decode_stored",
    "encode_stored",
    "is_record_key",
    "join_parts",
    "pack_record",
    "part_key",
    "unpack_record",
]

JOBS_BUCKET = "deadpool-jobs"
RECORD_VERSION = 1
RECORD_BYTES_MAX = 64 * 1024 * 1024
"""The largest record, uncompressed (a job of 16,384 ranks with long names is about 6 MB)."""
STORED_VERSION = 2
"""The stored form: a head, compressed, with its parts under keys of their own when it is large."""
PARTS_MAX = 256
PART_SEPARATOR = ".part."
COMPRESS_LEVEL = 1
"""zlib's fastest level: the names a record holds repeat, and it is written at every change."""


def part_key(job: str, tag: str, index: int) -> str:
    return f"{job}{PART_SEPARATOR}{tag}.{index}"


ARCHIVE_SEPARATOR = ".archive."


def archive_key(job: str, generation: int) -> str:
    """Where the record of a run of `job` that ended at `generation` is kept (generations only grow
    across a name's runs, so the key is unique)."""
    return f"{job}{ARCHIVE_SEPARATOR}g{generation}"


def is_record_key(key: str) -> bool:
    """A job's head (its name): not one of its parts, nor an archived run (names hold no dots)."""
    return "." not in key


@dataclass(frozen=True)
class StoredRecord:
    """A record as stored: the head (under the job's key) and the parts it names (possibly none)."""

    head: bytes
    parts: list[bytes]
    tag: str


def encode_stored(record: bytes, part_bytes: int, tag: str) -> StoredRecord:
    """The stored form of `record` (from `pack_record`), in pieces of at most `part_bytes`. Raises
    ProtocolError when the record exceeds `RECORD_BYTES_MAX` or needs more than `PARTS_MAX` parts."""
    if len(record) > RECORD_BYTES_MAX:
        raise ProtocolError(f"job record of {len(record)} bytes exceeds {RECORD_BYTES_MAX}")
    packed = zlib.compress(record, COMPRESS_LEVEL)
    inline: bytes = msgpack.packb({"v": STORED_VERSION, "z": packed}, use_bin_type=True)
    if len(inline) <= part_bytes:
        return StoredRecord(inline, [], "")
    parts = [packed[i : i + part_bytes] for i in range(0, len(packed), part_bytes)]
    if len(parts) > PARTS_MAX:
        raise ProtocolError(f"job record needs {len(parts)} parts of {part_bytes} bytes (at most {PARTS_MAX})")
    head: bytes = msgpack.packb(
        {"v": STORED_VERSION, "tag": tag, "parts": len(parts), "sha256": hashlib.sha256(packed).digest()},
        use_bin_type=True,
    )
    return StoredRecord(head, parts, tag)


def decode_stored(head: bytes) -> tuple[bytes | None, str, int]:
    """A stored head: (the record, if it is inline; the parts' tag and count otherwise). A record of
    the first version (written whole, uncompressed) is returned as is. Raises ProtocolError."""
    if len(head) > RECORD_BYTES_MAX:
        raise ProtocolError(f"job record head of {len(head)} bytes")
    try:
        body = msgpack.unpackb(head, raw=False)
    except Exception as exc:
        raise ProtocolError(f"job record is not msgpack: {exc}") from exc
    if isinstance(body, dict) and body.get("v") == RECORD_VERSION:
        return head, "", 0
    if not isinstance(body, dict) or body.get("v") != STORED_VERSION:
        raise ProtocolError("job record of an unknown version")
    if "z" in body:
        return _inflate(body["z"]), "", 0
    tag, count = body.get("tag"), body.get("parts")
    if not isinstance(tag, str) or not tag.isalnum() or not isinstance(count, int) or not 0 < count <= PARTS_MAX:
        raise ProtocolError("job record head names no valid parts")
    return None, tag, count


def join_parts(head: bytes, parts: list[bytes]) -> bytes:
    """The record from its head and parts, checked against the head's digest. Raises ProtocolError."""
    body = msgpack.unpackb(head, raw=False)
    packed = b"".join(parts)
    if not isinstance(body, dict) or hashlib.sha256(packed).digest() != body.get("sha256"):
        raise ProtocolError("job record parts do not match their head (a newer record replaced them)")
    return _inflate(packed)


def _inflate(packed: object) -> bytes:
    if not isinstance(packed, bytes):
        raise ProtocolError("job record body is not bytes")
    inflater = zlib.decompressobj()
    try:
        record = inflater.decompress(packed, RECORD_BYTES_MAX)
    except zlib.error as exc:
        raise ProtocolError(f"job record does not decompress: {exc}") from exc
    if inflater.unconsumed_tail:
        raise ProtocolError(f"job record exceeds {RECORD_BYTES_MAX} bytes uncompressed")
    return record


@dataclass(frozen=True, slots=True)
class JobSummary:
    job: Name
    world_size: int
    generation: int
    ranks: Members
    spares: Members
    hosts: Annotated[dict[Name, Host], MEMBER_ENTRIES]
    """member -> host, for every live member."""
    failed: Members
    """Members declared failed (the most recent ones): fenced, never to return."""
    committed_step: int
    finished: bool
    failed_reason: Text = ""
    """Why the swapper ended the job, if it did."""

    def check(self) -> None:
        if not is_valid_name(self.job):
            raise ProtocolError(f"job {self.job!r} is not a valid name")
        if self.generation < 0 or self.world_size < 0:
            raise ProtocolError("generation and world_size are not negative")
        if self.ranks and len(self.ranks) != self.world_size:
            raise ProtocolError("ranks does not hold world_size members")
        for member in [*self.ranks, *self.spares, *self.failed, *self.hosts]:
            if not is_valid_name(member):
                raise ProtocolError(f"member {member!r} is not a valid name")


def pack_record(summary: JobSummary, private: dict[str, Any]) -> bytes:
    data: bytes = msgpack.packb(
        {"v": RECORD_VERSION, "summary": to_fields(summary), "swapper": private}, use_bin_type=True
    )
    return data


def unpack_record(data: bytes) -> tuple[JobSummary, dict[str, Any]]:
    """The record's summary, validated, and the swapper's private part (raw). Raises ProtocolError."""
    if len(data) > RECORD_BYTES_MAX:
        raise ProtocolError(f"job record of {len(data)} bytes exceeds {RECORD_BYTES_MAX}")
    try:
        body = msgpack.unpackb(data, raw=False)
    except Exception as exc:
        raise ProtocolError(f"job record is not msgpack: {exc}") from exc
    if not isinstance(body, dict) or body.get("v") != RECORD_VERSION:
        raise ProtocolError("job record of an unknown version")
    summary = from_fields(JobSummary, body.get("summary"), "job_record.summary")
    summary.check()
    private = body.get("swapper")
    return summary, private if isinstance(private, dict) else {}
