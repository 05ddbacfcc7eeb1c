"""One job's actor inside the swapper leader: its events, its decisions, its actions, in order.

Each job has its own inbox, its own reader of the events stream and its own task, so one job's fence,
KV write or slow member never delays another job. The worker applies one input at a time (an event
from the stream, a member's hello, or a tick when a deadline passes), then carries out the actions the
core returned:

- fences run concurrently with each other and with the record's save (a lost host's members are
  killed in parallel, each bounded by `fence_timeout_s`);
- nothing is published, and no hello is answered, before the record that includes it is saved: a
  new leader always knows every generation anyone heard of. A save that fails (KV unreachable, a
  stream leader being elected) holds the publications back and is retried every `save_retry_s`;
  it never takes the swapper down.

Events are applied at most once into the state (each carries its stream sequence; the record saves
the last one applied), and the reader of a new leader starts right after the saved sequence, so it
replays exactly what its predecessor had not made durable.
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
    RebuildAck,
    SnapshotComplete,
    StepResumed,
)
from deadpool_protocol.events import SWAPPER_EVENTS, event_subjects
from deadpool_runtime import EventReader
from deadpool_swapper.core import Decision, Fence, JobState, Persist, Publish, SwapperCore
from deadpool_swapper.job_records import JobRecords, RecordConflictError, UnreadableRecordError

__all__ = ["Event", "Hello", "JobWorker"]

JOB_INBOX_MAX = 4096
"""Inputs waiting for one job; a full inbox slows that job's reader, never another job."""
SAVE_RETRY_S = 0.2


@dataclass
class Event:
    message: Message
    seq: int


@dataclass
class Hello:
    hello: MemberHello
    reply: asyncio.Future[HelloReply] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


Item = Event | Hello


class JobWorker:
    def __init__(
        self,
        job: str,
        core: SwapperCore,
        records: JobRecords,
        nc: Any,
        log: Any,
        publish: Callable[[Publish], Awaitable[None]],
        fence: Callable[[Fence], Awaitable[None]],
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
        self.inbox: asyncio.Queue[Item] = asyncio.Queue(maxsize=JOB_INBOX_MAX)
        self._held: list[Publish] = []
        """Publications waiting for the record to be saved."""
        self._dirty = False
        self._replies: list[tuple[Hello, HelloReply]] = []
        self._had_state = False
        self._last_reason = ""
        self._stop = asyncio.Event()
        self._reader: EventReader | None = None
        self._start_seq = 0
        self._task: asyncio.Task[None] | None = None

    @property
    def state(self) -> JobState | None:
        return self.core.jobs.get(self.job)

    @property
    def forgotten(self) -> bool:
        """The core had this job's state and pruned it (finished long ago, or never formed)."""
        return self._had_state and self.state is None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"job-{self.job}")

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        if self._reader is not None:
            await self._reader.stop()
        for hello, _ in self._replies:
            hello.reply.cancel()

    # ------------------------------------------------------------------ the loop

    async def _start_reader(self) -> None:
        """Follow this job's events from just after what its state already includes."""
        state = self.state
        if state is not None and state.stream_id == self._stream_id and state.applied_seq > 0:
            start = state.applied_seq + 1
        else:  # a new job, or a stream that was created again: from now on
            start = self._stream_last + 1
        self._start_seq = start
        self._adopt_position()
        self._reader = EventReader(self.nc, event_subjects(self.job, SWAPPER_EVENTS), self._on_event, self.log)
        await self._reader.start(self._stop, start_seq=start)

    def _adopt_position(self) -> None:
        """A state that does not count in this stream yet starts where this worker's reader starts."""
        state = self.state
        if state is not None and (state.stream_id != self._stream_id or state.applied_seq <= 0):
            state.stream_id, state.applied_seq = self._stream_id, self._start_seq - 1

    async def _on_event(self, message: Message, seq: int) -> None:
        await self.inbox.put(Event(message, seq))

    async def _run(self) -> None:
        await self._start_reader()
        while not self._stop.is_set():
            now = time.time()
            timeout = self.core.next_deadline(self.job, now) - now
            if self._dirty or self._held:
                timeout = min(timeout, SAVE_RETRY_S)
            try:
                item: Item | None = await asyncio.wait_for(self.inbox.get(), max(0.0, timeout))
            except TimeoutError:
                item = None
            try:
                decision = self._decide(item, time.time())
                self._had_state = self._had_state or self.state is not None
                await self._carry_out(decision)
            except Exception:  # a bug must not silence this job for good: log it, go on with the next input
                self.log.exception("job worker failed on an input; going on", item=type(item).__name__)
                await asyncio.sleep(SAVE_RETRY_S)

    def _decide(self, item: Item | None, now: float) -> Decision:
        if item is None:
            return self.core.tick_job(self.job, now)
        if isinstance(item, Hello):
            reply, decision = self.core.on_hello(item.hello, now)
            self._adopt_position()  # the first hello creates the job's state
            self._replies.append((item, reply))
            return decision
        state = self.state
        if state is not None and item.seq <= state.applied_seq:
            return Decision([], f"event {item.seq} already applied")
        decision = self._dispatch(item.message, now)
        state = self.state
        if state is not None:
            state.applied_seq = max(state.applied_seq, item.seq)
        return decision

    def _dispatch(self, message: Message, now: float) -> Decision:
        core = self.core
        if isinstance(message, Failure):
            return core.on_failure(message, now)
        if isinstance(message, RebuildAck):
            return core.on_ack(message, now)
        if isinstance(message, SnapshotComplete):
            return core.on_snapshot_complete(message, now)
        if isinstance(message, MemberDone):
            return core.on_done(message, now)
        if isinstance(message, GroupBroken):
            return core.on_group_broken(message, now)
        if isinstance(message, StepResumed):
            return core.on_step_resumed(message, now)
        return Decision([], f"event {message.KIND} is not for the swapper")

    # ------------------------------------------------------------------ actions

    async def _carry_out(self, decision: Decision) -> None:
        if (
            decision.reason != self._last_reason
            and decision.reason != "tick"
            and "already applied" not in decision.reason
        ):
            self.log.info("decision", reason=decision.reason)
            self._last_reason = decision.reason
        fences = [a for a in decision.actions if isinstance(a, Fence)]
        self._dirty = self._dirty or any(isinstance(a, Persist) for a in decision.actions)
        self._held += [a for a in decision.actions if isinstance(a, Publish)]
        await asyncio.gather(*(self._fence(f) for f in fences), self._save())
        if self._dirty or not self._leading():
            return  # not durable yet (or no longer ours to say): nothing goes out
        held, self._held = self._held, []
        for action in held:
            await self._publish(action)
        replies, self._replies = self._replies, []
        for hello, reply in replies:
            if not hello.reply.done():
                hello.reply.set_result(reply)

    async def _save(self) -> None:
        state = self.state
        if not self._dirty:
            return
        if state is None:
            self._dirty = False
            return
        try:
            await self.records.save(state)
            self._dirty = False
        except RecordConflictError as exc:
            self.log.error("job record changed under us: reloading it", reason=str(exc))
            await self._reload()
        except (TimeoutError, nats.errors.Error) as exc:
            self.log.warning("job record not saved yet: will retry", error=repr(exc), held=len(self._held))

    async def _reload(self) -> None:
        """Another swapper wrote our job: take its record as the truth and follow the stream from there.
        Publications and replies decided on the state we drop are dropped with it (members retry)."""
        self._held.clear()
        self._replies.clear()
        self._dirty = False
        try:
            fresh = await self.records.load(self.job)
        except UnreadableRecordError:
            self.core.jobs.pop(self.job, None)
            self._stop.set()  # someone else wrote what we cannot read: act on nothing of this job
            return
        except (TimeoutError, nats.errors.Error) as exc:
            self.log.error("job record not reloaded", error=repr(exc))
            self._dirty = True
            return
        if fresh is None:
            self.core.jobs.pop(self.job, None)
        else:
            self.core.jobs[self.job] = fresh
        if self._reader is not None:
            await self._reader.stop()
        await self._start_reader()
