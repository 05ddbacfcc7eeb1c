"""Job state in a JetStream KV bucket, so a restarted (or standby) swapper continues where it stopped.

The record holds the whole `JobState`: membership and generation, and also the rebuild in flight (its
command and the acks so far), the open incidents, the commit bookkeeping, the void notice, and the
events-stream position the state includes (`applied_seq`). A new leader loads it and replays the
events after that position, so it ends where its predecessor was, then finishes the rebuild in flight
(it retransmits the command; members re-ack) or supersedes it. Each part of the state writes and
reads its own entries (`job_parts`); this module puts them in one record and keeps it in the bucket.

Only the swapper leader writes, with a revision check (`kv.update(..., last=revision)`): a write
against a revision someone else changed is refused by the server. `save` then raises
`RecordConflictError` and the caller reloads: it never overwrites a newer record.

The record carries no instant of this host's clock for another host to read with its own: timers (the
last call, retransmissions, how long a job has been finished or waiting) are saved as ages or time
left, taken at the save, and become instants again on the loader's monotonic clock.

A save writes what changed (`deadpool_protocol.job_record`): the small fields go in the head, each
large field is a section stored under its digest and written only when its content is new. So the
large fields are encoded to stay equal while the job does not change: members' registration instants
relative to the oldest one (one age in the head), holders sorted by rank, the rebuild in flight's
command apart from its acks and its age, less the ranks and placement it shares with the job. A
commit of a job of 16,384 ranks writes a head of a few kB; its membership and placement are written
when they change, a chunk at a time (`section_memo`). A record too large even so is refused
(`RecordTooLargeError`), never retried for ever.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Collection, Coroutine, Iterable
from dataclasses import dataclass
from typing import Any

import msgpack
import nats.errors
from nats.js.api import KeyValueConfig
from nats.js.errors import BucketNotFoundError, KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from deadpool_protocol import ProtocolError
from deadpool_protocol.errors import DeadPoolError
from deadpool_protocol.job_record import (
    JOBS_BUCKET,
    PART_SEPARATOR,
    RECORD_PART_BYTES_MAX,
    JobSummary,
    SectionRef,
    archive_key,
    is_record_key,
    pack_head,
    pack_record,
    part_key,
    section_parts,
    split_record,
    unpack_record,
)
from deadpool_runtime.job_record_kv import bucket_keys, read_record
from deadpool_swapper.core import JobState
from deadpool_swapper.job_parts import (
    CommitLedger,
    EventsPosition,
    IncidentLog,
    Membership,
    Protection,
    Recovery,
    RestoreReports,
    StorePlacement,
    age,
    command_entries,
)
from deadpool_swapper.section_memo import SectionMemo, pending_shares

__all__ = [
    "JobRecords",
    "RecordConflictError",
    "RecordTooLargeError",
    "UnreadableRecordError",
    "state_from_record",
    "state_to_record",
]

KV_TIMEOUT_S = 2.0
"""How long one KV request may take (also the JetStream context's request timeout). Every KV call is
bounded here as well: some of nats.py's (`keys()`, a watch) have no timeout of their own, and one
that never returned once stopped both swappers for good while a NATS node was down."""
KEYS_TIMEOUT_S = 5.0
PAYLOAD_MARGIN_BYTES = 4096
"""Room left in a NATS message for the KV's subject and headers beside a record's head or part."""
KV_WRITES_IN_FLIGHT_MAX = 16
"""A save's parts go to the bucket this many at a time (each is a JetStream round trip: one after
the other, a rebuild's save at 4,096 ranks took 8 to 29 ms before its command could go out)."""


class RecordConflictError(DeadPoolError, RuntimeError):
    """The job record changed under us: another swapper wrote it (this one is no longer the leader)."""


class RecordTooLargeError(DeadPoolError, RuntimeError):
    """The job record cannot be stored, even compressed and in parts: the input that made it so is
    refused (the caller reloads the last stored record), never retried for ever."""


def state_to_record(state: JobState, now: float) -> bytes:
    """The record of `state` at `now` (this process's monotonic clock), whole."""
    return pack_record(*state_fields(state, now))


def state_fields(state: JobState, now: float, left_out: Collection[str] = ()) -> tuple[JobSummary, dict[str, Any]]:
    """The record of `state` at `now` (this process's monotonic clock), as its summary and the
    swapper's private fields: timers travel as ages or time left, never as instants, and a large field
    is the same while what it says is (see the module's docstring). `left_out`: large fields the
    caller has packed already (`SectionMemo`), not built (an empty value stands in)."""
    membership = state.membership
    summary = JobSummary(
        job=state.job,
        world_size=membership.world_size,
        generation=state.generation,
        ranks=[] if "ranks" in left_out else list(membership.ranks),
        spares=list(membership.spares),
        hosts={} if "hosts" in left_out else {m: info.host for m, info in membership.members.items()},
        failed=list(membership.failed),
        committed_step=state.ledger.committed_step,
        finished=state.finished,
        failed_reason=state.failed_reason,
    )
    private: dict[str, Any] = {
        "finished_age_s": age(now, state.finished_t),
        "run": state.run,
        "base_generation": state.base_generation,
    }
    for part in state.parts():
        private |= part.to_record(now, left_out)
    return summary, private | command_entries(state.recovery.pending, pending_shares(state), left_out)


def state_from_record(data: bytes, now: float) -> JobState:
    """Rebuild a `JobState` from its record, its timers on this process's monotonic clock at `now`.
    Raises ProtocolError (or KeyError, TypeError, ValueError) when the record cannot be read. Private
    fields a record of an older version lacks take their defaults, so a swapper that was upgraded reads
    the records of the one it replaces (an older record's wall-clock instants are not read: its timers
    start afresh)."""
    summary, p = unpack_record(data)
    return JobState(
        job=summary.job,
        run=str(p.get("run", "")),
        base_generation=int(p.get("base_generation", 0)),
        generation=summary.generation,
        finished=summary.finished,
        finished_t=now - p.get("finished_age_s", 0.0),
        failed_reason=summary.failed_reason,
        membership=Membership.from_record(summary, p, now),
        recovery=Recovery.from_record(summary, p, now),
        ledger=CommitLedger.from_record(summary, p, now),
        restores=RestoreReports.from_record(summary, p, now),
        stores=StorePlacement.from_record(summary, p, now),
        incident_log=IncidentLog.from_record(summary, p, now),
        protection=Protection.from_record(summary, p, now),
        position=EventsPosition.from_record(summary, p, now),
    )


async def _bounded(writes: Iterable[Coroutine[Any, Any, object]]) -> None:
    """Await `writes` at most `KV_WRITES_IN_FLIGHT_MAX` at a time, each within `KV_TIMEOUT_S`. The
    first failure is raised once its group is done; the groups after it are never started."""
    pending = list(writes)
    started = 0
    try:
        while started < len(pending):
            group = pending[started : started + KV_WRITES_IN_FLIGHT_MAX]
            started += len(group)
            results = await asyncio.gather(*(asyncio.wait_for(w, KV_TIMEOUT_S) for w in group), return_exceptions=True)
            if failed := next((r for r in results if isinstance(r, BaseException)), None):
                raise failed
    finally:
        for write in pending[started:]:
            write.close()


class UnreadableRecordError(DeadPoolError, RuntimeError):
    """A job record exists but cannot be read: acting on the job as if it were new would start its
    generations again from 1, so the swapper acts on it not at all (and says so)."""


class JobRecords:
    def __init__(self, kv: KeyValue, log: Any, payload_bytes: int = 1024 * 1024) -> None:
        self.kv = kv
        self.log = log
        self.part_bytes = max(1024, min(RECORD_PART_BYTES_MAX, payload_bytes - PAYLOAD_MARGIN_BYTES))
        """The largest head or part written: 256 kB, or the server's max payload less room for subject
        and headers where that is smaller."""
        self.revisions: dict[str, int] = {}
        self._named: dict[str, set[str]] = {}
        self._unnamed: dict[str, set[str]] = {}
        """job -> parts its saves stopped naming, not deleted yet (`collect`)."""
        """Per job, the part keys its stored head names."""
        self._sections: dict[str, dict[str, int]] = {}
        """Per job, the sections its stored head names (digest -> parts): already in KV, not written again."""
        self._unconfirmed: dict[str, bytes] = {}
        """Per job, the head of a write that failed without an answer (it may have been stored)."""
        self.written: list[tuple[str, int]] = []
        """The keys and sizes of the last save's writes, head last (for tests and benchmarks)."""
        self._memos: dict[str, SectionMemo] = {}
        """Per job, its large fields as last packed."""

    @classmethod
    async def open(cls, js: Any, log: Any, replicas: int = 1, payload_bytes: int = 1024 * 1024) -> JobRecords:
        try:
            kv = await js.key_value(JOBS_BUCKET)
        except BucketNotFoundError:
            kv = await js.create_key_value(KeyValueConfig(bucket=JOBS_BUCKET, history=1, replicas=replicas))
        return cls(kv, log, payload_bytes)

    async def load_all(self, now: float) -> list[JobState]:
        """Every readable record (an unreadable one is logged by `load` and left alone). Parts that no
        head names any more (a swapper stopped between writing them and its head, or a write refused
        by the revision check) are deleted."""
        keys = await self._keys()
        states = []
        for key in filter(is_record_key, keys):
            try:
                state = await self.load(key, now)
            except UnreadableRecordError:
                continue
            if state is not None:
                states.append(state)
        named = set().union(*self._named.values())
        for key in keys:
            if not is_record_key(key) and key not in named and key.split(PART_SEPARATOR)[0] in self.revisions:
                await self._delete(key)
        return states

    async def names(self) -> list[str]:
        """The jobs that have a record, as the bucket lists them now."""
        return list(filter(is_record_key, await self._keys()))

    async def _keys(self) -> list[str]:
        return await bucket_keys(self.kv, KEYS_TIMEOUT_S)

    async def load(self, job: str, now: float) -> JobState | None:
        """The job's record as it is now in KV (None if there is none), remembering its revision.
        Raises UnreadableRecordError if there is one that cannot be read."""
        try:
            stored = await read_record(self.kv, job, KV_TIMEOUT_S)
            if stored is None:
                self.forget(job)
                return None
            state = state_from_record(stored.record, now)
        except (ProtocolError, KeyError, TypeError, ValueError, msgpack.UnpackException) as exc:
            self.log.error("job record unreadable: the job is left alone", job=job, reason=repr(exc))
            raise UnreadableRecordError(f"job {job}: record unreadable ({exc!r})") from exc
        self.revisions[job] = stored.revision
        self._named[job] = set(stored.part_keys)
        self._sections[job] = dict(stored.sections)
        return state

    def _encode(self, key: str, state: JobState, now: float, known: dict[str, int], memo: SectionMemo) -> _Encoded:
        """The head of `state`'s record under `key`, and the parts of its sections not in `known`
        (what is unchanged since `memo` last saw it is not built again)."""
        try:
            packed = memo.packed(state)
            summary, private = state_fields(state, now, left_out={name for _, name in packed})
            inline, sections = split_record(summary, private, packed)
            memo.keep(state, sections)
            refs: list[SectionRef] = []
            parts: dict[str, bytes] = {}
            for section in sections:
                count = known.get(section.digest)
                if count is None:
                    pieces = section_parts(section, self.part_bytes)
                    parts |= {part_key(key, section.digest, i): piece for i, piece in enumerate(pieces)}
                    count = len(pieces)
                refs.append((section.group, section.field, section.digest, count))
            head = pack_head(inline, refs)
        except ProtocolError as exc:
            raise RecordTooLargeError(f"job {state.job}: {exc}") from exc
        if len(head) > self.part_bytes:
            raise RecordTooLargeError(f"job {state.job}: a head of {len(head)} bytes (at most {self.part_bytes})")
        named = {part_key(key, digest, i) for _, _, digest, count in refs for i in range(count)}
        return _Encoded(head, parts, named, {digest: count for _, _, digest, count in refs})

    async def save(self, state: JobState, now: float) -> None:
        """Write the record on top of the revision we last read or wrote: the parts of its sections
        that are new first, then its head with the revision check, then the parts no longer named
        away. Raises RecordConflictError if someone else wrote since, RecordTooLargeError if it cannot
        be stored at all, and the KV's own errors (a timeout during a leader election) as is.

        A write whose acknowledgement was lost may still have landed: the next write then meets a
        newer revision. If that revision holds exactly the head of our unconfirmed write, it is ours.
        Parts written for a write that was refused stay until the next takeover's `load_all` (their
        keys are their content's: another swapper's head may name the same)."""
        job = state.job
        encoded = self._encode(job, state, now, self._sections.get(job, {}), self._memos.setdefault(job, SectionMemo()))
        self.written = [(key, len(part)) for key, part in encoded.parts.items()]
        await _bounded(self.kv.put(key, part) for key, part in encoded.parts.items())
        await self._write_head(job, encoded.head)
        self.written.append((job, len(encoded.head)))
        self._unnamed.setdefault(job, set()).update(self._named.get(job, set()) - encoded.named)
        self._named[job], self._sections[job] = encoded.named, encoded.sections

    async def collect(self, job: str) -> None:
        """Delete the parts that the saves of `job` since the last call stopped naming (best effort). A
        save leaves them to this, so that what it decided goes out one round trip sooner."""
        gone = self._unnamed.pop(job, set()) - self._named.get(job, set())  # a part named again stays
        await _bounded(self._delete(key) for key in gone)

    async def archive(self, state: JobState, now: float) -> None:
        """Keep the record of a run that ended under `archive_key` (written whole, parts first; no
        revision check: the key is the run's alone). Raises the KV's errors, RecordTooLargeError."""
        key = archive_key(state.job, state.generation)
        encoded = self._encode(key, state, now, {}, SectionMemo())  # once per run: nothing to remember
        for part_name, part in encoded.parts.items():
            await asyncio.wait_for(self.kv.put(part_name, part), KV_TIMEOUT_S)
        await asyncio.wait_for(self.kv.put(key, encoded.head), KV_TIMEOUT_S)

    async def _write_head(self, job: str, head: bytes) -> None:
        for attempt in range(2):
            revision = self.revisions.get(job)
            try:
                if revision is None:
                    revision = await asyncio.wait_for(self.kv.create(job, head), KV_TIMEOUT_S)
                else:
                    revision = await asyncio.wait_for(self.kv.update(job, head, last=revision), KV_TIMEOUT_S)
            except KeyWrongLastSequenceError as exc:
                if attempt == 0 and await self._adopt_unconfirmed(job):
                    continue
                raise RecordConflictError(f"job {job}: record changed under us (another swapper wrote it)") from exc
            except nats.errors.MaxPayloadError as exc:
                raise RecordTooLargeError(f"job {job}: a head of {len(head)} bytes: {exc!r}") from exc
            except BaseException:
                self._unconfirmed[job] = head  # it may have landed all the same
                raise
            self.revisions[job] = revision
            self._unconfirmed.pop(job, None)
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

    async def _delete(self, key: str) -> None:
        """Best effort: a part left behind is deleted at the next takeover."""
        with contextlib.suppress(TimeoutError, nats.errors.Error):
            await asyncio.wait_for(self.kv.purge(key), KV_TIMEOUT_S)

    def forget(self, job: str) -> None:
        self.revisions.pop(job, None)
        self._unnamed.pop(job, None)
        self._named.pop(job, None)
        self._sections.pop(job, None)
        self._memos.pop(job, None)


@dataclass(frozen=True)
class _Encoded:
    head: bytes
    parts: dict[str, bytes]
    """Part key -> bytes, for the sections not stored yet."""
    named: set[str]
    """Every part key the head names."""
    sections: dict[str, int]
