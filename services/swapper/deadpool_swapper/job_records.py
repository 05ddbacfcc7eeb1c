"""Job state in a JetStream KV bucket, so a restarted (or standby) swapper continues where it stopped.

The record holds the whole `JobState`: membership and generation, and also the rebuild in flight (its
command and the acks so far), the open incidents, the commit bookkeeping, the void notice, and the
events-stream position the state includes (`applied_seq`). A new leader loads it and replays the
events after that position, so it ends where its predecessor was, then finishes the rebuild in flight
(it retransmits the command; members re-ack) or supersedes it.

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
command apart from its acks and its age. A commit of a job of 16,384 ranks writes a head of a few kB;
its membership and placement are written when they change. A record too large even so is refused
(`RecordTooLargeError`), never retried for ever.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import msgpack
import nats.errors
from nats.js.api import KeyValueConfig
from nats.js.errors import BucketNotFoundError, KeyNotFoundError, KeyWrongLastSequenceError, NoKeysError
from nats.js.kv import KeyValue

from deadpool_protocol import Incident, ProtocolError, Rebuild, RebuildAck
from deadpool_protocol.codec import from_fields, to_fields
from deadpool_protocol.errors import DeadPoolError
from deadpool_protocol.job_record import (
    JOBS_BUCKET,
    PART_SEPARATOR,
    RECORD_PART_BYTES_MAX,
    JobSummary,
    Section,
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
from deadpool_runtime.job_record_kv import read_record
from deadpool_swapper.core import JobState, OpenIncident, PendingRebuild
from deadpool_swapper.placement import MemberInfo
from deadpool_swapper.restore_chain import CommittedCopies

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


class RecordConflictError(DeadPoolError, RuntimeError):
    """The job record changed under us: another swapper wrote it (this one is no longer the leader)."""


class RecordTooLargeError(DeadPoolError, RuntimeError):
    """The job record cannot be stored, even compressed and in parts: the input that made it so is
    refused (the caller reloads the last stored record), never retried for ever."""


def _age(now: float, instant: float) -> float:
    return max(0.0, now - instant)


def state_to_record(state: JobState, now: float) -> bytes:
    """The record of `state` at `now` (this process's monotonic clock), whole."""
    return pack_record(*state_fields(state, now))


def _member_row(i: MemberInfo, oldest: float) -> list[Any]:
    """A member in the record: its fields, then its registration instant as the time after the
    oldest member's (so the row stays the same from save to save)."""
    return [
        i.member,
        i.host,
        i.pid,
        i.launcher,
        i.rank_hint,
        i.rendezvous_host,
        i.rendezvous_port,
        i.registered_at - oldest,
    ]


def _holders(holders: dict[int, set[str]]) -> list[list[Any]]:
    """Per rank in order, its stores in order (a set of one is its own order: most are one or two)."""
    return [[rank, sorted(stores) if len(stores) > 1 else list(stores)] for rank, stores in sorted(holders.items())]


def state_fields(state: JobState, now: float, left_out: Collection[str] = ()) -> tuple[JobSummary, dict[str, Any]]:
    """The record of `state` at `now` (this process's monotonic clock), as its summary and the
    swapper's private fields: timers travel as ages or time left, never as instants, and a large field
    is the same while what it says is (see the module's docstring). `left_out`: large fields the
    caller has packed already (`SectionMemo`), not built (an empty value stands in)."""
    oldest = min((info.registered_at for info in state.members.values()), default=now)
    summary = JobSummary(
        job=state.job,
        world_size=state.world_size,
        generation=state.generation,
        ranks=[] if "ranks" in left_out else list(state.ranks),
        spares=list(state.spares),
        hosts={} if "hosts" in left_out else {m: info.host for m, info in state.members.items()},
        failed=list(state.failed),
        committed_step=state.committed_step,
        finished=state.finished,
        failed_reason=state.failed_reason,
    )
    pending = state.pending
    private = {
        "members_oldest_age_s": _age(now, oldest),
        "member_rows": [] if "member_rows" in left_out else [_member_row(i, oldest) for i in state.members.values()],
        "restore_step": state.restore_step,
        "placement": [] if "placement" in left_out else state.placement,
        "completes": [
            [step, rank, sorted(stores)] for step, ranks in state.completes.items() for rank, stores in ranks.items()
        ],
        "pending_command": None if pending is None or "pending_command" in left_out else to_fields(pending.command),
        "pending_sent_age_s": None if pending is None else _age(now, pending.t_sent),
        "pending_acks": [] if pending is None else [to_fields(a) for a in pending.acks.values()],
        "open_incidents": [to_fields(i) for i in state.open_incidents],
        "incidents": [to_fields(i) for i in state.incidents],
        "done": dict(sorted(state.done.items())),
        "finished_age_s": _age(now, state.finished_t),
        "incident_seq": state.incident_seq,
        "hold_left_s": max(0.0, state.hold_until - now) if state.hold_until else None,
        "last_hello_age_s": _age(now, state.last_hello_t),
        "silent_hosts": {h: list(v) for h, v in state.silent_hosts.items()},
        "void_generation": state.void_generation,
        "attempts": state.attempts,
        "formed": state.formed,
        "applied_seq": state.applied_seq,
        "stream_id": state.stream_id,
        "placement_version": state.placement_version,
        "placement_confirmed": state.placement_confirmed,
        "committed_generation": state.committed_generation,
        "committed_holders": [] if "committed_holders" in left_out else _holders(state.committed_holders),
        "rank_bytes": [] if "rank_bytes" in left_out else sorted([r, n] for r, n in state.rank_bytes.items()),
        "previous_committed_step": [state.previous_committed.step, state.previous_committed.generation],
        "previous_committed_holders": []
        if "previous_committed_holders" in left_out
        else _holders(state.previous_committed.holders),
        "unavailable": sorted([rank, step] for rank, step in state.unavailable),
        "durable_failed": state.durable_failed,
        "durable_completes": _holders(state.durable_completes),
        "awaiting_first_step": state.awaiting_first_step,
        "awaiting_age_s": _age(now, state.awaiting_since),
        "first_steps": sorted([rank, t] for rank, t in state.first_steps.items()),
        "announced_stores": {name: list(address) for name, address in state.announced_stores.items()},
        "unprotected_age_s": None if state.unprotected_since is None else _age(now, state.unprotected_since),
        "unprotected_step": state.unprotected_step,
        "run": state.run,
        "base_generation": state.base_generation,
        "hold_without_stores_s": state.hold_without_stores_s,
        "held_age_s": None if state.held_since is None else _age(now, state.held_since),
        "local_failed": state.local_failed,
    }
    return summary, private


def _frozen_holders(holders: dict[int, set[str]]) -> dict[int, frozenset[str]]:
    return {rank: frozenset(stores) for rank, stores in holders.items()}


def _command_copy(command: Rebuild | None) -> Rebuild | None:
    """A rebuild command with lists of its own (the swapper's placement is the command's own list)."""
    if command is None:
        return None
    return dataclasses.replace(
        command, ranks=list(command.ranks), spares=list(command.spares), placement=[list(p) for p in command.placement]
    )


_REMEMBERED: tuple[tuple[str, str, Callable[[JobState], Any], Callable[[Any], Any]], ...] = (
    ("summary", "hosts", lambda s: s.members, dict),
    ("summary", "ranks", lambda s: s.ranks, list),
    ("swapper", "member_rows", lambda s: s.members, dict),
    ("swapper", "placement", lambda s: s.placement, lambda placement: [list(p) for p in placement]),
    ("swapper", "committed_holders", lambda s: s.committed_holders, _frozen_holders),
    ("swapper", "previous_committed_holders", lambda s: s.previous_committed.holders, _frozen_holders),
    ("swapper", "rank_bytes", lambda s: s.rank_bytes, dict),
    ("swapper", "pending_command", lambda s: None if s.pending is None else s.pending.command, _command_copy),
)
"""The large fields a save builds again only when what they are built from changed (`SectionMemo`):
each with its source in the state, and how to copy that source so that the state's changes in place
do not reach the copy (a member's info is kept as it is: `MemberInfo` is frozen). The rebuild in
flight's command is one: every save while its acks came in packed its 16,384 ranks and their stores
again, 10 ms."""


class SectionMemo:
    """One job's large fields as its last save packed them, beside copies of what they were built
    from: a field whose source equals (`==`) its copy is not built, packed or digested again.

    At 16,384 ranks a save built, packed and digested 5.5 MB of membership, placement and holders,
    53 ms, to find most of it unchanged; comparing the sources costs a few ms (the same member infos,
    the same strings: compared by identity first)."""

    def __init__(self) -> None:
        self._kept: dict[tuple[str, str], tuple[Any, Section]] = {}

    def unchanged(self, state: JobState) -> dict[tuple[str, str], Section]:
        """The sections of `state` that are as last kept, by (group, field)."""
        found = {}
        for group, field_name, source, _ in _REMEMBERED:
            kept = self._kept.get((group, field_name))
            if kept is not None and kept[0] == source(state):
                found[(group, field_name)] = kept[1]
        return found

    def keep(self, state: JobState, sections: list[Section]) -> None:
        """Remember the sections just packed from `state` (a field small enough for the head is not
        a section: nothing is kept for it)."""
        packed = {(s.group, s.field): s for s in sections}
        for group, field_name, source, copy in _REMEMBERED:
            section = packed.get((group, field_name))
            kept = self._kept.get((group, field_name))
            if section is None:
                self._kept.pop((group, field_name), None)
            elif kept is None or kept[1] is not section:
                self._kept[(group, field_name)] = (copy(source(state)), section)


def state_from_record(data: bytes, now: float) -> JobState:
    """Rebuild a `JobState` from its record, its timers on this process's monotonic clock at `now`.
    Raises ProtocolError (or KeyError, TypeError, ValueError) when the record cannot be read. Private
    fields a record of an older version lacks take their defaults, so a swapper that was upgraded reads
    the records of the one it replaces (an older record's wall-clock instants are not read: its timers
    start afresh)."""
    summary, p = unpack_record(data)
    defaults = JobState(summary.job)
    hold_left_s = p.get("hold_left_s")
    unprotected_age_s = p.get("unprotected_age_s")
    state = JobState(
        job=summary.job,
        world_size=summary.world_size,
        generation=summary.generation,
        ranks=list(summary.ranks),
        spares=list(summary.spares),
        members=_members(p, now),
        failed=list(summary.failed),
        committed_step=summary.committed_step,
        restore_step=p.get("restore_step", defaults.restore_step),
        placement=[list(x) for x in p.get("placement", [])],
        finished=summary.finished,
        failed_reason=summary.failed_reason,
        incident_seq=p.get("incident_seq", 0),
        incidents=[from_fields(Incident, i, "incident") for i in p.get("incidents", [])],
        open_incidents=[OpenIncident(**i) for i in p.get("open_incidents", [])],
        done=_done(p.get("done", {})),
        finished_t=now - p.get("finished_age_s", 0.0),
        hold_until=now + hold_left_s if hold_left_s is not None else 0.0,
        last_hello_t=now - p.get("last_hello_age_s", 0.0),
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
        awaiting_since=now - p.get("awaiting_age_s", 0.0),
        first_steps={int(rank): float(t) for rank, t in p.get("first_steps", [])},
        announced_stores={name: (str(a[0]), int(a[1])) for name, a in p.get("announced_stores", {}).items()},
        unprotected_since=None if unprotected_age_s is None else now - unprotected_age_s,
        unprotected_step=p.get("unprotected_step", defaults.unprotected_step),
        run=str(p.get("run", "")),
        base_generation=int(p.get("base_generation", 0)),
        hold_without_stores_s=float(p.get("hold_without_stores_s", 0.0)),
        held_since=None if p.get("held_age_s") is None else now - float(p["held_age_s"]),
        local_failed=bool(p.get("local_failed", False)),
    )
    if "previous_committed_step" in p:
        step, generation = p["previous_committed_step"]
        holders = p.get("previous_committed_holders", [])
        state.previous_committed = CommittedCopies(int(step), int(generation), {int(r): set(s) for r, s in holders})
    elif "previous_committed" in p:  # a record written before the holders were a field of their own
        step, generation, holders = p["previous_committed"]
        state.previous_committed = CommittedCopies(int(step), int(generation), {int(r): set(s) for r, s in holders})
    for step, rank, stores in p.get("completes", []):
        state.completes.setdefault(int(step), {})[int(rank)] = set(stores)
    old_pending = p.get("pending") or {}  # a record written before the command was a field of its own
    raw_command = p.get("pending_command", old_pending.get("command"))
    if raw_command is not None:
        command = from_fields(Rebuild, raw_command, "pending.command")
        command.check()
        sent_age_s = p.get("pending_sent_age_s", old_pending.get("sent_age_s")) or 0.0
        pending = PendingRebuild(command, t_sent=now - float(sent_age_s))
        for raw in p.get("pending_acks", old_pending.get("acks", [])):
            ack = from_fields(RebuildAck, raw, "pending.ack")
            pending.acks[ack.member] = ack
        state.pending = pending
    return state


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
        try:
            keys: list[str] = await asyncio.wait_for(self.kv.keys(), KEYS_TIMEOUT_S)
        except NoKeysError:
            return []
        return keys

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
        (the large fields unchanged since `memo` last saw them are not built again)."""
        try:
            unchanged = memo.unchanged(state)
            summary, private = state_fields(state, now, left_out={name for _, name in unchanged})
            inline, sections = split_record(summary, private, unchanged)
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
        self.written = []
        for key, part in encoded.parts.items():
            await asyncio.wait_for(self.kv.put(key, part), KV_TIMEOUT_S)
            self.written.append((key, len(part)))
        await self._write_head(job, encoded.head)
        self.written.append((job, len(encoded.head)))
        gone = self._named.get(job, set()) - encoded.named
        self._named[job], self._sections[job] = encoded.named, encoded.sections
        for key in gone:
            await self._delete(key)

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


def _members(p: dict[str, Any], now: float) -> dict[str, MemberInfo]:
    """The members of a record, their registration instants on this process's clock."""
    if "member_rows" in p:
        oldest = now - float(p.get("members_oldest_age_s", 0.0))
        rows = [
            MemberInfo(str(m), str(host), int(pid), str(launcher), int(hint), str(rdv_host), int(rdv_port), oldest + t)
            for m, host, pid, launcher, hint, rdv_host, rdv_port, t in p["member_rows"]
        ]
        return {info.member: info for info in rows}
    return {m: MemberInfo(**(i | {"registered_at": now + i["registered_at"]})) for m, i in p["members"].items()}


def _done(recorded: object) -> dict[str, int]:
    """The done ranks' members and steps of a record (a record written before steps were kept lists the
    members only: their steps are unknown, -1, and their next report says them)."""
    if isinstance(recorded, dict):
        return {str(member): int(step) for member, step in recorded.items()}
    return dict.fromkeys((str(member) for member in recorded or []), -1)  # type: ignore[attr-defined]
