"""A job's state in parts, each with one concern and its own record encoding.

`JobState` was 42 loose fields, written to its record and read back field by field in one function
each way (`job_records`): a field added to the state and forgotten in one of them was lost at a
leader change, silently. Now each part says what it holds and how it travels: `to_record` gives its
entries of the record's private map at `now` (this process's monotonic clock), `from_record` makes
the part again from them on the loader's clock. An entry a record of an older version lacks takes its
default, so an upgraded swapper reads its predecessor's records.

The encodings are those of before (same keys, same values): a record written by a swapper before this
split loads here. The rebuild in flight's command is the one entry written otherwise since: less the
ranks and placement it shares with the job (`command_entries`), in a record of a stored form that an
older reader refuses (`deadpool_protocol.job_record`). Timers travel as ages or time left, never as
instants (another host's clock means nothing here); retransmission instants do not travel at all (a new
leader sends what is outstanding at once: each message is idempotent). Large entries are built to stay
equal while what they say does (members' registration instants relative to the oldest one, holders
sorted by rank), so a save writes only what changed; `left_out` names the large entries the caller has
packed already (an empty value stands in).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, Self, TypeVar

from deadpool_protocol import (
    NO_STEP,
    Incident,
    Placement,
    PlacementDelta,
    Rebuild,
    RebuildAck,
    RebuildDelta,
    Reserve,
)
from deadpool_protocol.bounds import MEMBERS_PER_JOB_MAX
from deadpool_protocol.codec import from_fields, to_fields
from deadpool_protocol.job_record import JobSummary
from deadpool_protocol.placement_delta import placement_notice
from deadpool_protocol.rebuild_delta import notice_of
from deadpool_swapper.commit_progress import CommitProgress
from deadpool_swapper.placement import MemberInfo
from deadpool_swapper.restore_chain import CommittedCopies

__all__ = [
    "CommitLedger",
    "EventsPosition",
    "IncidentLog",
    "JobPart",
    "Membership",
    "OpenIncident",
    "PendingRebuild",
    "Protection",
    "Recovery",
    "RestoreReports",
    "StorePlacement",
    "member_row",
]

Private = Mapping[str, Any]
"""A record's private map (the swapper's entries beside the public `JobSummary`)."""


class JobPart(Protocol):
    def to_record(self, now: float, left_out: Collection[str] = ()) -> dict[str, Any]:
        """Its entries of the record's private map at `now`."""
        ...


def age(now: float, instant: float) -> float:
    return max(0.0, now - instant)


def holders_entry(holders: dict[int, set[str]]) -> list[list[Any]]:
    """Per rank in order, its stores in order (a set of one is its own order: most are one or two)."""
    return holder_rows(sorted(holders.items()))


def holder_rows(items: list[tuple[int, set[str]]]) -> list[list[Any]]:
    """`holders_entry` of holders already in rank order, as (rank, stores) items."""
    return [[rank, sorted(stores) if len(stores) > 1 else list(stores)] for rank, stores in items]


def holders_of(entry: list[Any]) -> dict[int, set[str]]:
    return {int(rank): set(stores) for rank, stores in entry}


def rank_runs(ranks: Collection[int]) -> list[list[int]]:
    """`ranks` as sorted runs `[first, last + 1]`: ranks 0 to n - 1 are one run, found without sorting."""
    if not ranks:
        return []
    if min(ranks) == 0 and max(ranks) == len(ranks) - 1:
        return [[0, len(ranks)]]
    runs: list[list[int]] = []
    for rank in sorted(ranks):
        if runs and runs[-1][1] == rank:
            runs[-1][1] = rank + 1
        else:
            runs.append([rank, rank + 1])
    return runs


def ranks_of_runs(entry: list[Any]) -> set[int]:
    """The ranks `rank_runs` wrote; ValueError for a run out of a job's bounds (nothing is allocated
    past `MEMBERS_PER_JOB_MAX` ranks)."""
    ranks: set[int] = set()
    for run in entry:
        first, end = int(run[0]), int(run[1])
        if not 0 <= first < end <= MEMBERS_PER_JOB_MAX or len(ranks) + end - first > MEMBERS_PER_JOB_MAX:
            raise ValueError(f"a run of ranks out of a job's bounds: [{first}, {end})")
        ranks.update(range(first, end))
    return ranks


@dataclass
class OpenIncident:
    incident_id: str
    rank: int
    member: str
    host: str
    reason: str
    evidence: dict[str, str]
    t_fault: float
    t_detected: float
    t_decided: float = 0.0
    replacement: str = ""
    fence_s: float = 0.0
    traceparent: str = ""
    """The failure's trace context (the detector's `detect` span)."""
    launcher: str = ""
    """The failed member's launcher: while its host is up, its crash copy is there (`host_copy`)."""
    host_lost: bool = False
    """The detector saw the member's whole host go silent: no crash copy of it can be had."""


@dataclass
class PendingRebuild:
    command: Rebuild
    t_sent: float
    acks: dict[str, RebuildAck] = field(default_factory=dict)
    rank_members: frozenset[str] = frozenset()
    delta: RebuildDelta | None = None
    """The command as its changes from the generation before (`rebuild_delta`), sent beside it with
    every retransmission, and kept in the record beside it: a leader that loads the command sends the
    same delta, and a member that missed the command takes it from there. Without one (a record from
    before) a notice goes instead (`delta_sent`): every member then takes the whole command, one
    retransmission (`rebuild_retransmit_s`) after the notice sent it to the whole subject."""

    def __post_init__(self) -> None:
        self.rank_members = frozenset(self.command.ranks)

    def delta_sent(self) -> RebuildDelta:
        return notice_of(self.command) if self.delta is None else self.delta


@dataclass
class Membership:
    """Who is in the job: its ranks, its spares, every live member that registered, and the ranks done."""

    world_size: int = 0
    ranks: list[str] = field(default_factory=list)
    spares: list[str] = field(default_factory=list)
    members: dict[str, MemberInfo] = field(default_factory=dict)
    """Live members that registered: ranks, spares, and (before formation) the ones waiting."""
    failed: list[str] = field(default_factory=list)
    done: dict[str, int] = field(default_factory=dict)
    """Member -> the last step it says it finished, for the ranks of this generation that are done."""
    last_hello_t: float = 0.0

    def vacant_ranks(self) -> list[int]:
        """The ranks whose member is gone (every tick asks: none, found by a loop in C)."""
        if all(map(self.members.__contains__, self.ranks)):
            return []
        return [r for r, m in enumerate(self.ranks) if m not in self.members]

    def oldest_registration(self, now: float) -> float:
        return min(map(_registered_at, self.members.values()), default=now)

    def to_record(self, now: float, left_out: Collection[str] = ()) -> dict[str, Any]:
        """Its private entries; the ranks, spares, hosts and failed go in the summary (`JobSummary`)."""
        oldest = self.oldest_registration(now)
        return {
            "members_oldest_age_s": age(now, oldest),
            "member_rows": [] if "member_rows" in left_out else [member_row(i, oldest) for i in self.members.values()],
            "done": dict(sorted(self.done.items())),
            "last_hello_age_s": age(now, self.last_hello_t),
        }

    @classmethod
    def from_record(cls, summary: JobSummary, p: Private, now: float) -> Self:
        return cls(
            world_size=summary.world_size,
            ranks=list(summary.ranks),
            spares=list(summary.spares),
            members=_members(p, now),
            failed=list(summary.failed),
            done=_done(p.get("done", {})),
            last_hello_t=now - p.get("last_hello_age_s", 0.0),
        )


@dataclass
class Recovery:
    """The rebuild in flight and what leads to the next one: the void notice, the last call, the tries."""

    pending: PendingRebuild | None = None
    attempts: int = 0
    """Generations published since the last one that formed."""
    formed: bool = False
    """A generation has formed (every rank acked it): from then on rebuilds restore a committed step."""
    void_generation: int = 0
    """The newest generation announced void (it will not train again)."""
    void_sent_t: float = 0.0
    hold_until: float = 0.0
    """The next rebuild waits until then: the last call after a failure, longer for a lost host."""
    silent_hosts: dict[str, tuple[int, int]] = field(default_factory=dict)
    """host -> (failures arrived, members the detector said went silent) while a rebuild is held."""

    def to_record(self, now: float, left_out: Collection[str] = ()) -> dict[str, Any]:
        """Its entries but the rebuild in flight's command, which names the job's ranks and placement
        rather than hold them twice (`command_entries`, with the state's)."""
        pending = self.pending
        return {
            "pending_sent_age_s": None if pending is None else age(now, pending.t_sent),
            "pending_acks": (
                [] if pending is None or "pending_acks" in left_out else [to_fields(a) for a in pending.acks.values()]
            ),
            "hold_left_s": max(0.0, self.hold_until - now) if self.hold_until else None,
            "silent_hosts": {h: list(v) for h, v in self.silent_hosts.items()},
            "void_generation": self.void_generation,
            "attempts": self.attempts,
            "formed": self.formed,
        }

    @classmethod
    def from_record(cls, summary: JobSummary, p: Private, now: float) -> Self:
        hold_left_s = p.get("hold_left_s")
        formed = summary.generation > 1 or (summary.generation == 1 and p.get("pending") is None)
        return cls(
            pending=_pending(summary, p, now),
            attempts=p.get("attempts", 0),
            formed=p.get("formed", formed),
            void_generation=p.get("void_generation", 0),
            hold_until=now + hold_left_s if hold_left_s is not None else 0.0,
            silent_hosts={h: (int(v[0]), int(v[1])) for h, v in p.get("silent_hosts", {}).items()},
        )


@dataclass
class CommitLedger:
    """The committed step, its copies and the one before, and the steps above it as stores seal them."""

    committed_step: int = NO_STEP
    committed_generation: int = 0
    """The generation whose snapshots make up the committed step (the only valid copies of it)."""
    committed_holders: dict[int, set[str]] = field(default_factory=dict)
    """rank -> the stores holding its snapshot of the committed step (replicas made later included)."""
    previous_committed: CommittedCopies = field(default_factory=CommittedCopies)
    """The committed step before the current one, which stores keep too (the chain's second link)."""
    restore_step: int = NO_STEP
    """The restore step of the current generation: older generations' snapshots above it are void."""
    completes: dict[int, dict[int, set[str]]] = field(default_factory=dict)
    """step -> rank -> stores holding it complete, for steps above the committed one."""
    rank_bytes: dict[int, int] = field(default_factory=dict)
    """rank -> the size of its last snapshot (placement reserves room for it)."""
    replicate_sent_t: float = 0.0
    commit_progress: CommitProgress = field(default_factory=CommitProgress, repr=False, compare=False)
    """Derived from `completes` (not in the record): how many ranks each step has complete."""

    def committed_copies(self) -> CommittedCopies:
        return CommittedCopies(self.committed_step, self.committed_generation, self.committed_holders)

    def snapshot_bytes_max(self) -> int:
        """The largest snapshot a rank streamed (0: none yet): a warm spare's landing size. O(ranks), at
        each commit: 0.3 ms at 16,384 ranks."""
        return max(self.rank_bytes.values(), default=0)

    def to_record(self, now: float, left_out: Collection[str] = ()) -> dict[str, Any]:
        """Its private entries; the committed step goes in the summary (`JobSummary`)."""
        previous = self.previous_committed
        return {
            "restore_step": self.restore_step,
            "completes": [
                [step, rank, sorted(stores)] for step, ranks in self.completes.items() for rank, stores in ranks.items()
            ],
            "committed_generation": self.committed_generation,
            "committed_holders": [] if "committed_holders" in left_out else holders_entry(self.committed_holders),
            "rank_bytes": [] if "rank_bytes" in left_out else sorted([r, n] for r, n in self.rank_bytes.items()),
            "previous_committed_step": [previous.step, previous.generation],
            "previous_committed_holders": []
            if "previous_committed_holders" in left_out
            else holders_entry(previous.holders),
        }

    @classmethod
    def from_record(cls, summary: JobSummary, p: Private, now: float) -> Self:
        ledger = cls(
            committed_step=summary.committed_step,
            committed_generation=p.get("committed_generation", 0),
            committed_holders=holders_of(p.get("committed_holders", [])),
            restore_step=p.get("restore_step", NO_STEP),
            rank_bytes={int(rank): int(nbytes) for rank, nbytes in p.get("rank_bytes", [])},
        )
        if "previous_committed_step" in p:
            step, generation = p["previous_committed_step"]
            holders = holders_of(p.get("previous_committed_holders", []))
            ledger.previous_committed = CommittedCopies(int(step), int(generation), holders)
        elif "previous_committed" in p:  # a record written before the holders were an entry of their own
            step, generation, old = p["previous_committed"]
            ledger.previous_committed = CommittedCopies(int(step), int(generation), holders_of(old))
        for step, rank, stores in p.get("completes", []):
            ledger.completes.setdefault(int(step), {})[int(rank)] = set(stores)
        return ledger


@dataclass
class RestoreReports:
    """What members reported of the restore chain's links since the last generation that formed."""

    unavailable: set[tuple[int, int]] = field(default_factory=set)
    """(rank, step) a member reported it found no copy of."""
    durable_failed: bool = False
    """A durable restore was reported impossible."""
    durable_completes: dict[int, set[str]] = field(default_factory=dict)
    """rank -> stores holding the resumed step's snapshot, while a durable rebuild is pending."""
    local_failed: bool = False
    """A restore from the ranks' own buffers was reported impossible."""

    def to_record(self, now: float, left_out: Collection[str] = ()) -> dict[str, Any]:
        return {
            "unavailable": sorted([rank, step] for rank, step in self.unavailable),
            "durable_failed": self.durable_failed,
            "durable_completes": holders_entry(self.durable_completes),
            "local_failed": self.local_failed,
        }

    @classmethod
    def from_record(cls, summary: JobSummary, p: Private, now: float) -> Self:
        return cls(
            unavailable={(int(rank), int(step)) for rank, step in p.get("unavailable", [])},
            durable_failed=bool(p.get("durable_failed", False)),
            durable_completes=holders_of(p.get("durable_completes", [])),
            local_failed=bool(p.get("local_failed", False)),
        )


@dataclass
class StorePlacement:
    """Which stores each rank streams to, and what the members were last told of it."""

    placement: list[list[str]] = field(default_factory=list)
    placement_version: int = 0
    """Placements published within the current generation (the rebuild's own is 0)."""
    placement_sent_t: float = 0.0
    """When the newest placement was last sent; it is sent again until a step commits under it."""
    placement_confirmed: bool = True
    """A step committed under the newest placement (so every member has it)."""
    announced_stores: dict[str, tuple[str, int]] = field(default_factory=dict)
    """store -> (host, port) as the members were last told (in a rebuild or a placement): a store heard
    on another address (restarted under its name) gets a new placement."""
    reserving: list[Reserve] = field(default_factory=list)
    """The reservations of the newest placement, sent again with it until a step commits under it (then
    every rank has uploaded to its stores). Not in the record: a hint, which a new leader does not send."""
    delta: PlacementDelta | None = None
    """The newest placement as its changes from the one before (`placement_delta`), sent beside it with
    every retransmission. In the record while the placement is not confirmed, so a leader that loads it
    sends the same delta; without one (a record from before) a notice goes instead (`delta_sent`), and
    the members that had not heard the placement take it whole."""

    def delta_sent(self, placement: Placement) -> PlacementDelta:
        """What goes beside `placement` (the newest, whole): its delta, or a notice where none is held."""
        delta = self.delta
        if delta is None or (delta.generation, delta.version) != (placement.generation, placement.version):
            return placement_notice(placement)
        return delta

    def unconfirmed_delta(self) -> PlacementDelta | None:
        """The delta while the placement is sent again (not confirmed): what the record keeps."""
        return None if self.placement_confirmed else self.delta

    def to_record(self, now: float, left_out: Collection[str] = ()) -> dict[str, Any]:
        return {
            "placement": [] if "placement" in left_out else self.placement,
            "placement_version": self.placement_version,
            "placement_confirmed": self.placement_confirmed,
            "announced_stores": {name: list(address) for name, address in self.announced_stores.items()},
            "placement_delta": None if "placement_delta" in left_out else _fields_of(self.unconfirmed_delta()),
        }

    @classmethod
    def from_record(cls, summary: JobSummary, p: Private, now: float) -> Self:
        return cls(
            placement=[list(x) for x in p.get("placement", [])],
            placement_version=p.get("placement_version", 0),
            placement_confirmed=p.get("placement_confirmed", True),
            announced_stores={name: (str(a[0]), int(a[1])) for name, a in p.get("announced_stores", {}).items()},
            delta=_delta(PlacementDelta, p.get("placement_delta"), summary.job, "placement_delta"),
        )


@dataclass
class IncidentLog:
    """The incidents open, those closed, and those closed but waiting for their first step."""

    open_incidents: list[OpenIncident] = field(default_factory=list)
    incidents: list[Incident] = field(default_factory=list)
    incident_seq: int = 0
    awaiting_first_step: list[str] = field(default_factory=list)
    """Closed incidents (ids, in `incidents`) not yet published: they end at the first step every rank
    completes after them, in the generation that formed (or `first_step_wait_s` after its acks)."""
    awaiting_since: float = 0.0
    """When the generation holding them formed."""
    first_step_ranks: set[int] = field(default_factory=set)
    """The ranks that completed their first step of the current generation."""
    first_step_t: float = 0.0
    """When the last of them did (wall clock, the member's stamp): all an incident needs of them. The
    record holds the ranks as runs (`rank_runs`): every rank of a job is one entry at any size, where
    a time per rank was 16,384 entries packed at every save after a rebuild at that size."""

    def count_first_step(self, rank: int, t_completed: float) -> None:
        self.first_step_ranks.add(rank)
        self.first_step_t = max(self.first_step_t, t_completed)

    def forget_first_steps(self) -> None:
        self.first_step_ranks, self.first_step_t = set(), 0.0

    def to_record(self, now: float, left_out: Collection[str] = ()) -> dict[str, Any]:
        return {
            "open_incidents": [to_fields(i) for i in self.open_incidents],
            "incidents": [to_fields(i) for i in self.incidents],
            "incident_seq": self.incident_seq,
            "awaiting_first_step": self.awaiting_first_step,
            "awaiting_age_s": age(now, self.awaiting_since),
            "first_step_ranks": rank_runs(self.first_step_ranks),
            "first_step_t": self.first_step_t,
        }

    @classmethod
    def from_record(cls, summary: JobSummary, p: Private, now: float) -> Self:
        before = [(int(rank), float(t)) for rank, t in p.get("first_steps", [])]  # a record of before: rank, t
        return cls(
            open_incidents=[OpenIncident(**i) for i in p.get("open_incidents", [])],
            incidents=[from_fields(Incident, i, "incident") for i in p.get("incidents", [])],
            incident_seq=p.get("incident_seq", 0),
            awaiting_first_step=list(p.get("awaiting_first_step", [])),
            awaiting_since=now - p.get("awaiting_age_s", 0.0),
            first_step_ranks=ranks_of_runs(p.get("first_step_ranks", [])) | {rank for rank, _ in before},
            first_step_t=max([float(p.get("first_step_t", 0.0)), *(t for _, t in before)]),
        )


@dataclass
class Protection:
    """Whether some store receives the job's snapshots, and the run's policy when none does."""

    unprotected_since: float | None = None
    """Since when no snapshot store receives the job's snapshots (None: some store does)."""
    unprotected_step: int = NO_STEP
    """The committed step when it became unprotected: every step trained after it is at risk."""
    hold_without_stores_s: float = 0.0
    """The run's policy when every store is lost: 0 trains on unprotected; above 0 holds training until
    a store returns, for at most this long, then ends the job (`RunStart.hold_without_stores_s`)."""
    held_since: float | None = None
    """Since when training is held for want of a store (None: it is not)."""

    def to_record(self, now: float, left_out: Collection[str] = ()) -> dict[str, Any]:
        return {
            "unprotected_age_s": None if self.unprotected_since is None else age(now, self.unprotected_since),
            "unprotected_step": self.unprotected_step,
            "hold_without_stores_s": self.hold_without_stores_s,
            "held_age_s": None if self.held_since is None else age(now, self.held_since),
        }

    @classmethod
    def from_record(cls, summary: JobSummary, p: Private, now: float) -> Self:
        unprotected_age_s = p.get("unprotected_age_s")
        held_age_s = p.get("held_age_s")
        return cls(
            unprotected_since=None if unprotected_age_s is None else now - unprotected_age_s,
            unprotected_step=p.get("unprotected_step", NO_STEP),
            hold_without_stores_s=float(p.get("hold_without_stores_s", 0.0)),
            held_since=None if held_age_s is None else now - float(held_age_s),
        )


@dataclass
class EventsPosition:
    """Which events of the job's stream the state includes, kept by the shell and saved with it."""

    applied_seq: int = 0
    """The events-stream sequence of the last event applied of those read in turn (`SWAPPER_IN_TURN`)."""
    stream_id: str = ""
    """Which incarnation of the events stream the sequences count in."""
    reported_seq: int = 0
    """The same for the stores' reports (`SWAPPER_REPORTS`), read in a lane of their own, ahead."""

    def last(self, report: bool) -> int:
        """The sequence of the last event applied in a lane."""
        return self.reported_seq if report else self.applied_seq

    def applied(self, report: bool, seq: int) -> None:
        if report:
            self.reported_seq = max(self.reported_seq, seq)
        else:
            self.applied_seq = max(self.applied_seq, seq)

    def to_record(self, now: float, left_out: Collection[str] = ()) -> dict[str, Any]:
        return {"applied_seq": self.applied_seq, "stream_id": self.stream_id, "reported_seq": self.reported_seq}

    @classmethod
    def from_record(cls, summary: JobSummary, p: Private, now: float) -> Self:
        applied = p.get("applied_seq", 0)
        # A record saved before the lanes: every event was read in turn, up to `applied_seq`.
        return cls(applied_seq=applied, stream_id=p.get("stream_id", ""), reported_seq=p.get("reported_seq", applied))


_registered_at = operator.attrgetter("registered_at")


def member_row(i: MemberInfo, oldest: float) -> list[Any]:
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


def _members(p: Private, now: float) -> dict[str, MemberInfo]:
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


SHARED_WITH_THE_JOB = ("ranks", "placement")
"""A rebuild command's large lists that are most often the job's own: its rank map and placement."""


def command_shares(command: Rebuild, ranks: list[str], placement: list[list[str]]) -> tuple[str, ...]:
    """Which of the command's large lists equal the job's `ranks` and `placement` (the same objects
    most often: compared by identity first)."""
    return tuple(
        name for name, job in zip(SHARED_WITH_THE_JOB, (ranks, placement), strict=True) if getattr(command, name) == job
    )


def command_entries(
    pending: PendingRebuild | None, shares: tuple[str, ...], left_out: Collection[str]
) -> dict[str, Any]:
    """The rebuild in flight's command in the record, less the lists it `shares` with the job (which
    the record holds already): at 16,384 ranks the command packed 937 kB, its ranks and placement
    again, at every save that decided a rebuild. A record's reader takes them from the job's
    (`_pending`). `left_out`: the command is packed already (`SectionMemo`), not built."""
    if pending is None:
        return {"pending_command": None, "pending_command_shares": [], "pending_delta": None}
    command = None if "pending_command" in left_out else to_fields(command_less(pending.command, shares))
    delta = None if "pending_delta" in left_out else _fields_of(pending.delta)
    return {"pending_command": command, "pending_command_shares": list(shares), "pending_delta": delta}


def command_less(command: Rebuild, shares: Collection[str]) -> Rebuild:
    """`command` less the lists it `shares` with the job (empty in their place)."""
    if not shares:
        return command
    return dataclasses.replace(
        command,
        ranks=[] if "ranks" in shares else command.ranks,
        placement=[] if "placement" in shares else command.placement,
    )


def _pending(summary: JobSummary, p: Private, now: float) -> PendingRebuild | None:
    """The rebuild in flight of a record: its command (with the job's ranks and placement where it
    shares them), when it was sent, the acks so far."""
    old_pending = p.get("pending") or {}  # a record written before the command was an entry of its own
    raw_command = p.get("pending_command", old_pending.get("command"))
    if raw_command is None:
        return None
    shares = p.get("pending_command_shares") or []
    if not isinstance(raw_command, dict) or not set(shares) <= set(SHARED_WITH_THE_JOB):
        raise ValueError("the rebuild in flight's command in the record is malformed")
    job_lists = {"ranks": list(summary.ranks), "placement": p.get("placement", [])}
    command = from_fields(Rebuild, raw_command | {name: job_lists[name] for name in shares}, "pending.command")
    command.check()
    sent_age_s = p.get("pending_sent_age_s", old_pending.get("sent_age_s")) or 0.0
    delta = _delta(RebuildDelta, p.get("pending_delta"), summary.job, "pending.delta")
    if delta is not None and delta.generation != command.generation:
        raise ValueError("the rebuild in flight's delta in the record is of another generation")
    pending = PendingRebuild(command, t_sent=now - float(sent_age_s), delta=delta)
    for raw in p.get("pending_acks", old_pending.get("acks", [])):
        ack = from_fields(RebuildAck, raw, "pending.ack")
        pending.acks[ack.member] = ack
    return pending


_Delta = TypeVar("_Delta", RebuildDelta, PlacementDelta)


def _fields_of(delta: RebuildDelta | PlacementDelta | None) -> dict[str, Any] | None:
    return None if delta is None else to_fields(delta)


def _delta(kind: type[_Delta], raw: Any, job: str, what: str) -> _Delta | None:
    """A delta kept in the record (None where there is none), checked as one off the wire is."""
    if raw is None:
        return None
    delta = from_fields(kind, raw, what)
    delta.check()
    if delta.job != job:
        raise ValueError(f"the record's {what} is another job's")
    return delta


def copy_command(command: Rebuild | None) -> Rebuild | None:
    """A rebuild command with lists of its own (the swapper's placement is the command's own list)."""
    if command is None:
        return None
    return dataclasses.replace(
        command, ranks=list(command.ranks), spares=list(command.spares), placement=[list(p) for p in command.placement]
    )
