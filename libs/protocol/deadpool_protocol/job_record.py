"""The job record in JetStream KV: what every service may read about a job.

The swapper leader writes one record per job (key: the job name) into the `deadpool-jobs` bucket,
with a revision check. Its private part (the rebuild in flight, incidents, commit bookkeeping) is the
swapper's own; the `summary` part is the contract other services read, e.g. a detector that restarts
loads each job's ranks from it. Readers validate it like any message off the bus.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

from deadpool_protocol.codec import from_fields, to_fields
from deadpool_protocol.messages import ProtocolError
from deadpool_protocol.names import is_valid_name

__all__ = ["JOBS_BUCKET", "RECORD_VERSION", "JobSummary", "pack_record", "unpack_record"]

JOBS_BUCKET = "deadpool-jobs"
RECORD_VERSION = 1
RECORD_BYTES_MAX = 8 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class JobSummary:
    job: str
    world_size: int
    generation: int
    ranks: list[str]
    spares: list[str]
    hosts: dict[str, str]
    """member -> host, for every live member."""
    failed: list[str]
    """Members declared failed (the most recent ones): fenced, never to return."""
    committed_step: int
    finished: bool
    failed_reason: str = ""
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
