"""The job record in JetStream KV: what every service may read about a job.

The swapper leader writes one record per job (key: the job name) into the `deadpool-jobs` bucket,
with a revision check. Its private part (the rebuild in flight, incidents, commit bookkeeping) is the
swapper's own; the `summary` part is the contract other services read, e.g. a detector that restarts
loads each job's ranks from it. Readers validate it like any message off the bus.

How the swapper stores it (`split_record`, `pack_head`): by field. A field whose packed value is small
(`SECTION_INLINE_BYTES`: the generation, the committed step, the timers) goes in the head; a large one
(the members, the placement, the holders of the committed step) is a *section*, compressed and stored
in parts of at most `RECORD_PART_BYTES_MAX` under keys named by its content's digest
(`part_key(job, digest, i)`). A section already stored is not written again, so a save costs what
changed: a commit writes the head (a few kB) and the sections that moved, never the membership of a
job of 16,384 ranks (about 2 MB). Parts are written before the head that names them (by digest and
count), so a reader that reads the head finds parts that match it or none (then it reads again). The
head is the key under the revision check; no head or part is larger than `RECORD_PART_BYTES_MAX`.

A large list or map may be stored as several sections, its *chunks*: the head names each under the
field's name, in order, and the field's value is their values joined (lists end to end, maps merged).
The swapper chunks the members and the rank maps, so a save during a formation, or after a swap,
writes the chunks that changed rather than the membership of the whole job.

The earlier stored form (`encode_stored`, `decode_stored`: the whole record compressed, split into
parts under one tag when large) is still read. A record larger than `RECORD_BYTES_MAX` is refused,
never retried.
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
from deadpool_protocol.names import DIGEST_CHARS, content_digest, is_valid_name

__all__ = [
    "JOBS_BUCKET",
    "RECORD_BYTES_MAX",
    "RECORD_GROUPS",
    "RECORD_PART_BYTES_MAX",
    "RECORD_VERSION",
    "JobSummary",
    "Section",
    "SectionRef",
    "StoredRecord",
    "archive_key",
    "decode_stored",
    "encode_stored",
    "is_record_key",
    "join_parts",
    "join_sections",
    "pack_head",
    "pack_record",
    "part_key",
    "section_parts",
    "section_value",
    "sections_of",
    "split_record",
    "unpack_record",
]

JOBS_BUCKET = "deadpool-jobs"
RECORD_VERSION = 1
RECORD_BYTES_MAX = 64 * 1024 * 1024
"""The largest record, uncompressed (a job of 16,384 ranks with long names is about 6 MB)."""
STORED_VERSION = 2
"""The stored form: a head, compressed, with its parts under keys of their own when it is large."""
SECTIONED_VERSION = 4
"""The stored form by field: small fields in the head, large ones in sections named by digest, a
field possibly in several (its chunks). Version 3 (one section per field) is still read; a reader
of version 3 refuses a head of version 4 rather than read one chunk of a field as all of it."""
SECTIONED_VERSIONS_READ = (3, SECTIONED_VERSION)
SECTION_INLINE_BYTES = 2048
"""A field whose packed value is larger is stored as a section of its own."""
RECORD_PART_BYTES_MAX = 256 * 1024
"""No head or part of a record is larger, at any rank count."""
RECORD_GROUPS = ("summary", "swapper")
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
    body = _unpacked(head)
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


@dataclass(frozen=True)
class Section:
    """A large field of a record, packed, and the digest that names its parts."""

    group: str
    field: str
    packed: bytes
    digest: str


def split_record(
    summary: JobSummary, private: dict[str, Any], packed: dict[tuple[str, str], list[Section]] | None = None
) -> tuple[dict[str, dict[str, Any]], list[Section]]:
    """The record's fields by group: the small ones (for the head) and the large ones as sections.
    `packed`: sections the caller knows already (a field's chunks, in order), by (group, field),
    taken as they are whatever the field's value says. Raises ProtocolError when the record exceeds
    `RECORD_BYTES_MAX`."""
    inline: dict[str, dict[str, Any]] = {group: {} for group in RECORD_GROUPS}
    sections: list[Section] = []
    known = packed or {}
    total = 0
    for group, fields in zip(RECORD_GROUPS, (to_fields(summary), private), strict=True):
        for name, value in fields.items():
            chunks = known.get((group, name))
            if chunks is not None:
                sections += chunks
                total += sum(len(chunk.packed) for chunk in chunks)
                continue
            packed_value: bytes = msgpack.packb(value, use_bin_type=True)
            total += len(packed_value)
            if len(packed_value) <= SECTION_INLINE_BYTES:
                inline[group][name] = value
            else:
                sections.append(Section(group, name, packed_value, content_digest(packed_value)))
    if total > RECORD_BYTES_MAX:
        raise ProtocolError(f"job record of {total} bytes exceeds {RECORD_BYTES_MAX}")
    return inline, sections


def section_parts(section: Section, part_bytes: int) -> list[bytes]:
    """A section's stored parts: compressed, in pieces of at most `part_bytes`."""
    packed = zlib.compress(section.packed, COMPRESS_LEVEL)
    parts = [packed[i : i + part_bytes] for i in range(0, len(packed), part_bytes)] or [b""]
    if len(parts) > PARTS_MAX:
        raise ProtocolError(f"record field {section.field} needs {len(parts)} parts (at most {PARTS_MAX})")
    return parts


SectionRef = tuple[str, str, str, int]
"""(group, field, digest, parts) of a section, as its head names it."""


def pack_head(inline: dict[str, dict[str, Any]], refs: list[SectionRef]) -> bytes:
    if sum(count for *_, count in refs) > PARTS_MAX:
        raise ProtocolError(f"job record needs more than {PARTS_MAX} parts")
    head: bytes = msgpack.packb(
        {"v": SECTIONED_VERSION, "inline": inline, "sections": [list(ref) for ref in refs]}, use_bin_type=True
    )
    return head


def sections_of(head: bytes) -> tuple[dict[str, dict[str, Any]], list[SectionRef]] | None:
    """A sectioned head's inline fields and the sections it names, checked; None for a head of an
    earlier form (`decode_stored` reads those). Raises ProtocolError."""
    body = _unpacked(head)
    if not isinstance(body, dict) or body.get("v") not in SECTIONED_VERSIONS_READ:
        return None
    inline, raw_refs = body.get("inline"), body.get("sections")
    if not isinstance(inline, dict) or set(inline) != set(RECORD_GROUPS) or not isinstance(raw_refs, list):
        raise ProtocolError("sectioned job record head is malformed")
    refs: list[SectionRef] = []
    for ref in raw_refs:
        if not (isinstance(ref, list) and len(ref) == 4 and ref[0] in RECORD_GROUPS):
            raise ProtocolError("sectioned job record head names a malformed section")
        group, field, digest, count = ref
        valid_digest = isinstance(digest, str) and len(digest) == DIGEST_CHARS and digest.isalnum()
        if not (isinstance(field, str) and len(field) <= 64 and valid_digest):
            raise ProtocolError("sectioned job record head names a malformed section")
        if not (isinstance(count, int) and 0 < count <= PARTS_MAX):
            raise ProtocolError("sectioned job record head names a section of no valid part count")
        refs.append((group, field, digest, count))
    if sum(count for *_, count in refs) > PARTS_MAX:
        raise ProtocolError(f"job record names more than {PARTS_MAX} parts")
    return inline, refs


def section_value(digest: str, parts: list[bytes]) -> Any:
    """A section's value from its parts, checked against its digest. Raises ProtocolError."""
    packed = _inflate(b"".join(parts))
    if content_digest(packed) != digest:
        raise ProtocolError("job record section does not match its digest (a newer record replaced it)")
    try:
        return msgpack.unpackb(packed, raw=False)
    except Exception as exc:
        raise ProtocolError(f"job record section is not msgpack: {exc}") from exc


def join_sections(inline: dict[str, dict[str, Any]], values: list[tuple[str, str, Any]]) -> bytes:
    """The whole record (as `pack_record` makes it) from a head's inline fields and its sections'
    values as (group, field, value), in the head's order: a field named more than once is its chunks
    joined. Raises ProtocolError for chunks that cannot be joined (not all lists, nor all maps)."""
    chunks: dict[tuple[str, str], list[Any]] = {}
    for group, field, value in values:
        chunks.setdefault((group, field), []).append(value)
    groups = {group: dict(fields) for group, fields in inline.items()}
    for (group, field), parts in chunks.items():
        groups[group][field] = _joined(field, parts)
    data: bytes = msgpack.packb({"v": RECORD_VERSION, **groups}, use_bin_type=True)
    return data


def _joined(field: str, chunks: list[Any]) -> Any:
    if len(chunks) == 1:
        return chunks[0]
    if all(isinstance(chunk, list) for chunk in chunks):
        return [item for chunk in chunks for item in chunk]
    if all(isinstance(chunk, dict) for chunk in chunks):
        return {key: value for chunk in chunks for key, value in chunk.items()}
    raise ProtocolError(f"job record field {field} has chunks that are neither all lists nor all maps")


def _unpacked(data: bytes) -> Any:
    """A head or a record, unpacked once its size is within bounds. Raises ProtocolError."""
    if len(data) > RECORD_BYTES_MAX:
        raise ProtocolError(f"job record of {len(data)} bytes exceeds {RECORD_BYTES_MAX}")
    try:
        return msgpack.unpackb(data, raw=False)
    except Exception as exc:
        raise ProtocolError(f"job record is not msgpack: {exc}") from exc


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
    body = _unpacked(data)
    if not isinstance(body, dict) or body.get("v") != RECORD_VERSION:
        raise ProtocolError("job record of an unknown version")
    summary = from_fields(JobSummary, body.get("summary"), "job_record.summary")
    summary.check()
    private = body.get("swapper")
    return summary, private if isinstance(private, dict) else {}
