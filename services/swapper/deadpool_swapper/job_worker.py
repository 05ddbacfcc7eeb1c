"""One job's actor inside the swapper leader: its events, its decisions, its actions, in order.

Each job has its own inbox, its own readers of the events stream and its own task, so one job's fence,
KV write or slow member never delays another job. The worker applies one input at a time (an event
from the stream, a member's hello, a fence's answer, or a tick when the core's next deadline comes),
then carries out the actions the core returned. The stores' reports, which commit steps, are read in
a lane of their own, ahead of the rest (`SWAPPER_REPORTS`, `lanes.py`):

- nothing is published, and no hello is answered, before the record that includes it is saved: a
  new leader always knows every generation anyone heard of. A save that fails (KV unreachable, a
  stream leader being elected) holds the publications back and is retried every `SAVE_RETRY_S`; it
  never takes the swapper down. A record too large to store is refused: the input that made it so
  is dropped (reloaded away), with the reason logged, never retried for ever;
- fences run in the background (a lost host's members are killed in parallel, each bounded by
  `fence_timeout_s`) while the worker goes on reading events; a rebuild, and whatever was decided
  after it, goes out only once every fence before it that holds it has answered (not a lost host's:
  `Fence.holds_rebuild`).

The worker never stops reading: an input waiting in the inbox is taken before a tick that is not
due, a tick's deadline comes from the core's own rules (`Decision.next_at`, always in the future), and
every event's wait in the inbox is measured (`unheard_s_max`).

Events are applied at most once into the state (each carries its stream sequence; the record saves
the last one applied in each lane), and the readers of a new leader start right after the saved
sequences, so they replay exactly what its predecessor had not made durable.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import nats.errors

from deadpool_protocol import (
    Failure,
    GroupBroken,
    HelloReply,
    MemberDone,
    MemberHello,
    Message,
    Rebuild,
    RebuildAck,
    RebuildAckBatch,
    RunReply,
    RunStart,
    SnapshotComplete,
    StepResumed,
    StepResumedBatch,
)
from deadpool_protocol.events import EVENT_KINDS, SWAPPER_IN_TURN, SWAPPER_REPORTS, event_subjects
from deadpool_runtime import EventReader
from deadpool_swapper.core import Archive, Decision, Fence, JobState, Persist, Publish, SwapperCore
from deadpool_swapper.job_records import JobRecords, RecordConflictError, RecordTooLargeError, UnreadableRecordError
from deadpool_swapper.lanes import AHEAD, IN_TURN, LanedQueue

__all__ = ["Event", "Fenced", "Hello", "JobWorker", "Poke", "RunRequest"]

JOB_INBOX_MAX = 4096
"""Inputs waiting for one job, both lanes together; a full inbox slows that job's readers, never
another job."""
REPORTS = tuple(EVENT_KINDS[kind] for kind in SWAPPER_REPORTS)
"""The message types read in the reports' lane."""
SAVE_RETRY_S = 0.2
TICK_MIN_S = 0.005
"""The shortest pause between two ticks with nothing read between them (the core only ever schedules
the future; this bounds the cost of a bug that would not)."""
INPUTS_PER_SAVE_MAX = 1024
"""Inputs already waiting that are decided together and saved in one write (a job of thousands of
members registers in a few saves). A batch ends at the first input that has something to publish (a
commit, a rebuild): it is saved and sent at once, not after the rest of the inbox (a commit at 8,192
ranks waited up to 311 ms behind the launchers' acks that followed its store report)."""
BATCH_APPLY_S_MAX = 0.05
"""The longest the worker decides inputs before it saves and lets the process's other tasks run (the
leader lease's renewal every 0.2 s, the readers): a batch of 1,024 acks is about 50 ms of one core at
8,192 ranks, and much more on a machine short of cores."""
HELD_MAX = 10_000
"""Publications held while the record cannot be saved; past it the oldest are dropped (logged): every
command is retransmitted until it is confirmed, and commits and incidents are in the record."""
HELD_DEDUPE_WINDOW = 64
"""A publication equal to one of the last this many held is not held twice (a tick's retransmissions)."""
REPLIES_HELD_MAX = 4096
"""Hello answers held while the record cannot be saved (a member asks again after `HELLO_ANSWER_S`)."""
UNPROTECTED_LOG_S = 30.0
"""While no store receives the job's snapshots, the worker says so this often."""
UNHEARD_LOGGED_S = 0.5
"""An event that waited longer than this in the inbox is logged, when its wait is the longest yet (so
a burst of late events writes one line): the worker's promise is to read every event within 50 ms."""


@dataclass
class Event:
    message: Message
    seq: int
    received: float = field(default_factory=time.monotonic)
    """When the reader handed it over (monotonic): its wait in the inbox counts from here."""

    @property
    def report(self) -> bool:
        """Whether it is read in the reports' lane, ahead (and counted in `EventsPosition.reported_seq`)."""
        return isinstance(self.message, REPORTS)


@dataclass
class RunRequest:
    start: RunStart
    reply: asyncio.Future[RunReply] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


@dataclass
class Fenced:
    """A fence has answered (or gone unanswered within its bound)."""

    fence: Fence
    took_s: float


@dataclass
class Poke:
    """Something the job's rules depend on changed outside its inbox (a store came, came back or
    moved): tick now."""


@dataclass
class Hello:
    hello: MemberHello
    reply: asyncio.Future[HelloReply] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


Item = Event | Hello | RunRequest | Fenced | Poke


class JobWorker:
    def __init__(
        self,
        job: str,
        core: SwapperCore,
        records: JobRecords,
        nc: Any,
        log: Any,
        publish: Callable[[Publish], Awaitable[None]],
        fence: Callable[[Fence], Awaitable[float]],
        leading: Callable[[], bool],
        stream: tuple[str, int],
    ) -> None:
        self.job = job
        self.core = core
        self.records = records
        self.nc = nc
        self.log = log.bind(job=job)
        self._publish = publish
        self._fence = fence
        self._leading = leading
        self._stream_id, self._stream_last = stream
        self.inbox: LanedQueue[Item] = LanedQueue(JOB_INBOX_MAX)
        self._held: list[Publish] = []
        """Publications waiting for the record to be saved (and a rebuild, for the fences before it)."""
        self._dirty = False
        self._save_retry_at = 0.0
        self._replies: list[tuple[Hello | RunRequest, HelloReply | RunReply]] = []
        self._archives: list[JobState] = []
        """Records of runs that ended, to keep before the state that replaced them is saved."""
        self._fences: dict[asyncio.Task[None], Fence] = {}
        """The fences in flight, each with its task. A task that is done has answered, even while its
        removal from here is still to run: the worker can take the answer from its inbox first (it was
        woken before the task ended; only `wait_for`'s own task, in Python 3.11, puts a turn of the
        loop between them)."""
        self._had_state = False
        self._last_reason = ""
        self._stop = asyncio.Event()
        self._readers: list[EventReader] = []
        self._start_seq = 0
        self._task: asyncio.Task[None] | None = None
        self._next_tick = 0.0
        self._unprotected_log_at = 0.0
        self.unheard_s_max = 0.0
        """The longest an event waited in this worker's inbox before it was handled (seconds)."""

    @property
    def state(self) -> JobState | None:
        return self.core.jobs.get(self.job)

    @property
    def forgotten(self) -> bool:
        """The core had this job's state and pruned it (finished long ago, or never formed)."""
        return self._had_state and self.state is None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"job-{self.job}")

    def poke(self) -> None:
        """Tick soon: something the job's rules depend on changed outside its inbox."""
        with contextlib.suppress(asyncio.QueueFull):  # a full inbox is read, and ticked, soon anyway
            self.inbox.put_nowait(Poke())

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        for task in list(self._fences):
            task.cancel()
        await self._stop_readers()
        for hello, _ in self._replies:
            hello.reply.cancel()

    # ------------------------------------------------------------------ the loop

    async def _start_reader(self) -> None:
        """Follow this job's events, in each lane from just after what its state already includes."""
        self._start_seq = self._stream_last + 1  # a new job, or a stream that was created again: from now on
        starts = (self._start_seq, self._start_seq)
        if self._counts_in_stream():
            assert self.state is not None
            position = self.state.position
            starts = (position.reported_seq + 1, position.applied_seq + 1)  # 1: saved while the stream was empty
        self._adopt_position()
        self._readers = [
            EventReader(self.nc, event_subjects(self.job, kinds), self._on_event, self.log)
            for kinds in (SWAPPER_REPORTS, SWAPPER_IN_TURN)
        ]
        for reader, start in zip(self._readers, starts, strict=True):
            await reader.start(self._stop, start_seq=start)

    async def _stop_readers(self) -> None:
        for reader in self._readers:
            await reader.stop()
        self._readers = []

    def _counts_in_stream(self) -> bool:
        """Whether the state's `applied_seq` is a position in this incarnation of the events stream.
        Its value alone does not say so: 0 is where a job that started on an empty stream stands, and
        reading from "now" instead skipped every event stored before a new leader took over."""
        state = self.state
        return state is not None and bool(self._stream_id) and state.position.stream_id == self._stream_id

    def _adopt_position(self) -> None:
        """A state that does not count in this stream yet starts where this worker's readers start."""
        if self.state is not None and not self._counts_in_stream():
            position = self.state.position
            position.stream_id = self._stream_id
            position.applied_seq = position.reported_seq = self._start_seq - 1

    async def _on_event(self, message: Message, seq: int) -> None:
        event = Event(message, seq)
        await self.inbox.put(event, AHEAD if event.report else IN_TURN)

    def _due(self) -> float:
        """The next moment the loop has work without an input: a tick, a save to retry, a log line."""
        due = self._next_tick
        if self._dirty:
            due = min(due, self._save_retry_at)
        state = self.state
        if state is not None and state.protection.unprotected_since is not None and not state.finished:
            due = min(due, self._unprotected_log_at)
        return due

    async def _next_input(self) -> Item | None:
        """The next input waiting, else one that arrives before the next due moment, else None (a tick)."""
        wait_s = self._due() - time.monotonic()
        if wait_s <= 0:
            return None
        with contextlib.suppress(asyncio.QueueEmpty):
            return self.inbox.get_nowait()
        try:
            return await asyncio.wait_for(self.inbox.get(), wait_s)
        except TimeoutError:
            return None

    async def _run(self) -> None:
        await self._start_reader()
        while not self._stop.is_set():
            item = await self._next_input()
            try:
                held, until = len(self._held), time.monotonic() + BATCH_APPLY_S_MAX
                self._apply(item)
                for _ in range(INPUTS_PER_SAVE_MAX - 1):  # what else is waiting goes into the same save
                    if item is None or len(self._held) > held or time.monotonic() > until:  # news to send now
                        break
                    try:
                        item = self.inbox.get_nowait()
                    except asyncio.QueueEmpty:
                        break
                    self._apply(item)
                await self._flush()
            except Exception:  # a bug must not silence this job for good: log it, go on with the next input
                self.log.exception("job worker failed on an input; going on", item=type(item).__name__)
                await asyncio.sleep(SAVE_RETRY_S)

    def _apply(self, item: Item | None) -> None:
        """Decide one input (None: a tick) and take its actions in; `_flush` carries them out."""
        now = time.monotonic()
        decision = self._decide(item, now)
        self._had_state = self._had_state or self.state is not None
        if item is None or isinstance(item, Poke):
            self._next_tick = max(decision.next_at, now + TICK_MIN_S)
            self._log_unprotected(now)
        elif any(isinstance(a, Persist) for a in decision.actions):
            # The state changed: its deadlines may have too (none is sooner than the last call).
            self._next_tick = min(self._next_tick, now + TICK_MIN_S)
        self._take(decision)

    def _decide(self, item: Item | None, now: float) -> Decision:
        if item is None or isinstance(item, Poke):
            return self.core.tick_job(self.job, now)
        if isinstance(item, Fenced):
            if not item.fence.holds_rebuild:  # its time was nobody's downtime
                return Decision([], f"fence of {item.fence.member}, of a lost host, over in {item.took_s:.2f} s")
            self.core.on_fenced(self.job, item.fence.member, item.took_s)
            return Decision([], f"fence of {item.fence.member} answered")
        if isinstance(item, Hello):
            reply, decision = self.core.on_hello(item.hello, now)
            self._adopt_position()  # the first hello creates the job's state
            self._replies.append((item, reply))
            return decision
        if isinstance(item, RunRequest):
            run_reply, decision = self.core.on_run_start(item.start, now)
            self._adopt_position()
            self._replies.append((item, run_reply))
            return decision
        waited = now - item.received
        if waited > self.unheard_s_max:
            self.unheard_s_max = waited
            if waited > UNHEARD_LOGGED_S:
                self.log.warning(
                    "event waited in the inbox",
                    job=self.job,
                    kind=item.message.KIND,
                    seq=item.seq,
                    waited_s=round(waited, 3),
                    waiting=self.inbox.qsize(),
                )
        state = self.state
        if state is not None and item.seq <= state.position.last(item.report):
            return Decision([], f"event {item.seq} already applied", routine=True)
        decision = self._dispatch(item.message, now)
        state = self.state
        if state is not None:
            state.position.applied(item.report, item.seq)
        return decision

    def _dispatch(self, message: Message, now: float) -> Decision:
        core = self.core
        if isinstance(message, Failure):
            return core.on_failure(message, now)
        if isinstance(message, RebuildAck):
            return core.on_ack(message, now)
        if isinstance(message, RebuildAckBatch):
            return core.on_ack_batch(message, now)
        if isinstance(message, SnapshotComplete):
            return core.on_snapshot_complete(message, now)
        if isinstance(message, MemberDone):
            return core.on_done(message, now)
        if isinstance(message, GroupBroken):
            return core.on_group_broken(message, now)
        if isinstance(message, StepResumed):
            return core.on_step_resumed(message, now)
        if isinstance(message, StepResumedBatch):
            return core.on_step_resumed_batch(message, now)
        return Decision([], f"event {message.KIND} is not for the swapper")

    def _log_unprotected(self, now: float) -> None:
        state = self.state
        if state is None or state.protection.unprotected_since is None or state.finished:
            self._unprotected_log_at = 0.0
            return
        if now < self._unprotected_log_at:
            return
        self._unprotected_log_at = now + UNPROTECTED_LOG_S
        self.log.warning(
            "job unprotected: no snapshot store receives its snapshots",
            since_committed_step=state.protection.unprotected_step,
            committed_step=state.ledger.committed_step,
            unprotected_s=round(now - state.protection.unprotected_since, 1),
            generation=state.generation,
        )

    # ------------------------------------------------------------------ actions

    def _take(self, decision: Decision) -> None:
        if not decision.routine and decision.reason != self._last_reason:
            self.log.info("decision", reason=decision.reason)
            self._last_reason = decision.reason
        for fence in (a for a in decision.actions if isinstance(a, Fence)):
            task = asyncio.create_task(self._fenced(fence), name=f"fence-{fence.member}")
            self._fences[task] = fence
            task.add_done_callback(self._fences.pop)
        self._dirty = self._dirty or any(isinstance(a, Persist) for a in decision.actions)
        self._archives += [a.state for a in decision.actions if isinstance(a, Archive)]
        for action in (a for a in decision.actions if isinstance(a, Publish)):
            if action not in self._held[-HELD_DEDUPE_WINDOW:]:  # a retransmission of one still held
                self._held.append(action)
        if len(self._held) > HELD_MAX:  # the record unsaved for long: the oldest go (commands are repeated)
            self.log.warning("publications held too long dropped", dropped=len(self._held) - HELD_MAX)
            del self._held[:-HELD_MAX]
        del self._replies[:-REPLIES_HELD_MAX]  # members ask again; their earlier requests gave up waiting

    async def _flush(self) -> None:
        """Save the record if it changed, then (once saved) answer hellos and publish, in order."""
        await self._save()
        if self._dirty or not self._leading():
            return  # not durable yet (or no longer ours to say): nothing goes out
        replies, self._replies = self._replies, []
        for request, reply in replies:
            if not request.reply.done():
                request.reply.set_result(reply)  # type: ignore[arg-type]
        while self._held:
            action = self._held[0]
            if isinstance(action.message, Rebuild) and self._fence_holding():
                break  # a member that may still run is killed before anyone takes its place
            del self._held[0]
            await self._publish(action)
        # A publish only queues its bytes: the client's flusher, a task of this loop, writes them once
        # this task yields. Without a yield here the next batch's deciding and its save's encoding (tens of
        # ms at 8,192 ranks, more on a busy machine) ran first, and a commit waited behind them.
        await asyncio.sleep(0)
        await self.records.collect(self.job)  # the parts the saves stopped naming, once the news is out

    def _fence_holding(self) -> bool:
        """Whether a fence that holds the rebuild (`Fence.holds_rebuild`) has not answered yet."""
        return any(fence.holds_rebuild and not task.done() for task, fence in self._fences.items())

    async def _fenced(self, fence: Fence) -> None:
        took_s = await self._fence(fence)
        await self.inbox.put(Fenced(fence, took_s))

    async def _save(self) -> None:
        state = self.state
        if not self._dirty:
            return
        if state is None:
            self._dirty = False
            return
        now = time.monotonic()
        if now < self._save_retry_at:
            return
        try:
            while self._archives:  # the ended run's record, before the next run is saved over it
                await self.records.archive(self._archives[0], now)
                del self._archives[0]
            await self.records.save(state, now)
            self._dirty = False
        except RecordConflictError as exc:
            self.log.error("job record changed under us: reloading it", reason=str(exc))
            await self._reload()
        except RecordTooLargeError as exc:
            self.log.error("job record refused: the input that made it too large is dropped", reason=str(exc))
            await self._reload()
        except (TimeoutError, nats.errors.Error) as exc:
            self._save_retry_at = time.monotonic() + SAVE_RETRY_S
            self.log.warning("job record not saved yet: will retry", error=repr(exc), held=len(self._held))

    async def _reload(self) -> None:
        """Take the record in KV as the truth (another swapper wrote our job, or what we decided cannot
        be stored) and follow the stream from there. Publications and replies decided on the state we
        drop are dropped with it (members retry)."""
        self._held.clear()
        self._replies.clear()
        self._archives.clear()
        self._dirty = False
        try:
            fresh = await self.records.load(self.job, time.monotonic())
        except UnreadableRecordError:
            self.core.jobs.pop(self.job, None)
            self._stop.set()  # someone else wrote what we cannot read: act on nothing of this job
            return
        except (TimeoutError, nats.errors.Error) as exc:
            self.log.error("job record not reloaded", error=repr(exc))
            self._dirty = True
            self._save_retry_at = time.monotonic() + SAVE_RETRY_S
            return
        if fresh is None:
            self.core.jobs.pop(self.job, None)
        else:
            self.core.jobs[self.job] = fresh
        await self._stop_readers()
        await self._start_reader()
