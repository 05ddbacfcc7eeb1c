"""The detector's decision core: signals in, at most one `Failure` per member out. No I/O.

Signals: a launcher's report that a process ended, a member's report of its own fatal error,
heartbeats (silence longer than `heartbeat_timeout_s` is a failure), and step progress carried by the
heartbeats. Every verdict carries its reason and evidence.

Clocks. Each function takes `now`, a monotonic clock's reading in seconds (`time.monotonic()` in the
service; a fake clock in tests): every timeout, silence, wait and back-off here is a difference of two
such readings, so a step of the wall clock (an NTP correction, a VM resumed, an operator's `date -s`)
neither fires a verdict nor delays one. Wall-clock instants appear only in what is reported
(`Failure.t_fault`/`t_detected`, `GroupBroken` times, `Straggler.t`), converted at the moment of
reporting with `wall_offset()` (wall minus monotonic now; injectable so a test can step the wall
clock). Instants other hosts stamped (an exit's `t_exit`, an error report's `t`) are passed on as they are.

Hangs. A member whose heartbeats go on but whose step counter has not moved for longer than the hang
threshold, `max(hang_floor_s, hang_factor x the job's recent median step time)` (before the job has
step times: `max(hang_floor_s, first_step_s)`), is hung, unless its training thread is waiting on its
peers (inside torch's distributed/autograd code, as its heartbeat says): when one rank hangs, the
others block in the collective waiting for it, and only the one that is not waiting is to blame. A
culprit needs a waiting peer: if every stalled rank is busy in its own code at once (all in a long
evaluation, a GC pause, a slow shared filesystem), that is a job-wide pause, not W hangs, and nobody is
declared (a bench run showed all four ranks fenced for one slow step). If every stalled member is
waiting, nobody is declared either (the culprit is unknown; the process group's own timeout ends it)
and `stalls` says so.

Work the user marks as a section (`job.section("evaluation")`) suspends the hang rule for that member:
the step clock restarts when the section ends. Heartbeat silence is still a failure inside a section.

Stragglers. In synchronous training every rank takes the same time per step; a slow rank shows as the
one whose training thread is busy (not waiting on peers) while the others wait. A rank busy for
`straggler_factor` times the median rank's share over the last `straggler_window` heartbeats, and at
least `straggler_margin` more, is reported once per generation (an event, not a failure).

A lost host: when a silent member's host-mates are all silent for half the timeout too, they are declared
in the same pass, each failure saying how many members of the host went silent, so the swapper can
replace them in one generation.

No verdict from silence the detector did not see: after an outage of its own connection, or a pause of
its own longer than half the heartbeat timeout, `grace(now)` restarts every member's clocks.

A broken group with nobody to blame. A member that left a broken collective (or gave up forming a
generation's group) says in its heartbeats that it awaits a rebuild; a member carrying one out says it
is rebuilding. Both are waiting (on the control plane), never culprits. When every rank of the current
generation has awaited a rebuild *in that generation* for `regroup_after_s` (by default the heartbeat
timeout, so a member that died silently is declared first) and nobody was declared, the group broke
by itself (a connection reset, a collective timed out everywhere, a rendezvous nobody could reach):
`broken_groups` reports it as a `GroupBroken`, and again every `regroup_after_s` while it stays broken
(the swapper ignores the repeats; one lost report must not leave the job waiting), and the swapper
regroups the same members. Members still rebuilding, or beating from an older generation, are not
awaiting: formation and restores may take long. When every rank but some has left and
awaited that long, and those few are still inside a step of the current generation with no step for
the hang threshold, they are left behind: declared hung even though they look like they wait (a call
that never returns inside torch's code, which the stack probe cannot tell from waiting on peers).

A member that stays in its rebuild. A member carrying out the rebuild of the current generation says
so (`rebuilding`) and counts as waiting, so neither the hang rule nor a broken group can name it. Past
the rendezvous every rank of the generation is in the same group, so once one rank has finished its
rebuild (it beat in the generation, neither rebuilding nor awaiting), the others are at most the local
work of re-wrapping and sealing behind it: a rank still rebuilding `rebuild_lag_s` after the first rank
of its generation finished is declared `hang`, with evidence saying how long after which rank (seen:
a rank that never left its rebuild while its peer's first collective timed out and awaited a
rebuild, and nobody acted for minutes). A rank still carrying out an *older* generation's rebuild
`rebuild_lag_s` after a newer generation that names it was announced is stuck too: every wait of a
superseded rebuild is broken the moment the newer command arrives, so only user code (re-wrapping,
the optimizer factory) can hold it, and the newer generation cannot form without it. `rebuild_max_s`
is the absolute backstop, see `DetectorConfig`.

A member is declared failed once, ever: member ids are unique per process and a declared member is
fenced, so a second verdict could only be a duplicate. But a verdict is not done with once published:
it stays *unanswered* until a rebuild answers it (a rebuild of a newer generation that no longer names
the member, or the job's end), and `repeats(now)` publishes it again (the same verdict) after
`redeclare_after_s`, then at a doubling interval capped at `redeclare_max_s`: a verdict lost on its
way (a publisher that gave up, JetStream away longer than anyone waited) comes again, and the swapper
drops the repeats of one it had (a failure of a member that is no longer live is a no-op). A rebuild
that still names the member is proof the swapper has not acted: the next repeat comes
`redeclare_after_s` after the last, and the interval starts doubling again. A verdict on a spare is
answered the same way (a later generation whose spares no longer name it).

A restarted detector loads each job's ranks, spares and declared members from the job record
(`load_job`) and watches them at once: a rank whose heartbeat does not come back is declared after the
heartbeat timeout, like any other.

Who is watched. Only members a rebuild or the job record named: a job's key could otherwise make the
detector watch members it invents (5,000 forged heartbeats once became 5,000 stored failure events).
A member heard of first (a spare's heartbeat between its hello and the next rebuild, a report or an exit)
is noted as unnamed (`JobView.unnamed`, bounded) and not watched; while one heard of lately stays
unnamed, the service reads the job's record again (`records_wanted`, at most every `RECORD_REREAD_S`),
where the swapper lists every member it accepted, and `name_from_record` names those it lists. An exit
or a report of a member still unnamed after that is refused: no verdict, no event.
"""

from __future__ import annotations

import statistics
import time
from bisect import bisect_left
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from itertools import repeat

from deadpool_protocol import (
    FIRST_STEP_SECTION,
    NO_RANK,
    ChildExit,
    Failure,
    FailureReason,
    GroupBroken,
    Heartbeat,
    HeartbeatBatch,
    JobFinished,
    MemberDone,
    MemberError,
    MemberErrorCause,
    Rebuild,
    Straggler,
)
from deadpool_protocol.job_record import JobSummary
from deadpool_protocol.messages import members_digest
from deadpool_protocol.timeouts import HEARTBEAT_PERIOD_S_DEFAULT

__all__ = ["DetectorConfig", "DetectorCore", "JobView", "Unanswered", "Watched", "wall_minus_monotonic"]

STEP_TIMES_KEPT = 64
BUSY_KEPT = 1024
BUSY_SAMPLES_PER_BEAT_MAX = 10
"""The most heartbeat periods one beat stands for in `busy` (a second at 10 Hz)."""
DECLARED_KEPT = 4096
"""Verdicts remembered per job (to drop repeats and to publish again one the swapper missed); the
unanswered ones, repeated until a rebuild answers them, are among these, so they are bounded too."""
UNNAMED_KEPT_MAX = 4096
"""Unnamed members remembered per job; past it, more are ignored until the oldest are forgotten."""
UNNAMED_KEPT_S = 60.0
"""How long an unnamed member is remembered."""
LAUNCHERS_KEPT_MAX = 65_536
"""Launchers whose last batch is remembered per job (`JobView.launcher_seen`): past it, new ones are not."""
NAMING_WAIT_S = 10.0
"""How long after an unnamed member was first heard of the job record is read again for it (the
swapper writes a spare into the record as it accepts its hello)."""
RECORD_REREAD_S = 1.0
"""The least time between two reads of one job's record for unnamed members."""


def wall_minus_monotonic() -> float:
    """The wall clock's reading minus the monotonic clock's, now: a monotonic instant plus this is the
    wall-clock instant to report (it changes when the wall clock is stepped; the monotonic one does not)."""
    return time.time() - time.monotonic()


@dataclass(frozen=True)
class DetectorConfig:
    heartbeat_timeout_s: float = 5.0
    hang_factor: float = 10.0
    hang_floor_s: float = 10.0
    first_step_s: float = 120.0
    """The hang threshold while the job has no step times yet (its first step may compile, load data...)."""
    straggler_factor: float = 2.0
    straggler_margin: float = 0.2
    straggler_window: int = 300
    """Heartbeats (30 s at 10 Hz): long enough that a rank's GC pause or slow batch is not a straggler."""
    regroup_after_s: float = 0.0
    """How long every rank must await a rebuild, nobody failed, before the group is reported broken;
    0 means the heartbeat timeout (a member that died without a word is declared by then)."""
    redeclare_after_s: float = 1.0
    """A verdict no rebuild answered yet is published again this long after it, then at a doubling
    interval; when a rebuild still names the member, again this long after the last time."""
    redeclare_max_s: float = 30.0
    """The longest interval between two publications of an unanswered verdict (one small event per
    member this often while, say, a job waits for a spare)."""
    rebuild_lag_s: float = 30.0
    """A rank still rebuilding the current generation this long after another rank of it finished its
    rebuild is declared hung. Past the rendezvous what is left is local (re-wrapping, the optimizer,
    the step-0 snapshot of a formation), which takes every rank about as long."""
    rebuild_max_s: float = 600.0
    """The backstop: a rank rebuilding one generation for this long is declared hung whatever its
    peers do (0: no backstop). For it: without it, a rebuild where every rank is stuck past the
    rendezvous (the same deadlock in every rank's re-wrap or optimizer factory) has nobody finished to
    compare with and holds the job for ever, since no rank awaits and no collective runs. Against it:
    heartbeats do not say which state a rebuild is in, so the bound covers restores too, which grow
    with the model and the tier restored from; and with no rank finished there is no culprit, so every
    stuck rank is swapped at once and spares may meet the same cause (the swapper's
    `rebuild_attempts_max` then ends the job with a reason). So it is kept, far above any honest
    rebuild (the formation's snapshot wait is 120 s), and a job with longer restores raises it."""
    generation_lead_max: int = 1
    """How far ahead of the newest generation a rebuild (or the job record) announced a heartbeat may
    claim to be: a member beats in g+1 a moment before the detector hears of rebuild g+1, but a beat
    from generation 2**62 would make every real rebuild look stale."""
    jobs_max: int = 1000
    """Jobs watched at once; heartbeats of one more job are refused until a job is pruned."""
    finished_kept_s: float = 600.0
    """A finished job is forgotten this long after it finished."""
    idle_job_s: float = 3600.0
    """A job nothing was heard of for this long (a job name made up on the bus, say) is forgotten."""

    @property
    def regroup_wait_s(self) -> float:
        return self.regroup_after_s or self.heartbeat_timeout_s

    def __post_init__(self) -> None:
        if self.heartbeat_timeout_s <= 0:
            raise ValueError("heartbeat_timeout_s must be positive")
        if self.hang_factor < 1 or self.first_step_s <= 0:
            raise ValueError("hang_factor must be at least 1 and first_step_s positive")
        if self.hang_floor_s <= self.heartbeat_timeout_s:
            raise ValueError(
                f"hang_floor_s ({self.hang_floor_s}) must exceed heartbeat_timeout_s ({self.heartbeat_timeout_s}): "
                "a silent member is a heartbeat failure before it can be a hang"
            )
        if 0 < self.regroup_after_s < self.heartbeat_timeout_s:
            raise ValueError(
                f"regroup_after_s ({self.regroup_after_s}) must be at least heartbeat_timeout_s "
                f"({self.heartbeat_timeout_s}): a member that died silently must be declared before a regroup"
            )
        if self.straggler_factor <= 1 or not 2 <= self.straggler_window <= BUSY_KEPT:
            raise ValueError(f"straggler_factor must exceed 1 and straggler_window be 2 to {BUSY_KEPT}")
        if not 0 < self.redeclare_after_s <= self.redeclare_max_s:
            raise ValueError("redeclare_after_s must be positive and at most redeclare_max_s")
        if self.rebuild_lag_s <= 0 or self.rebuild_max_s < 0:
            raise ValueError("rebuild_lag_s must be positive and rebuild_max_s not negative")
        if self.rebuild_max_s and self.rebuild_max_s <= self.rebuild_lag_s:
            raise ValueError(
                f"rebuild_max_s ({self.rebuild_max_s}) must exceed rebuild_lag_s ({self.rebuild_lag_s}), or be 0"
            )


@dataclass(slots=True)
class Watched:
    member: str
    rank: int
    last_seen: float
    """When its last heartbeat arrived (monotonic, like every instant the core keeps)."""
    last_step: int = -1
    pid: int = 0
    done: bool = False
    progress_t: float = 0.0
    """When the step counter last moved (or the member's clocks were last restarted)."""
    waiting: bool = False
    """Waiting on its peers (in torch's collective code) or on the control plane (awaiting a rebuild)."""
    on_control_plane: bool = False
    """Its last whole beat said it awaits or carries out a rebuild (a name's `waiting` bit adds to it)."""
    awaiting_since: float = 0.0
    """Since when its heartbeats say it awaits a rebuild (0: it does not)."""
    in_step: bool = False
    rebuilding_since: float = 0.0
    """Since when its heartbeats say it carries out the rebuild of `beat_generation` (0: they do not)."""
    rebuilt: tuple[int, float] = (0, 0.0)
    """(generation, when): its first heartbeat of that generation neither rebuilding nor awaiting
    (it finished its rebuild). Kept when it later awaits: it did finish."""
    beat_generation: int = 0
    """The generation its last heartbeat was sent in (behind the job's while it has not joined a newer one)."""
    where: str = ""
    section: str = ""
    host: str = ""
    phase: str = ""
    """Its last heartbeat's `MemberPhase`, and the state of its rebuild if one is under way (for `deadpool status`)."""
    rebuild_state: str = ""
    local_step: int = -1
    """The newest step its own buffers hold whole (its crash copy on its host), for `deadpool status`."""
    snapshot_every: int = 1
    """The job's snapshot interval as it knows it, for `deadpool status`."""
    busy_total: int = 0
    """Heartbeat periods in which the training thread was in a step and not waiting on peers, counted
    since `busy` was last cleared."""
    busy: deque[int] = field(default_factory=lambda: deque(maxlen=BUSY_KEPT))
    """`busy_total` before each of the last heartbeat periods (one per period, up to `BUSY_KEPT`): the
    busy share of any window is one subtraction (`busy_share`), not a sum over the window per rank."""
    sampled_t: float = 0.0
    """When `busy` was last sampled (`_sample_busy`)."""
    named_rank: int = NO_RANK
    """The rank the newest rebuild (or the job record) named it to; NO_RANK: a spare, or not named."""
    named_in: int = 0
    """The generation that named it to `named_rank`: before it, a member promoted there was a spare."""
    launcher: str = ""
    """The launcher that forwarded its first batched heartbeat: the one that runs it, and the only one
    whose report of its exit is taken ('' until then)."""

    def busy_share(self, window: int) -> float:
        """The share of the last `window` heartbeat periods it was busy in (`window` <= len(busy))."""
        return (self.busy_total - self.busy[-window]) / window


@dataclass
class Unanswered:
    """A verdict this detector published that no rebuild has answered yet."""

    failure: Failure
    sent_t: float
    """When it was last published (monotonic)."""
    wait_s: float
    """How long after `sent_t` it is published again."""


@dataclass
class JobView:
    job: str
    generation: int = 0
    generation_t: float = 0.0
    """When the current generation was first heard of (a rebuild, a heartbeat, the job record)."""
    announced: int = 0
    """The newest generation a rebuild or the job record announced (heartbeats may lead it by little)."""
    finished: bool = False
    finished_t: float = 0.0
    finished_generation: int = 0
    """The generation the job finished in: a rebuild of a newer one is the name's next run."""
    heard_t: float = 0.0
    """When anything was last heard of the job (for pruning)."""
    members: dict[str, Watched] = field(default_factory=dict)
    declared: dict[str, Failure | None] = field(default_factory=dict)
    """Members declared failed, with the verdict this detector published (None: loaded from KV)."""
    unanswered: dict[str, Unanswered] = field(default_factory=dict)
    """This detector's verdicts that no rebuild answered yet: published again until one does."""
    step_times: deque[float] = field(default_factory=lambda: deque(maxlen=STEP_TIMES_KEPT))
    """Recent step durations of the job's ranks, seconds."""
    stragglers_reported: set[tuple[int, str]] = field(default_factory=set)
    broken_reported: tuple[int, float] = (0, 0.0)
    """(generation, when) of the last broken-group report: repeated every regroup wait while broken."""
    declared_in: int = 0
    """The generation of the last rank declared failed (a group with a failed rank is not 'broken')."""
    unnamed: dict[str, float] = field(default_factory=dict)
    """Members heard of that no rebuild or job record named, with when first heard: not watched."""
    record_read_t: float = float("-inf")
    """When the job record was last read for unnamed members."""
    launcher_seen: dict[str, float] = field(default_factory=dict)
    """Launcher -> when its last batch arrived. A launcher sends one every period, empty when none of
    its members beat (`deadpool.launcher`): one gone silent went with its host, or is cut off with it."""
    heard_since: float = float("-inf")
    """Every watched member was last heard at or after this: a lower bound of their `last_seen`, which
    only grows, and a member is watched from when it is named. The silence check, every 50 ms, passes
    over every member only once the heartbeat timeout has run past it (`DetectorCore.overdue`): about
    once per timeout, not 20 times a second (at 16,384 members that pass was a tenth of the detector's
    CPU)."""
    progressed_since: float = float("-inf")
    """Every watched member's step clock (`Watched.progress_t`) started at or after this: the hang rules'
    lower bound, lowered where a clock is set to a beat's time (`_progressed`), which may be older."""
    rebuilding: set[str] = field(default_factory=set)
    """Members whose beat said they were rebuilding (`Watched.rebuilding_since` set): the ones the
    stuck-in-rebuild rule looks at, instead of every member 4 times a second. Some may have finished or
    left since: the rule checks each, and forgets those."""


class DetectorCore:
    def __init__(self, config: DetectorConfig, wall_offset: Callable[[], float] = wall_minus_monotonic) -> None:
        self.config = config
        self.wall_offset = wall_offset
        """Wall minus monotonic, read when a stamp is reported (tests inject one to step the wall clock)."""
        self.jobs: dict[str, JobView] = {}

    def _wall(self, t: float) -> float:
        """The wall-clock instant of monotonic instant `t`, by the wall clock as it reads now."""
        return t + self.wall_offset()

    def _view(self, job: str) -> JobView:
        view = self.jobs.get(job)
        if view is None:
            view = self.jobs[job] = JobView(job)
        return view

    def on_heartbeat(self, hb: Heartbeat, now: float, launcher: str = "") -> str:
        """Take a heartbeat in (forwarded by `launcher` in its batch, or '' if sent directly); returns why
        it was refused ('' when taken)."""
        view = self.jobs.get(hb.job)
        if view is None:
            if len(self.jobs) >= self.config.jobs_max:
                return f"already watching {len(self.jobs)} jobs (jobs_max)"
            view = self._view(hb.job)
        if hb.generation > view.announced + self.config.generation_lead_max:
            return f"generation {hb.generation} is far ahead of the newest announced, {view.announced}"
        view.heard_t = now
        if hb.member in view.declared:
            return ""  # a declared member is being fenced; its last words change nothing
        self._generation(view, hb.generation, now)
        watched = view.members.get(hb.member)
        if watched is not None and launcher and watched.launcher and launcher != watched.launcher:
            return f"launcher {launcher} forwards a beat of {hb.member}, run by launcher {watched.launcher}"
        if watched is None:
            self._note_unnamed(view, hb.member, now)
            return ""  # a spare not yet named, or a member nobody accepted: not watched
        watched.launcher = watched.launcher or launcher
        watched.last_seen = max(watched.last_seen, now)  # `now`: when the beat was sent (its age less)
        if hb.step != watched.last_step:
            if hb.rank >= 0 and watched.last_step >= 0 and hb.step > watched.last_step:
                view.step_times.append((now - watched.progress_t) / (hb.step - watched.last_step))
            _progressed(view, watched, now)
        watched.last_step = hb.step
        watched.pid = hb.pid
        watched.phase, watched.rebuild_state = hb.phase, hb.rebuild_state or ""
        watched.local_step, watched.snapshot_every = hb.local_step, hb.snapshot_every
        watched.on_control_plane = hb.awaiting_rebuild or hb.rebuilding
        watched.waiting = hb.waiting or watched.on_control_plane
        awaiting = hb.awaiting_rebuild and not hb.rebuilding and hb.generation >= view.generation
        if not awaiting:
            watched.awaiting_since = 0.0
        elif not watched.awaiting_since:
            watched.awaiting_since = now
        if not hb.rebuilding:
            watched.rebuilding_since = 0.0
            if hb.rank >= 0 and not hb.awaiting_rebuild and watched.rebuilt[0] != hb.generation:
                watched.rebuilt = (hb.generation, now)
        elif not watched.rebuilding_since or hb.generation != watched.beat_generation:
            watched.rebuilding_since = now
            view.rebuilding.add(hb.member)
        watched.where = hb.where
        if _suspends_hang_rule(hb.section) or _suspends_hang_rule(watched.section):
            _progressed(view, watched, now)  # inside a named section no step is expected; the clock starts after it
        watched.section = hb.section
        watched.host = hb.host
        watched.in_step = hb.in_step
        watched.beat_generation = hb.generation
        _sample_busy(watched, hb.in_step and not watched.waiting, now)
        if hb.generation >= view.generation:
            if watched.rank != hb.rank:
                _progressed(view, watched, now)  # a spare that just got a rank: its step clock starts now
            watched.rank = hb.rank
        return ""

    def on_batch(self, batch: HeartbeatBatch, now: float) -> list[tuple[str, str]]:
        """A launcher's batch, arrived at `now`: each beat and name dated by `now` less its age in the
        launcher (`HeartbeatBatch.ages_ms`), so a silence is timed from a member's last beat however
        long the launcher gathered beats. Returns (member, why) for each one refused."""
        view = self.jobs.get(batch.job)
        if view is not None and (batch.launcher in view.launcher_seen or len(view.launcher_seen) < LAUNCHERS_KEPT_MAX):
            view.launcher_seen[batch.launcher] = now
        refused = [
            (hb.member, self.on_heartbeat(hb, now - batch.age_s(i), batch.launcher)) for i, hb in enumerate(batch.beats)
        ]
        whole = len(batch.beats)
        bits: list[bool | None] = [*batch.alive_waiting] or [None] * len(batch.alive)
        refused += [
            (m, self.on_alive(batch, m, now - batch.age_s(whole + i), waiting))
            for i, (m, waiting) in enumerate(zip(batch.alive, bits, strict=True))
        ]
        return [(member, why) for member, why in refused if why]

    def on_alive(self, batch: HeartbeatBatch, member: str, now: float, waiting: bool | None = None) -> str:
        """`member` beat again, saying what its last whole beat said (`HeartbeatBatch.alive`): alive
        now, in the state last heard, but `waiting` now if the batch says (None: as last heard). Refused
        as a beat would be (a job not heard of, a generation far ahead, another launcher's member);
        returns why ('' when taken)."""
        view = self.jobs.get(batch.job)
        if view is None:
            return "a beat named alive before any whole beat of its job"
        if batch.generation > view.announced + self.config.generation_lead_max:
            return f"generation {batch.generation} is far ahead of the newest announced, {view.announced}"
        view.heard_t = now
        if member in view.declared:
            return ""
        watched = view.members.get(member)
        if watched is None:
            self._note_unnamed(view, member, now)
            return ""
        if watched.launcher and batch.launcher != watched.launcher:
            return f"launcher {batch.launcher} forwards a beat of {member}, run by launcher {watched.launcher}"
        watched.launcher = batch.launcher
        watched.last_seen = max(watched.last_seen, now)
        if waiting is not None:
            watched.waiting = waiting or watched.on_control_plane
        if _suspends_hang_rule(watched.section):
            _progressed(view, watched, now)
        _sample_busy(watched, watched.in_step and not watched.waiting, now)
        return ""

    def on_rebuild(self, rebuild: Rebuild, now: float) -> None:
        """Learn the rank map. Members named there are watched from now on, even before they beat.
        It answers the unanswered verdicts of the members it no longer names, if it is newer than them;
        one it still names is published again soon (`repeats`)."""
        view = self._view(rebuild.job)
        if view.finished and rebuild.generation > view.finished_generation:
            # The name runs again (a new run, its generations going on): watched afresh.
            self.jobs[rebuild.job] = view = JobView(
                rebuild.job, generation=view.generation, announced=view.announced, declared=view.declared
            )
        self._answer(view, rebuild)
        view.heard_t = now
        view.announced = max(view.announced, rebuild.generation)
        if rebuild.generation < view.generation:
            return
        newer = rebuild.generation > view.generation
        self._generation(view, rebuild.generation, now)
        for member in [*rebuild.ranks, *rebuild.spares]:
            view.unnamed.pop(member, None)
            if member not in view.members and member not in view.declared:
                view.members[member] = Watched(member, NO_RANK, now, progress_t=now)
        rank_of = {member: rank for rank, member in enumerate(rebuild.ranks)}  # O(n): thousands of members
        for member, watched in view.members.items():
            rank = rank_of.get(member, NO_RANK)
            if rank != watched.named_rank:
                watched.named_in = rebuild.generation
            watched.rank = watched.named_rank = rank
            if newer:  # a new generation: rendezvous and restore take time; step clocks start again
                watched.progress_t = now
                watched.awaiting_since = 0.0  # awaiting counts again only in the new generation
                watched.busy.clear()
                watched.busy_total = 0

    @staticmethod
    def _generation(view: JobView, generation: int, now: float) -> None:
        if generation > view.generation:
            view.generation, view.generation_t = generation, now

    def _answer(self, view: JobView, rebuild: Rebuild) -> None:
        if not view.unanswered:
            return
        named = {*rebuild.ranks, *rebuild.spares}
        for member, unanswered in list(view.unanswered.items()):
            if member in named:  # the swapper still counts on it: it has not had the verdict
                unanswered.wait_s = self.config.redeclare_after_s
            elif rebuild.generation > unanswered.failure.generation:
                del view.unanswered[member]

    def repeats(self, now: float) -> list[Failure]:
        """The unanswered verdicts due to be published again (see the module docstring)."""
        c = self.config
        again: list[Failure] = []
        for view in self.jobs.values():
            for unanswered in view.unanswered.values():
                if now - unanswered.sent_t >= unanswered.wait_s:
                    unanswered.sent_t = now
                    unanswered.wait_s = min(2 * unanswered.wait_s, c.redeclare_max_s)
                    again.append(unanswered.failure)
        return again

    def load_job(self, summary: JobSummary, now: float) -> None:
        """What a restarted detector knows of a job from its KV record: its ranks and spares, watched
        from now (a rank whose heartbeat does not come back is declared after the timeout), and the
        members already declared failed."""
        view = self._view(summary.job)
        view.finished = view.finished or summary.finished
        view.finished_t = view.finished_t or (now if summary.finished else 0.0)
        view.heard_t = now
        self._generation(view, summary.generation, now)
        view.announced = max(view.announced, summary.generation)
        for member in summary.failed:
            view.declared.setdefault(member, None)
        rank_of = {member: rank for rank, member in enumerate(summary.ranks)}
        for member in [*summary.ranks, *summary.spares]:
            view.unnamed.pop(member, None)
            if member not in view.members and member not in view.declared:
                view.members[member] = _named_by_record(summary, member, rank_of, now)

    def _note_unnamed(self, view: JobView, member: str, now: float) -> None:
        if member not in view.unnamed and len(view.unnamed) < UNNAMED_KEPT_MAX:
            view.unnamed[member] = now

    def unnamed_refusal(self, job: str, member: str) -> str:
        """Why a report about `member` of `job` is not taken because no one named it ('' if named)."""
        view = self.jobs.get(job)
        if view is not None and (member in view.members or member in view.declared):
            return ""
        return f"{member} is named by no rebuild and by no job record of {job}: not watched"

    def records_wanted(self, now: float) -> list[str]:
        """Jobs whose record the service should read again now, for members heard of lately and unnamed."""
        wanted = []
        for job, view in self.jobs.items():
            due = now - view.record_read_t >= RECORD_REREAD_S
            if due and any(now - heard < NAMING_WAIT_S for heard in view.unnamed.values()):
                view.record_read_t = now  # one read at a time: the next is due a period later
                wanted.append(job)
        return wanted

    def claim_record_read(self, job: str, now: float, every_s: float) -> bool:
        """Whether `job`'s record may be read again now (at most every `every_s`); the read is counted."""
        view = self.jobs.get(job)
        if view is None or now - view.record_read_t < every_s:
            return False
        view.record_read_t = now
        return True

    def name_from_record(self, summary: JobSummary, now: float) -> list[str]:
        """Watch the unnamed members of `summary.job` that its record lists (as a rank, a spare, or a
        live member before formation). Returns them."""
        view = self.jobs.get(summary.job)
        if view is None or view.finished:
            return []
        listed = {*summary.ranks, *summary.spares, *summary.hosts}
        rank_of = {member: rank for rank, member in enumerate(summary.ranks)}
        named = [m for m in view.unnamed if m in listed and m not in view.members and m not in view.declared]
        for member in named:
            del view.unnamed[member]
            view.members[member] = _named_by_record(summary, member, rank_of, now)
        return named

    def on_done(self, done: MemberDone) -> None:
        watched = self._view(done.job).members.get(done.member)
        if watched is not None:
            watched.done = True

    def on_finished(self, finished: JobFinished, now: float) -> None:
        view = self._view(finished.job)
        if finished.generation < view.generation:
            return  # an older generation's notice (a late retransmission of the name's previous run)
        view.unanswered.clear()  # the job's end answers every verdict
        if not view.finished:
            view.finished, view.finished_t = True, now
            view.finished_generation = max(finished.generation, view.generation)

    def prune(self, now: float) -> list[str]:
        """Forget jobs finished `finished_kept_s` ago, and jobs nothing was heard of for `idle_job_s`."""
        for view in self.jobs.values():
            view.heard_t = view.heard_t or now  # known only from an exit or a report: its clock starts now
            for member, heard in list(view.unnamed.items()):
                if now - heard > UNNAMED_KEPT_S:
                    del view.unnamed[member]
        gone = [
            job
            for job, view in self.jobs.items()
            if (view.finished and now - view.finished_t > self.config.finished_kept_s)
            or now - max(view.heard_t, view.finished_t) > self.config.idle_job_s
        ]
        for job in gone:
            del self.jobs[job]
        return gone

    def exit_refusal(self, exit_: ChildExit) -> str:
        """Why a launcher's report of a process's exit is not taken ('' if it is): a member's exit is its
        own launcher's to report. (Forged exits once swapped live ranks, without a fence, and used up
        their spares.)"""
        view = self.jobs.get(exit_.job)
        watched = view.members.get(exit_.member) if view is not None else None
        if unnamed := self.unnamed_refusal(exit_.job, exit_.member):
            return unnamed
        if watched is not None and watched.launcher and exit_.launcher != watched.launcher:
            return f"launcher {exit_.launcher} reports an exit of {exit_.member}, run by launcher {watched.launcher}"
        return ""

    def error_cause(self, error: MemberError) -> MemberErrorCause:
        """The cause a member's error report is taken with. One that would end the job is taken as such
        only for the reporter's own place: the rank the job's current generation named it to, in that
        generation, or a spare's report as a spare, including one the current generation promoted and
        whose report comes from before it learned so (its factory raised while it warmed up). Anything
        else is that member's own failure (a forged `user_code` report once ended any job)."""
        if not error.cause.ends_job:
            return error.cause
        view = self.jobs.get(error.job)
        watched = view.members.get(error.member) if view is not None else None
        if view is None or watched is None:
            return MemberErrorCause.STEP
        if (
            error.rank != NO_RANK
            and view.generation < error.generation <= view.generation + self.config.generation_lead_max
        ):
            return error.cause  # a rebuild this detector has not read yet (its verdicts and reports race)
        if error.rank == NO_RANK and watched.named_rank != NO_RANK and error.generation < watched.named_in:
            return error.cause  # a spare then, which a rebuild it had not yet taken promoted
        if error.rank != watched.named_rank or (error.rank != NO_RANK and error.generation != view.generation):
            return MemberErrorCause.STEP
        return error.cause

    def on_exit(self, exit_: ChildExit, now: float) -> list[Failure]:
        if self.exit_refusal(exit_):
            view = self.jobs.get(exit_.job)
            if view is not None and self.unnamed_refusal(exit_.job, exit_.member):
                self._note_unnamed(view, exit_.member, now)
            return []
        view = self._view(exit_.job)
        watched = view.members.pop(exit_.member, None)
        normal = exit_.returncode == 0 and (view.finished or (watched is not None and watched.done))
        if normal or exit_.member in view.declared:
            return []
        evidence = {"returncode": str(exit_.returncode), "pid": str(exit_.pid), "launcher": exit_.launcher}
        if exit_.returncode < 0:
            evidence["signal"] = str(-exit_.returncode)
        rank = watched.rank if watched is not None else NO_RANK
        return [self._declare(view, exit_.member, rank, FailureReason.EXIT, evidence, exit_.t_exit, now)]

    def on_error(self, error: MemberError, now: float) -> list[Failure]:
        """A member's report of its own error: it is declared failed, in the rank the detector knows it
        by (a report cannot name another member's rank), with the cause `error_cause` allows."""
        cause = self.error_cause(error)
        view = self._view(error.job)
        if error.member in view.declared:
            return []
        if self.unnamed_refusal(error.job, error.member):
            self._note_unnamed(view, error.member, now)
            return []
        watched = view.members.pop(error.member, None)
        rank = watched.rank if watched is not None else NO_RANK
        evidence = {"error": error.error[:2000]}
        return [self._declare(view, error.member, rank, FailureReason.ERROR, evidence, error.t, now, cause=cause)]

    def grace(self, now: float) -> None:
        """Restart every member's clocks: the detector itself missed a stretch of time."""
        for view in self.jobs.values():
            if view.generation_t:
                view.generation_t = now
            for watched in view.members.values():
                watched.last_seen = now
                watched.progress_t = max(watched.progress_t, now)
                if watched.rebuilding_since:
                    watched.rebuilding_since = now
                if watched.rebuilt[0]:
                    watched.rebuilt = (watched.rebuilt[0], now)

    def hang_threshold_s(self, view: JobView) -> float:
        c = self.config
        if not view.step_times:
            return max(c.hang_floor_s, c.first_step_s)
        return max(c.hang_floor_s, c.hang_factor * statistics.median(view.step_times))

    def broken_groups(self, now: float) -> list[GroupBroken]:
        """Generations whose every rank has awaited a rebuild in that generation for `regroup_wait_s`,
        nobody declared; each reported again every `regroup_wait_s` while it stays so."""
        found: list[GroupBroken] = []
        wait = self.config.regroup_wait_s
        for view in self.jobs.values():
            if view.finished or view.generation == 0 or view.generation == view.declared_in:
                continue
            ranks = (w for w in view.members.values() if w.rank >= 0 and not w.done)
            if not all(w.awaiting_since and w.beat_generation == view.generation for w in ranks):
                continue  # stops at the first rank training or rebuilding, before any list is made
            ranked = [w for w in view.members.values() if w.rank >= 0 and not w.done]
            if not ranked:
                continue
            if now - max(w.awaiting_since for w in ranked) < wait:
                continue
            generation, reported_t = view.broken_reported
            if generation == view.generation and now - reported_t < wait:
                continue
            view.broken_reported = (view.generation, now)
            ranked.sort(key=lambda w: (w.awaiting_since, w.rank))
            first = ranked[0]
            evidence = {
                "ranks_awaiting": str(len(ranked)),
                "first_to_leave": first.member,
                "first_rank": str(first.rank),
                "awaiting_s": f"{now - first.awaiting_since:.3f}",
            }
            found.append(
                GroupBroken(
                    view.job,
                    view.generation,
                    len(ranked),
                    members_digest(w.member for w in ranked),
                    evidence,
                    self._wall(first.awaiting_since),
                    self._wall(now),
                )
            )
        return found

    def stalls(self, now: float) -> dict[str, list[str]]:
        """Jobs whose every stalled rank waits on peers (no culprit): job -> the stalled members."""
        found: dict[str, list[str]] = {}
        for view in self.jobs.values():
            stalled = self._stalled(view, now, self.hang_threshold_s(view))
            if stalled and all(w.waiting for w in stalled):
                found[view.job] = [w.member for w in stalled]
        return found

    def _stalled(self, view: JobView, now: float, threshold: float) -> list[Watched]:
        if view.finished or view.generation == 0 or now - view.progressed_since <= threshold:
            return []  # every step clock started within the threshold (a member's own is never less)
        view.progressed_since = min((w.progress_t for w in view.members.values()), default=now)
        return [
            w
            for w in view.members.values()
            if w.rank >= 0 and not w.done and now - w.progress_t > self._threshold_of(w, threshold)
        ]

    def _threshold_of(self, w: Watched, threshold: float) -> float:
        """A member in its first step of a generation (it may be compiling) has the first-step threshold."""
        if w.section == FIRST_STEP_SECTION:
            return max(threshold, self.config.hang_floor_s, self.config.first_step_s)
        return threshold

    def stragglers(self, now: float) -> list[Straggler]:
        """Ranks that hold the others back, each reported once per generation."""
        c = self.config
        window = c.straggler_window
        events: list[Straggler] = []
        for view in self.jobs.values():
            if view.finished:
                continue
            ranked = [w for w in view.members.values() if w.rank >= 0 and len(w.busy) >= window]
            if len(ranked) < 2:
                continue
            shares = [w.busy_share(window) for w in ranked]
            ordered = sorted(shares)
            for w, share in zip(ranked, shares, strict=True):
                typical = _median_without(ordered, share)
                key = (view.generation, w.member)
                if share >= c.straggler_factor * typical and share - typical >= c.straggler_margin:
                    if key in view.stragglers_reported:
                        continue
                    view.stragglers_reported.add(key)
                    evidence = {
                        "busy_share": f"{share:.2f}",
                        "others_median_busy_share": f"{typical:.2f}",
                        "window_heartbeats": str(c.straggler_window),
                        "where": w.where,
                    }
                    events.append(Straggler(view.job, view.generation, w.member, w.rank, evidence, self._wall(now)))
        return events

    def overdue(self, now: float) -> bool:
        """Whether a member's heartbeat is overdue at `now`: `check` would declare it (the service first
        reads the beats on their way to it)."""
        silent_before = now - self.config.heartbeat_timeout_s
        return any(_overdue(view, silent_before, now) for view in self.jobs.values() if not view.finished)

    def check(self, now: float, hang_rules: bool = True, timeouts: bool = True) -> list[Failure]:
        """Heartbeat timeouts (with `timeouts`: the service passes False when `overdue` found none),
        then (with `hang_rules`) ranks stuck in their rebuild, then hangs (see the module docstring)."""
        failures: list[Failure] = []
        silent_before = now - self.config.heartbeat_timeout_s
        for view in self.jobs.values():
            if view.finished:
                continue
            silent = list(_silent(view, silent_before)) if timeouts else []
            if silent:
                silent += self._silent_host_mates(view, silent, now)
            silent_on_host = Counter(w.host for w in silent if w.host)
            for w in silent:
                del view.members[w.member]
                evidence = {
                    "silence_s": f"{now - w.last_seen:.3f}",
                    "last_step": str(w.last_step),
                    "pid": str(w.pid),
                }
                here = silent_on_host[w.host] if w.host else 0
                lost_host = here if here and self._host_lost(view, w, here, now) else 0
                failures.append(
                    self._declare(
                        view,
                        w.member,
                        w.rank,
                        FailureReason.HEARTBEAT,
                        evidence,
                        self._wall(w.last_seen),
                        now,
                        lost_host=(w.host, lost_host) if lost_host else ("", 0),
                    )
                )
            if not hang_rules:
                continue
            failures += self._stuck_in_rebuild(view, now)
            threshold = self.hang_threshold_s(view)
            stalled = self._stalled(view, now, threshold)
            for w in self._left_behind(view, stalled, now):
                stalled.remove(w)
                why = f"every other rank left generation {view.generation}'s group and awaits a rebuild"
                failures.append(self._declare_hung(view, w, now, threshold, left_behind=why))
            busy = bool(stalled) and not any(w.waiting for w in stalled)
            if busy and sum(1 for w in view.members.values() if w.rank >= 0) > 1:
                stalled = []  # every stalled rank busy in its own code: a job-wide pause, not a culprit
            for w in stalled:
                if w.waiting:
                    continue  # blocked on a peer: the peer is the one to blame
                failures.append(self._declare_hung(view, w, now, self._threshold_of(w, threshold)))
        return failures

    def _declare_hung(self, view: JobView, w: Watched, now: float, threshold: float, **extra: str) -> Failure:
        del view.members[w.member]
        evidence = {
            **extra,
            "no_step_s": f"{now - w.progress_t:.3f}",
            "hang_threshold_s": f"{threshold:.3f}",
            "median_step_s": f"{statistics.median(view.step_times):.3f}" if view.step_times else "",
            "last_step": str(w.last_step),
            "where": w.where,
            "pid": str(w.pid),
        }
        return self._declare(view, w.member, w.rank, FailureReason.HANG, evidence, self._wall(w.progress_t), now)

    def _stuck_in_rebuild(self, view: JobView, now: float) -> list[Failure]:
        """Ranks stuck in a rebuild, declared hung (no other rule can name a member that says it is
        rebuilding): still carrying out the current generation's rebuild `rebuild_lag_s` after another
        rank of it finished its own, or for `rebuild_max_s` whatever the others do; or still carrying
        out an older generation's `rebuild_lag_s` after a newer one, which names it, was announced
        (every wait of a superseded rebuild is broken at once; only user code can hold it)."""
        c = self.config
        generation = view.generation
        watched = [view.members.get(member) for member in view.rebuilding]
        rebuilding = sorted(
            (w for w in watched if w is not None and w.rank >= 0 and w.rebuilding_since), key=lambda w: w.rank
        )
        view.rebuilding = {w.member for w in watched if w is not None and w.rebuilding_since}
        if not rebuilding:  # the usual case
            return []
        finished = [w for w in view.members.values() if w.rank >= 0 and w.rebuilt[0] == generation]
        first = min(finished, key=lambda w: w.rebuilt[1], default=None)
        failures: list[Failure] = []
        for w in rebuilding:
            rebuilding_s = now - w.rebuilding_since
            superseded_t = max(view.generation_t, w.rebuilding_since)
            if w.beat_generation < generation and now - superseded_t > c.rebuild_lag_s:
                behind_s = now - superseded_t
                why = f"still rebuilding generation {w.beat_generation} {behind_s:.1f} s after generation {generation}"
                evidence = {"stuck_in_rebuild": f"{why} superseded it", "behind_s": f"{behind_s:.3f}"}
                t_fault = superseded_t
            elif w.beat_generation < generation:
                continue
            elif first is not None and now - first.rebuilt[1] > c.rebuild_lag_s:
                behind_s = now - first.rebuilt[1]
                evidence = {
                    "stuck_in_rebuild": (
                        f"still rebuilding generation {generation} {behind_s:.1f} s after rank {first.rank} "
                        f"({first.member}) finished its rebuild"
                    ),
                    "behind_s": f"{behind_s:.3f}",
                    "finished_first": first.member,
                }
                t_fault = first.rebuilt[1]
            elif c.rebuild_max_s and rebuilding_s > c.rebuild_max_s:
                evidence = {
                    "stuck_in_rebuild": f"rebuilding generation {generation} for {rebuilding_s:.1f} s",
                    "rebuild_max_s": f"{c.rebuild_max_s:.3f}",
                }
                t_fault = w.rebuilding_since
            else:
                continue
            del view.members[w.member]
            evidence |= {
                "rebuilding_s": f"{rebuilding_s:.3f}",
                "rebuild_lag_s": f"{c.rebuild_lag_s:.3f}",
                "last_step": str(w.last_step),
                "pid": str(w.pid),
            }
            failures.append(
                self._declare(view, w.member, w.rank, FailureReason.HANG, evidence, self._wall(t_fault), now)
            )
        return failures

    def _left_behind(self, view: JobView, stalled: list[Watched], now: float) -> list[Watched]:
        """Ranks stuck inside a step of the current generation while every other rank has left its
        group and awaited a rebuild for `regroup_wait_s`: the peers gave up on them (their collectives
        failed or timed out), so they are the culprits, even if they look like they wait (a call that
        never returns inside torch's code). Not after a rank of this generation was declared failed
        (the others await its replacement; one of them may still be leaving its broken collective),
        and not a rank whose heartbeats are from an older generation (a rebuild is under way)."""
        if not stalled or view.declared_in == view.generation:  # the usual case, at no cost
            return []
        ranked = [w for w in view.members.values() if w.rank >= 0 and not w.done]
        awaiting = [w for w in ranked if w.awaiting_since]
        if not awaiting or now - max(w.awaiting_since for w in awaiting) < self.config.regroup_wait_s:
            return []
        behind = [w for w in ranked if not w.awaiting_since]
        stalled_ids = {id(w) for w in stalled}
        if not behind or not all(
            id(w) in stalled_ids
            and w.in_step
            and not _suspends_hang_rule(w.section)
            and w.beat_generation == view.generation
            for w in behind
        ):
            return []
        return behind

    def _launcher_sending(self, view: JobView, w: Watched, now: float) -> bool | None:
        """Whether `w`'s launcher sent a batch in the last half heartbeat timeout (it sends one every
        period, empty when none of its members beat); None where it was never heard of (its members
        beat to the detector directly)."""
        seen = view.launcher_seen.get(w.launcher) if w.launcher else None
        return None if seen is None else now - seen <= self.config.heartbeat_timeout_s / 2

    def _host_lost(self, view: JobView, w: Watched, silent_on_host: int, now: float) -> bool:
        """Whether silent `w` went with its host (a fence sent there reaches nobody: `Fence.holds_rebuild`)
        rather than alone: its launcher went silent too, or, where no launcher was heard of, two or more
        of the host's members went silent together. Members frozen beside a launcher that still sends
        (stopped, hung in the kernel) are members lost, however many: the launcher can kill them, and
        their spares wait for that."""
        sending = self._launcher_sending(view, w, now)
        return not sending if sending is not None else silent_on_host > 1

    def _silent_host_mates(self, view: JobView, silent: list[Watched], now: float) -> list[Watched]:
        """Members sharing a host with a silent member, and silent for half the timeout themselves,
        when every member of that host is: the host is gone, and all of it is declared in one pass
        (their heartbeats stopped together but cross the timeout up to a period apart). Not where the
        host's launcher still sends: the host is there, and each member is declared at its own timeout."""
        declared = {w.member for w in silent}
        hosts = {w.host for w in silent if w.host and not self._launcher_sending(view, w, now)}
        mates_of: dict[str, list[Watched]] = {host: [] for host in hosts}
        for w in view.members.values():  # one pass over the job, not one per silent host (a lost rack)
            if w.host in mates_of and not w.done and w.member not in declared:
                mates_of[w.host].append(w)
        half = self.config.heartbeat_timeout_s / 2
        extra: list[Watched] = []
        for mates in mates_of.values():
            if mates and all(now - w.last_seen > half for w in mates):
                extra += mates
        return extra

    def _declare(
        self,
        view: JobView,
        member: str,
        rank: int,
        reason: FailureReason,
        evidence: dict[str, str],
        t_fault: float,
        now: float,
        cause: MemberErrorCause = MemberErrorCause.STEP,
        lost_host: tuple[str, int] = ("", 0),
    ) -> Failure:
        """The verdict, kept unanswered (`repeats`). `t_fault` is a wall-clock instant already;
        `lost_host` is the host whose members went silent together, and how many."""
        if rank >= 0:
            view.declared_in = view.generation
        failure = Failure(
            job=view.job,
            generation=view.generation,
            member=member,
            rank=rank,
            reason=reason,
            evidence=evidence,
            t_fault=t_fault,
            t_detected=self._wall(now),
            cause=cause,
            lost_host=lost_host[0],
            lost_host_members=lost_host[1],
        )
        view.declared[member] = failure
        view.unanswered[member] = Unanswered(failure, now, self.config.redeclare_after_s)
        while len(view.declared) > DECLARED_KEPT:
            oldest = next(iter(view.declared))
            del view.declared[oldest]
            view.unanswered.pop(oldest, None)
        return failure


def _silent(view: JobView, silent_before: float) -> Iterator[Watched]:
    """The members of `view` last heard before `silent_before` (and not done): what `check` declares,
    and what `overdue` looks for."""
    return (w for w in view.members.values() if w.last_seen < silent_before and not w.done)


def _overdue(view: JobView, silent_before: float, now: float) -> bool:
    """Whether a member of `view` was last heard before `silent_before`. Passes over every member only
    when `JobView.heard_since` does not answer, and raises that bound to what the pass found."""
    if silent_before <= view.heard_since:
        return False
    view.heard_since = min((w.last_seen for w in view.members.values() if not w.done), default=now)
    return view.heard_since < silent_before


def _progressed(view: JobView, watched: Watched, t: float) -> None:
    """`watched`'s step clock starts again at `t` (a beat's time, which may be older than the bound)."""
    watched.progress_t = t
    view.progressed_since = min(view.progressed_since, t)


def _sample_busy(watched: Watched, busy: bool, now: float) -> None:
    """One busy sample per heartbeat period since the last one: a launcher's batch carries a member's
    newest beat of a quarter second, which stands for the beats before it, so a straggler's window of
    `straggler_window` beats spans the same time whatever the batch period."""
    period = HEARTBEAT_PERIOD_S_DEFAULT
    if not watched.sampled_t:
        watched.sampled_t = now - period
    if now <= watched.sampled_t:
        return  # a beat dated before the last sample (a batch's older beat): nothing more to count
    since = min(now - watched.sampled_t, BUSY_SAMPLES_PER_BEAT_MAX * period)
    periods = int(since / period + 0.5)  # the rest carries over to the next beat
    watched.sampled_t = now - since + periods * period
    total = watched.busy_total
    if busy:
        watched.busy.extend(range(total, total + periods))
        watched.busy_total += periods
    else:
        watched.busy.extend(repeat(total, periods))


def _median_without(ordered: list[float], value: float) -> float:
    """The median of sorted `ordered` less one element equal to `value` (which it holds), as
    `statistics.median` gives it: each rank's share against the others' in O(log n), not a sort of
    the others per rank (at 4,096 ranks that was half a second of the detector's loop per review)."""
    gone = bisect_left(ordered, value)
    rest = len(ordered) - 1

    def at(i: int) -> float:
        return ordered[i] if i < gone else ordered[i + 1]

    middle = rest // 2
    return at(middle) if rest % 2 else (at(middle - 1) + at(middle)) / 2


def _suspends_hang_rule(section: str) -> bool:
    """A user's section suspends the hang rule; the first step of a generation only lengthens it."""
    return bool(section) and section != FIRST_STEP_SECTION


def _named_by_record(summary: JobSummary, member: str, rank_of: dict[str, int], now: float) -> Watched:
    """A member the job record `summary` names, watched from `now` as its rank there (or a spare)."""
    rank = rank_of.get(member, NO_RANK)
    return Watched(
        member,
        rank,
        now,
        progress_t=now,
        host=summary.hosts.get(member, ""),
        named_rank=rank,
        named_in=summary.generation,
    )
