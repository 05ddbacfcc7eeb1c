"""Reading a job record out of the `deadpool-jobs` KV bucket, parts included.

A large record is stored as a head under the job's key and parts under keys of their own
(`deadpool_protocol.job_record`). The swapper writes the parts before the head and deletes the old
parts after it, so a reader can meet a head whose parts were just replaced by a newer record: it reads
the head again (at most `RECORD_READ_ATTEMPTS` times). Every KV call is bounded.
"""

from __future__ import annotations

import asyncio
from typing import Any

from nats.js.errors import KeyNotFoundError

from deadpool_protocol import ProtocolError
from deadpool_protocol.job_record import decode_stored, join_parts, part_key

__all__ = ["RECORD_READ_ATTEMPTS", "StoredHead", "read_record"]

RECORD_READ_ATTEMPTS = 3


class StoredHead:
    """What a read found under the job's key: the record, the head's revision and bytes, and the tag
    of the parts it names ('' when the record is inline)."""

    def __init__(self, record: bytes, revision: int, head: bytes, tag: str, parts: int) -> None:
        self.record = record
        self.revision = revision
        self.head = head
        self.tag = tag
        self.parts = parts


async def read_record(kv: Any, job: str, timeout_s: float) -> StoredHead | None:
    """The job's record as stored now (None if there is none). Raises ProtocolError when it cannot be
    read, and the KV's own errors (a timeout) as they are."""
    for attempt in range(RECORD_READ_ATTEMPTS):
        try:
            entry = await asyncio.wait_for(kv.get(job), timeout_s)
        except KeyNotFoundError:
            return None
        if entry.value is None or entry.revision is None:
            return None
        inline, tag, count = decode_stored(entry.value)
        if inline is not None:
            return StoredHead(inline, entry.revision, entry.value, "", 0)
        try:
            parts = [
                (await asyncio.wait_for(kv.get(part_key(job, tag, i)), timeout_s)).value or b"" for i in range(count)
            ]
            return StoredHead(join_parts(entry.value, parts), entry.revision, entry.value, tag, count)
        except (KeyNotFoundError, ProtocolError):
            if attempt == RECORD_READ_ATTEMPTS - 1:
                raise ProtocolError(f"job {job}: the parts its record names cannot be read") from None
    return None
