"""`deadpool launch`: start a host's ranks and warm spares, report their exits, fence on request.

Like torchrun, it runs one process per local rank plus `spares` warm spares, all the same script with
the same arguments; which of them end up holding ranks is the swapper's call (members started for
rank r ask for rank r). It reports every child's exit the moment `waitpid` returns (an event, stored
in the events stream), answers the swapper's fence requests by SIGKILLing the member, forwards
SIGINT/SIGTERM to its children, and optionally respawns a dead child as a new spare. Children die
with it (PR_SET_PDEATHSIG), so a lost launcher means a lost host, never orphans that keep training.

When the job finishes, children still running after `finish_grace_s` (a spare that missed the
notice) are stopped. When the swapper ends the job (a member could not go on), the launcher stops
its children and exits non-zero, printing the swapper's reason. Stopped by a signal, it ends within
`SHUTDOWN_BUDGET_S`, NATS reachable or not: its children have the budget less what the last exit
reports and the connection need, then get SIGKILL.

No torch here: the launcher starts in a fraction of a second.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import secrets
import signal
import sys
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from deadpool.beat_compaction import BeatCompaction
from deadpool.cuda_devices import DevicePlan
from deadpool.host_copy_dir import SHM_ROOT, make_job_dir, remove_job_dir, sweep_stale
from deadpool.member_config import ENV, MemberConfig, env_float, host_name
from deadpool_protocol import (
    NO_RANK,
    ChildExit,
    FenceReply,
    FenceRequest,
    Heartbeat,
    JobFinished,
    ProtocolError,
    RebuildAck,
    RebuildAckBatch,
    RebuildDelta,
    RunReply,
    RunStart,
    StepResumed,
    StepResumedBatch,
    Subjects,
    decode,
    encode,
)
from deadpool_protocol.bounds import BEAT_AGE_MS_MAX, HEARTBEATS_PER_BATCH_MAX
from deadpool_protocol.codec import decode_on
from deadpool_runtime import EventPublisher, connect, stopped_within, subscribe_validated
from deadpool_runtime.credentials import CREDENTIALS_ENV
from deadpool_runtime.host import LOOPBACK, address_towards, interface_of
from deadpool_runtime.lifecycle import CONNECTION_CLOSE_S, SHUTDOWN_BUDGET_S, StopDeadline, close_connection
from deadpool_runtime.log_limit import RefusalLog

__all__ = ["LaunchConfig", "Launcher", "unclean_after_finish"]

PR_SET_PDEATHSIG = 1
TERMINATE_GRACE_S = 10.0
FINISH_GRACE_S = 30.0
"""After the job finished, children still running this much later are stopped."""
EXIT_REPORTS_WAIT_S = 10.0
EXIT_REPORTS_ON_STOP_S = 0.5
"""Stopped by a signal: how long the exit reports of its children may take to be stored (part of the
stop's budget; a detector also learns of the exits from the heartbeats that stopped)."""
HOLD_MARGIN_S = 60.0
"""A held member awaits the next generation this much longer than the hold may last."""
RUN_START_WAIT_S = 120.0
"""How long the launcher asks a swapper to start its run before it gives up (the control plane may
still be starting)."""
RUN_START_ANSWER_S = 5.0
RUN_START_RETRY_S = 0.5
ACK_BATCH_S = 0.005
"""A member's rebuild ack waits at most this long in its launcher: a rebuild's acks of one host go to
the swapper as one event (8 per host), not one each (16,384 per rebuild at 16,384 ranks)."""
ACKS_HELD_MAX = 4 * HEARTBEATS_PER_BATCH_MAX
"""Acks held between two batches; more (a flood from a member gone wrong) are dropped: re-sent with
the next retransmission of the rebuild. The same bound holds members' first steps (`StepResumed`),
which go out with the acks: one unanswered is stored by its member itself."""
STORED_ANSWER = b"stored"
"""The launcher's answer to a member's first step, once the batch that holds it is stored."""
HEARTBEAT_BATCH_PERIOD_S = 0.25
"""How often the launcher sends its members' beats, each member's newest with its age
(`HeartbeatBatch.ages_ms`): the detector dates each beat by it, so a verdict still comes a timeout
after a member's last beat, and a detector reads a host's message 4 times a second, not 10 (at 16,384
members, 8 per host: 8,200 messages a second instead of 20,500, where the detector's cost is per
message). An alive member looks at most this much older to the detector: keep it within a quarter of
the heartbeat timeout (`LaunchConfig.heartbeat_batch_s`)."""


@dataclass(frozen=True)
class LaunchConfig:
    nats_url: str
    job: str
    nproc: int
    spares: int
    command: Sequence[str]
    """The script and its arguments (run with this Python)."""
    world_size: int = 0
    """Ranks in the whole job (all hosts); 0 means nproc (one host), or with nproc 0 (a host of spares
    only) the world size of the run the job's other launchers started, which this one joins."""
    rank_offset: int = 0
    """The first rank this host's processes ask for (node_rank * nproc on several hosts)."""
    rendezvous_host: str = ""
    """The address other hosts reach this host's members at; '' is this host's address on its route
    to the NATS server (`address_towards`): loopback when the server runs here."""
    respawns: int = 0
    """How many dead children may be replaced by a fresh spare."""
    collective_timeout_s: float = 0.0
    """Passed to members as DEADPOOL_PG_TIMEOUT_S; 0 keeps their default."""
    extra_env: dict[str, str] = field(default_factory=dict)
    batch_heartbeats: bool = True
    """Members send heartbeats to this launcher, which forwards them in one message per period."""
    heartbeat_batch_s: float = HEARTBEAT_BATCH_PERIOD_S
    """How often the members' beats go out in one batch (see `HEARTBEAT_BATCH_PERIOD_S`)."""
    devices: DevicePlan | None = None
    """Each slot's GPU (`cuda_devices`); None for a CPU job."""
    nkey_file: str = ""
    """The job's own NATS nkey seed file ('' where the server has no auth): this launcher's, and handed
    to its members (`DEADPOOL_NATS_NKEY`). It speaks for this job alone."""
    run: str = ""
    """The run this launcher starts (or joins, with the job's other launchers); '' makes a new one.
    A job name holds one run at a time (`RunStart`)."""
    hold_without_stores_s: float = 0.0
    """When every snapshot store is lost: 0 trains on unprotected; above 0 holds training until a store
    returns, at most this long (`RunStart.hold_without_stores_s`)."""
    host_copy_root: str = str(SHM_ROOT)
    """Where the job's host-local crash copies live (`deadpool.host_copy`); '' keeps every member's
    snapshot buffers in its own process (a crash then restores from the stores)."""

    def __post_init__(self) -> None:
        if self.nproc < 0 or self.spares < 0 or self.nproc + self.spares == 0:
            raise ValueError("launch at least one process (--nproc and --spares)")
        if not 0 < self.heartbeat_batch_s <= BEAT_AGE_MS_MAX / 1000:
            raise ValueError(f"--heartbeat-batch-s {self.heartbeat_batch_s} is out of range")
        if not self.command:
            raise ValueError("no training script given")
        if self.devices is not None and len(self.devices.devices) < self.nproc + self.spares:
            raise ValueError("the device plan needs a device for every rank and spare")


def _die_with_parent() -> None:
    """In the child before exec: get SIGKILL if the launcher dies (Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


@dataclass
class Child:
    member: str
    rank_hint: int
    slot: int
    """Its place on this host (LOCAL_RANK, and its device): a respawn takes the slot of the dead."""
    process: asyncio.subprocess.Process


def unclean_after_finish(alive_at_finish: Collection[str], exit_codes: Mapping[str, int]) -> str:
    """Why the launcher exits 1 although the job finished ('' when it does not): members that were
    still running when every rank had said it was done, and then did not exit cleanly. Their code
    after the training loop (a final save, an evaluation) ran once, on them: no spare replays it."""
    unclean = sorted(m for m in alive_at_finish if exit_codes.get(m) != 0)
    if not unclean:
        return ""
    codes = ", ".join(f"{m} (exit {exit_codes.get(m, 'unknown')})" for m in unclean)
    return (
        f"the job finished, but {codes} did not exit cleanly after it: the code after the training loop "
        "is not replayed on a spare, so what it writes (a final save) may be missing"
    )


class Launcher:
    def __init__(self, config: LaunchConfig, log: Any) -> None:
        self.config = config
        self.log = log
        self._refusals = RefusalLog(log)
        self.host = os.environ.get(ENV.HOST) or host_name()  # DEADPOOL_HOST: e.g. several 'hosts' on one machine
        self.launcher_id = f"{self.host}-{os.getpid()}-{secrets.token_hex(2)}"
        self.subjects = Subjects.for_job(config.job)
        self.run_id = config.run or secrets.token_hex(6)
        self.world_size = config.world_size or config.nproc
        self.rendezvous_host = config.rendezvous_host or self._address_towards_nats()
        self.gloo_interface = "lo" if self.rendezvous_host.startswith("127.") else interface_of(self.rendezvous_host)
        """The interface the members' gloo binds ('' leaves gloo's choice: a name, not an address, given)."""
        """0 until a host of spares only has joined its run (`_start_run`)."""
        self.children: dict[str, Child] = {}
        self.exit_codes: dict[str, int] = {}
        self.generation = 0
        self.finished = False
        self.failed_reason = ""
        """Why the swapper ended the job ('' if it finished, or has not ended)."""
        self._alive_at_finish: set[str] = set()
        self._events: EventPublisher | None = None
        self.respawns_left = config.respawns
        self._serial = 0
        self._free_slots = list(range(config.nproc + config.spares))
        self._nc: Client | None = None
        self._all_exited = asyncio.Event()
        self._watchers: set[asyncio.Task[None]] = set()
        self._beats: dict[str, tuple[Heartbeat, float]] = {}
        """member -> its newest beat since the last batch, and when it came (monotonic)."""
        self._acks: list[RebuildAck] = []
        """Members' rebuild acks since the last batch (`_send_ack_batches`)."""
        self._resumed: list[tuple[StepResumed, str]] = []
        """Members' first steps of a generation since the last batch, each with where its member waits
        for the answer (`_send_ack_batches`)."""
        self._answering: set[asyncio.Task[None]] = set()
        self._compaction = BeatCompaction()
        self._stopper: asyncio.Task[None] | None = None
        self._stopping = False
        self.host_copy_dir: Path | None = None
        """The job's crash copies on this host (removed when the launcher ends)."""

    def _address_towards_nats(self) -> str:
        try:
            return address_towards(self.config.nats_url)
        except OSError as exc:  # no route: connecting will say so; its members cannot meet other hosts'
            self.log.warning("no route to the NATS server: the rendezvous stays on loopback", error=str(exc))
            return LOOPBACK

    async def run(self, stop: asyncio.Event) -> int:
        """Run the children to the end; returns the launcher's exit code (0: the job finished)."""
        self.host_copy_dir = self._make_host_copy_dir()
        try:
            return await self._run(stop)
        finally:
            if self.host_copy_dir is not None:  # the children have exited: nothing outlives the job here
                remove_job_dir(self.host_copy_dir)

    def _make_host_copy_dir(self) -> Path | None:
        root = self.config.host_copy_root
        if not root:
            return None
        try:
            sweep_stale(self.log, Path(root))
            return make_job_dir(self.config.job, self.launcher_id, Path(root))
        except OSError as exc:
            self.log.warning("no host-local crash copies: a crashed member restores from the stores", error=str(exc))
            return None

    async def _run(self, stop: asyncio.Event) -> int:
        self._nc = await connect(
            self.config.nats_url,
            f"deadpool-launcher-{self.launcher_id}",
            self.log,
            self.config.nkey_file,
            inbox_prefix=self.subjects.inbox,  # the job's key reads the job's replies only
        )
        self._events = EventPublisher(self._nc, self.log)
        # The generation is all a launcher reads of a rebuild: the delta says it (`RebuildDelta`, a few
        # hundred bytes, where the whole command is 937 kB at 16,384 ranks), notices included.
        await subscribe_validated(self._nc, self.subjects.rebuild_delta, RebuildDelta, self._on_rebuild, self.log)
        await subscribe_validated(self._nc, self.subjects.finished, JobFinished, self._on_finished, self.log)
        await self._nc.subscribe(self.subjects.fence(self.launcher_id), cb=self._on_fence)
        await subscribe_validated(
            self._nc, self.subjects.launcher_heartbeat(self.launcher_id), Heartbeat, self._on_heartbeat, self.log
        )
        await subscribe_validated(
            self._nc, self.subjects.launcher_ack(self.launcher_id), RebuildAck, self._on_ack, self.log
        )
        await subscribe_validated(
            self._nc,
            self.subjects.launcher_step_resumed(self.launcher_id),
            StepResumed,
            self._on_step_resumed,
            self.log,
        )
        await self._nc.flush()
        refused = await self._start_run(stop)
        if refused:
            print(f"deadpool launch: job {self.config.job} not started: {refused}", file=sys.stderr, flush=True)
            self.log.error("run not started", run=self.run_id, reason=refused)
            await close_connection(self._nc, CONNECTION_CLOSE_S, self.log)
            return 2
        batcher = asyncio.create_task(self._send_heartbeat_batches(stop))
        ack_batcher = asyncio.create_task(self._send_ack_batches(stop))
        for local_rank in range(self.config.nproc):
            await self._spawn(self.config.rank_offset + local_rank)
        for _ in range(self.config.spares):
            await self._spawn(NO_RANK)
        stopper = asyncio.create_task(stop.wait())
        exited = asyncio.create_task(self._all_exited.wait())
        await asyncio.wait({stopper, exited}, return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
        deadline = StopDeadline.after(SHUTDOWN_BUDGET_S)
        if stop.is_set() and not self._all_exited.is_set():
            await self._terminate_all(deadline.left_s(keep_s=EXIT_REPORTS_ON_STOP_S + CONNECTION_CLOSE_S))
        await self._all_exited.wait()
        batcher.cancel()
        ack_batcher.cancel()
        self._flush_acks()  # acks still held go into the stream before it drains
        if stop.is_set():
            await self._events.drain(deadline.left_s(keep_s=CONNECTION_CLOSE_S))
        else:
            await self._events.drain(EXIT_REPORTS_WAIT_S)
        await close_connection(self._nc, deadline.left_s() if stop.is_set() else CONNECTION_CLOSE_S, self.log)
        if self.failed_reason:
            print(f"deadpool launch: the job was ended: {self.failed_reason}", file=sys.stderr, flush=True)
        elif self.finished and (unclean := unclean_after_finish(self._alive_at_finish, self.exit_codes)):
            print(f"deadpool launch: {unclean}", file=sys.stderr, flush=True)
        return self._exit_code()

    async def _start_run(self, stop: asyncio.Event) -> str:
        """Start the job's run (or join it, as its other launchers do) before any member says hello;
        '' once the swapper accepted it, else why not. Asked again while no swapper answers, up to
        `RUN_START_WAIT_S`."""
        assert self._nc is not None
        start = RunStart(
            self.config.job,
            0,
            self.run_id,
            self.world_size,
            self.launcher_id,
            time.time(),
            self.config.hold_without_stores_s,
        )
        deadline = time.monotonic() + RUN_START_WAIT_S
        while not stop.is_set():
            request = asyncio.ensure_future(
                self._nc.request(self.subjects.run_start, encode(start), timeout=RUN_START_ANSWER_S)
            )
            stopped = asyncio.ensure_future(stop.wait())
            await asyncio.wait({request, stopped}, return_when=asyncio.FIRST_COMPLETED)
            stopped.cancel()
            if not request.done():  # a signal: the stop budget is not spent waiting for an answer
                request.cancel()
                break
            try:
                msg = request.result()
            except (NoRespondersError, NatsTimeoutError):
                if time.monotonic() > deadline:
                    return f"no swapper answered within {RUN_START_WAIT_S:.0f} s"
                if await stopped_within(stop, RUN_START_RETRY_S):
                    break
                continue
            if msg.headers and msg.headers.get("Nats-Service-Error"):
                return msg.headers["Nats-Service-Error"]
            try:
                reply = decode(msg.data, RunReply)
            except ProtocolError as exc:
                return f"the swapper's answer was not understood: {exc}"
            if reply.accepted:
                self.world_size = self.world_size or reply.world_size
                self.log.info(
                    "run started",
                    run=self.run_id,
                    world_size=self.world_size,
                    rendezvous_host=self.rendezvous_host,
                    gloo_interface=self.gloo_interface or "(gloo's choice)",
                )
                return "" if self.world_size > 0 else "the swapper named no world size for the run"
            if not reply.not_yet:
                return reply.reason
            if time.monotonic() > deadline:  # a host of spares only: no launcher of ranks started the run
                return f"{reply.reason} (asked for {RUN_START_WAIT_S:.0f} s)"
            if await stopped_within(stop, RUN_START_RETRY_S):
                break
        return "stopped before the run started"

    def _exit_code(self) -> int:
        """0 when the job finished and every member still running at that moment exited cleanly;
        members that failed earlier were replaced and do not count against the job. 1 otherwise, and
        when the swapper ended the job."""
        if not self.finished or self.failed_reason:
            return 1
        return 1 if unclean_after_finish(self._alive_at_finish, self.exit_codes) else 0  # what it says is why

    def _torchrun_env(self, rank_hint: int, slot: int) -> dict[str, str]:
        """The variables torchrun sets that mean the same here. `RANK` only for a member started to hold
        a rank (a spare has none until it is promoted: read `job.rank`, which also follows a swap);
        `LOCAL_RANK` is the member's slot on this host, spares included, so that a spare can pick its
        own device with it. No `MASTER_ADDR`/`MASTER_PORT`: the job forms each generation's group."""
        env = {
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.config.nproc),
            "LOCAL_RANK": str(slot),
        }
        if rank_hint >= 0:
            env["RANK"] = str(rank_hint)
        return env

    async def _spawn(self, rank_hint: int) -> None:
        self._serial += 1
        member = f"{self.launcher_id}-{self._serial}"
        slot = self._free_slots.pop(0)  # the lowest free: a respawn takes the slot its dead member left
        env = dict(os.environ)
        env.pop(CREDENTIALS_ENV, None)  # a member gets its job's key, no other credentials
        env.pop(ENV.NATS_NKEY, None)
        if self.config.nkey_file:
            env[ENV.NATS_NKEY] = self.config.nkey_file
        env.setdefault("OMP_NUM_THREADS", "1")
        if self.gloo_interface:  # gloo binds where the rendezvous is reached, not where the host name says
            env.setdefault("GLOO_SOCKET_IFNAME", self.gloo_interface)
        env.update(
            {
                ENV.JOB: self.config.job,
                ENV.NATS_URL: self.config.nats_url,
                ENV.MEMBER: member,
                ENV.LAUNCHER: self.launcher_id,
                ENV.RUN: self.run_id,
                ENV.RANK_HINT: str(rank_hint),
                ENV.HEARTBEAT_VIA_LAUNCHER: "1" if self.config.batch_heartbeats else "0",
                ENV.LOCAL_INDEX: str(slot),
                ENV.WORLD_SIZE: str(self.world_size),
                ENV.HOST: self.host,
                ENV.RENDEZVOUS_HOST: self.rendezvous_host,
                ENV.HOST_COPY_DIR: str(self.host_copy_dir or ""),
                "PYTHONUNBUFFERED": "1",
            }
        )
        env.pop("RANK", None)  # inherited from a launcher run under torchrun, say: a spare must not have one
        env.update(self._torchrun_env(rank_hint, slot))
        if self.config.devices is not None:
            env.update(self.config.devices.env_for(slot))
        if self.config.collective_timeout_s > 0:
            env[ENV.PG_TIMEOUT_S] = str(self.config.collective_timeout_s)
        if self.config.hold_without_stores_s > 0:  # a held rank awaits its next generation that long
            wait_s = env_float(env, ENV.REBUILD_WAIT_S, MemberConfig.rebuild_wait_s)
            env[ENV.REBUILD_WAIT_S] = str(max(wait_s, self.config.hold_without_stores_s + HOLD_MARGIN_S))
        env.update(self.config.extra_env)
        process = await asyncio.create_subprocess_exec(
            sys.executable, *self.config.command, env=env, preexec_fn=_die_with_parent
        )
        child = Child(member, rank_hint, slot, process)
        self.children[member] = child
        self.log.info("member started", member=member, pid=process.pid, rank_hint=rank_hint, slot=slot)
        task = asyncio.create_task(self._watch(child))
        self._watchers.add(task)
        task.add_done_callback(self._watchers.discard)

    async def _watch(self, child: Child) -> None:
        returncode = await child.process.wait()
        t_exit = time.time()
        self.exit_codes[child.member] = returncode
        self._free_slots = sorted([*self._free_slots, child.slot])  # its device is free again
        report = ChildExit(
            self.config.job,
            self.generation,
            self.launcher_id,
            child.member,
            child.process.pid,
            returncode,
            t_exit,
        )
        assert self._events is not None
        self._events.publish_soon(self.subjects.child_exit, report)  # retried until stored
        level = self.log.info if returncode == 0 else self.log.warning
        level("member exited", member=child.member, pid=child.process.pid, returncode=returncode)
        failed = returncode != 0 and not self.finished and not self._stopping
        if failed and self.respawns_left > 0:
            self.respawns_left -= 1
            await self._spawn(NO_RANK)
        if all(member in self.exit_codes for member in self.children):
            self._all_exited.set()

    async def _on_rebuild(self, rebuild: RebuildDelta, _msg: Msg) -> None:
        self.generation = max(self.generation, rebuild.generation)

    async def _on_heartbeat(self, hb: Heartbeat, _msg: Msg) -> None:
        if hb.member in self.children:  # only our own members' beats travel in our batches
            self._beats[hb.member] = (hb, time.monotonic())

    async def _on_ack(self, ack: RebuildAck, _msg: Msg) -> None:
        """A member's rebuild ack, held for the next batch (a member re-sends it with every retransmission
        of the rebuild, so one lost here is sent again)."""
        if ack.member in self.children and len(self._acks) < ACKS_HELD_MAX:
            self._acks.append(ack)

    async def _on_step_resumed(self, resumed: StepResumed, msg: Msg) -> None:
        """A member's first step of a generation, held for the next batch; the member hears once the
        batch is stored (unanswered, it stores the step as an event itself)."""
        if resumed.member in self.children and len(self._resumed) < ACKS_HELD_MAX:
            self._resumed.append((resumed, msg.reply))

    async def _send_ack_batches(self, stop: asyncio.Event) -> None:
        """Every `ACK_BATCH_S`, the acks and first steps received since the last batch, each stored as
        one event."""
        while not stop.is_set():
            await asyncio.sleep(ACK_BATCH_S)
            self._flush_acks()

    def _flush_acks(self) -> None:
        while self._acks and self._events is not None:
            acks, self._acks = self._acks[:HEARTBEATS_PER_BATCH_MAX], self._acks[HEARTBEATS_PER_BATCH_MAX:]
            generation = max(a.generation for a in acks)
            batch = RebuildAckBatch(self.config.job, generation, self.launcher_id, acks)
            self._events.publish_soon(self.subjects.rebuild_ack_batch, batch)  # retried until stored
        while self._resumed and self._events is not None:
            held = self._resumed[:HEARTBEATS_PER_BATCH_MAX]
            self._resumed = self._resumed[HEARTBEATS_PER_BATCH_MAX:]
            resumed = [r for r, _ in held]
            batch_of = StepResumedBatch(self.config.job, max(r.generation for r in resumed), self.launcher_id, resumed)
            stored = self._events.publish_soon(self.subjects.step_resumed_batch, batch_of)  # retried until stored
            if stored is not None:
                self._answer_once_stored(stored, [reply for _, reply in held if reply])

    def _answer_once_stored(self, stored: asyncio.Task[bool], replies: list[str]) -> None:
        task = asyncio.create_task(self._answer(stored, replies))
        self._answering.add(task)
        task.add_done_callback(self._answering.discard)

    async def _answer(self, stored: asyncio.Task[bool], replies: list[str]) -> None:
        """Tell the members whose first steps a batch holds that it is stored (not stored: they hear
        nothing, and store their own)."""
        if not await stored or self._nc is None:
            return
        try:
            for reply in replies:
                await self._nc.publish(reply, STORED_ANSWER)
        except Exception as exc:  # the connection closing: unanswered, they store their own
            self.log.warning("first steps stored but not answered", members=len(replies), error=repr(exc))

    async def _send_heartbeat_batches(self, stop: asyncio.Event) -> None:
        """Every heartbeat period, the beats received since the last batch, in one message: an empty one
        when no member beat, so that the detector tells this launcher's members gone silent from its
        host gone (`DetectorCore._host_lost`): a fence sent to a vanished host is never answered."""
        assert self._nc is not None
        while not stop.is_set():
            await asyncio.sleep(self.config.heartbeat_batch_s)
            received, self._beats = self._beats, {}
            batch = self._compaction.batch(
                self.config.job, self.generation, self.launcher_id, received, time.monotonic()
            )
            try:
                await self._nc.publish(self.subjects.heartbeat_batch, encode(batch))
            except Exception as exc:  # an outage must not end the batching
                self.log.warning("heartbeat batch not sent", error=repr(exc))

    async def _on_finished(self, finished: JobFinished, _msg: Msg) -> None:
        if self.finished:
            return
        if finished.generation < self.generation:  # an older generation's notice (a stale or replayed one)
            self.log.warning("finished notice of an older generation ignored", generation=finished.generation)
            return
        self.finished = True
        self._alive_at_finish = {m for m in self.children if m not in self.exit_codes}
        if finished.failed:
            self.failed_reason = finished.reason or "no reason given"
            self.log.error("the swapper ended the job", reason=self.failed_reason)
            self._stopper = asyncio.create_task(self._terminate_all())
        else:
            self._stopper = asyncio.create_task(self._stop_stragglers())

    async def _stop_stragglers(self) -> None:
        """Children still running `FINISH_GRACE_S` after the job finished missed the notice: stop them."""
        try:
            await asyncio.wait_for(self._all_exited.wait(), FINISH_GRACE_S)
        except TimeoutError:
            self.log.warning("members still running after the job finished: stopping them")
            await self._terminate_all()

    async def _on_fence(self, msg: Msg) -> None:
        try:
            request = decode_on(msg.subject, msg.data, FenceRequest)
        except ProtocolError as exc:
            self._refusals.warning("rejected fence request", reason=str(exc))
            return
        child = self.children.get(request.member)
        if child is None or child.process.returncode is not None:
            killed, detail = False, "not running"
        else:
            child.process.kill()
            await child.process.wait()
            killed, detail = True, f"SIGKILL sent to pid {child.process.pid}"
        self.log.warning("fence", member=request.member, reason=request.reason, killed=killed)
        reply = FenceReply(request.job, self.generation, request.member, killed, detail, time.time())
        await msg.respond(encode(reply))

    async def _terminate_all(self, grace_s: float = TERMINATE_GRACE_S) -> None:
        """Forward a stop to the children; SIGKILL whatever is still alive after `grace_s`."""
        self._stopping = True  # no respawns from here on
        for child in self.children.values():
            if child.process.returncode is None:
                child.process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(self._all_exited.wait(), grace_s)
        except TimeoutError:
            for child in self.children.values():
                if child.process.returncode is None:
                    child.process.kill()
