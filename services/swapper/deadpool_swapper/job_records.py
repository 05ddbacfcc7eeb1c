"""Job state in a JetStream KV bucket, so a restarted (or standby) swapper continues where it stopped.

The record holds the whole `JobState`: membership and generation, and also the rebuild in flight (its
command and the acks so far), the open incidents, the commit bookkeeping, the void notice, and the
events-stream position the state includes (`applied_seq`). A new leader loads it and replays the
events after that position, so it ends where its predecessor was, then finishes the rebuild in flight
(it retransmits the command; members re-ack) or supersedes it.

Only the swapper leader writes, with a revision check (`kv.update(..., last=revision)`): a write
against a revision someone else changed is refused by the server. `save` then raises
`RecordConflictError` and the caller reloads: it never overwrites a newer record.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgpack
from nats.js.api import KeyValueConfig
from nats.js.errors import BucketNotFoundError, KeyNotFoundError, KeyWrongLastSequenceError, NoKeysError
from nats.js.kv import KeyValue

from deadpool_protocol import Incident, ProtocolError, Rebuild, RebuildAck
from deadpool_protocol.codec import from_fields, to_fields
from deadpool_protocol.job_record import JOBS_BUCKET, JobSummary, pack_record, unpack_record
from deadpool_swapper.core import JobState, OpenIncident, PendingRebuild
from deadpool_swapper.placement import MemberInfo
from deadpool_swapper.restore_chain import CommittedCopies

__all__ = ["JobRecords", "RecordConflictError", "UnreadableRecordError", "state_from_record", "state_to_record"]

KV_TIMEOUT_S = 2.0
"""How long one KV request may take (also the JetStream context's request timeout). Every KV call is
bounded here as well: some of nats.py's (`keys()`, a watch) have no timeout of their own, and one
that never returned once stopped both swappers for good while a NATS node was down."""
KEYS_TIMEOUT_S = 5.0


class RecordConflictError(RuntimeError):
    """The job record changed under us: another swapper wrote it (this one is no longer the leader)."""


def state_to_record(state: JobState) -> bytes:
    summary = JobSummary(
        job=state.job,
        world_size=state.world_size,
        generation=state.generation,
        ranks=list(state.ranks),
        spares=list(state.spares),
        hosts={m: info.host for m, info in state.members.items()},
        failed=list(state.failed),
        committed_step=state.committed_step,
        finished=state.finished,
        failed_reason=state.failed_reason,
    )
    pending = state.pending
    private = {
        "members": {m: to_fields(info) for m, info in state.members.items()},
        "restore_step": state.restore_step,
        "placement": state.placement,
        "completes": [
            [step, rank, sorted(stores)] for step, ranks in state.completes.items() for rank, stores in ranks.items()
        ],
        "pending": None
        if pending is None
        else {
            "command": to_fields(pending.command),
            "t_sent": pending.t_sent,
            "acks": [to_fields(a) for a in pending.acks.values()],
        },
        "open_incidents": [to_fields(i) for i in state.open_incidents],
        "incidents": [to_fields(i) for i in state.incidents],
        "done": sorted(state.done),
        "finished_t": state.finished_t,
        "incident_seq": state.incident_seq,
        "hold_until": state.hold_until,
        "silent_hosts": {h: list(v) for h, v in state.silent_hosts.items()},
        "void_generation": state.void_generation,
        "attempts": state.attempts,
        "formed": state.formed,
        "applied_seq": state.applied_seq,
        "stream_id": state.stream_id,
        "placement_version": state.placement_version,
        "placement_confirmed": state.placement_confirmed,
        "committed_generation": state.committed_generation,
        "committed_holders": [[rank, sorted(stores)] for rank, stores in state.committed_holders.items()],
        "rank_bytes": [[rank, nbytes] for rank, nbytes in state.rank_bytes.items()],
        "previous_committed": [
            state.previous_committed.step,
            state.previous_committed.generation,
            [[rank, sorted(stores)] for rank, stores in state.previous_committed.holders.items()],
        ],
        "unavailable": sorted([rank, step] for rank, step in state.unavailable),
        "durable_failed": state.durable_failed,
        "durable_completes": [[rank, sorted(stores)] for rank, stores in state.durable_completes.items()],
        "awaiting_first_step": state.awaiting_first_step,
        "awaiting_since": state.awaiting_since,
        "first_steps": [[rank, t] for rank, t in state.first_steps.items()],
    }
    return pack_record(summary, private)


def state_from_record(data: bytes) -> JobState:
    """Rebuild a `JobState` from its record. Raises ProtocolError (or KeyError, TypeError, ValueError)
    when the record cannot be read. Private fields a record of an older version lacks take their
    defaults, so a swapper that was upgraded reads the records of the one it replaces."""
    summary, p = unpack_record(data)
    defaults = JobState(summary.job)
    state = JobState(
        job=summary.job,
        world_size=summary.world_size,
        generation=summary.generation,
        ranks=list(summary.ranks),
        spares=list(summary.spares),
        members={m: MemberInfo(**info) for m, info in p["members"].items()},
        failed=list(summary.failed),
        committed_step=summary.committed_step,
        restore_step=p.get("restore_step", defaults.restore_step),
        placement=[list(x) for x in p.get("placement", [])],
        finished=summary.finished,
        failed_reason=summary.failed_reason,
        incident_seq=p.get("incident_seq", 0),
        incidents=[from_fields(Incident, i, "incident") for i in p.get("incidents", [])],
        open_incidents=[OpenIncident(**i) for i in p.get("open_incidents", [])],
        done=set(p.get("done", [])),
        finished_t=p.get("finished_t", 0.0),
        hold_until=p.get("hold_until", 0.0),
        silent_hosts={h: (int(v[0]), int(v[1])) for h, v in p.get("silent_hosts", {}).items()},
        void_generation=p.get("void_generation", 0),
        attempts=p.get("attempts", 0),
        formed=p.get("formed", summary.generation > 1 or (summary.generation == 1 and p.get("pending") is None)),
        applied_seq=p.get("applied_seq", 0),
        stream_id=p.get("stream_id", ""),
        placement_version=p.get("placement_version", 0),
        placement_confirmed=p.get("placement_confirmed", True),
        committed_generation=p.get("committed_generation", 0),
        committed_holders={int(rank): set(stores) for rank, stores in p.get("committed_holders", [])},
        rank_bytes={int(rank): int(nbytes) for rank, nbytes in p.get("rank_bytes", [])},
        unavailable={(int(rank), int(step)) for rank, step in p.get("unavailable", [])},
        durable_failed=bool(p.get("durable_failed", False)),
        durable_completes={int(rank): set(stores) for rank, stores in p.get("durable_completes", [])},
        awaiting_first_step=list(p.get("awaiting_first_step", [])),
        awaiting_since=p.get("awaiting_since", 0.0),
        first_steps={int(rank): float(t) for rank, t in p.get("first_steps", [])},
    )
    if "previous_committed" in p:
        step, generation, holders = p["previous_committed"]
        state.previous_committed = CommittedCopies(
            int(step), int(generation), {int(rank): set(stores) for rank, stores in holders}
        )
    for step, rank, stores in p.get("completes", []):
        state.completes.setdefault(int(step), {})[int(rank)] = set(stores)
    if p.get("pending") is not None:
        command = from_fields(Rebuild, p["pending"]["command"], "pending.command")
        command.check()
        pending = PendingRebuild(command, t_sent=p["pending"]["t_sent"])
        for raw in p["pending"]["acks"]:
            ack = from_fields(RebuildAck, raw, "pending.ack")
            pending.acks[ack.member] = ack
        state.pending = pending
    return state


class UnreadableRecordError(RuntimeError):
    """A job record exists but cannot be read: acting on the job as if it were new would start its
    generations again from 1, so the swapper acts on it not at all (and says so)."""


class JobRecords:
    def __init__(self, kv: KeyValue, log: Any) -> None:
        self.kv = kv
        self.log = log
        self.revisions: dict[str, int] = {}
        self._unconfirmed: dict[str, bytes] = {}
        """Per job, the value of a write that failed without an answer (it may have been stored)."""

    @classmethod
    async def open(cls, js: Any, log: Any, replicas: int = 1) -> JobRecords:
        try:
            kv = await js.key_value(JOBS_BUCKET)
        except BucketNotFoundError:
            kv = await js.create_key_value(KeyValueConfig(bucket=JOBS_BUCKET, history=1, replicas=replicas))
        return cls(kv, log)

    async def load_all(self) -> list[JobState]:
        """Every readable record (an unreadable one is logged by `load` and left alone)."""
        try:
            keys = await asyncio.wait_for(self.kv.keys(), KEYS_TIMEOUT_S)
        except NoKeysError:
            return []
        states = []
        for key in keys:
            try:
                state = await self.load(key)
            except UnreadableRecordError:
                continue
            if state is not None:
                states.append(state)
        return states

    async def load(self, job: str) -> JobState | None:
        """The job's record as it is now in KV (None if there is none), remembering its revision.
        Raises UnreadableRecordError if there is one that cannot be read."""
        try:
            entry = await asyncio.wait_for(self.kv.get(job), KV_TIMEOUT_S)
        except KeyNotFoundError:
            self.revisions.pop(job, None)
            return None
        if entry.value is None or entry.revision is None:
            return None
        try:
            state = state_from_record(entry.value)
        except (ProtocolError, KeyError, TypeError, ValueError, msgpack.UnpackException) as exc:
            self.log.error("job record unreadable: the job is left alone", job=job, reason=repr(exc))
            raise UnreadableRecordError(f"job {job}: record unreadable ({exc!r})") from exc
        self.revisions[job] = entry.revision
        return state

    async def save(self, state: JobState) -> None:
        """Write the record on top of the revision we last read or wrote. Raises RecordConflictError if
        someone else wrote since, and the KV's own errors (a timeout during a leader election) as is.

        A write whose acknowledgement was lost may still have landed: the next write then meets a
        newer revision. If that revision holds exactly the value of our unconfirmed write, it is ours."""
        value = state_to_record(state)
        for attempt in range(2):
            revision = self.revisions.get(state.job)
            try:
                if revision is None:
                    revision = await asyncio.wait_for(self.kv.create(state.job, value), KV_TIMEOUT_S)
                else:
                    revision = await asyncio.wait_for(self.kv.update(state.job, value, last=revision), KV_TIMEOUT_S)
            except KeyWrongLastSequenceError as exc:
                if attempt == 0 and await self._adopt_unconfirmed(state.job):
                    continue
                raise RecordConflictError(
                    f"job {state.job}: record changed under us (another swapper wrote it)"
                ) from exc
            except BaseException:
                self._unconfirmed[state.job] = value  # it may have landed all the same
                raise
            self.revisions[state.job] = revision
            self._unconfirmed.pop(state.job, None)
            return

    async def _adopt_unconfirmed(self, job: str) -> bool:
        """Whether the record in KV is our own write whose acknowledgement was lost (then adopt it)."""
        unconfirmed = self._unconfirmed.pop(job, None)
        if unconfirmed is None:
            return False
        try:
            entry = await asyncio.wait_for(self.kv.get(job), KV_TIMEOUT_S)
        except KeyNotFoundError:
            return False
        if entry.revision is None or entry.value != unconfirmed:
            return False
        self.revisions[job] = entry.revision
        return True

    def forget(self, job: str) -> None:
        self.revisions.pop(job, None)
