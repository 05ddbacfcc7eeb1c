"""Job state in a JetStream KV bucket, so a restarted (or standby) swapper continues where it stopped.

Only the swapper leader writes, with a revision check (`kv.update(..., last=revision)`): a write
against a revision someone else changed is refused by the server, logged, and retried on top of the
newer revision, so two swappers never silently overwrite each other.
"""

from __future__ import annotations

from typing import Any

import msgpack
from nats.js.errors import BucketNotFoundError, KeyNotFoundError, KeyWrongLastSequenceError, NoKeysError
from nats.js.kv import KeyValue

from deadpool_protocol import Incident
from deadpool_protocol.codec import from_fields, to_fields
from deadpool_swapper.core import JobState
from deadpool_swapper.placement import MemberInfo

__all__ = ["BUCKET", "JobRecords", "state_from_record", "state_to_record"]

BUCKET = "deadpool-jobs"


def state_to_record(state: JobState) -> bytes:
    record = {
        "job": state.job,
        "world_size": state.world_size,
        "generation": state.generation,
        "ranks": state.ranks,
        "spares": state.spares,
        "members": {m: to_fields(info) for m, info in state.members.items()},
        "failed": state.failed,
        "committed_step": state.committed_step,
        "restore_step": state.restore_step,
        "placement": state.placement,
        "finished": state.finished,
        "incident_seq": state.incident_seq,
        "incidents": [to_fields(i) for i in state.incidents],
    }
    data: bytes = msgpack.packb(record, use_bin_type=True)
    return data


def state_from_record(data: bytes) -> JobState:
    r: dict[str, Any] = msgpack.unpackb(data, raw=False)
    return JobState(
        job=r["job"],
        world_size=r["world_size"],
        generation=r["generation"],
        ranks=list(r["ranks"]),
        spares=list(r["spares"]),
        members={m: MemberInfo(**info) for m, info in r["members"].items()},
        failed=list(r["failed"]),
        committed_step=r["committed_step"],
        restore_step=r["restore_step"],
        placement=[list(p) for p in r["placement"]],
        finished=r["finished"],
        incident_seq=r["incident_seq"],
        incidents=[from_fields(Incident, i, "incident") for i in r["incidents"]],
    )


class JobRecords:
    def __init__(self, kv: KeyValue, log: Any) -> None:
        self.kv = kv
        self.log = log
        self.revisions: dict[str, int] = {}

    @classmethod
    async def open(cls, js: Any, log: Any) -> JobRecords:
        try:
            kv = await js.key_value(BUCKET)
        except BucketNotFoundError:
            kv = await js.create_key_value(bucket=BUCKET, history=1)
        return cls(kv, log)

    async def load_all(self) -> list[JobState]:
        try:
            keys = await self.kv.keys()
        except NoKeysError:
            return []
        states = []
        for key in keys:
            try:
                entry = await self.kv.get(key)
            except KeyNotFoundError:
                continue
            if entry.value is None or entry.revision is None:
                continue
            try:
                states.append(state_from_record(entry.value))
            except (KeyError, TypeError, ValueError) as exc:
                self.log.error("unreadable job record skipped", key=key, reason=str(exc))
                continue
            self.revisions[key] = entry.revision
        return states

    async def save(self, state: JobState) -> None:
        value = state_to_record(state)
        revision = self.revisions.get(state.job)
        for _attempt in range(2):
            try:
                if revision is None:
                    revision = await self.kv.create(state.job, value)
                else:
                    revision = await self.kv.update(state.job, value, last=revision)
                self.revisions[state.job] = revision
                return
            except KeyWrongLastSequenceError:
                self.log.error("job record changed under us: another swapper is writing", job=state.job)
                entry = await self.kv.get(state.job)
                revision = entry.revision
        self.log.error("job record not saved after retry", job=state.job)
