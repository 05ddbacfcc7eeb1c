"""The typed messages of the control plane (NATS).

Every message is a frozen dataclass with a `KIND` tag. Job-scoped messages carry `job` and the sender's
view of the `generation`; receivers drop ones from an older generation where that matters.
`check()` holds the semantic rules that a type annotation cannot say; the codec calls it on
every decode, so a service never acts on a message that breaks them.

Time stamps (`t_*`) are wall-clock seconds (`time.time()`), so they can be compared across processes;
durations are seconds as floats. Every string, bytes, list and map field has a bound, declared by its
type (`Name`, `Host`, `Text`, `Members`...: see `bounds`), which the codec checks before a message is
built.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, ClassVar

from deadpool_protocol.bounds import (
    BEAT_AGE_MS_MAX,
    BEAT_AGES,
    BEATS,
    HEARTBEATS_PER_BATCH_MAX,
    MEMBERS_PER_JOB_MAX,
    STORES,
    TOKEN_BYTES,
    TRACEPARENT_CHARS_MAX,
    Evidence,
    Host,
    IncidentId,
    IncidentIds,
    Marks,
    Members,
    Name,
    Placements,
    Ranks,
    Sealed,
    Section,
    Tag,
    Text,
    Token,
    Traceparent,
    Where,
)
from deadpool_protocol.errors import DeadPoolError
from deadpool_protocol.names import content_digest, first_invalid_name, is_content_digest, is_valid_name

__all__ = [
    "FIRST_STEP_SECTION",
    "HEARTBEATS_PER_BATCH_MAX",
    "NO_RANK",
    "NO_STEP",
    "SNAPSHOT_EVERY_MAX",
    "TOKEN_BYTES",
    "TRACEPARENT_CHARS_MAX",
    "ChildExit",
    "Commit",
    "Failure",
    "FailureReason",
    "FenceReply",
    "FenceRequest",
    "GenerationVoid",
    "GroupBroken",
    "Heartbeat",
    "HeartbeatBatch",
    "HelloReply",
    "Incident",
    "JobFinished",
    "JobMessage",
    "MemberDone",
    "MemberError",
    "MemberErrorCause",
    "MemberHello",
    "MemberPhase",
    "Message",
    "Placement",
    "PlacementDelta",
    "ProtocolError",
    "Rebuild",
    "RebuildAck",
    "RebuildAckBatch",
    "RebuildMarks",
    "RebuildState",
    "Replicate",
    "Reserve",
    "RestoreSource",
    "RunReply",
    "RunStart",
    "SnapshotComplete",
    "SnapshotInterval",
    "StepResumed",
    "StepResumedBatch",
    "StoreAddress",
    "StoreStatus",
    "Straggler",
    "members_digest",
]

NO_RANK = -1
"""`rank` of a member that holds none (a spare, or a member not yet placed)."""
NO_STEP = -1
"""`step` meaning "no step": nothing committed yet, or a fresh start."""
SNAPSHOT_EVERY_MAX = 64
"""The longest interval between two streamed snapshots a member may ask for (steps): the most a lost
host can cost, when the stores can take no more than that."""
FIRST_STEP_SECTION = "first-step"
"""The section a member names during its first step of a generation (after formation or a rebuild),
which may compile (`torch.compile` recompiles a re-wrapped model) or warm caches: the detector holds
it to the first-step hang threshold, not to the job's recent step times."""


class ProtocolError(DeadPoolError, ValueError):
    """A message that cannot be accepted; the text says why (it goes into the log line)."""


class FailureReason(enum.StrEnum):
    """Why the detector declared a member failed."""

    EXIT = "exit"
    """The launcher saw the process end (crash, signal, or an exit before the job finished)."""
    ERROR = "error"
    """The member reported a fatal error of its own."""
    HEARTBEAT = "heartbeat"
    """No heartbeat for longer than the timeout."""
    HANG = "hang"
    """Heartbeats go on but the member's training thread made no step for longer than the hang
    threshold, while it was not waiting on its peers (see the detector)."""

    @property
    def needs_fence(self) -> bool:
        """After this reason the process may still be alive and must be killed before a swap."""
        return self is not FailureReason.EXIT


class RestoreSource(enum.StrEnum):
    """Where a member's rebuild took its state from (`RebuildAck.restore_source`)."""

    LOCAL = "local"
    """Its own ping-pong buffer."""
    STORE = "store"
    """Fetched from a snapshot store."""
    HOST_COPY = "host_copy"
    """A newcomer: the crash copy the rank's dead holder left on this host (`deadpool.host_copy`)."""
    DURABLE = "durable"
    """Resumed from the durable tier's files."""
    FRESH = "fresh"
    """No restore: a fresh start."""
    UNAVAILABLE = "unavailable"
    """No copy of the restore step to be had: the member waits for the next command (the swapper then
    tries the next link of its fallback chain)."""


def _need(cond: bool, why: str) -> None:
    if not cond:
        raise ProtocolError(why)


def _need_name(value: str, what: str, allow_empty: bool = False) -> None:
    if not is_valid_name(value) and not (allow_empty and value == ""):
        raise ProtocolError(f"{what} {value!r} is not a valid name")


@dataclass(frozen=True, slots=True)
class Message:
    KIND: ClassVar[str] = ""

    def check(self) -> None:
        """Raise ProtocolError if a field holds a value the protocol does not allow."""


@dataclass(frozen=True, slots=True)
class JobMessage(Message):
    job: Name
    generation: int

    def check(self) -> None:
        _need_name(self.job, "job")
        if self.generation < 0:  # each check says why only when it fails: a beat is checked 4 times a second
            raise ProtocolError(f"generation {self.generation} is negative")


def _check_rank(rank: int) -> None:
    if rank < NO_RANK:
        raise ProtocolError(f"rank {rank} is below {NO_RANK}")


def _check_step(step: int) -> None:
    if step < NO_STEP:
        raise ProtocolError(f"step {step} is below {NO_STEP}")


@dataclass(frozen=True, slots=True)
class MemberHello(JobMessage):
    """A member registers with the swapper (request/reply; the reply is `HelloReply`)."""

    KIND: ClassVar[str] = "member_hello"
    member: Name
    host: Host
    pid: int
    launcher: Name
    rank_hint: int
    world_size: int
    rendezvous_host: Host
    rendezvous_port: int
    t: float
    run: Name = ""
    """The run the member was started in (`RunStart`; '' where nothing started one)."""

    def check(self) -> None:
        JobMessage.check(self)
        _need_name(self.member, "member")
        _need_name(self.run, "run", allow_empty=True)
        _need_name(self.launcher, "launcher", allow_empty=True)
        _need(self.pid > 0, f"pid {self.pid} is not positive")
        _check_rank(self.rank_hint)
        _need(self.world_size >= 1, f"world_size {self.world_size} is below 1")
        _need(0 < self.rendezvous_port < 65536, f"rendezvous_port {self.rendezvous_port} out of range")
        _need(self.rendezvous_host != "", "rendezvous_host is empty")


HOLD_WITHOUT_STORES_S_MAX = 24 * 3600.0


@dataclass(frozen=True, slots=True)
class RunStart(JobMessage):
    """A launcher starts a run of the job before its members say hello (request/reply; the reply is
    `RunReply`). A job name holds one run at a time: a run of a name that runs is refused, saying which
    run holds it; a finished run's record is archived and the name starts afresh (its generations go
    on from the last run's, so every wait and fence of the old run stays superseded). Only launchers may
    start runs, so a name cannot be squatted by a member's key."""

    KIND: ClassVar[str] = "run_start"
    run: Name
    world_size: int
    """Ranks in the whole job; 0 joins the run another launcher started, whatever its world size (a
    host of spares only). The reply says the world size."""
    launcher: Name
    t: float
    hold_without_stores_s: float = 0.0
    """When every snapshot store is lost: 0 goes on training unprotected (a lost rank restores from the
    durable tier, if any); above 0 holds training until a store returns, for at most this long, then
    ends the job saying why."""

    def check(self) -> None:
        JobMessage.check(self)
        _need_name(self.run, "run")
        _need_name(self.launcher, "launcher")
        _need(0 <= self.world_size <= MEMBERS_PER_JOB_MAX, f"world_size {self.world_size} out of range")
        _need(0.0 <= self.hold_without_stores_s <= HOLD_WITHOUT_STORES_S_MAX, "hold_without_stores_s out of range")


@dataclass(frozen=True, slots=True)
class RunReply(JobMessage):
    KIND: ClassVar[str] = "run_reply"
    run: Name
    accepted: bool
    reason: Text
    world_size: int = 0
    """The run's world size (when accepted)."""
    not_yet: bool = False
    """Refused only for now: a launcher of spares only asked to join a run no launcher has started yet.
    It asks again."""

    def check(self) -> None:
        JobMessage.check(self)
        _need_name(self.run, "run")
        _need(0 <= self.world_size <= MEMBERS_PER_JOB_MAX, f"world_size {self.world_size} out of range")


@dataclass(frozen=True, slots=True)
class HelloReply(JobMessage):
    KIND: ClassVar[str] = "hello_reply"
    member: Name
    accepted: bool
    reason: Text
    finished: bool = False
    """The job has already ended: a member that arrives late (a respawned spare) simply stops."""
    failed_reason: Text = ""
    """Why the swapper ended the job, if it did."""
    store_token: Token = b""
    """The job's data-plane token (`dataplane.job_token`), for an accepted member of a job whose stores
    check tokens; empty where they do not."""
    seal_key: Token = b""
    """The job's seal key (`dataplane.seal_key`), which its members sign and check their snapshots'
    seals with; empty where the swapper has no signing key. It comes only to the job's own inbox."""
    snapshot_bytes: int = 0
    """The largest snapshot a rank of the job has streamed so far (0: none yet), which a warm spare
    faults in a landing buffer of (`deadpool.spare_landing`); later ones come with each `Commit`."""

    def check(self) -> None:
        JobMessage.check(self)
        _need(len(self.store_token) in (0, TOKEN_BYTES), f"a store token of {len(self.store_token)} bytes")
        _need(len(self.seal_key) in (0, TOKEN_BYTES), f"a seal key of {len(self.seal_key)} bytes")
        _need(self.snapshot_bytes >= 0, "a snapshot size is not negative")


class MemberPhase(enum.StrEnum):
    """Where a member is in its life (the member's state machine: `deadpool.member_lifecycle`)."""

    SPARE = "spare"
    """Holds no rank: a warm spare, or a member before the job's first formation."""
    WARMING = "warming"
    """A spare building its wrapper and optimizer once, so that taking a rank costs no imports."""
    REBUILDING = "rebuilding"
    """Carrying out a rebuild (`rebuild_state` says which state of it)."""
    TRAINING = "training"
    """Holds a rank and runs steps."""
    RECOVERING = "recovering"
    """Left a broken process group (or a rebuild that could not complete); awaits the next command."""
    LEFT_EARLY = "left_early"
    """The training loop ended before its last step; the rank is done when the script ends."""
    FINISHING = "finishing"
    """After the last step: reports done until the job finishes."""
    DONE = "done"
    """The job finished, or this member left it."""
    CLOSED = "closed"


class RebuildState(enum.StrEnum):
    """The states of a member's rebuild, in order (`deadpool.member_rebuild`)."""

    LEAVE = "leave"
    RESTORE = "restore"
    CONNECT = "connect"
    FORM = "form"
    EXCHANGE = "exchange"
    APPLY = "apply"
    SEAL = "seal"
    ACK = "ack"


@dataclass(frozen=True, slots=True)
class Heartbeat(JobMessage):
    """Sent by every member from its own thread, every heartbeat period."""

    KIND: ClassVar[str] = "heartbeat"
    member: Name
    rank: int
    pid: int
    step: int
    """Optimizer steps completed in this process's timeline."""
    in_step: bool
    step_started_t: float
    t: float
    snapshots_skipped: int = 0
    waiting: bool = False
    """The training thread is inside torch's distributed or autograd code (waiting on peers, probably)."""
    where: Where = ""
    """The training thread's innermost frame in user code ('file:line function'), for evidence."""
    section: Section = ""
    """A named stretch of work between steps (`job.section("evaluation")`): no step progress expected.
    `FIRST_STEP_SECTION`: the member's first step of its generation (see there)."""
    host: Host = ""
    """The member's host, so that the detector can tell a lost host from a lost process."""
    awaiting_rebuild: bool = False
    """The member left a broken process group (or gave up on forming `generation`'s) and waits for the
    swapper's next command. Waiting on the control plane, not hung; when every rank of a generation
    does it and nobody failed, the group broke by itself (see `GroupBroken`)."""
    rebuilding: bool = False
    """The member is carrying out the rebuild of `generation` (restore, rendezvous, re-wrap): waiting
    on the control plane and its peers, never a hang culprit, and not yet "awaiting"."""
    step_completed_t: float = 0.0
    """When `step` was completed (wall clock), so recovery can be timed to the step, not the beat."""
    phase: MemberPhase = MemberPhase.SPARE
    rebuild_state: RebuildState | None = None
    """The state of the rebuild under way (`phase` REBUILDING), else None."""
    local_step: int = NO_STEP
    """The newest step the member's own snapshot buffers hold whole: on its host's shared memory, the
    crash copy a newcomer there restores from if this member dies (`deadpool.host_copy`)."""
    snapshot_every: int = 1
    """The job's snapshot interval as the member knows it: it streams every `snapshot_every`-th step,
    so a lost host loses at most that many steps (`SnapshotInterval`)."""

    def check(self) -> None:
        JobMessage.check(self)
        _need_name(self.member, "member")
        # Not bounded by SNAPSHOT_EVERY_MAX: a forced interval (`--snapshot-every N`) may be any N.
        if self.snapshot_every < 1:
            raise ProtocolError(f"snapshot interval {self.snapshot_every} is not a number of steps")
        _check_rank(self.rank)
        _check_step(self.step)
        _check_step(self.local_step)
        _need(self.snapshots_skipped >= 0, "snapshots_skipped is negative")


class MemberErrorCause(enum.StrEnum):
    """Why a member cannot go on. An exception inside a step (`STEP`) is that member's fault: it is
    swapped for a spare. The others are faults that a spare would meet as well, so the swapper ends
    the job with the member's reason instead of burning every spare on it."""

    STEP = ""
    """An exception inside a training step (a bug in the step, a CUDA error): swap the member."""
    USER_CODE = "user_code"
    """The optimizer factory or the wrapper raised during a rebuild: the same code runs on every member."""
    SNAPSHOT_UNAVAILABLE = "snapshot_unavailable"
    """No store could provide the snapshot the rebuild named."""
    REPLICAS_DISAGREE = "replicas_disagree"
    """The ranks' snapshots of the restore step do not fit together (steps, layouts or partitions differ)."""
    STUCK_COLLECTIVE = "stuck_collective"
    """The training thread is caught in a collective its broken group could not release (gloo's send
    waiting for a peer that left, `stuck_watch.py`): that member's lot, not the job's: swap it."""

    @property
    def ends_job(self) -> bool:
        """A spare would meet this cause as well: the job ends with the member's reason."""
        return self not in (MemberErrorCause.STEP, MemberErrorCause.STUCK_COLLECTIVE)


@dataclass(frozen=True, slots=True)
class MemberError(JobMessage):
    """A member reports that it cannot go on, with the reason, before it dies."""

    KIND: ClassVar[str] = "member_error"
    member: Name
    rank: int
    error: Text
    """What went wrong (the sender clips it: `bounds.clip_text`)."""
    t: float
    cause: MemberErrorCause = MemberErrorCause.STEP

    def check(self) -> None:
        JobMessage.check(self)
        _need_name(self.member, "member")
        _check_rank(self.rank)


@dataclass(frozen=True, slots=True)
class HeartbeatBatch(JobMessage):
    """The heartbeats a launcher received from its members during one period, sent as one message.

    At a thousand members the detector's cost is per NATS message, not per heartbeat: batching by
    host divides it by the members per host. Only beats received in the period are included, so a
    frozen member goes silent in the batches too. A launcher sends one every period, empty when none
    of its members beat: its own silence says its host is gone (a fence sent there reaches nobody).
    """

    KIND: ClassVar[str] = "heartbeat_batch"
    launcher: Name
    beats: Annotated[list[Heartbeat], BEATS]
    alive: Annotated[list[Name], BEATS] = field(default_factory=list)
    """Members whose beat of this period said what their last one in `beats` said (its send time, its
    `where` and its `waiting` aside): named, not repeated. A launcher repeats a member's whole beat when
    anything else in it changes and at least every 2 s (`deadpool.beat_compaction`), so the detector
    decodes about one beat in twenty at a step every 2 s."""
    ages_ms: Annotated[list[int], BEAT_AGES] = field(default_factory=list)
    """How long before the batch was sent the launcher received each member's beat, in `beats` then
    `alive` order, on the launcher's own clock (empty: all just now). The detector dates a beat by
    its arrival less its age, so a verdict comes a timeout after a member's last beat however long
    the launcher gathers beats (`deadpool.launcher.HEARTBEAT_BATCH_PERIOD_S`); no two hosts' clocks
    are compared."""
    alive_waiting: Annotated[list[bool], BEATS] = field(default_factory=list)
    """Each named member's `waiting` now, in `alive` order (empty: as its last whole beat said). It
    changes within a step, many times a second; the straggler rule samples it every period."""

    def check(self) -> None:
        JobMessage.check(self)
        _need_name(self.launcher, "launcher")
        for beat in self.beats:
            if beat.job != self.job:
                raise ProtocolError(f"a beat of job {beat.job!r} in a batch of job {self.job!r}")
            beat.check()
        if (bad := first_invalid_name(self.alive)) is not None:
            raise ProtocolError(f"member {bad!r} is not a valid name")
        _need(len(self.alive_waiting) in (0, len(self.alive)), "alive_waiting does not match the names")
        _need(len(self.ages_ms) in (0, len(self.beats) + len(self.alive)), "ages_ms does not match the beats and names")
        ages = self.ages_ms
        _need(not ages or (min(ages) >= 0 and max(ages) <= BEAT_AGE_MS_MAX), f"a beat's age past {BEAT_AGE_MS_MAX} ms")

    def age_s(self, i: int) -> float:
        """The age of the i-th beat (`beats`, then `alive`), in seconds."""
        return self.ages_ms[i] / 1000 if self.ages_ms else 0.0


@dataclass(frozen=True, slots=True)
class Straggler(JobMessage):
    """The detector's report of a rank that holds the others back (an event, not a failure)."""

    KIND: ClassVar[str] = "straggler"
    member: Name
    rank: int
    evidence: Evidence
    t: float

    def check(self) -> None:
        JobMessage.check(self)
        _need_name(self.member, "member")
        _check_rank(self.rank)


@dataclass(frozen=True, slots=True)
class MemberDone(JobMessage):
    """A rank finished the last step of the job."""

    KIND: ClassVar[str] = "member_done"
    member: Name
    rank: int
    step: int

    def check(self) -> None:
        JobMessage.check(self)
        _need_name(self.member, "member")
        _check_rank(self.rank)
        _check_step(self.step)


@dataclass(frozen=True, slots=True)
class StepResumed(JobMessage):
    """A rank completed its first step of `generation`: training goes on. The recovery a user feels
    ends when every rank of the new generation has sent this (its incident's `t_first_step`)."""

    KIND: ClassVar[str] = "step_resumed"
    member: Name
    rank: int
    step: int
    t_completed: float

    def check(self) -> None:
        JobMessage.check(self)
        _need_name(self.member, "member")
        _need(self.rank >= 0, "a resumed step belongs to a rank")
        _need(self.step >= 0, "a resumed step has a step")


@dataclass(frozen=True, slots=True)
class SnapshotInterval(JobMessage):
    """The interval (`every`) at which a rank's snapshot stream keeps up, sent by the rank to its peers
    when it changes and every few seconds (delivery at least once; the newest from each rank counts).
    A job streams at the longest interval its ranks ask for, a power of two, so that every rank
    streams the same steps (`step % every == 0`) even while they disagree (`deadpool.snapshot_cadence`)."""

    KIND: ClassVar[str] = "snapshot_interval"
    member: Name
    rank: int
    every: int
    t: float

    def check(self) -> None:
        JobMessage.check(self)
        _need_name(self.member, "member")
        _need(self.rank >= 0, "an interval belongs to a rank")
        _need(
            1 <= self.every <= SNAPSHOT_EVERY_MAX and self.every & (self.every - 1) == 0,
            f"interval {self.every} is not a power of two from 1 to {SNAPSHOT_EVERY_MAX}",
        )


@dataclass(frozen=True, slots=True)
class ChildExit(JobMessage):
    """A launcher saw one of its processes end. `returncode` < 0 is the signal number, negated."""

    KIND: ClassVar[str] = "child_exit"
    launcher: Name
    member: Name
    pid: int
    returncode: int
    t_exit: float

    def check(self) -> None:
        JobMessage.check(self)
        _need_name(self.launcher, "launcher")
        _need_name(self.member, "member")


@dataclass(frozen=True, slots=True)
class Failure(JobMessage):
    """The detector's verdict: this member is dead (exactly one per member)."""

    KIND: ClassVar[str] = "failure"
    member: Name
    rank: int
    reason: FailureReason
    evidence: Evidence
    """What the detector saw, for people (logs, incidents, status); no decision reads it."""
    t_fault: float
    """Best estimate of when the fault happened (exit time, last heartbeat, error time)."""
    t_detected: float
    traceparent: Traceparent = ""
    """The W3C trace context of the detector's `detect` span: the incident's trace starts there."""
    cause: MemberErrorCause = MemberErrorCause.STEP
    """For `ERROR`: the cause the member reported (`MemberError.cause`); the swapper ends the job on
    one a spare would meet as well."""
    lost_host: Host = ""
    """The host whose members all went silent together ("" when one process was lost)."""
    lost_host_members: int = 0
    """How many members of `lost_host` the detector saw go silent: the swapper waits for the verdicts
    of all of them before it rebuilds."""

    def check(self) -> None:
        JobMessage.check(self)
        _need_name(self.member, "member")
        _check_rank(self.rank)
        _need(
            0 <= self.lost_host_members <= MEMBERS_PER_JOB_MAX,
            f"lost_host_members {self.lost_host_members} is out of range",
        )
        _need((self.lost_host == "") == (self.lost_host_members == 0), "a lost host comes with its members lost")

    def described(self) -> dict[str, str]:
        """The typed facts as text, then the evidence: what people read (logs, incidents)."""
        facts: dict[str, str] = {}
        if self.cause:
            facts["cause"] = self.cause
        if self.lost_host:
            facts |= {"host": self.lost_host, "host_members_silent": str(self.lost_host_members)}
        return facts | {k: v for k, v in self.evidence.items() if k not in facts}


@dataclass(frozen=True, slots=True)
class GroupBroken(JobMessage):
    """The detector's verdict: every rank of `generation` left its process group and waits for a
    rebuild, and nobody failed (a connection reset by the network, a collective that timed out on
    every rank). The swapper answers with a new generation of the same members (a regroup)."""

    KIND: ClassVar[str] = "group_broken"
    INCIDENT_REASON: ClassVar[str] = "group"
    """The reason of the incident a regroup closes."""
    members: int
    """How many ranks awaited the rebuild."""
    members_digest: Name
    """Which ones (`members_digest`): the swapper regroups only when they are its ranks. Named by a
    digest, not listed: the list was 700 kB at 16,384 ranks with 40-character names, past the events
    stream's message bound at 24,000, where the verdict could not be sent and the job wedged."""
    evidence: Evidence
    t_broken: float
    """When the first rank left the group (its first heartbeat awaiting a rebuild)."""
    t_detected: float

    def check(self) -> None:
        JobMessage.check(self)
        _need(1 <= self.members <= MEMBERS_PER_JOB_MAX, f"a broken group of {self.members} members")
        _need(is_content_digest(self.members_digest), "members_digest is not a digest")


def members_digest(members: Iterable[str]) -> str:
    """A set of members named in 32 characters at any size: the `content_digest` of their names, sorted,
    one per line."""
    return content_digest("".join(f"{m}\n" for m in sorted(members)).encode())


@dataclass(frozen=True, slots=True)
class StoreAddress:
    """Where a snapshot store listens for the data plane."""

    store: Name
    host: Host
    port: int


@dataclass(frozen=True, slots=True)
class Rebuild(JobMessage):
    """The swapper's command: form generation `generation` with this rank map.

    Formation and recovery are the same command. `ranks[r]` is the member holding rank r,
    `placement[r]` the stores rank r streams its snapshots to, `restore_step` the step every rank
    must load before training resumes (`NO_STEP` for a fresh start).
    """

    KIND: ClassVar[str] = "rebuild"
    world_size: int
    ranks: Members
    spares: Members
    rendezvous_member: Name
    rendezvous_host: Host
    rendezvous_port: int
    restore_step: int
    stores: Annotated[list[StoreAddress], STORES]
    placement: Placements
    incident: IncidentIds
    """The ids of the incidents this rebuild answers, comma-separated ('' for a formation)."""
    t_decided: float
    restore_generation: int = 0
    """The generation that produced the committed `restore_step` (0: unknown, any is accepted). A
    store's copy from another generation belongs to an abandoned timeline and is not restored."""
    durable: bool = False
    """No RAM copy is left: restore from the durable tier, the newest step every rank has intact
    (the ranks agree on it; `restore_step` is NO_STEP)."""
    traceparent: Traceparent = ""
    """The trace context of the swapper's `recovery` span of the (first) incident this rebuild answers:
    members and stores put their spans under it."""
    local: bool = False
    """Every rank survived and no store holds their state (training was held while every store was
    lost): restore the newest step every rank holds in its own buffers (the ranks agree on it;
    `restore_step` is NO_STEP)."""

    def check(self) -> None:
        JobMessage.check(self)
        _need(len(self.ranks) == self.world_size, "ranks does not hold world_size members")
        _need(len(self.ranks) + len(self.spares) <= MEMBERS_PER_JOB_MAX, "more members than MEMBERS_PER_JOB_MAX")
        _check_command(self, self.ranks)
        _need(self.rendezvous_member in self.ranks, "the rendezvous host holds no rank")
        _check_placement(self.stores, self.placement, self.world_size)

    def rank_of(self, member: str) -> int:
        """The rank `member` holds in this generation, or NO_RANK."""
        try:
            return self.ranks.index(member)
        except ValueError:
            return NO_RANK


@dataclass(frozen=True, slots=True)
class RebuildDelta(JobMessage):
    """A rebuild command as its changes from the generation before: what a member that holds that
    generation's command needs, in a few hundred bytes where the whole command is about 57 bytes a
    rank (937 kB at 16,384 ranks, sent to every member: 15 GB out of the server per rebuild).

    `moved[i]` is the rank `movers[i]` holds now, `replaced[i]` the rank whose snapshots go to
    `replacements[i]`; every other rank keeps its member and stores of `base_generation` (its stores as
    placement `base_version` of it said: 0, its rebuild's own). `digest` is `rebuild_delta.maps_digest`
    of the whole command's ranks and placement, so a member whose base differs (it missed a placement,
    or a generation) finds out and takes the whole command instead. With `base_generation` 0 the
    command has no base to go by (a formation, a changed world size, a leader that took over mid-rebuild):
    it says only that generation `generation` is out, whole, on the rebuild subject. The other fields
    are the command's own (`Rebuild`).
    """

    KIND: ClassVar[str] = "rebuild_delta"
    base_generation: int
    base_version: int
    digest: Tag
    world_size: int
    moved: Ranks
    movers: Members
    replaced: Ranks
    replacements: Placements
    spares: Members
    rendezvous_member: Name
    rendezvous_host: Host
    rendezvous_port: int
    restore_step: int
    stores: Annotated[list[StoreAddress], STORES]
    incident: IncidentIds
    t_decided: float
    restore_generation: int = 0
    durable: bool = False
    traceparent: Traceparent = ""
    local: bool = False

    def check(self) -> None:
        JobMessage.check(self)
        _need(0 <= self.base_generation < self.generation, "a delta's base is an earlier generation")
        _need(self.base_version >= 0, "a placement version is 0 or more")
        _need(0 < self.world_size <= MEMBERS_PER_JOB_MAX, "world_size out of range")
        _need(len(self.moved) == len(self.movers), "a delta names one member per moved rank")
        _need(len(self.replaced) == len(self.replacements), "a delta names one placement per replaced rank")
        if self.base_generation == 0:
            _need(not self.moved and not self.replaced and not self.digest, "a notice without a base changes nothing")
        else:
            _need(is_content_digest(self.digest), "a delta's digest is not a content digest")
        for ranks in (self.moved, self.replaced):
            _check_ranks(ranks, self.world_size)
        _need(len(self.spares) <= MEMBERS_PER_JOB_MAX, "more spares than MEMBERS_PER_JOB_MAX")
        _check_command(self, self.movers)
        _check_placement(self.stores, self.replacements, len(self.replaced))


def _check_command(command: Rebuild | RebuildDelta, members: list[str]) -> None:
    """What a rebuild and its delta check alike, `members` the ranks' members either names."""
    _need(command.generation >= 1, "a rebuild names generation 1 or later")
    _need(not (command.local and command.durable), "a rebuild restores from the durable tier or from buffers, not both")
    _need(0 <= command.restore_generation <= command.generation, "restore_generation out of range")
    _need(len(set(members)) == len(members), "a member holds more than one rank")
    _need(not set(members) & set(command.spares), "a member is both rank and spare")
    if (bad := first_invalid_name([*members, *command.spares, command.rendezvous_member])) is not None:
        _need_name(bad, "member")
    _need(0 < command.rendezvous_port < 65536, "rendezvous_port out of range")
    _check_step(command.restore_step)


def _check_placement(stores: list[StoreAddress], placement: list[list[str]], world_size: int) -> None:
    _need(len(placement) == world_size, "placement does not cover every rank")
    known = {s.store for s in stores}
    for address in stores:
        _need_name(address.store, "store")
        _need(0 < address.port < 65536, "a store's port is out of range")
    # One pass each in C over every rank's stores (16,384 ranks at scale), not a Python loop per rank.
    _need(known.issuperset(itertools.chain.from_iterable(placement)), "placement names an unknown store")
    _need(sum(map(len, map(set, placement))) == sum(map(len, placement)), "placement names a store twice for one rank")


@dataclass(frozen=True, slots=True)
class Placement(JobMessage):
    """The swapper's new placement of the ranks' snapshots within `generation`, without a rebuild: a
    store was lost (or one came back to an under-replicated job). Members stream their next snapshots
    to `placement[rank]`; `version` counts placements within the generation (the rebuild's is 0)."""

    KIND: ClassVar[str] = "placement"
    version: int
    stores: Annotated[list[StoreAddress], STORES]
    placement: Placements
    reason: Text

    def check(self) -> None:
        JobMessage.check(self)
        _need(self.generation >= 1, "a placement belongs to a generation that was announced")
        _need(self.version >= 1, "a placement after the rebuild's has version 1 or later")
        _check_placement(self.stores, self.placement, len(self.placement))


@dataclass(frozen=True, slots=True)
class PlacementDelta(JobMessage):
    """A placement as its changes from placement `base_version` of the same generation (0: the
    rebuild's own): what a member that holds that one needs. A store lost at 16,384 ranks on 32 stores
    moves 1,024 ranks' copies: a delta of 24 kB, where the whole placement (313 kB) went to every
    member, 5 GB out of the server per placement and per retransmission.

    `replaced[i]` is the rank whose snapshots go to `replacements[i]` now; every other rank keeps its
    stores. `digest` is `placement_delta.placement_digest` of the whole placement, so a member whose
    base differs finds out and takes the whole placement instead. With an empty digest the delta is a
    notice: placement `version` is out, whole, on the placement subject (no base to go by: a leader
    that took over). `stores` and `reason` are the placement's own (`Placement`)."""

    KIND: ClassVar[str] = "placement_delta"
    version: int
    base_version: int
    world_size: int
    digest: Tag
    replaced: Ranks
    replacements: Placements
    stores: Annotated[list[StoreAddress], STORES]
    reason: Text

    def check(self) -> None:
        JobMessage.check(self)
        _need(self.generation >= 1, "a placement belongs to a generation that was announced")
        _need(0 <= self.base_version < self.version, "a delta's base is an earlier placement")
        _need(0 < self.world_size <= MEMBERS_PER_JOB_MAX, "world_size out of range")
        _need(len(self.replaced) == len(self.replacements), "a delta names one placement per replaced rank")
        if not self.digest:
            _need(not self.replaced, "a notice without a base changes nothing")
        else:
            _need(is_content_digest(self.digest), "a delta's digest is not a content digest")
        _check_ranks(self.replaced, self.world_size)
        _check_placement(self.stores, self.replacements, len(self.replaced))


def _check_ranks(ranks: list[int], world_size: int) -> None:
    """A delta's changed ranks: each once, in order, within the world."""
    _need(all(map(int.__lt__, ranks, ranks[1:])), "a delta's ranks are named once each, in order")
    _need(not ranks or (ranks[0] >= 0 and ranks[-1] < world_size), "a delta's rank is out of range")


def _check_rank_sizes(ranks: list[int], nbytes: list[int], what: str, least_bytes: int) -> None:
    """Ranks each named once, with a snapshot size each (a store's report, a reservation)."""
    _need(len(ranks) > 0, f"a {what} names a rank")
    _need(len(ranks) == len(nbytes), f"a {what} gives one size per rank")
    _need(min(ranks) >= 0, "a snapshot belongs to a rank")
    _need(min(nbytes) >= least_bytes, f"a snapshot size below {least_bytes} bytes")
    _need(len(set(ranks)) == len(ranks), f"a {what} names a rank once")


@dataclass(frozen=True, slots=True)
class Reserve(JobMessage):
    """The swapper placed these ranks' snapshots on `store`, each `nbytes[i]` long: the store faults in
    the buffers their uploads will take now, not at their first upload (a GB of memory the host never
    touched costs seconds to fault in). Sent when a placement moves ranks of known size to a store
    (after a store is lost or returns, in a rebuild), and again with each retransmission of that
    placement until a step commits under it; the first placement knows no sizes. A store takes a
    rank's reservation once (at its size): a message sent again changes nothing."""

    KIND: ClassVar[str] = "reserve"
    store: Name
    ranks: Sealed
    nbytes: Sealed

    def check(self) -> None:
        JobMessage.check(self)
        _need_name(self.store, "store")
        _check_rank_sizes(self.ranks, self.nbytes, "reservation", least_bytes=1)


@dataclass(frozen=True, slots=True)
class Replicate(JobMessage):
    """The swapper asks store `source` to copy its sealed snapshot (rank, step) to `target` over the
    data plane, so a committed step has its replicas again after a store was lost."""

    KIND: ClassVar[str] = "replicate"
    rank: int
    step: int
    source: Name
    target: StoreAddress

    def check(self) -> None:
        JobMessage.check(self)
        _check_rank(self.rank)
        _need(self.rank >= 0 and self.step >= 0, "a replica has a rank and a step")
        _need_name(self.source, "store")
        _need_name(self.target.store, "store")
        _need(self.source != self.target.store, "a store does not replicate to itself")
        _need(0 < self.target.port < 65536, "the target's port is out of range")


@dataclass(frozen=True, slots=True)
class RebuildMarks:
    """When a member passed each point of its rebuild (wall clock; None: it did not pass it). The
    swapper times an incident's phases from them (`incident_phases`)."""

    received: float | None = None
    """The command arrived."""
    out: float | None = None
    """The member's broken process group was dropped (survivors only)."""
    begin: float | None = None
    """The training thread started the rebuild."""
    restored: float | None = None
    """The state was loaded."""
    rendezvous: float | None = None
    """The new process group was ready."""
    ready: float | None = None
    """Re-wrapped, about to train."""

    def check(self) -> None:
        times = (self.received, self.out, self.begin, self.restored, self.rendezvous, self.ready)
        _need(all(t is None or t >= 0.0 for t in times), "a time mark is negative")


@dataclass(frozen=True, slots=True)
class RebuildAck(JobMessage):
    """A member finished its part of a rebuild and is about to train (or wait, as a spare)."""

    KIND: ClassVar[str] = "rebuild_ack"
    member: Name
    rank: int
    restore_step: int
    last_completed_step: int
    """The step this member had completed before it rolled back (NO_STEP for a spare)."""
    restore_source: RestoreSource
    marks: RebuildMarks
    t_ready: float

    def check(self) -> None:
        JobMessage.check(self)
        _need_name(self.member, "member")
        _check_rank(self.rank)
        _check_step(self.restore_step)
        _check_step(self.last_completed_step)
        self.marks.check()


@dataclass(frozen=True, slots=True)
class RebuildAckBatch(JobMessage):
    """The rebuild acks a launcher's members sent it in one short period, stored as one event. Every rank
    acks every rebuild: 16,384 events per rebuild at 16,384 ranks, which the swapper reads in the
    stream's order, so a failure right after a rebuild waited behind them. A host's launcher sends one
    event for its members (`generation`: the newest of theirs)."""

    KIND: ClassVar[str] = "rebuild_ack_batch"
    launcher: Name
    acks: Annotated[list[RebuildAck], BEATS]

    def check(self) -> None:
        _check_launchers_batch(self, self.launcher, self.acks, "an ack", "acks")


@dataclass(frozen=True, slots=True)
class StepResumedBatch(JobMessage):
    """The first steps a launcher's members completed in one short period, stored as one event: every
    rank of a generation sends one (16,384 events a rebuild at 16,384 ranks, and a failure right after
    a rebuild waited 4 s behind them in the swapper's inbox). `generation`: the newest of theirs."""

    KIND: ClassVar[str] = "step_resumed_batch"
    launcher: Name
    resumed: Annotated[list[StepResumed], BEATS]

    def check(self) -> None:
        _check_launchers_batch(self, self.launcher, self.resumed, "a first step", "first steps")


def _check_launchers_batch(
    batch: JobMessage, launcher: str, items: Sequence[RebuildAck] | Sequence[StepResumed], one: str, many: str
) -> None:
    """A launcher's batch of its members' messages: named, not empty, each item of the batch's job, of
    no newer generation than the batch's, and valid itself."""
    JobMessage.check(batch)
    _need_name(launcher, "launcher")
    _need(len(items) >= 1, f"a batch of no {many}")
    for item in items:
        _need(item.job == batch.job, f"{one} of job {item.job!r} in a batch of job {batch.job!r}")
        _need(item.generation <= batch.generation, f"{one} of a generation newer than its batch's")
        item.check()


@dataclass(frozen=True, slots=True)
class FenceRequest(JobMessage):
    KIND: ClassVar[str] = "fence_request"
    member: Name
    reason: Text

    def check(self) -> None:
        JobMessage.check(self)
        _need_name(self.member, "member")


@dataclass(frozen=True, slots=True)
class FenceReply(JobMessage):
    KIND: ClassVar[str] = "fence_reply"
    member: Name
    killed: bool
    detail: Text
    t: float


@dataclass(frozen=True, slots=True)
class SnapshotComplete(JobMessage):
    """A store holds every chunk and the manifest of these ranks' snapshots of `step`, checksums
    verified. A store reports what it sealed of a step in one message per batch (`SEALED_REPORT_S`),
    not one per rank, so the commits of a job cost O(stores) messages per step: 32,768 per step for
    16,384 ranks at R = 2 before, a few per store now. `nbytes[i]` is the size of `ranks[i]`'s."""

    KIND: ClassVar[str] = "snapshot_complete"
    store: Name
    step: int
    ranks: Sealed
    nbytes: Sealed

    def check(self) -> None:
        JobMessage.check(self)
        _need_name(self.store, "store")
        _need(self.step >= 0, "a snapshot has a step")
        _check_rank_sizes(self.ranks, self.nbytes, "report", least_bytes=0)


@dataclass(frozen=True, slots=True)
class Commit(JobMessage):
    """Every rank's snapshot of `step` is complete on its stores."""

    KIND: ClassVar[str] = "commit"
    step: int
    snapshot_bytes: int = 0
    """The largest snapshot a rank of the job has streamed: a warm spare's landing size (`HelloReply`)."""
    t_decided: float = 0.0
    """The swapper's wall clock when it decided the commit (0: not said), as `Rebuild.t_decided`: a
    reader on a synced clock splits a commit's time into the wait for the decision and the way out
    (the record's save, the publication, the transit)."""

    def check(self) -> None:
        JobMessage.check(self)
        _need(self.step >= 0, "a committed step is not negative")
        _need(self.snapshot_bytes >= 0, "a snapshot size is not negative")


@dataclass(frozen=True, slots=True)
class JobFinished(JobMessage):
    """The job ended: every rank finished its last step, or (`failed`) the swapper ended it, saying why."""

    KIND: ClassVar[str] = "job_finished"
    step: int
    failed: bool = False
    reason: Text = ""


@dataclass(frozen=True, slots=True)
class GenerationVoid(JobMessage):
    """The swapper's notice that `generation` will not train again: a rank of it failed, or it could not
    form. Every member stops waiting for it at once (rendezvous, process-group creation, collectives,
    fetches) and waits for the next rebuild, which has a higher generation. Sent before the swapper
    decides what comes next (last call, fences, a spare that has yet to register), so nobody is held by
    a generation that can no longer form while that happens."""

    KIND: ClassVar[str] = "generation_void"
    reason: Text
    t: float

    def check(self) -> None:
        JobMessage.check(self)
        _need(self.generation >= 1, "only a generation that was announced can be void")


@dataclass(frozen=True, slots=True)
class Incident(JobMessage):
    """One closed recovery, with its phases. `generation` is the one training resumed in."""

    KIND: ClassVar[str] = "incident"
    incident_id: IncidentId
    rank: int
    member: Name
    replacement: Name
    reason: Text
    t_fault: float
    t_detected: float
    t_decided: float
    t_resumed: float
    """Every rank acked the rebuild: ready to train."""
    restore_step: int
    lost_steps: int
    phases: Marks
    evidence: Evidence = field(default_factory=dict)
    t_first_step: float = 0.0
    """Every rank completed its first step after the fault (0: not known, see `downtime_s`)."""
    traceparent: Traceparent = ""
    """The trace context of the failure that opened the incident (the detector's `detect` span)."""

    @property
    def detect_s(self) -> float:
        return self.t_detected - self.t_fault

    @property
    def downtime_s(self) -> float:
        """The recovery as a user feels it: from the fault to the first step completed by every rank
        after it (to every rank's ack where that step was not heard of in time)."""
        return (self.t_first_step or self.t_resumed) - self.t_fault


@dataclass(frozen=True, slots=True)
class StoreStatus(Message):
    """A snapshot store announces itself and its memory use (not job-scoped: stores serve every job)."""

    KIND: ClassVar[str] = "store_status"
    store: Name
    host: Host
    port: int
    used_bytes: int
    capacity_bytes: int
    snapshots: int
    t: float
    node: Host = ""
    """The host the store runs on, by the same name members give theirs (`DEADPOOL_HOST`), so a
    rank's snapshots are kept off its own host; '' means the address `host` stands for it."""
    unsealed: int = 0
    """Uploads in progress (or abandoned, until `unsealed_max_s` frees them)."""
    incarnation: Tag = ""
    """Changes each time the store process starts: a store restarted (empty) under the same name is
    known as such even if it came back before anyone missed it."""

    def check(self) -> None:
        _need_name(self.store, "store")
        _need(self.capacity_bytes >= 0 and self.snapshots >= 0 and self.unsealed >= 0, "a negative count")
        _need(0 < self.port < 65536, "port out of range")
        _need(self.used_bytes >= 0, "used_bytes is negative")
