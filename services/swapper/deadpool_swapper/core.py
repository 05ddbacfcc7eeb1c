"""The swapper's decision core: events in, actions out, each decision with a reason. No I/O.

It owns, per job: membership (ranks and spares), the generation, the committed step, the rebuild in
flight and the open incidents. The asyncio shell (`service.py`) feeds it events and carries out the
actions it returns, in order. Formation and recovery take the same path (`_start_rebuild`), as in
DESIGN §5. Invariants asserted here: generations only grow, the committed step never goes back, a
member holds at most one rank.

Never wedge. A rank failure first makes its generation *void* (`GenerationVoid`, at once): every
member stops waiting for that generation, whatever comes next. The new generation is then published
after a short **last call** (`last_call_s`), so failures close together (two ranks killed at once, a
lost host) are swapped in one rebuild; a failure that arrives while a rebuild is under way supersedes
it at once. Vacant ranks are filled the moment a spare registers. A member that cannot go on for a
reason a spare would meet too (the user's optimizer factory raised, no snapshot can be fetched)
ends the job with that reason, and so do `rebuild_attempts_max` generations in a row that never
formed: the job stops, saying why, instead of waiting for ever.

Clocks. Every `now` is this process's monotonic clock: timers (the last call, retransmissions, the
store timeout, pruning) never move when a wall clock steps, and the job record carries them as ages,
never as instants another host would read with its own clock (`job_records`). The few stamps that
leave the process for humans and traces (`Rebuild.t_decided`, `GenerationVoid.t`, an incident's
`t_decided`) are wall-clock, from `wall_offset`.

Time-driven work has one set of rules (`tick_job`): each rule acts when it is due, and otherwise
names the moment it will be, which is when the shell ticks next. A rule that cannot act names no
moment, so a deadline in the past can never make the shell spin.

Idempotent. Every handler accepts a repeated or stale event as a no-op (a failure of a member that is
no longer live, an ack of another generation, a snapshot already counted), because events are
delivered at least once and a new leader replays the ones its predecessor had not made durable.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import operator
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from deadpool_protocol import (
    NO_STEP,
    Commit,
    Failure,
    GenerationVoid,
    GroupBroken,
    HelloReply,
    Incident,
    JobFinished,
    MemberDone,
    MemberHello,
    Placement,
    PlacementDelta,
    Rebuild,
    RebuildAck,
    RebuildAckBatch,
    RebuildDelta,
    Replicate,
    Reserve,
    RestoreSource,
    RunReply,
    RunStart,
    SnapshotComplete,
    StepResumed,
    StepResumedBatch,
    StoreAddress,
    StoreStatus,
)
from deadpool_protocol.bounds import (
    EVIDENCE_ENTRIES_MAX,
    INCIDENT_IDS_CHARS_MAX,
    MEMBERS_PER_JOB_MAX,
    SEALED_PER_REPORT_MAX,
    clip_text,
)
from deadpool_protocol.messages import members_digest
from deadpool_protocol.placement_delta import placement_delta_of
from deadpool_protocol.rebuild_delta import delta_of
from deadpool_protocol.subjects import Subjects, store_replicate, store_reserve
from deadpool_swapper.job_parts import (
    CommitLedger,
    EventsPosition,
    IncidentLog,
    JobPart,
    Membership,
    OpenIncident,
    PendingRebuild,
    Protection,
    Recovery,
    RestoreReports,
    StorePlacement,
)
from deadpool_swapper.job_phase import check_transition, phase_of
from deadpool_swapper.placement import (
    MemberInfo,
    StoreInfo,
    pick_rendezvous,
    pick_spare,
    place_snapshots,
    under_placed,
)
from deadpool_swapper.restore_chain import CommittedCopies, RestoreChoice, RestoreLink, choose_restore

__all__ = [
    "Action",
    "Archive",
    "Decision",
    "Fence",
    "JobState",
    "OpenIncident",
    "PendingRebuild",
    "Persist",
    "Publish",
    "SwapperConfig",
    "SwapperCore",
    "incident_phases",
]

INCIDENTS_KEPT = 16
FAILED_KEPT = 256
STORE_LOSS_MARGIN_S = 0.01
"""A store's loss is checked this long after its timeout, so the check lands after it, not on it."""
ALREADY_COUNTED = "already counted"
"""How a first step said again is answered (a member whose launcher's answer was lost stores its own)."""


@dataclass(frozen=True)
class SwapperConfig:
    replication: int = 2
    store_timeout_s: float = 1.5
    """A store silent for longer is taken as lost: jobs whose snapshots it held get a new placement
    and their committed step is copied again (stores announce themselves every 0.5 s)."""
    rebuild_retransmit_s: float = 1.0
    """A rebuild not acked by every rank (and a void notice not yet followed by a rebuild) is published
    again after this long: commands travel on core NATS, and members confirm them."""
    formation_grace_s: float = 2.0
    """Formation waits this long after the last hello for members asking for the ranks still unclaimed
    (launchers start ranks and spares together; a spare that registers first should stay a spare)."""
    last_call_s: float = 0.05
    """After a rank failure, how long the swapper waits for other failures before it publishes the new
    generation, so failures close together are swapped in one rebuild (a double kill, a crash and its
    host-mate). Survivors are released at once anyway (the void notice); this only delays the spare.
    It delays every recovery, and a failure that comes just after it supersedes the rebuild at once
    (members drop the superseded rendezvous within milliseconds), so it is kept short: 0.1 s cost
    kill_in_recovery faults up to 0.975 s in the chaos benchmark."""
    host_loss_window_s: float = 0.3
    """When the detector says a host went silent (`host_members_silent` > 1 in a failure's evidence),
    the rebuild waits for that many failures, at most this long, so the host moves in one generation.
    The detector publishes them back to back; the bound only covers a lost message."""
    rebuild_attempts_max: int = 16
    """Generations published in a row without one forming; one more ends the job, saying why."""
    finished_kept_s: float = 3600.0
    """A finished job's state is kept this long (late members are told it finished), then pruned."""
    unformed_kept_s: float = 600.0
    """A job that never formed is forgotten this long after its last hello (a name made up on the bus,
    or a launch abandoned before its ranks came)."""
    jobs_max: int = 1000
    """Jobs one swapper drives at once; a hello for one more is refused until a job is pruned."""
    first_step_wait_s: float = 120.0
    """A recovery's incident is published once every rank completed its first step after it (the
    downtime a user feels), or this long after every rank acked (that step may compile, say)."""
    runs_required: bool = False
    """Members must belong to a run a launcher started (`RunStart`): a name cannot be squatted by a
    member's hello. The service requires it; off here for tests that drive the core with hellos alone."""
    members_max: int = MEMBERS_PER_JOB_MAX
    """Members (ranks and spares) one job may have; a hello for one more is refused, saying so."""
    tick_idle_s: float = 1.0
    """A job's time-driven rules run at least this often, whatever their deadlines (a store that comes
    back is also announced by a poke from the shell)."""
    snapshot_step_lead_max: int = 100_000
    """How far beyond the committed step a stored snapshot may be: a snapshot of step 2**62 would
    commit a step nobody has, after which no real step could ever commit."""

    def __post_init__(self) -> None:
        if self.replication < 1:
            raise ValueError("replication must be at least 1")
        if not 0 <= self.last_call_s <= 1.0:
            raise ValueError("last_call_s must be between 0 and 1 s: it delays every recovery")
        if self.rebuild_attempts_max < 1:
            raise ValueError("rebuild_attempts_max must be at least 1")


@dataclass(frozen=True)
class Publish:
    message: (
        Rebuild
        | RebuildDelta
        | GenerationVoid
        | Commit
        | JobFinished
        | Incident
        | Placement
        | PlacementDelta
        | Replicate
        | Reserve
    )

    @property
    def subject(self) -> str:
        """Where the message goes: its job's subject for its type, or, for a `Replicate` or a `Reserve`,
        the store's own subject."""
        message = self.message
        if isinstance(message, Replicate):
            return store_replicate(message.source)
        if isinstance(message, Reserve):
            return store_reserve(message.store)
        subjects = Subjects.for_job(message.job)
        match message:
            case Rebuild():
                return subjects.rebuild
            case RebuildDelta():
                return subjects.rebuild_delta
            case GenerationVoid():
                return subjects.void
            case Commit():
                return subjects.commit
            case JobFinished():
                return subjects.finished
            case Incident():
                return subjects.incident
            case Placement():
                return subjects.placement
            case PlacementDelta():
                return subjects.placement_delta
            case _:
                typing.assert_never(message)


@dataclass(frozen=True)
class Fence:
    job: str
    generation: int
    member: str
    launcher: str
    reason: str
    holds_rebuild: bool = True
    """Whether the rebuild waits for this fence's answer (`JobWorker`). Not for a member whose whole
    host went silent (`Failure.lost_host`): its launcher went with it, or is cut off with it. A request
    to it reaches nobody, yet the server keeps a vanished host's connection until its pings go
    unanswered (tens of seconds): no "no responders" comes, and the rebuild waited the whole
    `fence_timeout_s` (5.00 s of a lost host's 10.25 s in `test_multi_node.py`). The fence still goes, and
    such a member is fenced by generation anyway: refused at hello, its uploads refused by the stores."""


@dataclass(frozen=True)
class Persist:
    job: str


@dataclass(frozen=True)
class Archive:
    """The record of a run that ended is kept aside (before the name's next run is saved over it)."""

    state: JobState


Action = Publish | Fence | Persist | Archive


@dataclass(frozen=True)
class Decision:
    actions: list[Action]
    reason: str
    next_at: float = math.inf
    """A tick's answer: when the job's time-driven rules next have work (monotonic; inf: none)."""
    routine: bool = False
    """Nothing was decided that deserves a log line: a tick that only kept time or sent again what
    was sent before, or an event applied before."""


class _Schedule:
    """When a job's time-driven rules next have work. Each rule asks `due(at)`: a moment not reached
    yet becomes a candidate for the next tick, and a rule that acts schedules its next moment itself.
    Only moments after `now` are ever scheduled, so the tick and its deadline come from the same rules
    and a rule that stays due without acting cannot make the shell spin."""

    def __init__(self, now: float, idle_s: float) -> None:
        self.now = now
        self.next_at = now + idle_s

    def due(self, at: float) -> bool:
        if at <= self.now:
            return True
        self.next_at = min(self.next_at, at)
        return False


@dataclass
class JobState:
    """One job as the swapper knows it: who it is and how its run ends, then its parts (`job_parts`),
    each with one concern and its own record encoding."""

    job: str
    run: str = ""
    """The run of the job this state belongs to ('' for members nothing started a run for)."""
    base_generation: int = 0
    """The last generation of the name's previous run (0: none): this run's first is the next one."""
    generation: int = 0
    finished: bool = False
    finished_t: float = 0.0
    failed_reason: str = ""
    """Why the swapper ended the job ('' if it finished normally or runs)."""
    membership: Membership = field(default_factory=Membership)
    recovery: Recovery = field(default_factory=Recovery)
    ledger: CommitLedger = field(default_factory=CommitLedger)
    restores: RestoreReports = field(default_factory=RestoreReports)
    stores: StorePlacement = field(default_factory=StorePlacement)
    incident_log: IncidentLog = field(default_factory=IncidentLog)
    protection: Protection = field(default_factory=Protection)
    position: EventsPosition = field(default_factory=EventsPosition)

    def started(self) -> bool:
        """A generation of this run was published (formation went out)."""
        return self.generation > self.base_generation

    def parts(self) -> list[JobPart]:
        """Every part, each of which writes its own entries of the record."""
        return [self.membership, self.recovery, self.ledger, self.restores, self.stores,
                self.incident_log, self.protection, self.position]  # fmt: skip


def _reservations(state: JobState, before: list[list[str]], fresh: frozenset[str] = frozenset()) -> list[Action]:
    """Tell each store the ranks of known size that the placement just put on it (not there `before`,
    or on a store in `fresh`: one restarted, its memory empty), so that it faults in their buffers
    before their first upload there (`Reserve`). O(ranks) per placement, not per step. They are kept
    (`StorePlacement.reserving`) to go again with the placement's retransmissions."""
    state.stores.reserving = _reserves(state, before, fresh)
    return [Publish(r) for r in state.stores.reserving]


def _reserves(state: JobState, before: list[list[str]], fresh: frozenset[str]) -> list[Reserve]:
    if (
        not fresh
        and len(state.stores.placement) == len(before)
        and all(map(operator.is_, state.stores.placement, before))
    ):
        return []  # every rank kept its stores (`place_snapshots` keeps their lists): checked in C
    by_store: dict[str, tuple[list[int], list[int]]] = {}
    rank_bytes = state.ledger.rank_bytes
    for rank, stores in enumerate(state.stores.placement):
        old = before[rank] if rank < len(before) else []
        if not fresh and (stores is old or stores == old):  # kept: the same list (`place_snapshots`)
            continue
        nbytes = rank_bytes.get(rank, 0)
        if nbytes <= 0:
            continue
        for store in stores:
            if store not in old or store in fresh:
                ranks, sizes = by_store.setdefault(store, ([], []))
                ranks.append(rank)
                sizes.append(nbytes)
    reserves: list[Reserve] = []
    for store, (ranks, sizes) in sorted(by_store.items()):
        for i in range(0, len(ranks), SEALED_PER_REPORT_MAX):
            window = slice(i, i + SEALED_PER_REPORT_MAX)
            reserves.append(Reserve(state.job, state.generation, store, ranks[window], sizes[window]))
    return reserves


F = typing.TypeVar("F", bound=Callable[..., typing.Any])


def _placed_on(store: str, placements: list[list[list[str]]]) -> Callable[[int], bool]:
    """Whether a rank is put on `store` by one of `placements` (the job's, and the pending rebuild's):
    asked for every rank a store's report names, so the usual case, one placement, is one lookup."""
    if len(placements) == 1:
        (only,) = placements
        placed = len(only)
        return lambda rank: rank < placed and store in only[rank]
    return lambda rank: any(rank < len(placement) and store in placement[rank] for placement in placements)


def _phased(method: F) -> F:
    """An entry point whose decision is checked against the legal changes of phase (`job_phase`): the
    job is its first argument's (a message's `job`, or the name itself)."""

    @functools.wraps(method)
    def checked(self: SwapperCore, first: typing.Any, *args: typing.Any) -> typing.Any:
        job = first if isinstance(first, str) else first.job
        before = phase_of(self.jobs.get(job))
        result = method(self, first, *args)
        check_transition(job, before, phase_of(self.jobs.get(job)), method.__name__)
        return result

    return typing.cast(F, checked)


class SwapperCore:
    def __init__(self, config: SwapperConfig, wall_offset: Callable[[], float] = lambda: 0.0) -> None:
        self.config = config
        self.jobs: dict[str, JobState] = {}
        self.stores: dict[str, StoreInfo] = {}
        self.wall_offset = wall_offset
        """Wall clock minus the monotonic clock, for the stamps that leave the process (tests step it)."""
        self.view_since = -math.inf
        """Since when this process has been hearing the stores' announcements without a gap (its own
        start, a reconnection to NATS, a pause of its loop reset it: `reset_store_view`)."""
        self.live_at_gap: frozenset[str] = frozenset()
        """The stores that were live when the last gap began: the view is known once each is live again
        (or still), or once the view has had a whole `store_timeout_s` (then the silent ones are lost)."""

    def _wall(self, now: float) -> float:
        return now + self.wall_offset()

    # ---------------------------------------------------------------- the stores' view

    def reset_store_view(self, now: float, heard_until: float | None = None) -> None:
        """This process may have missed the stores' announcements (it just started, its NATS connection
        came back, its loop was paused since `heard_until`): a silent store is not taken as lost until
        it has had a full `store_timeout_s` to be heard again, and the view is not known while a store
        live at `heard_until` is not live again (one store's status after a pause once made it count as
        known, with every other store's copies taken for lost)."""
        self.view_since = now
        live_then = self.live_stores(heard_until) if heard_until is not None else []
        self.live_at_gap = frozenset(s.store for s in live_then)

    def _stores_known_at(self) -> float:
        return self.view_since + self.config.store_timeout_s

    def _stores_known(self, now: float) -> bool:
        """Whether the live stores are known: some store is live and so is every store live when the gap
        began (heard again, or heard recently enough still: a short pause waits for nobody), or silence
        has lasted long enough in a view without gaps to mean that the silent ones are lost."""
        if now >= self._stores_known_at():
            return True
        live = self._live_names(now)
        return bool(live) and self.live_at_gap <= live

    # ---------------------------------------------------------------- registration and stores

    @_phased
    def on_run_start(self, start: RunStart, now: float) -> tuple[RunReply, Decision]:
        """A launcher starts a run of the job. A name holds one run at a time: the same run again is a
        no-op; a finished run makes way (its record archived, the generations going on from its); a run
        still going refuses the newcomer, saying which run holds the name. Members that said hello
        under no run, while nothing formed, make way too (they were not started by a launcher). A
        launcher of spares only (world size 0) joins the run another launcher started, and is told to
        ask again until one has; a finished run is never joined nor started again."""
        state = self.jobs.get(start.job)

        def reply(accepted: bool, reason: str, world_size: int = start.world_size, not_yet: bool = False) -> RunReply:
            generation = state.generation if state else 0
            return RunReply(start.job, generation, start.run, accepted, reason, world_size, not_yet)

        if state is not None and state.run == start.run and state.finished:
            why = f"run {start.run} of job {start.job} has ended: launch the name again with a new --run-id"
            return reply(False, why), Decision([], f"run refused: {why}")
        if start.world_size == 0:
            if state is not None and state.run == start.run and state.membership.world_size > 0:
                joined = f"joined run {start.run} of {state.membership.world_size} ranks"
                return reply(True, joined, state.membership.world_size), Decision([], joined)
            why = f"run {start.run} of job {start.job} is not started yet: a launcher of its ranks starts it"
            return reply(False, why, not_yet=True), Decision([], f"run not joined yet: {why}")
        if state is not None and state.run == start.run:
            if start.world_size != state.membership.world_size:
                why = f"run {start.run} has world size {state.membership.world_size}, not {start.world_size}"
                return reply(False, why), Decision([], f"run refused: {why}")
            return reply(True, "the run is started"), Decision([], f"run {start.run} started again")
        actions: list[Action] = []
        if state is not None and not state.finished and (state.started() or state.run):
            why = (
                f"job {start.job} is running as run {state.run or '(undeclared)'} (generation {state.generation}): "
                "a job name holds one run at a time; choose another --job, or end that run first"
            )
            return reply(False, why), Decision([], f"run {start.run} refused: {why}")
        if state is not None and state.finished:
            actions.append(Archive(state))
        if state is None and len(self.jobs) >= self.config.jobs_max:
            why = f"the swapper drives {len(self.jobs)} jobs already (jobs_max)"
            return reply(False, why), Decision([], f"run refused: {why}")
        fresh = JobState(
            start.job,
            run=start.run,
            membership=Membership(world_size=start.world_size, last_hello_t=now),
            protection=Protection(hold_without_stores_s=start.hold_without_stores_s),
        )
        if state is not None:  # generations only grow, across runs too: the old run's waits stay superseded
            fresh.generation = fresh.recovery.void_generation = max(state.generation, state.recovery.void_generation)
            fresh.base_generation = fresh.generation
        self.jobs[start.job] = fresh
        how = f"after run {state.run or '(undeclared)'}" if state is not None else "a new job"
        return reply(True, "the run is started"), Decision([*actions, Persist(start.job)], f"run {start.run}: {how}")

    @_phased
    def on_hello(self, hello: MemberHello, now: float) -> tuple[HelloReply, Decision]:
        if hello.job not in self.jobs and self.config.runs_required:
            why = f"no run of job {hello.job} was started: members start under `deadpool launch`"
            refused = HelloReply(hello.job, 0, hello.member, False, why)
            return refused, Decision([], f"hello refused: {why}")
        state = self.jobs.setdefault(hello.job, JobState(hello.job, run=hello.run))

        def reply(accepted: bool, reason: str) -> HelloReply:
            return HelloReply(
                hello.job,
                state.generation,
                hello.member,
                accepted,
                reason,
                snapshot_bytes=state.ledger.snapshot_bytes_max(),
            )

        if hello.run != state.run:
            why = f"the member is of run {hello.run or '(none)'}, the job's run is {state.run or '(none)'}"
            return reply(False, why), Decision([], f"hello refused: {why}")
        if state.finished:
            why = clip_text(
                f"the job has ended: {state.failed_reason}" if state.failed_reason else "the job has finished"
            )
            late = HelloReply(hello.job, state.generation, hello.member, False, why, True, state.failed_reason)
            return late, Decision([], "hello refused: job finished")
        if hello.member in state.membership.failed:
            return reply(False, "this member was declared failed and is fenced"), Decision([], "hello refused: fenced")
        if state.membership.world_size == 0:
            state.membership.world_size = hello.world_size
        if hello.world_size != state.membership.world_size:
            why = f"world size {hello.world_size} differs from the job's {state.membership.world_size}"
            return reply(False, why), Decision([], f"hello refused: {why}")
        known = state.membership.members.get(hello.member)
        if known is None and len(state.membership.members) >= self.config.members_max:
            why = f"the job has {len(state.membership.members)} members, the most one job may have (members_max)"
            return reply(False, why), Decision([], f"hello refused: {why}")
        if known is not None and not _same_process(known, hello):
            why = f"member {hello.member} is registered from {known.host} pid {known.pid}: its identity never changes"
            return reply(False, why), Decision([], f"hello refused: {why}")
        state.membership.last_hello_t = now
        state.membership.members[hello.member] = MemberInfo(
            member=hello.member,
            host=hello.host,
            pid=hello.pid,
            launcher=hello.launcher,
            rank_hint=hello.rank_hint,
            rendezvous_host=hello.rendezvous_host,
            rendezvous_port=hello.rendezvous_port,
            registered_at=known.registered_at if known else now,
        )
        if known:
            return reply(True, "already registered"), Decision([], "repeated hello")
        actions: list[Action] = [Persist(state.job)]
        if not state.started():
            decision = self._try_formation(state, now)
            registered = Decision(actions + decision.actions, decision.reason, routine=decision.routine)
            return reply(True, "registered"), registered
        state.membership.spares.append(hello.member)
        reason = f"member {hello.member} joins the spare pool ({len(state.membership.spares)} spares)"
        if (
            state.membership.vacant_ranks() and not state.recovery.hold_until
        ):  # a vacant rank is filled the moment a spare comes
            decision = self._start_rebuild(state, now)
            return reply(True, "registered as spare"), Decision(actions + decision.actions, decision.reason)
        return reply(True, "registered as spare"), Decision(actions, reason)

    def on_store_status(self, status: StoreStatus, now: float) -> bool:
        """Record a store's announcement; True when it is news the jobs should act on at once (a store
        new to this process, one heard again after it counted as lost, one restarted or on another
        address), so the shell ticks them. A store that started again under the same name holds
        nothing: no copy counts on it any more (the next tick copies the committed step again)."""
        known = self.stores.get(status.store)
        news = (
            known is None
            or now - known.last_seen > self.config.store_timeout_s
            or known.incarnation != status.incarnation
            or (known.host, known.port) != (status.host, status.port)
        )
        if known is not None and known.incarnation != status.incarnation:
            for state in self.jobs.values():
                for holders in [
                    *state.ledger.committed_holders.values(),
                    *state.ledger.previous_committed.holders.values(),
                ]:
                    holders.discard(status.store)
                for by_rank in state.ledger.completes.values():
                    for stores in by_rank.values():
                        stores.discard(status.store)
                state.ledger.commit_progress.invalidate()
        self.stores[status.store] = StoreInfo(
            status.store,
            status.host,
            status.port,
            now,
            status.used_bytes,
            status.capacity_bytes,
            status.node,
            status.snapshots,
            status.unsealed,
            status.incarnation,
        )
        return news

    def live_stores(self, now: float) -> list[StoreInfo]:
        return [s for s in self.stores.values() if now - s.last_seen <= self.config.store_timeout_s]

    def _live_names(self, now: float) -> frozenset[str]:
        return frozenset(s.store for s in self.live_stores(now))

    def _try_formation(self, state: JobState, now: float) -> Decision:
        if len(state.membership.members) < state.membership.world_size:
            registered = (
                f"waiting for members: {len(state.membership.members)} of {state.membership.world_size} registered"
            )
            return Decision([], registered, routine=True)  # one per hello: thousands at formation
        claimed = {
            m.rank_hint for m in state.membership.members.values() if 0 <= m.rank_hint < state.membership.world_size
        }
        if (
            len(claimed) < state.membership.world_size
            and now - state.membership.last_hello_t < self.config.formation_grace_s
        ):
            return Decision(
                [], f"waiting for members asking for ranks: {len(claimed)} of {state.membership.world_size} claimed"
            )
        if not self.live_stores(now):
            return Decision([], "waiting for a snapshot store to announce itself")
        by_preference = sorted(
            state.membership.members.values(),
            key=lambda m: (m.rank_hint < 0, m.rank_hint, m.registered_at, m.member),
        )
        state.membership.ranks = [m.member for m in by_preference[: state.membership.world_size]]
        state.membership.spares = [m.member for m in by_preference[state.membership.world_size :]]
        return self._publish_rebuild(state, now, newcomers=set(state.membership.ranks), reason="formation")

    # ---------------------------------------------------------------- failures and rebuilds

    @_phased
    def on_failure(self, failure: Failure, now: float) -> Decision:
        state = self.jobs.get(failure.job)
        if state is None:
            return Decision([], f"failure for unknown job {failure.job}")
        if state.finished:
            return Decision([], f"failure of {failure.member} after the job finished: ignored")
        if failure.member not in state.membership.members:
            return Decision([], f"failure of {failure.member}: not a live member (stale or repeated)")
        info = state.membership.members.pop(failure.member)
        state.membership.failed.append(failure.member)
        del state.membership.failed[:-FAILED_KEPT]
        actions: list[Action] = [Persist(state.job)]
        if failure.reason.needs_fence:
            holds = not failure.lost_host  # a lost host's launcher answers nobody (`Fence.holds_rebuild`)
            actions.append(Fence(state.job, state.generation, failure.member, info.launcher, failure.reason, holds))
        if failure.cause.ends_job:
            rank = state.membership.ranks.index(failure.member) if failure.member in state.membership.ranks else -1
            error = failure.evidence.get("error", "")
            why = f"member {failure.member} (rank {rank}) cannot go on ({failure.cause}): {error}"
            decision = self._end_job(state, now, why)
            return Decision(actions + decision.actions, decision.reason)
        if host := failure.lost_host:  # the detector saw this member's whole host go silent
            arrived, announced = state.recovery.silent_hosts.get(host, (0, 0))
            state.recovery.silent_hosts[host] = (arrived + 1, max(announced, failure.lost_host_members))
            state.recovery.hold_until = max(state.recovery.hold_until, now + self.config.host_loss_window_s)
        if failure.member in state.membership.spares:
            state.membership.spares.remove(failure.member)
            why = f"spare {failure.member} lost ({failure.reason}); {len(state.membership.spares)} left"
            if state.recovery.hold_until and not self._host_failures_missing(state) and state.membership.vacant_ranks():
                decision = self._start_rebuild(state, now)  # every announced member of the host is in
                return Decision(actions + decision.actions, f"{why}; {decision.reason}")
            return Decision(actions, why)
        if failure.member not in state.membership.ranks:
            return Decision(actions, f"member {failure.member} lost before formation ({failure.reason})")
        rank = state.membership.ranks.index(failure.member)
        state.incident_log.incident_seq += 1
        state.incident_log.open_incidents.append(
            OpenIncident(
                incident_id=f"{state.job}-{state.incident_log.incident_seq}",
                rank=rank,
                member=failure.member,
                host=info.host,
                reason=failure.reason,
                evidence=_incident_evidence(failure.described()),
                t_fault=failure.t_fault,
                t_detected=failure.t_detected,
                traceparent=failure.traceparent,
                launcher=info.launcher,
                host_lost=bool(failure.lost_host),
            )
        )
        actions += self._void(state, now, f"rank {rank} ({failure.member}) failed: {failure.reason}")
        what = f"rank {rank} ({failure.member}) failed: {failure.reason}"
        if self._host_failures_missing(state):
            return Decision(actions, f"{what}; host {info.host} lost: waiting for its other failures")
        if state.recovery.pending is None and not state.recovery.silent_hosts and self.config.last_call_s > 0:
            state.recovery.hold_until = (
                state.recovery.hold_until or now + self.config.last_call_s
            )  # counted from the first failure
            return Decision(actions, f"{what}; last call for other failures ({self.config.last_call_s} s)")
        # At once: the rebuild under way cannot form without this member (it is superseded), or every
        # failure of a lost host is in.
        superseded = " (supersedes the rebuild under way)" if state.recovery.pending is not None else ""
        decision = self._start_rebuild(state, now)
        return Decision(actions + decision.actions, f"{what}{superseded}; {decision.reason}")

    def _void(self, state: JobState, now: float, reason: str) -> list[Action]:
        """Announce that the current generation will not train again (once; retransmitted by `tick`)."""
        if not state.started() or state.recovery.void_generation >= state.generation:
            return []
        state.recovery.void_generation = state.generation
        state.recovery.void_sent_t = now
        return [Publish(GenerationVoid(state.job, state.generation, reason, self._wall(now)))]

    @staticmethod
    def _host_failures_missing(state: JobState) -> bool:
        """Whether a lost host announced more silent members than failures arrived so far."""
        return any(arrived < announced for arrived, announced in state.recovery.silent_hosts.values())

    @_phased
    def on_group_broken(self, broken: GroupBroken, now: float) -> Decision:
        """Every rank left the group (or gave up forming it) and nobody failed: a new generation of the
        same members, restored to the committed step (a regroup). Also when the broken generation is the
        rebuild under way: every one of its members is alive and waiting, so it will never form.
        Ignored when a failure's rebuild is coming anyway (a vacant rank, a last call)."""
        state = self.jobs.get(broken.job)
        if state is None or state.finished or broken.generation != state.generation:
            return Decision([], f"group of generation {broken.generation} broken: not the current one, ignored")
        if state.membership.vacant_ranks() or state.recovery.hold_until:
            return Decision([], f"group of generation {broken.generation} broken: a rebuild is already under way")
        if state.protection.held_since is not None:
            return Decision([], f"group of generation {broken.generation} broken: held until a store returns")
        if broken.members_digest != members_digest(state.membership.ranks) or any(
            m not in state.membership.members for m in state.membership.ranks
        ):
            return Decision([], f"group of generation {broken.generation} broken: its members differ from the ranks")
        first = broken.evidence.get("first_to_leave", "")
        rank = state.membership.ranks.index(first) if first in state.membership.ranks else 0
        state.incident_log.incident_seq += 1
        state.incident_log.open_incidents.append(
            OpenIncident(
                incident_id=f"{state.job}-{state.incident_log.incident_seq}",
                rank=rank,
                member=state.membership.ranks[rank],
                host=state.membership.members[state.membership.ranks[rank]].host,
                reason=GroupBroken.INCIDENT_REASON,
                evidence=_incident_evidence(broken.evidence),
                t_fault=broken.t_broken,
                t_detected=broken.t_detected,
                replacement=state.membership.ranks[rank],
            )
        )
        actions = self._void(state, now, "the group broke with every rank alive")
        decision = self._publish_rebuild(
            state, now, newcomers=set(), reason="regroup: the group broke, every rank alive"
        )
        return Decision(actions + decision.actions, decision.reason)

    @_phased
    def on_fenced(self, job: str, member: str, fence_s: float) -> None:
        state = self.jobs.get(job)
        for incident in state.incident_log.open_incidents if state else []:
            if incident.member == member:
                incident.fence_s = fence_s

    def _start_rebuild(self, state: JobState, now: float) -> Decision:
        state.recovery.hold_until = 0.0
        state.recovery.silent_hosts.clear()
        vacant = state.membership.vacant_ranks()
        if not vacant:
            return Decision([], "no rank is vacant")
        if len(state.membership.spares) < len(vacant):
            return Decision(
                [],
                f"{len(vacant)} rank(s) vacant but {len(state.membership.spares)} spare(s) free: waiting for a spare",
            )
        if not self._stores_known(now):  # the tick tries again once they are
            return Decision([], "the stores' view is not fresh: waiting to hear them before choosing a restore")
        committed = self._commit_newest(state, self._live_names(now), now)
        base_ranks = list(state.membership.ranks)  # what members hold: the delta goes from it
        failed_hosts = {i.host for i in state.incident_log.open_incidents}
        newcomers: set[str] = set()
        host_copies = True
        """Every vacant rank goes to a spare of the launcher its crash copy is on (its host is up)."""
        for rank in vacant:
            incident = next((i for i in reversed(state.incident_log.open_incidents) if i.rank == rank), None)
            launcher = incident.launcher if incident is not None and not incident.host_lost else ""
            spare = pick_spare(state.membership.spares, state.membership.members, failed_hosts, launcher)
            assert spare is not None
            state.membership.spares.remove(spare)
            state.membership.ranks[rank] = spare
            newcomers.add(spare)
            host_copies = host_copies and bool(launcher) and state.membership.members[spare].launcher == launcher
            for incident in state.incident_log.open_incidents:
                if incident.rank == rank:
                    incident.replacement = spare
        rebuild = self._publish_rebuild(
            state,
            now,
            newcomers,
            reason=f"rank(s) {vacant} go to {sorted(newcomers)}",
            host_copies=host_copies,
            base_ranks=base_ranks,
        )
        if committed is None:
            return rebuild
        return dataclasses.replace(
            rebuild, actions=committed.actions + rebuild.actions, reason=f"{committed.reason}; {rebuild.reason}"
        )

    def _publish_rebuild(
        self,
        state: JobState,
        now: float,
        newcomers: set[str],
        reason: str,
        local: bool = False,
        host_copies: bool = False,
        base_ranks: list[str] | None = None,
    ) -> Decision:
        """Publish the next generation. With no live store it still goes out: it restores from the next
        link of the chain that has the state (the survivors' own buffers, the durable tier), or the job
        ends saying why; its placement names no store until one comes back (`_heal_placement`).
        `host_copies`: every newcomer takes its rank where the rank's crash copy is (its dead holder's
        launcher): the ranks restore the newest step they all hold, survivors in their own buffers and
        newcomers in the copies (a process crash loses at most the step it was in), stores or none.
        `base_ranks`: the rank map of the generation before, where the caller changed it (the members
        hold that one: the command's delta goes from it)."""
        stores = self.live_stores(now)
        if not stores and not state.recovery.formed:
            return Decision([], "waiting for a snapshot store: a generation forms with its step-0 snapshot stored")
        if state.recovery.attempts >= self.config.rebuild_attempts_max:
            why = f"{state.recovery.attempts} generations in a row did not form (the last was {state.generation})"
            return self._end_job(state, now, why)
        assert len(set(state.membership.ranks)) == len(state.membership.ranks), "a member holds more than one rank"
        # A rendezvous host that keeps failing is not named again: the choice rotates with the attempt,
        # over the members' addresses first.
        who, attempt = state.membership, state.recovery.attempts
        addresses = {m: who.members[m].rendezvous_host for m in who.ranks if m in who.members} if attempt else {}
        rendezvous = who.members[pick_rendezvous(who.ranks, newcomers, attempt, addresses)]
        # Until a generation has formed, every attempt starts fresh (a rank that died during formation
        # may never have stored step 0). Every later generation restores a committed step (members ack
        # formation only once their first snapshot is sealed on its stores), or, when no RAM copy of one
        # is left, the durable tier: the fallback chain (`restore_chain`).
        choice: RestoreChoice | None = choose_restore(
            state.recovery.formed,
            [
                (RestoreLink.COMMITTED, state.ledger.committed_copies()),
                (RestoreLink.OLDER_COMMITTED, state.ledger.previous_committed),
            ],
            state.membership.ranks,
            newcomers,
            {s.store for s in stores},
            state.restores.unavailable,
            state.restores.durable_failed,
            state.membership.world_size,
        )
        if host_copies and newcomers and state.recovery.formed and not state.restores.local_failed:
            choice = RestoreChoice(
                NO_STEP,
                0,
                RestoreLink.LOCAL,
                "the newest step every rank holds, newcomers in their host's crash copies",
            )
        elif choice is None:
            why = (
                "every copy of the committed step is gone: no live store holds it for some rank, and no "
                "member could restore from a durable tier (none configured, or no step all ranks have intact)"
            )
            return self._end_job(state, now, why)
        elif state.recovery.formed and state.ledger.committed_step == NO_STEP and not state.restores.unavailable:
            # Formed, and step 0's reports not in yet: members ack formation once it is sealed.
            choice = RestoreChoice(0, 0, RestoreLink.COMMITTED, "step 0, stored at formation")
        if local and not newcomers and not state.restores.local_failed:
            choice = RestoreChoice(NO_STEP, 0, RestoreLink.LOCAL, "the newest step every rank holds itself")
        state.ledger.restore_step = choice.step
        for incident in state.incident_log.open_incidents:
            # The reason lists ranks (thousands, at scale): within the bound of an evidence entry.
            incident.evidence["restore_link"], incident.evidence["restore_reason"] = (
                choice.link,
                clip_text(choice.reason),
            )
        base = (state.generation, state.stores.placement_version, base_ranks or list(state.membership.ranks))
        generation = state.generation + 1
        assert generation > state.generation and generation > state.recovery.void_generation, "generations only grow"
        state.generation = generation
        state.incident_log.forget_first_steps()  # incidents still awaiting a first step end at this generation's
        state.recovery.attempts += 1
        before = state.stores.placement
        state.stores.placement = place_snapshots(
            state.membership.ranks,
            state.membership.members,
            stores,
            self.config.replication,
            state.ledger.rank_bytes,
            state.stores.placement,
        )
        reservations = _reservations(state, before)
        state.stores.placement_version, state.stores.placement_confirmed = 0, True
        state.ledger.completes = {s: v for s, v in state.ledger.completes.items() if s <= state.ledger.restore_step}
        state.restores.durable_completes = {}
        state.membership.done.clear()
        command = Rebuild(
            job=state.job,
            generation=state.generation,
            world_size=state.membership.world_size,
            ranks=list(state.membership.ranks),
            spares=list(state.membership.spares),
            rendezvous_member=rendezvous.member,
            rendezvous_host=rendezvous.rendezvous_host,
            rendezvous_port=rendezvous.rendezvous_port,
            restore_step=state.ledger.restore_step,
            stores=[StoreAddress(s.store, s.host, s.port) for s in stores],
            placement=state.stores.placement,
            incident=clip_text(
                ",".join(i.incident_id for i in state.incident_log.open_incidents), INCIDENT_IDS_CHARS_MAX
            ),
            t_decided=self._wall(now),
            restore_generation=choice.generation,
            durable=choice.durable,
            local=choice.local,
            traceparent=next((i.traceparent for i in state.incident_log.open_incidents if i.traceparent), ""),
        )
        command.check()
        delta = delta_of(command, *base, before)
        state.recovery.pending = PendingRebuild(command, t_sent=now, delta=delta)
        state.stores.announced_stores = {a.store: (a.host, a.port) for a in command.stores}
        self._note_protection(state, now, bool(stores))
        for incident in state.incident_log.open_incidents:
            if incident.t_decided == 0.0:
                incident.t_decided = command.t_decided
        return Decision(
            # The delta first: a member that holds the generation before has its command without
            # waiting behind the whole one's parts.
            [Persist(state.job), Publish(delta), Publish(command), *reservations],
            f"generation {state.generation}: {reason}; restore {choice.link}: {choice.reason}",
        )

    def _end_job(self, state: JobState, now: float, reason: str) -> Decision:
        """Stop the job for good, saying why: members exit with the reason, launchers exit non-zero."""
        reason = clip_text(reason)  # it quotes a member's error: within the bound of a message's text
        state.finished, state.finished_t, state.failed_reason = True, now, reason
        state.recovery.pending = None
        state.recovery.hold_until = 0.0
        ended = JobFinished(
            state.job, state.generation, max(state.ledger.committed_step, 0), failed=True, reason=reason
        )
        return Decision([Persist(state.job), Publish(ended)], f"job ended: {reason}")

    @_phased
    def on_ack(self, ack: RebuildAck, now: float) -> Decision:
        return self._take_ack(ack, now)

    def _take_ack(self, ack: RebuildAck, now: float) -> Decision:
        """`on_ack`, unchecked: a batch's acks are checked as one decision (`on_ack_batch`)."""
        state = self.jobs.get(ack.job)
        pending = state.recovery.pending if state else None
        if state is None or pending is None or ack.generation != pending.command.generation:
            # a member answers every retransmission: at thousands of ranks, a line each would flood the log
            why = f"ack from {ack.member} for generation {ack.generation}: no such rebuild pending"
            return Decision([], why, routine=True)
        if ack.member not in pending.rank_members:
            return Decision([], f"ack from {ack.member}, which holds no rank in generation {ack.generation}")
        if ack.restore_source is RestoreSource.UNAVAILABLE:
            return self._restore_unavailable(state, pending, ack, now)
        pending.acks[ack.member] = ack
        missing = len(pending.rank_members) - len(pending.acks)  # O(1): thousands of acks per generation
        if missing:
            return Decision([], f"generation {ack.generation}: waiting for {missing} ack(s)", routine=True)
        state.recovery.pending = None
        state.recovery.attempts = 0
        state.recovery.formed = True
        state.restores.unavailable.clear()
        state.restores.durable_failed = state.restores.local_failed = False
        if pending.command.durable:
            self._adopt_durable_step(state, pending)
        elif pending.command.local:
            self._adopt_local_step(state, pending)
        actions: list[Action] = [Persist(state.job)]
        incidents = [self._close(state, incident, pending) for incident in state.incident_log.open_incidents]
        state.incident_log.open_incidents.clear()
        state.incident_log.incidents = (state.incident_log.incidents + incidents)[-INCIDENTS_KEPT:]
        if incidents:
            state.incident_log.awaiting_first_step += [i.incident_id for i in incidents]
            state.incident_log.awaiting_since = now
            actions += self._end_incidents(state, now)  # every first step may be in already
        what = "formed" if not incidents else f"recovered from {len(incidents)} incident(s)"
        return Decision(actions, f"generation {state.generation} {what}: every rank acked")

    @_phased
    def on_ack_batch(self, batch: RebuildAckBatch, now: float) -> Decision:
        """A launcher's batch of its members' acks: each taken as `on_ack` takes it, except one of a
        member another launcher runs (the job's key could speak for any member of the job through a
        launcher subject; refused and named)."""
        actions: list[Action] = []
        said: list[str] = []
        for ack in batch.acks:
            state = self.jobs.get(batch.job)
            info = state.membership.members.get(ack.member) if state is not None else None
            if info is not None and info.launcher != batch.launcher:
                said.append(f"ack of {ack.member} from launcher {batch.launcher}, which does not run it: refused")
                continue
            decision = self._take_ack(ack, now)
            actions += decision.actions
            if not decision.routine:
                said.append(decision.reason)
        if not said:
            return Decision(actions, f"{len(batch.acks)} ack(s) from launcher {batch.launcher}", routine=True)
        return Decision(actions, "; ".join(said[:4]) + (f" (and {len(said) - 4} more)" if len(said) > 4 else ""))

    @_phased
    def on_step_resumed(self, resumed: StepResumed, now: float) -> Decision:
        """A rank completed its first step of a generation; with every rank's, its incidents end."""
        state = self.jobs.get(resumed.job)
        refused = self._count_first_step(state, resumed)
        if state is None or refused:
            return Decision([], refused)
        ended = self._end_incidents(state, now)  # saves the record itself when it ends any
        return Decision(ended or [Persist(state.job)], f"rank {resumed.rank} completed its first step")

    @_phased
    def on_step_resumed_batch(self, batch: StepResumedBatch, now: float) -> Decision:
        """A launcher's batch of its members' first steps: each counted as `on_step_resumed` counts it,
        except one of a member another launcher runs (refused and named, as `on_ack_batch` does), and
        the record saved once for the batch."""
        state = self.jobs.get(batch.job)
        said: list[str] = []
        counted = 0
        for resumed in batch.resumed:
            info = state.membership.members.get(resumed.member) if state is not None else None
            if info is not None and info.launcher != batch.launcher:
                said.append(f"first step of {resumed.member} from launcher {batch.launcher}, which does not run it")
                continue
            refused = self._count_first_step(state, resumed)
            counted += not refused
            if refused and not refused.endswith(ALREADY_COUNTED):
                said.append(refused)
        actions: list[Action] = []
        if state is not None and counted:
            actions = self._end_incidents(state, now) or [Persist(state.job)]
        reason = f"{counted} first step(s) from launcher {batch.launcher}"
        if not said:
            return Decision(actions, reason, routine=True)
        more = f" (and {len(said) - 4} more)" if len(said) > 4 else ""
        return Decision(actions, "; ".join([reason, *said[:4]]) + more)

    def _count_first_step(self, state: JobState | None, resumed: StepResumed) -> str:
        """Count `resumed` in its job's first steps; '' if counted, else why not (a repeat is harmless)."""
        if state is None or resumed.generation != state.generation or resumed.rank >= state.membership.world_size:
            return f"first step of {resumed.member} in generation {resumed.generation}: not current"
        if resumed.rank in state.incident_log.first_step_ranks:
            return f"first step of rank {resumed.rank}: {ALREADY_COUNTED}"
        state.incident_log.count_first_step(resumed.rank, resumed.t_completed)
        return ""

    def _end_incidents(self, state: JobState, now: float, force: bool = False) -> list[Action]:
        """Publish the incidents awaiting a first step: with every rank's first step of the generation
        that formed (`t_first_step`), or without it once `first_step_wait_s` has passed (or `force`: the
        job ended). While a newer rebuild is pending they wait for its generation's first steps."""
        if not state.incident_log.awaiting_first_step or (state.recovery.pending is not None and not force):
            return []
        every_rank = (
            len(state.incident_log.first_step_ranks) >= state.membership.world_size and state.recovery.pending is None
        )
        if not every_rank and not force and now - state.incident_log.awaiting_since < self.config.first_step_wait_s:
            return []
        t_first = state.incident_log.first_step_t if every_rank else 0.0
        ended: list[Action] = []
        for index, incident in enumerate(state.incident_log.incidents):
            if incident.incident_id in state.incident_log.awaiting_first_step:
                phases = dict(incident.phases)
                evidence = dict(incident.evidence)
                if t_first:
                    phases["first_step"] = max(0.0, t_first - incident.t_resumed)
                else:
                    evidence["first_step"] = "not every rank completed one after it in time"
                incident = dataclasses.replace(incident, t_first_step=t_first, phases=phases, evidence=evidence)
                state.incident_log.incidents[index] = incident
                ended.append(Publish(incident))
        state.incident_log.awaiting_first_step = []
        return [Persist(state.job), *ended]

    def _restore_unavailable(self, state: JobState, pending: PendingRebuild, ack: RebuildAck, now: float) -> Decision:
        """A member found no copy of what the rebuild restores: the next link of the chain, at once (the
        others are waiting for it in the rendezvous; the newer generation releases them)."""
        command = pending.command
        if command.durable:
            state.restores.durable_failed = True
            what = f"rank {ack.rank} ({ack.member}) could not restore from a durable tier"
        elif command.local:
            state.restores.local_failed = True
            what = f"rank {ack.rank} ({ack.member}): the ranks hold no step in common in their own buffers"
        else:
            state.restores.unavailable.add((ack.rank, command.restore_step))
            what = f"rank {ack.rank} ({ack.member}) found no copy of step {command.restore_step}"
        # The members that took a rank since the last generation that formed hold nothing of it.
        newcomers = {
            i.replacement for i in state.incident_log.open_incidents if i.replacement and i.replacement != i.member
        }
        decision = self._publish_rebuild(state, now, newcomers, reason=f"{what}: next link")
        return Decision([Persist(state.job), *decision.actions], f"{what}; {decision.reason}")

    def _adopt_local_step(self, state: JobState, pending: PendingRebuild) -> None:
        """Training resumed from the step every rank held itself (or in its host's crash copy). The
        committed step it is, the stores' copies stay known; a newer one is the committed step now (its
        copies are those the ranks seal of it), the one before it the older link."""
        step = max(a.restore_step for a in pending.acks.values())
        if step != state.ledger.committed_step:
            newer = step > state.ledger.committed_step
            state.ledger.previous_committed = state.ledger.committed_copies() if newer else CommittedCopies()
            state.ledger.committed_step, state.ledger.committed_generation = step, state.generation
            # The ranks store the step as training resumes (`MemberRebuild.seal`): the copies sealed
            # before the last ack count, the later ones are added as copies of the committed step.
            state.ledger.committed_holders = {
                rank: set(stores) for rank, stores in state.ledger.completes.get(step, {}).items()
            }
        state.ledger.restore_step = step
        state.ledger.completes = {}

    def _adopt_durable_step(self, state: JobState, pending: PendingRebuild) -> None:
        """A durable restore formed: the step the ranks agreed on is the committed step now. It goes back
        (the only place it may): the RAM copies of the steps after it are gone, which the incidents say."""
        step = max(a.restore_step for a in pending.acks.values())
        lost = max(0, state.ledger.committed_step - step)
        for incident in state.incident_log.open_incidents:
            incident.evidence["lost_committed_steps"] = str(lost)
        state.ledger.previous_committed = CommittedCopies()
        state.ledger.committed_step, state.ledger.committed_generation = step, state.generation
        state.ledger.committed_holders = {r: set(s) for r, s in state.restores.durable_completes.items()}
        state.restores.durable_completes = {}
        state.ledger.restore_step = step
        state.ledger.completes = {}

    def _close(self, state: JobState, incident: OpenIncident, pending: PendingRebuild) -> Incident:
        acks = list(pending.acks.values())
        t_resumed = max(a.t_ready for a in acks)
        # Every member that held a rank before reports the last step it completed, wherever it
        # restores from (a survivor whose own buffers no longer hold the restore step fetches too).
        last_completed = max((a.last_completed_step for a in acks), default=NO_STEP)
        last_completed = max(last_completed, state.ledger.restore_step)
        agreed = pending.command.durable or pending.command.local  # the ranks agreed on the step themselves
        restored = max(a.restore_step for a in acks) if agreed else pending.command.restore_step
        phases = incident_phases(incident, acks)
        return Incident(
            job=state.job,
            generation=state.generation,
            incident_id=incident.incident_id,
            rank=incident.rank,
            member=incident.member,
            replacement=incident.replacement,
            reason=incident.reason,
            t_fault=incident.t_fault,
            t_detected=incident.t_detected,
            t_decided=incident.t_decided,
            t_resumed=t_resumed,
            restore_step=restored,
            lost_steps=max(0, last_completed - restored),
            phases=phases,
            evidence=incident.evidence,
            traceparent=incident.traceparent,
        )

    def tick(self, now: float) -> Decision:
        """Periodic work of every job (tests; the service ticks each job on its own)."""
        actions: list[Action] = []
        next_at = math.inf
        for job in list(self.jobs):
            decision = self.tick_job(job, now)
            actions += decision.actions
            next_at = min(next_at, decision.next_at)
        return Decision(actions, "tick", next_at, routine=True)

    @_phased
    def tick_job(self, job: str, now: float) -> Decision:
        """Time-driven work of one job: formation, the end of a last call, a vacant rank to fill, store
        loss, retransmissions. Returns, with the actions, when it next has work (`Decision.next_at`)."""
        clock = _Schedule(now, self.config.tick_idle_s)
        state = self.jobs.get(job)
        if state is None:
            return Decision([], "tick", clock.next_at, routine=True)
        if state.finished:
            # The job ended before every rank's first step was heard of: its incidents go out now.
            ended = self._end_incidents(state, now, force=True) if state.incident_log.awaiting_first_step else []
            if clock.due(state.finished_t + self.config.finished_kept_s):
                del self.jobs[job]
            return Decision(ended, "tick", clock.next_at, routine=True)
        if not state.started() and clock.due(state.membership.last_hello_t + self.config.unformed_kept_s):
            del self.jobs[job]
            return Decision(
                [], f"job {job} never formed: forgotten {self.config.unformed_kept_s} s after its last hello"
            )
        actions: list[Action] = []
        decided: Decision | None = None

        def act(decision: Decision) -> None:
            nonlocal decided
            actions.extend(decision.actions)
            decided = decision if decision.actions else decided

        protection = state.protection
        if protection.held_since is not None and clock.due(protection.held_since + protection.hold_without_stores_s):
            why = (
                f"every snapshot store was lost and none came back within {protection.hold_without_stores_s:.0f} s "
                "(the run's --hold-without-stores-s): training was held since committed step "
                f"{protection.unprotected_step}"
            )
            return self._end_job(state, now, why)
        first_step_by = state.incident_log.awaiting_since + self.config.first_step_wait_s
        if state.incident_log.awaiting_first_step and state.recovery.pending is None and clock.due(first_step_by):
            actions += self._end_incidents(state, now)
        gathered = not state.started() and len(state.membership.members) >= state.membership.world_size
        if gathered and (
            self._all_claimed(state) or clock.due(state.membership.last_hello_t + self.config.formation_grace_s)
        ):
            act(self._try_formation(state, now))  # waiting for a store: one announcing itself pokes the shell
        if state.recovery.hold_until and clock.due(state.recovery.hold_until):
            act(self._start_rebuild(state, now))
        elif self._rebuild_wanted(state):  # a vacant rank and a spare for it: retried until it goes out
            if self._stores_known(now):
                act(self._start_rebuild(state, now))
            else:
                clock.due(self._stores_known_at())
        actions += self._heal_placement(state, now, clock)
        retransmit = self.config.rebuild_retransmit_s
        if (
            state.recovery.pending is None
            and not state.stores.placement_confirmed
            and clock.due(state.stores.placement_sent_t + retransmit)
        ):
            state.stores.placement_sent_t = now  # until a step commits under it, a member may not have it
            clock.due(now + retransmit)
            placement = self._placement_message(state, "sent again")
            actions += [Publish(state.stores.delta_sent(placement)), Publish(placement)]
            actions += [Publish(r) for r in state.stores.reserving]
        if state.recovery.pending is None and clock.due(state.ledger.replicate_sent_t + retransmit):
            wanted = self._replicas_wanted(state, now)
            if wanted:
                state.ledger.replicate_sent_t = now
                clock.due(now + retransmit)
                actions += wanted
        pending = state.recovery.pending
        if pending is not None and clock.due(pending.t_sent + retransmit):
            pending.t_sent = now
            clock.due(now + retransmit)
            actions += [Publish(pending.delta_sent()), Publish(pending.command)]
            actions += [Publish(r) for r in state.stores.reserving]
        voided = 0 < state.recovery.void_generation == state.generation and state.recovery.pending is None
        if voided and clock.due(state.recovery.void_sent_t + retransmit):
            state.recovery.void_sent_t = now
            clock.due(now + retransmit)
            why = "waiting for a spare" if state.membership.vacant_ranks() else "waiting for the next generation"
            actions.append(Publish(GenerationVoid(state.job, state.generation, why, self._wall(now))))
        if decided is None:
            return Decision(actions, "tick", clock.next_at, routine=True)
        return Decision(actions, decided.reason, clock.next_at)

    @staticmethod
    def _all_claimed(state: JobState) -> bool:
        claimed = {
            m.rank_hint for m in state.membership.members.values() if 0 <= m.rank_hint < state.membership.world_size
        }
        return len(claimed) >= state.membership.world_size

    @staticmethod
    def _rebuild_wanted(state: JobState) -> bool:
        """A formed job has a vacant rank, a free spare for each, and no rebuild under way or held."""
        if not state.started() or state.recovery.pending is not None or state.recovery.hold_until:
            return False
        vacant = state.membership.vacant_ranks()
        return bool(vacant) and len(state.membership.spares) >= len(vacant)

    # ---------------------------------------------------------------- commits and completion

    @_phased
    def on_snapshot_complete(self, sc: SnapshotComplete, now: float) -> Decision:
        """A store's report of the ranks it sealed of one step: each rank counted where its placement
        puts it, then the newest complete step committed. O(ranks named + stores), never O(ranks)."""
        state = self.jobs.get(sc.job)
        if state is None or not state.started():
            return Decision([], f"snapshot of unknown or unformed job {sc.job}")
        if sc.generation < state.generation and sc.step > state.ledger.restore_step:
            return Decision([], f"snapshot step {sc.step} of generation {sc.generation} was abandoned: stale")
        pending = state.recovery.pending
        durable = pending is not None and pending.command.durable and sc.generation == pending.command.generation
        committed_again = sc.step == state.ledger.committed_step and sc.generation == state.ledger.committed_generation
        if not durable and not committed_again:
            if sc.step <= state.ledger.committed_step:
                return Decision([], f"snapshot step {sc.step} on {sc.store}: already committed")
            lead = sc.step - max(state.ledger.committed_step, state.ledger.restore_step, 0)
            if lead > self.config.snapshot_step_lead_max:
                return Decision([], f"snapshot step {sc.step} on {sc.store}: {lead} steps beyond the committed step")
        live = self._live_names(now)
        refused: list[str] = []
        changed = False
        sealed: list[int] = []
        placements = self._placements(state)
        placed_here = _placed_on(sc.store, placements)
        for rank, nbytes in zip(sc.ranks, sc.nbytes, strict=True):
            if rank >= state.membership.world_size:
                refused.append(f"rank {rank}: no such rank")
            elif not placed_here(rank):
                refused.append(f"rank {rank}: not placed there")
            elif durable:
                state.restores.durable_completes.setdefault(rank, set()).add(sc.store)  # the resumed step, sealed
                changed = True
            elif committed_again:
                holders = state.ledger.committed_holders.setdefault(rank, set())  # a replica made again, or a late copy
                changed = changed or sc.store not in holders
                holders.add(sc.store)
            else:
                state.ledger.rank_bytes[rank] = nbytes
                sealed.append(rank)
        if sealed:
            state.ledger.commit_progress.add(
                state.ledger.completes,
                sc.step,
                sealed,
                sc.store,
                live,
                state.stores.placement,
                state.membership.world_size,
            )
        what = f"snapshot step {sc.step} on {sc.store}: {len(sc.ranks) - len(refused)} rank(s)"
        if refused:
            what += f", {len(refused)} refused ({'; '.join(refused[:4])})"
        if durable or committed_again:
            kind = "resumed" if durable else "committed"
            return Decision([Persist(state.job)] if changed else [], f"{kind} {what}")
        committed = self._commit_newest(state, live, now)
        if committed is None:
            return Decision([], what)  # not saved: replayed from the stream if this leader stops
        return Decision(committed.actions, f"{what}; {committed.reason}")

    @staticmethod
    def _placements(state: JobState) -> list[list[list[str]]]:
        """The placements a store's report may follow: the job's, and the pending rebuild's. A report
        of a rank from a store neither puts it on counts for nothing (forged reports once committed a
        step far ahead)."""
        placements = [state.stores.placement]
        if state.recovery.pending is not None:
            placements.append(state.recovery.pending.command.placement)
        return placements

    def _commit_newest(self, state: JobState, live: frozenset[str], now: float) -> Decision | None:
        """Commit the newest step every rank has complete on the `live` stores, if any is newer than the
        committed one. Also asked before a restore is chosen: a complete read while its store's status
        was stale (after a pause) did not count then, and its store may have been heard since."""
        newly = state.ledger.commit_progress.complete_steps(
            state.ledger.completes, live, state.stores.placement, state.membership.world_size
        )
        if not newly:
            return None
        step = newly[-1]
        assert step > state.ledger.committed_step, "a committed step never goes back"
        if state.ledger.committed_step != NO_STEP:
            state.ledger.previous_committed = state.ledger.committed_copies()
        state.ledger.committed_step = step
        state.ledger.committed_generation = state.generation
        # the step's table is the committed holders now: dropped from the table below, nothing else holds it
        state.ledger.committed_holders = state.ledger.completes[step]
        state.stores.placement_confirmed = True
        state.stores.reserving = []  # every rank has uploaded to its stores: nothing left to fault in first
        state.ledger.commit_progress.drop_through(state.ledger.completes, step)
        commit = Commit(state.job, state.generation, step, state.ledger.snapshot_bytes_max(), self._wall(now))
        return Decision([Persist(state.job), Publish(commit)], f"step {step} committed")

    # ---------------------------------------------------------------- store loss, without a rebuild

    def _heal_placement(self, state: JobState, now: float, clock: _Schedule) -> list[Action]:
        """Keep the members' placement true within the generation:
        - a placed store lost (or the job holding fewer replicas than it could): the ranks placed again
          (only the lost store's move), and the committed step copied to their new stores;
        - a placed store heard on another address (restarted under its own name, whenever in the loss
          window): the placement sent again with the new address;
        - every store lost: a placement naming none, so members stop streaming to stores that are gone;
          the job is unprotected until one comes back, which the next placement says.
        Not while the stores' view is not fresh, nor while a rebuild is under way or held (it places the
        snapshots itself)."""
        if not state.started() or state.recovery.pending is not None or state.recovery.hold_until:
            return []
        placed = {name for names in state.stores.placement for name in names}
        for name in placed:  # the moment each placed store counts as lost, should it stay silent
            store = self.stores.get(name)
            if store is not None:
                clock.due(store.last_seen + self.config.store_timeout_s + STORE_LOSS_MARGIN_S)
        if not self._stores_known(now):
            clock.due(self._stores_known_at())
            return []
        live = self.live_stores(now)
        names = {s.store for s in live}
        self._note_protection(state, now, bool(live))
        if not live:
            actions: list[Action] = []
            if placed:
                before, state.stores.placement = state.stores.placement, [[] for _ in state.stores.placement]
                held = state.protection.hold_without_stores_s > 0 and state.recovery.formed
                how = "training is held" if held else "training goes on unprotected"
                why = f"every snapshot store is lost ({sorted(placed)}): {how}"
                actions += self._new_placement(state, now, why, before)
            return actions + self._hold_training(state, now)
        if state.protection.held_since is not None:
            return self._resume_training(state, now)
        moved = under_placed(state.stores.placement, names, self.config.replication)
        readdressed = sorted(
            n
            for n in placed & names
            if (self.stores[n].host, self.stores[n].port) != state.stores.announced_stores.get(n)
        )
        if not moved and not readdressed:
            return []
        before = state.stores.placement
        if moved:
            state.stores.placement = place_snapshots(
                state.membership.ranks,
                state.membership.members,
                live,
                self.config.replication,
                state.ledger.rank_bytes,
                state.stores.placement,
            )
        lost = sorted(placed - names)
        if lost:
            reason = f"stores lost: {lost}"
        elif readdressed:
            reason = f"stores on a new address: {readdressed}"
        else:
            reason = "stores came back: more replicas"
        actions = self._new_placement(state, now, reason, before)
        return actions + _reservations(state, before, frozenset(readdressed))

    def _hold_training(self, state: JobState, now: float) -> list[Action]:
        """Every store is lost and the run holds training then: the generation is voided, so every rank
        stops at once (the step in flight abandoned) and awaits the next one, which comes when a store
        returns (`_resume_training`) or, past the run's bound, the job's end."""
        if state.protection.hold_without_stores_s <= 0 or not state.recovery.formed:
            return []
        first = state.protection.held_since is None
        if first:
            state.protection.held_since = now
        why = (
            f"every snapshot store is lost: training is held until one returns "
            f"(at most {state.protection.hold_without_stores_s:.0f} s)"
        )
        voided = self._void(state, now, why)  # again for a generation that formed meanwhile (a rank's swap)
        return [Persist(state.job), *voided] if first or voided else []

    def _resume_training(self, state: JobState, now: float) -> list[Action]:
        """A store is back while training is held: the same members regroup, each restoring the newest
        step every rank holds in its own buffers (no store holds their state), and stream on."""
        state.protection.held_since = None
        if state.membership.vacant_ranks():  # a rank was lost meanwhile: its rebuild restores and places (the tick)
            return [Persist(state.job)]
        decision = self._publish_rebuild(state, now, set(), "a store is back: training resumes", local=True)
        return [Persist(state.job), *decision.actions]

    def _new_placement(self, state: JobState, now: float, reason: str, before: list[list[str]]) -> list[Action]:
        """Publish the placement that follows `before` (the newest version's, sent and heard): as its
        changes from it first, which is all a member that holds it needs, then whole."""
        state.stores.placement_version += 1
        state.stores.reserving = []  # those of the placement before (`_reservations` says this one's)
        state.stores.placement_sent_t, state.stores.placement_confirmed = now, False
        state.ledger.replicate_sent_t = now
        message = self._placement_message(state, reason)
        state.stores.delta = placement_delta_of(message, message.version - 1, before)
        actions: list[Action] = [Persist(state.job), Publish(state.stores.delta), Publish(message)]
        return actions + self._replicas_wanted(state, now)

    def _placement_message(self, state: JobState, reason: str) -> Placement:
        named = sorted({name for names in state.stores.placement for name in names})
        stores = [StoreAddress(n, self.stores[n].host, self.stores[n].port) for n in named if n in self.stores]
        state.stores.announced_stores = {a.store: (a.host, a.port) for a in stores}
        return Placement(
            state.job,
            state.generation,
            state.stores.placement_version,
            stores,
            state.stores.placement,
            clip_text(reason),
        )

    @staticmethod
    def _note_protection(state: JobState, now: float, protected: bool) -> None:
        """Track whether any store receives the job's snapshots: while none does, a lost rank's state
        exists nowhere but in the durable tier (if any), and status, metrics and logs say so."""
        if protected:
            state.protection.unprotected_since = None
        elif state.protection.unprotected_since is None:
            state.protection.unprotected_since, state.protection.unprotected_step = now, state.ledger.committed_step

    def _replicas_wanted(self, state: JobState, now: float) -> list[Action]:
        """Copies of the committed step to make: from a surviving holder to each store of the rank's
        placement that lacks it, until the rank has as many live copies as its placement names."""
        if state.ledger.committed_step == NO_STEP or not state.ledger.committed_holders:
            return []
        live = {s.store: s for s in self.live_stores(now)}
        live_names = live.keys()
        committed_holders = state.ledger.committed_holders
        actions: list[Action] = []
        for rank, placed in enumerate(state.stores.placement):
            held = committed_holders.get(rank)
            if not held or held.issuperset(placed):
                continue  # none held (below), or every store of its placement holds it
            holders = sorted(held & live_names)
            if not holders:
                continue  # every copy of it is gone: the next commit, or a rebuild, has to do
            short = len(placed) - len(holders)
            for target in [n for n in placed if n not in holders and n in live][: max(0, short)]:  # not live: later
                address = live[target]
                actions.append(
                    Publish(
                        Replicate(
                            state.job,
                            state.generation,
                            rank,
                            state.ledger.committed_step,
                            holders[0],
                            StoreAddress(address.store, address.host, address.port),
                        ),
                    )
                )
        return actions

    def replicas_short(self, job: str, now: float) -> int:
        """Ranks whose committed step has fewer live copies than their placement names (status, tests)."""
        state = self.jobs.get(job)
        if state is None or state.ledger.committed_step == NO_STEP:
            return 0
        live = self._live_names(now)
        return sum(
            len(state.ledger.committed_holders.get(rank, set()) & live) < len(placed)
            for rank, placed in enumerate(state.stores.placement)
        )

    @_phased
    def on_done(self, done: MemberDone, now: float) -> Decision:
        state = self.jobs.get(done.job)
        if state is not None and state.finished:  # a member retransmits until it hears: tell it again
            finished = JobFinished(
                state.job, state.generation, done.step, failed=bool(state.failed_reason), reason=state.failed_reason
            )
            return Decision([Publish(finished)], f"done from {done.member}: the job has finished")
        if state is None or done.generation != state.generation or done.member not in state.membership.ranks:
            return Decision([], f"done from {done.member} in generation {done.generation}: stale")
        if done.rank >= len(state.membership.ranks) or state.membership.ranks[done.rank] != done.member:
            return Decision([], f"done from {done.member} for rank {done.rank}, which it does not hold: refused")
        if done.step < state.ledger.committed_step:
            return Decision([], f"done from {done.member} at step {done.step}, below the committed step: refused")
        state.membership.done[done.member] = done.step  # a member's later report replaces its earlier one
        if len(state.membership.done) < state.membership.world_size or state.recovery.pending is not None:
            return Decision([], f"{len(state.membership.done)} of {state.membership.world_size} ranks done")
        if len(set(state.membership.done.values())) > 1:  # every rank ends at the job's last step, or none has ended
            return Decision(
                [], f"ranks done at different steps {sorted(set(state.membership.done.values()))}: not finished"
            )
        state.finished, state.finished_t = True, now
        finished = JobFinished(state.job, state.generation, done.step)
        return Decision([Persist(state.job), Publish(finished)], f"job finished at step {done.step}")


INCIDENT_OWN_EVIDENCE = ("restore_link", "restore_reason", "first_step", "lost_committed_steps")
"""The entries the swapper adds to an incident's evidence, beside what the verdict showed."""


def _incident_evidence(shown: Mapping[str, str]) -> dict[str, str]:
    """What an incident keeps of a verdict's evidence: its first entries, leaving room for the swapper's
    own, so that the incident (published, and kept in the job record) stays within its bound."""
    room = EVIDENCE_ENTRIES_MAX - len(INCIDENT_OWN_EVIDENCE)
    return {k: v for k, v in itertools.islice(shown.items(), room) if k not in INCIDENT_OWN_EVIDENCE}


def _span(end: float, start: float) -> float:
    return max(0.0, end - start)


def incident_phases(incident: OpenIncident, acks: list[RebuildAck]) -> dict[str, float]:
    """Durations of the recovery phases, from the incident's times and every rank's time marks.

    detect: fault -> verdict; decide: verdict -> command; fence: kill of a possibly-alive member;
    abort: fault -> the last survivor out of the broken collective; notify: command -> the last
    member has it; restore / rendezvous / apply: the slowest member's state load, new process group,
    and re-wrap with optimizer state. Phases overlap (survivors abort while the detector decides).
    """

    def slowest(spans: Iterable[tuple[float | None, float | None]]) -> float:
        return max((_span(end, start) for end, start in spans if end is not None and start is not None), default=0.0)

    marks = [a.marks for a in acks]
    outs = [m.out for m in marks if m.out is not None]
    return {
        "detect": _span(incident.t_detected, incident.t_fault),
        "decide": _span(incident.t_decided, incident.t_detected),
        "fence": incident.fence_s,
        "abort": _span(max(outs), incident.t_fault) if outs else 0.0,
        "notify": max(
            (_span(incident.t_decided if m.received is None else m.received, incident.t_decided) for m in marks),
            default=0.0,
        ),
        "restore": slowest((m.restored, m.begin) for m in marks),
        "rendezvous": slowest((m.rendezvous, m.restored) for m in marks),
        "apply": slowest((m.ready, m.rendezvous) for m in marks),
    }


def _same_process(known: MemberInfo, hello: MemberHello) -> bool:
    """A repeated hello comes from the process that registered (a restarted process is a new member):
    where it runs, its launcher and its rendezvous endpoint never change."""
    return (known.host, known.pid, known.launcher, known.rendezvous_host, known.rendezvous_port) == (
        hello.host,
        hello.pid,
        hello.launcher,
        hello.rendezvous_host,
        hello.rendezvous_port,
    )
