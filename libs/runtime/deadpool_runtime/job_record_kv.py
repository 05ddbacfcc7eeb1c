"""Reading a job record out of the `deadpool-jobs` KV bucket, parts included.

A record is stored as a head under the job's key and, for its large fields, parts under keys of their
own (`deadpool_protocol.job_record`). The swapper writes the parts before the head and deletes the
parts no head names any more after it, so a reader can meet a head whose parts were just replaced by
a newer record: it reads the head again (at most `RECORD_READ_ATTEMPTS` times). Every KV call is
bounded.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection
from typing import Any

from nats.js.errors import KeyNotFoundError, NoKeysError

from deadpool_protocol import ProtocolError
from deadpool_protocol.job_record import (
    RECORD_GROUPS,
    decode_stored,
    join_parts,
    join_sections,
    part_key,
    section_value,
    sections_of,
)

__all__ = ["KEYS_TRIES", "RECORD_READ_ATTEMPTS", "StoredHead", "bucket_keys", "read_record"]

KEYS_TRIES = 3
"""How many times an answer of "no keys" is asked again (`bucket_keys`)."""


async def bucket_keys(kv: Any, timeout_s: float) -> list[str]:
    """A bucket's keys ([] when it has none), each listing within `timeout_s`. nats.py's `keys()` can
    answer "no keys" for a bucket that has some: its watcher decides there are none when the server
    has delivered every key but the client has not handed one to it yet. Under load a restarted
    detector loaded no job that way (CI), and a test's listing came back empty once in 20 runs; an
    empty answer is asked again, `KEYS_TRIES` times in all."""
    for _ in range(KEYS_TRIES):
        try:
            keys: list[str] = await asyncio.wait_for(kv.keys(), timeout_s)
            return keys
        except NoKeysError:
            continue
    return []


RECORD_READ_ATTEMPTS = 3


class StoredHead:
    """What a read found under the job's key: the record, the head's revision and bytes, and the keys
    of the parts it names; for a sectioned head, also its sections' digests and part counts."""

    def __init__(
        self, record: bytes, revision: int, head: bytes, part_keys: list[str], sections: dict[str, int] | None = None
    ) -> None:
        self.record = record
        self.revision = revision
        self.head = head
        self.part_keys = part_keys
        self.sections = sections or {}


async def read_record(
    kv: Any, job: str, timeout_s: float, groups: Collection[str] = RECORD_GROUPS
) -> StoredHead | None:
    """The job's record as stored now (None if there is none). Raises ProtocolError when it cannot be
    read, and the KV's own errors (a timeout) as they are. `groups`: the record's parts to read the
    sections of (a detector reads the summary alone, not the swapper's membership rows, placement and
    rebuild command: at 16,384 ranks most of the record); the others' inline fields come as they are."""
    for attempt in range(RECORD_READ_ATTEMPTS):
        try:
            entry = await asyncio.wait_for(kv.get(job), timeout_s)
        except KeyNotFoundError:
            return None
        if entry.value is None or entry.revision is None:
            return None
        sectioned = sections_of(entry.value)
        try:
            if sectioned is not None:
                fields, refs = sectioned
                values = []
                for group, field, digest, count in refs:
                    if group not in groups:
                        continue
                    parts = [await _part(kv, part_key(job, digest, i), timeout_s) for i in range(count)]
                    values.append((group, field, section_value(digest, parts)))
                keys = [part_key(job, digest, i) for _, _, digest, count in refs for i in range(count)]
                digests = {digest: count for _, _, digest, count in refs}
                return StoredHead(join_sections(fields, values), entry.revision, entry.value, keys, digests)
            inline, tag, count = decode_stored(entry.value)
            if inline is not None:
                return StoredHead(inline, entry.revision, entry.value, [])
            keys = [part_key(job, tag, i) for i in range(count)]
            parts = [await _part(kv, key, timeout_s) for key in keys]
            return StoredHead(join_parts(entry.value, parts), entry.revision, entry.value, keys)
        except (KeyNotFoundError, ProtocolError):
            if attempt == RECORD_READ_ATTEMPTS - 1:
                raise ProtocolError(f"job {job}: the parts its record names cannot be read") from None
    return None


async def _part(kv: Any, key: str, timeout_s: float) -> bytes:
    value: bytes | None = (await asyncio.wait_for(kv.get(key), timeout_s)).value
    return value or b""
