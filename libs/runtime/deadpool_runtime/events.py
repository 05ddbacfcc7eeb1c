"""The events stream: at-least-once delivery of every message that changes state.

Publishers store each event in the `DEADPOOL_EVENTS` JetStream stream and retry until the server
acknowledges it, however long that takes (`EventPublisher`), under one `Nats-Msg-Id` per event so a
retry after a lost acknowledgement is not stored twice. Readers follow the stream in order from a
position they choose (`EventReader`): the swapper from the stream sequence recorded in each job's KV
record, so a new leader replays exactly what its predecessor had not yet made durable; the detector
from a recent time, so a restarted one sees the exits it missed.

Why a stream rather than retransmit-until-confirmed everywhere: the events outlive the process that
consumes them (a swapper SIGKILLed mid-rebuild, a NATS server restarted right after a failure), and
the position a consumer has reached can be committed atomically with the state it produced (the job
record's revision check). Commands from the swapper to members stay on core NATS and are
retransmitted until confirmed: a member needs only the newest one.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import ConsumerConfig, DeliverPolicy, DiscardPolicy, RetentionPolicy, StorageType, StreamConfig

from deadpool_protocol import Message, ProtocolError, decode_any, encode, subject_refusal
from deadpool_protocol.codec import MESSAGE_BYTES_MAX
from deadpool_protocol.events import EVENTS_STREAM, event_subjects
from deadpool_runtime.lifecycle import stopped_within
from deadpool_runtime.log_limit import RefusalLog

__all__ = [
    "EventPublisher",
    "EventReader",
    "ensure_events_stream",
    "stream_position",
]

EVENT_ACK_TIMEOUT_S = 2.0
"""How long one attempt waits for the server's acknowledgement."""
EVENT_RETRY_FIRST_S = 0.05
EVENT_RETRY_MAX_S = 1.0
"""The pause between two attempts doubles from `EVENT_RETRY_FIRST_S` up to this, then stays: an event
is stored within about a second of JetStream coming back, however long it was away."""
EVENT_RETRY_LOG_EVERY = 60
"""While an event is retried, it is logged again every this many attempts (about a minute)."""
EVENTS_IN_FLIGHT_MAX = 10_000
EVENTS_IN_FLIGHT_BYTES_MAX = 64 * 1024**2
"""What a publisher holds while the stream is unavailable; beyond either bound, new events are dropped
(logged). Every event that matters is repeated by its sender until it is answered, so a dropped one
comes again: a verdict (the detector repeats it until a rebuild answers it), an ack (sent again for
each retransmitted rebuild), a done report (repeated until the job finishes), a broken-group report
(repeated while the group stays broken). An exit or error report is backed by heartbeat silence, a
snapshot completion by the next step's."""
STREAM_MAX_AGE_S = 3600.0
STREAM_MAX_BYTES = 1024**3
STREAM_DUPLICATE_WINDOW_S = 120.0
READER_IDLE_HEARTBEAT_S = 0.5
"""An ordered consumer that misses two of these is recreated from where it stopped."""
READER_START_RETRY_S = 0.5

EventHandler = Callable[[Message, int], Awaitable[None]]
"""Called with each valid event and its stream sequence, in stream order."""


async def ensure_events_stream(nc: Client, replicas: int = 1) -> None:
    """Create the events stream if it does not exist (every service may call this)."""
    js = nc.jetstream(timeout=5.0)
    config = StreamConfig(
        name=EVENTS_STREAM,
        subjects=event_subjects("*"),
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        num_replicas=replicas,
        max_age=STREAM_MAX_AGE_S,
        max_bytes=STREAM_MAX_BYTES,
        max_msg_size=MESSAGE_BYTES_MAX,
        discard=DiscardPolicy.OLD,
        duplicate_window=STREAM_DUPLICATE_WINDOW_S,
    )
    try:
        info = await js.stream_info(EVENTS_STREAM)
        if sorted(info.config.subjects or []) != sorted(config.subjects or []):  # a newer version's events
            with contextlib.suppress(nats.js.errors.BadRequestError):  # updated meanwhile by another service
                await js.update_stream(config)
    except nats.js.errors.NotFoundError:
        try:
            await js.add_stream(config)
        except nats.js.errors.BadRequestError:  # created meanwhile by another service
            await js.stream_info(EVENTS_STREAM)


async def stream_position(nc: Client) -> tuple[str, int]:
    """(which incarnation of the stream this is, its last sequence). A sequence is only meaningful
    within one incarnation: a stream deleted and created again starts counting at 1."""
    info = await nc.jetstream(timeout=5.0).stream_info(EVENTS_STREAM)
    created = info.created.isoformat() if info.created is not None else ""
    return created, info.state.last_seq


class EventPublisher:
    """Stores events in the stream, each retried until the server has it, however long JetStream is
    away (a lost quorum, a stream leader being elected, every server restarting): there is no give-up
    by time, because a dropped verdict or exit report can leave a job waiting for good. An attempt
    waits `EVENT_ACK_TIMEOUT_S`; the pause between attempts is capped (`EVENT_RETRY_MAX_S`). Retries
    end only when the server refuses the event outright (it can never be stored), the connection is
    closed, or the process stops (`drain`).

    What is held is bounded (`EVENTS_IN_FLIGHT_MAX`, `EVENTS_IN_FLIGHT_BYTES_MAX`), and an event equal
    to one still in flight (same subject, same bytes: a repeated verdict, a re-sent ack or done report)
    joins it instead of being held twice, so senders that repeat themselves during an outage do not
    fill the bound."""

    def __init__(self, nc: Client, log: Any) -> None:
        self.nc = nc
        self.log = log
        self._js = nc.jetstream(timeout=EVENT_ACK_TIMEOUT_S)
        self._in_flight: dict[tuple[str, bytes], asyncio.Task[bool]] = {}
        self._in_flight_bytes = 0
        self.dropped = 0

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    async def publish(self, subject: str, message: Message) -> bool:
        """Store `message`; True once the server acknowledged it, False if it was dropped (the bound),
        refused, or abandoned because the process is stopping."""
        task = self.publish_soon(subject, message)
        if task is None:
            return False
        try:
            return await asyncio.shield(task)  # a caller that stops waiting does not stop the retries
        except asyncio.CancelledError:
            if task.cancelled():  # abandoned by `drain`, not this caller cancelled
                return False
            raise

    def publish_soon(self, subject: str, message: Message) -> asyncio.Task[bool] | None:
        """Store `message` in the background (the caller does not wait); the task says whether it was
        stored. The same event still in flight: that one's task. None if the bound is reached."""
        payload = encode(message)
        key = (subject, payload)
        task = self._in_flight.get(key)
        if task is not None:
            return task
        if len(self._in_flight) >= EVENTS_IN_FLIGHT_MAX or (
            self._in_flight_bytes + len(payload) > EVENTS_IN_FLIGHT_BYTES_MAX
        ):
            self.dropped += 1
            if self.dropped & (self.dropped - 1) == 0:  # 1, 2, 4, 8...: a flood cannot fill the log
                self.log.error(
                    "event dropped: too many in flight",
                    subject=subject,
                    in_flight=len(self._in_flight),
                    in_flight_bytes=self._in_flight_bytes,
                    dropped=self.dropped,
                )
            return None
        task = asyncio.create_task(self._store(subject, payload, message.KIND))
        self._in_flight[key] = task
        self._in_flight_bytes += len(payload)

        def done(_task: asyncio.Task[bool]) -> None:
            del self._in_flight[key]
            self._in_flight_bytes -= len(payload)

        task.add_done_callback(done)
        return task

    async def _store(self, subject: str, payload: bytes, kind: str) -> bool:
        headers = {"Nats-Msg-Id": f"{kind}-{secrets.token_hex(8)}"}  # one id: a retry is stored once
        started = time.monotonic()
        delay = EVENT_RETRY_FIRST_S
        attempts = 0
        while True:
            attempts += 1
            try:
                await self._js.publish(subject, payload, timeout=EVENT_ACK_TIMEOUT_S, headers=headers)
                if attempts > 1:
                    waited_s = round(time.monotonic() - started, 3)
                    self.log.info("event stored after retries", subject=subject, attempts=attempts, waited_s=waited_s)
                return True
            except (nats.errors.MaxPayloadError, nats.js.errors.BadRequestError) as exc:
                self.log.error("event refused by the server: not stored", subject=subject, error=repr(exc))
                return False
            except (TimeoutError, nats.errors.Error) as exc:
                if self.nc.is_closed:
                    self.log.error("event not stored: the connection is closed", subject=subject, attempts=attempts)
                    return False
                if attempts == 1 or attempts % EVENT_RETRY_LOG_EVERY == 0:
                    waited_s = round(time.monotonic() - started, 3)
                    self.log.warning(
                        "event not stored yet: retrying",
                        subject=subject,
                        attempts=attempts,
                        waited_s=waited_s,
                        error=repr(exc),
                    )
            await asyncio.sleep(delay)
            delay = min(2 * delay, EVENT_RETRY_MAX_S)

    async def drain(self, timeout_s: float) -> None:
        """Before the process stops: wait (bounded) for the events still in flight, then abandon the
        rest (logged: they were never stored)."""
        if not self._in_flight:
            return
        pending = set(self._in_flight.values())
        _, left = await asyncio.wait(pending, timeout=timeout_s)
        if left:
            subjects = sorted({subject for subject, _ in self._in_flight})
            self.log.error("events not stored: the process is stopping", events=len(left), subjects=subjects[:20])
            for task in left:
                task.cancel()
            await asyncio.gather(*left, return_exceptions=True)


class EventReader:
    """Follows the events stream in order, from a stream sequence or a time, for a set of subjects.

    Built on JetStream's ordered consumer: no acknowledgements, and when its heartbeats stop (a server
    restarted, the node that held it died) it is recreated from the last sequence delivered, so
    nothing is skipped and nothing repeats. Every event is validated before `handler` sees it; an
    invalid one is logged and skipped.
    """

    def __init__(
        self,
        nc: Client,
        subjects: Sequence[str],
        handler: EventHandler,
        log: Any,
        expected: Sequence[type[Message]] = (),
        slice_s: float = 0.002,
    ) -> None:
        self.nc = nc
        self.subjects = list(subjects)
        self.handler = handler
        self.log = log
        self._refusals = RefusalLog(log)
        self.expected = tuple(expected)
        self.last_seq = 0
        self._sub: Subscription | None = None
        self.slice_s = slice_s
        """The longest this reader handles a burst of events before it lets the loop's other tasks run
        (0: after every event, a turn of the loop each, where a rebuild brings thousands)."""
        self._yield_at = 0.0

    async def start(
        self, stop: asyncio.Event, start_seq: int = 0, start_time: float = 0.0, attempts_max: int = 0
    ) -> bool:
        """Create the consumer, retrying (every `READER_START_RETRY_S`) until it exists, `stop` is set,
        or `attempts_max` attempts failed (0: no limit). Start at `start_seq` (> 0), else at
        `start_time` (> 0, wall clock), else with the next new event."""
        config = ConsumerConfig(filter_subjects=self.subjects, inactive_threshold=60.0)
        if start_seq > 0:
            config.deliver_policy, config.opt_start_seq = DeliverPolicy.BY_START_SEQUENCE, start_seq
        elif start_time > 0:
            config.deliver_policy = DeliverPolicy.BY_START_TIME
            config.opt_start_time = datetime.datetime.fromtimestamp(start_time, datetime.UTC)
        else:
            config.deliver_policy = DeliverPolicy.NEW
        js = self.nc.jetstream(timeout=5.0)
        attempts = 0
        while not stop.is_set():
            attempts += 1
            try:
                self._sub = await js.subscribe(
                    self.subjects[0],
                    stream=EVENTS_STREAM,
                    cb=self._on_msg,
                    ordered_consumer=True,
                    idle_heartbeat=READER_IDLE_HEARTBEAT_S,
                    config=config,
                )
                # nats.py recreates an ordered consumer "by start sequence" but keeps this config's
                # start time, which the server refuses: every later recreation failed and the reader
                # went deaf after the first server loss (seen in the chaos benchmark). The consumer
                # exists now; from here on only the sequence matters.
                config.opt_start_time = None
                return True
            except (TimeoutError, nats.errors.Error) as exc:
                if attempts == 1 or attempts % 20 == 0:
                    self.log.warning("events reader not started yet: retrying", subjects=self.subjects, error=repr(exc))
                if attempts_max and attempts >= attempts_max:
                    return False
                if await stopped_within(stop, READER_START_RETRY_S):
                    break
        return False

    async def stop(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(nats.errors.Error):
                await self._sub.unsubscribe()
            self._sub = None

    async def _on_msg(self, msg: Msg) -> None:
        try:
            await self._take(msg)
        finally:
            # nats.py hands a subscription's waiting messages to its callback without yielding in
            # between: a swapper's reader of a rebuild's 1,024 ack batches (8,192 ranks, 0.1 ms each to
            # decode) held the loop for their whole decode, 0.1 s and more on a busy machine, while
            # its other reader, its job worker and its leader lease (renewed every 0.2 s, lapsed past
            # 0.75 s) waited.
            if time.monotonic() >= self._yield_at:
                await asyncio.sleep(0)
                self._yield_at = time.monotonic() + self.slice_s

    async def _take(self, msg: Msg) -> None:
        try:
            seq = msg.metadata.sequence.stream
        except (nats.errors.Error, ValueError, IndexError):
            return  # not a stream message (a status or control message)
        self.last_seq = max(self.last_seq, seq)
        try:
            message = decode_any(msg.data)
            if self.expected and not isinstance(message, self.expected):
                raise ProtocolError(f"{message.KIND} is not an event this reader expects")
            if refused := subject_refusal(msg.subject, message):
                raise ProtocolError(refused)
        except ProtocolError as exc:
            self._refusals.warning("rejected event", subject=msg.subject, seq=seq, reason=str(exc))
            return
        try:
            await self.handler(message, seq)
        except Exception:
            self.log.exception("event handler failed", subject=msg.subject, seq=seq, kind=message.KIND)
