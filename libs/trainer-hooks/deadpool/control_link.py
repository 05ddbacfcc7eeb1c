"""The member's line to the control plane: a NATS client on its own thread and event loop.

It must not share the training thread: that thread can sit inside a blocked collective for as long as
it takes the cascade to release it, and heartbeats and the swapper's commands must keep flowing
meanwhile. The training thread talks to it through a condition variable (commands in) and
fire-and-forget publishes (reports out).

Delivery. The member's reports that change state (acks, done, its own errors) are events: stored in
the events stream, retried until the server has them. The swapper's commands arrive on core NATS and
are retransmitted until confirmed: a retransmitted rebuild of the generation this member has already
acked is answered with the same ack again, so a lost ack never leaves the job waiting.

Rebuilds as deltas. A whole rebuild names every rank's member and stores (937 kB at 16,384 ranks, to
every member). The swapper sends each one whole and as its changes from the generation before
(`RebuildDelta`). A member hears the whole ones until it holds a command, then the deltas only, and
subscribes to the whole ones again when a delta cannot be applied to what it holds (it missed a
generation or a placement, or the delta is a notice with no base): the whole command comes with the
next retransmission (`rebuild_retransmit_s`). Placements within a generation go the same way
(`PlacementDelta`): a member that holds the command of their generation takes each from its delta, and
hears whole placements only when one does not apply.
"""

from __future__ import annotations

import asyncio
import os
import random
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from deadpool.cpu_placement import BACKGROUND_CPUS_ENV, cpus_from_env, pin_this_thread
from deadpool.member_config import MemberConfig
from deadpool.thread_probe import probe_thread
from deadpool.wanted_subscription import WantedSubscription
from deadpool_protocol import (
    NO_RANK,
    Commit,
    GenerationVoid,
    Heartbeat,
    HelloReply,
    JobFinished,
    JobMessage,
    MemberHello,
    MemberPhase,
    Placement,
    PlacementDelta,
    ProtocolError,
    Rebuild,
    RebuildAck,
    RebuildDelta,
    RebuildState,
    SnapshotInterval,
    StepResumed,
    Subjects,
    decode,
    encode,
)
from deadpool_protocol.errors import DeadPoolError
from deadpool_protocol.placement_delta import placement_applied
from deadpool_protocol.rebuild_delta import applied, base_of
from deadpool_runtime import EventPublisher, connect, subscribe_validated

__all__ = ["ControlLink", "MemberRefusedError", "Progress"]

CONNECT_TIMEOUT_S = 30.0
HELLO_TIMEOUT_S = 2.0
"""How long a member first waits for the answer to its hello before it asks again."""
HELLO_TIMEOUT_MAX_S = 8.0
"""Each hello whose answer did not come in time doubles the next wait, up to this: when thousands of
members say hello at once, a swapper that needs 3 s to answer them all must not get every hello
again at 2 s, then again (every answer late, for ever)."""
HELLO_RETRY_S = 0.5


def longer_hello_wait(wait_s: float) -> float:
    """The wait for the next hello's answer after one that did not come within `wait_s`."""
    return min(2 * wait_s, HELLO_TIMEOUT_MAX_S)


def hello_retry_pause_s() -> float:
    """The pause before a hello is asked again, spread so that members that asked together do not ask
    again together."""
    return HELLO_RETRY_S * random.uniform(0.5, 1.5)


RESUMED_ANSWER_S = 5.0
"""How long a member waits for its launcher to say that the batch holding the member's first step of a
generation is stored; without that answer the member stores the first step as an event of its own."""
CLOSE_EVENTS_WAIT_S = 5.0
"""At close, how long the link waits for events still being stored (a done report, an error)."""


class MemberRefusedError(DeadPoolError, RuntimeError):
    """The swapper refused this member's registration (the text says why)."""


@dataclass(frozen=True)
class Progress:
    """What the heartbeat says about the training thread; replaced whole, so reads are consistent."""

    generation: int = 0
    rank: int = NO_RANK
    step: int = -1
    in_step: bool = False
    step_started_t: float = 0.0
    snapshots_skipped: int = 0
    section: str = ""
    awaiting_rebuild: bool = False
    rebuilding: bool = False
    step_completed_t: float = 0.0
    phase: MemberPhase = MemberPhase.SPARE
    rebuild_state: RebuildState | None = None
    local_step: int = -1
    """The newest step the member's own buffers hold whole (its crash copy, on its host)."""
    snapshot_every: int = 1
    """The job's snapshot interval as this member knows it (`deadpool.snapshot_cadence`)."""


Command = Rebuild | GenerationVoid | JobFinished
_Whole = TypeVar("_Whole", Rebuild, Placement)


class ControlLink:
    def __init__(
        self,
        config: MemberConfig,
        log: Any,
        on_command: Callable[[Command], None] | None = None,
        on_placement: Callable[[Placement], None] | None = None,
        on_interval: Callable[[SnapshotInterval], None] | None = None,
        on_snapshot_size: Callable[[int], bool] | None = None,
    ) -> None:
        self.config = config
        self._on_command_cb = on_command
        """Called on the control thread when a newer rebuild, a void notice or the job's end arrives
        (it must be quick and thread-safe: it breaks the waits that command makes pointless)."""
        self._on_placement_cb = on_placement
        """Called on the control thread with each newer placement (quick and thread-safe, too)."""
        self._on_interval_cb = on_interval
        """Called on the control thread with each snapshot interval a rank of the job says (quick too)."""
        self._on_snapshot_size_cb = on_snapshot_size
        """A spare's: called on the control thread with the largest snapshot a rank of the job streamed,
        from the hello's answer and each commit (quick too); it returns whether it still wants them.
        Without it, or once it wants no more (its landing was taken), the member hears no commits: a
        promoted spare heard every commit of its job for the rest of its life."""
        self._commits: Subscription | None = None
        self.log = log
        self.subjects = Subjects.for_job(config.job)
        self.progress = Progress()
        self.training_thread: int | None = threading.get_ident()
        """The thread whose stack heartbeats report (the one that created this link)."""
        self._cond = threading.Condition()
        self._rebuild: Rebuild | None = None
        self._rebuild_received_t = 0.0
        self._finished: JobFinished | None = None
        self._void = 0
        """The newest generation the swapper said will not form or train again."""
        self._placement: Placement | None = None
        """The newest placement within a generation (by generation, then version)."""
        self._whole_rebuilds = WantedSubscription(
            lambda: self._subscribe(self.subjects.rebuild, Rebuild, self._on_rebuild), "whole rebuilds", log
        )
        """Held while this member holds no command a delta can go from."""
        self._whole_placements = WantedSubscription(
            lambda: self._subscribe(self.subjects.placement, Placement, self._on_placement), "whole placements", log
        )
        """Held while a placement's delta did not apply to what this member holds, until a whole one comes."""
        self.rebuilds_from_deltas = 0
        """Commands this member made from deltas (a figure for tests)."""
        self.placements_from_deltas = 0
        """Placements this member made from deltas (a figure for tests)."""
        self._ack: RebuildAck | None = None
        """Our ack of the newest generation we completed, sent again if that rebuild is retransmitted."""
        self._events: EventPublisher | None = None
        self._refused = ""
        self._registered = False
        self.store_token = b""
        self.seal_key = b""
        """The job's seal key, from the swapper's answer to the hello (`StoreConnection.seal_key`)."""
        """The job's data-plane token, from the swapper's answer to our hello (b'' where stores take none)."""
        self._loop = asyncio.new_event_loop()
        self._nc: Client | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="deadpool-control", daemon=True)

    # ------------------------------------------------------------ called from the training thread

    def start(self, hello: MemberHello) -> None:
        """Connect, subscribe and register; returns once the swapper accepted us (or raises)."""
        self._hello = hello
        self._thread.start()
        if not self._ready.wait(CONNECT_TIMEOUT_S):
            raise ConnectionError(f"no NATS connection to {self.config.nats_url} within {CONNECT_TIMEOUT_S} s")
        deadline = time.monotonic() + self.config.hello_wait_s
        with self._cond:
            while not self._registered and not self._refused and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)
            registered, refused = self._registered, self._refused
        if refused:
            raise MemberRefusedError(f"the swapper refused member {self.config.member}: {refused}")
        if not registered:
            self.close()
            raise ConnectionError(
                f"no swapper answered member {self.config.member}'s hello within {self.config.hello_wait_s} s "
                f"(is DeadPool up at {self.config.nats_url}, and its JetStream reachable?)"
            )

    def latest_rebuild(self) -> tuple[Rebuild | None, float]:
        """The newest rebuild command seen, and when it arrived (wall clock)."""
        with self._cond:
            return self._rebuild, self._rebuild_received_t

    def hears_whole_rebuilds(self) -> bool:
        """Whether this member is subscribed to whole rebuilds (it holds no command a delta goes from)."""
        return self._whole_rebuilds.held

    def hears_whole_placements(self) -> bool:
        """Whether this member is subscribed to whole placements (a placement's delta did not apply)."""
        return self._whole_placements.held

    def latest_placement(self) -> Placement | None:
        with self._cond:
            return self._placement

    def finished(self) -> JobFinished | None:
        with self._cond:
            return self._finished

    def void_generation(self) -> int:
        with self._cond:
            return self._void

    def wait_command(self, newer_than: int, timeout_s: float | None) -> Rebuild | JobFinished | None:
        """Block until a rebuild of a generation above `newer_than` arrives, or the job finishes."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while True:
                if self._rebuild is not None and self._rebuild.generation > newer_than:
                    return self._rebuild
                if self._finished is not None:
                    return self._finished
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self._cond.wait(remaining)

    def server_ports(self) -> set[int]:
        """Ports of the NATS servers this link may be connected to."""
        nc = self._nc
        servers = nc.servers if nc is not None else []
        return {s.port for s in servers if s.port is not None}

    def publish(self, subject: str, message: JobMessage) -> Future[None]:
        """Send a report from any thread (core NATS: for what may be lost); returns a future."""
        return asyncio.run_coroutine_threadsafe(self._publish(subject, message), self._loop)

    def publish_event(self, subject: str, message: JobMessage) -> Future[bool]:
        """Store an event from any thread (retried until the server has it, however long); the future says
        whether it was stored (False: dropped, refused, or abandoned because the member is stopping)."""
        return asyncio.run_coroutine_threadsafe(self._publish_event(subject, message), self._loop)

    def ack(self, ack: RebuildAck) -> Future[bool]:
        """Send our ack of a rebuild, and remember it to answer that rebuild's retransmissions."""
        with self._cond:
            self._ack = ack
        return asyncio.run_coroutine_threadsafe(self._send_ack(ack), self._loop)

    async def _send_ack(self, ack: RebuildAck) -> bool:
        """To our launcher, which stores the acks of its members as one event (`RebuildAckBatch`), where
        our heartbeats go to it too; else stored as an event of its own. Sent again with every
        retransmission of the rebuild: one lost on the way to the launcher is not lost for good."""
        launcher_subject = self._launcher_ack_subject()
        if launcher_subject:
            try:
                await self._publish(launcher_subject, ack)
            except Exception as exc:  # an outage: the rebuild's retransmission asks for it again
                self.log.warning("ack not sent to the launcher", error=repr(exc))
                return False
            return True
        return await self._publish_event(self.subjects.rebuild_ack, ack)

    def step_resumed(self, resumed: StepResumed) -> Future[bool]:
        """Say our first completed step of a generation, from any thread; the future says whether it is
        held for the swapper (by our launcher, or stored as an event)."""
        return asyncio.run_coroutine_threadsafe(self._send_step_resumed(resumed), self._loop)

    async def _send_step_resumed(self, resumed: StepResumed) -> bool:
        """To our launcher, which stores its members' first steps as one event (`StepResumedBatch`) and
        answers once that is stored, where our heartbeats go to it; else, or without its answer, stored
        as an event of its own (said twice, it is counted once)."""
        if self._launcher_ack_subject() and self._nc is not None:
            subject = self.subjects.launcher_step_resumed(self.config.launcher)
            try:
                await self._nc.request(subject, encode(resumed), timeout=RESUMED_ANSWER_S)
                return True
            except Exception as exc:  # the launcher busy, gone, or the bus away: the event path holds it
                self.log.warning("first step not taken by the launcher: stored as an event", error=repr(exc))
        return await self._publish_event(self.subjects.step_resumed, resumed)

    def close(self, timeout_s: float = 5.0) -> None:
        if not self._thread.is_alive():
            return
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout_s)

    # ------------------------------------------------------------ the control thread

    def _run(self) -> None:
        pin_this_thread(cpus_from_env(BACKGROUND_CPUS_ENV))
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._main())

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        self._nc = await connect(
            self.config.nats_url,
            f"deadpool-member-{self.config.member}",
            self.log,
            self.config.nats_nkey,
            inbox_prefix=self.subjects.inbox,
        )
        self._events = EventPublisher(self._nc, self.log)
        await self._whole_rebuilds.start()
        await subscribe_validated(self._nc, self.subjects.rebuild_delta, RebuildDelta, self._on_rebuild_delta, self.log)
        await subscribe_validated(self._nc, self.subjects.void, GenerationVoid, self._on_void, self.log)
        await subscribe_validated(self._nc, self.subjects.finished, JobFinished, self._on_finished, self.log)
        await subscribe_validated(
            self._nc, self.subjects.placement_delta, PlacementDelta, self._on_placement_delta, self.log
        )
        await subscribe_validated(
            self._nc, self.subjects.snapshot_interval, SnapshotInterval, self._on_interval, self.log
        )
        if self._on_snapshot_size_cb is not None:
            self._commits = await subscribe_validated(self._nc, self.subjects.commit, Commit, self._on_commit, self.log)
        self._ready.set()
        # Beats go from the start, not once the hello is answered: the formation may name a member
        # whose answer is late (16,384 hellos at once: its request timed out and goes again), and a
        # named member must be heard within the heartbeat timeout. Unnamed, it is only noted.
        beat = asyncio.create_task(self._heartbeats())
        try:
            await self._register()
            await self._stop.wait()
        finally:
            beat.cancel()
        await self._events.drain(CLOSE_EVENTS_WAIT_S)
        await self._nc.drain()

    async def _register(self) -> None:
        assert self._nc is not None and self._stop is not None
        attempts = 0
        timeout_s = HELLO_TIMEOUT_S
        while not self._stop.is_set():
            attempts += 1
            try:
                msg = await self._nc.request(self.subjects.hello, encode(self._hello), timeout=timeout_s)
                if msg.headers and msg.headers.get("Nats-Service-Error-Code"):
                    raise ProtocolError(msg.headers.get("Nats-Service-Error", "hello rejected"))
                reply = decode(msg.data, HelloReply)
            except (NoRespondersError, NatsTimeoutError) as exc:
                if attempts % 20 == 1:  # every ~10 s, not every retry
                    self.log.info("waiting for the swapper to answer hello", attempts=attempts)
                if isinstance(exc, NatsTimeoutError):  # heard, not answered in time: a busy swapper
                    timeout_s = longer_hello_wait(timeout_s)
                await asyncio.sleep(hello_retry_pause_s())
                continue
            except ProtocolError as exc:
                reply = HelloReply(self.config.job, 0, self.config.member, False, str(exc))
            with self._cond:
                if reply.accepted:
                    self._registered = True
                    self.store_token = reply.store_token
                    self.seal_key = reply.seal_key
                    self._snapshot_size(reply.snapshot_bytes)
                elif reply.finished:  # too late: not an error, the member just has nothing to do
                    self._registered = True
                    failed = bool(reply.failed_reason)
                    self._finished = JobFinished(reply.job, reply.generation, 0, failed, reply.failed_reason)
                else:
                    self._refused = reply.reason or "no reason given"
                self._cond.notify_all()
            return

    async def _heartbeats(self) -> None:
        via_launcher = self.config.heartbeat_via_launcher and self.config.launcher
        heartbeat_subject = (
            self.subjects.launcher_heartbeat(self.config.launcher) if via_launcher else self.subjects.heartbeat
        )
        assert self._nc is not None
        pid = os.getpid()
        while True:
            p = self.progress
            waiting, where = probe_thread(self.training_thread)
            beat = Heartbeat(
                job=self.config.job,
                generation=p.generation,
                member=self.config.member,
                rank=p.rank,
                pid=pid,
                step=p.step,
                in_step=p.in_step,
                step_started_t=p.step_started_t,
                t=time.time(),
                snapshots_skipped=p.snapshots_skipped,
                waiting=waiting,
                where=where[:200],
                section=p.section[:64],
                host=self.config.host,
                awaiting_rebuild=p.awaiting_rebuild,
                rebuilding=p.rebuilding,
                step_completed_t=p.step_completed_t,
                phase=p.phase,
                rebuild_state=p.rebuild_state,
                local_step=p.local_step,
                snapshot_every=p.snapshot_every,
            )
            try:
                await self._nc.publish(heartbeat_subject, encode(beat))
            except Exception as exc:  # an outage must not kill the heartbeat task
                self.log.warning("heartbeat not sent", error=repr(exc))
            await asyncio.sleep(self.config.heartbeat_period_s)

    async def _on_rebuild(self, rebuild: Rebuild, _msg: Msg) -> None:
        with self._cond:
            ack = self._ack
            seen = self._rebuild is not None and rebuild.generation <= self._rebuild.generation
            if not seen:
                self._rebuild = rebuild
                self._rebuild_received_t = time.time()
                self._cond.notify_all()
        if not seen:
            self._command(rebuild)
            self._whole_rebuilds.want(False)  # we hold a command: the next one comes as its delta
        elif ack is not None and ack.generation == rebuild.generation:
            await self._resend_ack(ack)  # a retransmission: our ack was lost, again
        # else: an older generation's, nothing new

    async def _on_rebuild_delta(self, delta: RebuildDelta, msg: Msg) -> None:
        with self._cond:
            held, placement, ack = self._rebuild, self._placement, self._ack
        if held is not None and delta.generation <= held.generation:
            if ack is not None and ack.generation == delta.generation and not self._whole_rebuilds.held:
                await self._resend_ack(ack)  # a retransmission (heard whole too, it answers there)
            self._whole_rebuilds.want(False)  # deltas reach us, and we hold the command the next one goes from
            return
        version, stores = base_of(held, placement)
        command = applied(delta, held, version, stores)
        if command is None:
            if not self._whole_rebuilds.held:  # else it comes whole to us anyway (a formation's notice)
                self.log.info(
                    "rebuild comes whole: its delta does not go from the command held here",
                    generation=delta.generation,
                    base=(delta.base_generation, delta.base_version),
                    held=None if held is None else (held.generation, version),
                )
            self._whole_rebuilds.want(True)
            return
        self.rebuilds_from_deltas += 1
        await self._on_rebuild(command, msg)

    async def _subscribe(
        self, subject: str, kind: type[_Whole], handler: Callable[[_Whole, Msg], Awaitable[None]]
    ) -> Subscription:
        assert self._nc is not None
        return await subscribe_validated(self._nc, subject, kind, handler, self.log)

    async def _resend_ack(self, ack: RebuildAck) -> None:
        """Our ack again, without waiting on the server (this is the rebuild subscription's callback)."""
        launcher_subject = self._launcher_ack_subject()
        if launcher_subject and self._nc is not None:
            try:
                await self._nc.publish(launcher_subject, encode(ack))
            except Exception as exc:  # the next retransmission asks again
                self.log.warning("ack not sent to the launcher", error=repr(exc))
        elif not launcher_subject and self._events is not None:
            self._events.publish_soon(self.subjects.rebuild_ack, ack)

    def _launcher_ack_subject(self) -> str:
        """Where our acks go when our launcher batches them (where our heartbeats go to it); '' if not."""
        if self.config.heartbeat_via_launcher and self.config.launcher:
            return self.subjects.launcher_ack(self.config.launcher)
        return ""

    async def _on_void(self, void: GenerationVoid, _msg: Msg) -> None:
        with self._cond:
            if void.generation <= self._void:
                return
            self._void = void.generation
            self._cond.notify_all()
        self._command(void)

    async def _on_placement_delta(self, delta: PlacementDelta, msg: Msg) -> None:
        """A placement of the generation this member holds, from its delta where it goes from the
        newest one held; heard whole (from the next retransmission) where it does not. One of another
        generation is of no use here: the member takes that generation's command whole or from its
        delta, with its placement in it."""
        with self._cond:
            held, newest = self._rebuild, self._placement
        if held is None or delta.generation != held.generation:
            return
        version, stores = base_of(held, newest)
        if delta.version <= version:
            self._whole_placements.want(False)  # a retransmission, or an older one
            return
        placement = placement_applied(delta, held, version, stores)
        if placement is None:
            if not self._whole_placements.held:
                self.log.info(
                    "placement comes whole: its delta does not go from the one held here",
                    generation=delta.generation,
                    version=delta.version,
                    base=delta.base_version,
                    held=version,
                )
            self._whole_placements.want(True)
            return
        self.placements_from_deltas += 1
        await self._on_placement(placement, msg)

    async def _on_placement(self, placement: Placement, _msg: Msg) -> None:
        with self._cond:
            newest = self._placement
            if newest is not None and (placement.generation, placement.version) <= (newest.generation, newest.version):
                return  # a retransmission, or an older one
            self._placement = placement
        self._whole_placements.want(False)  # the next one's delta goes from this one
        if self._on_placement_cb is not None:
            try:
                self._on_placement_cb(placement)
            except Exception:
                self.log.exception("placement callback failed")

    async def _on_interval(self, interval: SnapshotInterval, _msg: Msg) -> None:
        if interval.job != self.config.job:
            self.log.warning("snapshot interval of another job ignored", job=interval.job)
            return
        if self._on_interval_cb is not None:
            try:
                self._on_interval_cb(interval)
            except Exception:
                self.log.exception("interval callback failed")

    async def _on_commit(self, commit: Commit, _msg: Msg) -> None:
        if commit.job != self.config.job:
            self.log.warning("commit of another job ignored", job=commit.job)
            return
        if not self._snapshot_size(commit.snapshot_bytes) and self._commits is not None:
            commits, self._commits = self._commits, None
            await commits.unsubscribe()
            self.log.info("commits no longer heard: the landing was taken")

    def _snapshot_size(self, nbytes: int) -> bool:
        """Hand a snapshot size on; whether sizes are still wanted."""
        if self._on_snapshot_size_cb is None:
            return False
        if nbytes <= 0:
            return True
        try:
            return self._on_snapshot_size_cb(nbytes)
        except Exception:
            self.log.exception("snapshot size callback failed")
            return True

    async def _on_finished(self, finished: JobFinished, _msg: Msg) -> None:
        with self._cond:
            known = max(self._void, self._rebuild.generation if self._rebuild is not None else 0)
            if finished.generation < known:  # an older generation's notice (a stale or replayed one)
                self.log.warning(
                    "finished notice of an older generation ignored", generation=finished.generation, known=known
                )
                return
            first = self._finished is None
            self._finished = finished
            self._cond.notify_all()
        if first:
            self._command(finished)

    def _command(self, command: Command) -> None:
        if self._on_command_cb is not None:
            try:
                self._on_command_cb(command)
            except Exception:  # the control thread must go on whatever the callback does
                self.log.exception("command callback failed", kind=command.KIND)

    async def _publish(self, subject: str, message: JobMessage) -> None:
        assert self._nc is not None
        await self._nc.publish(subject, encode(message))
        await self._nc.flush(timeout=5)

    async def _publish_event(self, subject: str, message: JobMessage) -> bool:
        assert self._events is not None
        return await self._events.publish(subject, message)
