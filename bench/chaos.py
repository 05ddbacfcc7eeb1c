"""Chaos: N faults drawn by seed from a catalogue, one training run, and the final weights checked.

    .venv/bin/python bench/chaos.py --faults 50 --seed 1
    .venv/bin/python bench/chaos.py --faults 10 --seed 3 --kinds kill,kill2,swapper
    .venv/bin/python bench/chaos.py --faults 20 --seed 5 --store-ingest-mb-s 2   # at K > 1

The example job (or `--script`: any script that takes the example's arguments) runs under the
project's own control plane, as shipped for high availability: a 3-node NATS cluster (JetStream
replicas 3), two detectors, two swappers (one leads), three stores, every service restarted 1 s after it
dies (as systemd's `Restart=always` would), 4 ranks and 3 warm spares, and the launcher's respawns.
Faults come one after another at random moments (inside steps, while snapshots stream, during
recoveries), each once the job has recovered from the one before:

    kill              a rank SIGKILLed
    kill2             two ranks SIGKILLed at once (0-15 ms apart)
    kill_in_recovery  a rank SIGKILLed, then a second one 50-500 ms later, in the recovery
    stop              a rank SIGSTOPped (frozen: found by heartbeat silence, fenced)
    spare_takeover    a rank SIGKILLed, then the spare promoted for it, 0-200 ms into its takeover
    rendezvous_host   a rank SIGKILLed, then the new generation's rendezvous host, 0-100 ms in
    swapper           the leading swapper SIGKILLed
    detector          a detector SIGKILLed
    nats              a NATS server SIGKILLed
    store_kill        a snapshot store holding snapshots SIGKILLed, while snapshots stream
    store_host        a store's host lost: the store frozen (SIGSTOP: its connections hang, as with a
                      link down) until the swapper has placed its snapshots elsewhere, then SIGKILLed
    corrupt           bytes flipped in a store's copies of one rank's snapshots, then that rank SIGKILLed
                      (its replacement must refuse the corrupt copy and restore from the other)
    replicas_lost     both stores holding one rank's snapshots SIGKILLed, and that rank with them: the
                      fallback chain ends in the durable tier (the job persists every
                      `--durable-every-steps` steps)
    all_stores        every store SIGKILLed (and kept down), a rank SIGKILLed 2-4 s later (no RAM copy
                      left: the durable tier), then the stores started again: the job goes on
                      unprotected meanwhile, and commits resume once a store is back
    stale_stores      both swappers SIGSTOPped (the store statuses held back from them), a rank SIGKILLed,
                      the swappers resumed 2-3 s later: the failure meets a stale view of the stores,
                      which must not send the job to the durable tier, nor drop the rebuild
    jetstream_outage  two of the three NATS servers SIGKILLed and kept down for 125-140 s (JetStream loses
                      its quorum; core NATS goes on through the third), a rank SIGKILLed 1-3 s into it:
                      its verdict waits in the detector for longer than the old 120 s give-up time
    disk_full         the durable tier's disk (a tmpfs) filled until persists fail, then freed: training
                      goes on, and a step is persisted again once there is room
    clock_step        the control plane's wall clocks (NATS aside: detectors, swappers, stores) stepped
                      an hour forward, then back (`DEADPOOL_CLOCK_STEP_FILE`), then a rank SIGKILLed: no
                      false verdict, no delay (the members' clocks stay: their step stamps are what
                      this benchmark measures downtime with)

Per fault: downtime_s, from the fault (for a fault that sets a stage and kills a rank in it, from
that kill) to the first step completed by every rank after it (the members' own completion times);
for a store fault also heal_s, from the fault until the swapper has placed the snapshots anew (or
seen the store back, empty) and every rank's committed step has its replicas again.
`unheard_s_max` is the longest any event waited in a job worker of the leading swapper (read from its
status every 0.25 s), and `false_verdicts` counts members declared failed that no fault touched.
A member that reported itself caught in a collective its broken group could not release (gloo's
pending send, `MemberErrorCause.STUCK_COLLECTIVE`: a known limit, docs/architecture.md §5) was touched
by the fault that broke its group: it counts in `stuck_exits`, apart.
`lost_committed` counts restores that found no copy of the committed step. A run is wedged if no rank
completes a step for longer than the slowest recovery the timeouts allow (`wedge_s`: collective timeout
+ heartbeat timeout + fence timeout; plus the outage itself for `jetstream_outage`). Then the same job runs again
without faults, and the final weights and optimizer shards of both runs are compared with
`torch.equal`. A human table, then one JSON object as the last line.
Goal: 50 faults, wedged 0, lost_committed 0, every store fault healed, bit_identical true,
overlapping-fault downtime p99 <= 1 s, unheard_s_max <= 0.5 s, no false verdict.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from measures import percentile
from nats.aio.client import Client

from deadpool_cli.demo import default_script
from deadpool_cli.job_watch import JobWatch
from deadpool_cli.stack import Stack, StackConfig
from deadpool_cli.weights_check import compare_final_states
from deadpool_protocol import SWAPPER_STATUS, Incident, MemberErrorCause, Rebuild
from deadpool_protocol.codec import to_fields
from deadpool_runtime.clock_fault import CLOCK_STEP_FILE_ENV
from deadpool_runtime.logs import get_logger
from deadpool_store.service import INGEST_LIMIT_ENV

KINDS = (
    "kill",
    "kill2",
    "kill_in_recovery",
    "stop",
    "spare_takeover",
    "rendezvous_host",
    "swapper",
    "detector",
    "nats",
    "store_kill",
    "store_host",
    "corrupt",
    "replicas_lost",
    "all_stores",
    "stale_stores",
    "jetstream_outage",
    "disk_full",
    "clock_step",
)
STORE_KINDS = ("store_kill", "store_host")
KILL_LATER = ("all_stores", "stale_stores", "jetstream_outage", "clock_step")
"""Faults that set a stage (stores gone, swappers frozen, JetStream away, clocks stepped) and kill a rank
in it some seconds later: their downtime runs from that kill."""
PROCESS_KILLS = ("kill", "kill2", "kill_in_recovery", "stop", "spare_takeover")
"""Faults that end a training process while its host stays up: its crash copy is there (`host_copy`)."""
OVERLAPPING = ("kill2", "kill_in_recovery", "spare_takeover", "rendezvous_host")
SPARES_NEEDED = {
    "kill": 1,
    "kill2": 2,
    "kill_in_recovery": 2,
    "stop": 1,
    "spare_takeover": 2,
    "rendezvous_host": 2,
    "corrupt": 1,
    "replicas_lost": 1,
    "all_stores": 1,
    "stale_stores": 1,
    "jetstream_outage": 1,
    "clock_step": 1,
}
NEW_GENERATION = set(SPARES_NEEDED)
"""Faults after which training resumes only in a newer generation."""

NPROC = 4
SPARES = 3
HEARTBEAT_TIMEOUT_S = 2.0
HANG_FLOOR_S = 3.0
COLLECTIVE_TIMEOUT_S = 20.0
FENCE_TIMEOUT_S = 5.0
WEDGE_S = COLLECTIVE_TIMEOUT_S + HEARTBEAT_TIMEOUT_S + FENCE_TIMEOUT_S
RESTART_AFTER_S = 1.0
SETTLE_S = (1.0, 3.0)
"""A random pause after the job recovered, before the next fault."""
NATS_SETTLE_S = 6.0
"""After a NATS server came back, time for its JetStream streams to catch up before the next fault."""
SPARE_WAIT_S = 90.0
STORES = 3
"""One more than the replication, so a lost store's copies can be made again elsewhere."""
HEAL_WAIT_S = 30.0
JETSTREAM_OUTAGE_S = (125.0, 140.0)
"""Longer than the old 120 s after which an event publisher gave up (a verdict was lost for good)."""
STALE_STORES_S = (2.0, 3.0)
"""How long both swappers are frozen: past the store timeout (1.5 s) and the lease (1 s)."""
ALL_STORES_DOWN_S = (2.0, 4.0)
DURABLE_TMPFS_BYTES = 64 * 1024 * 1024
STATUS_POLL_S = 0.25
GOAL = {
    "faults": 50,
    "wedged": 0,
    "lost_committed": 0,
    "bit_identical": True,
    "overlap_downtime_s_p99_max": 1.0,
    "unheard_s_max": 0.5,
    "false_verdicts": 0,
}


@dataclass
class Fault:
    index: int
    kind: str
    t: float
    detail: str
    generation: int
    steps_index: int
    """Where the watch's step log stood at the fault."""
    downtime_s: float | None = None
    t_resumed: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


class Chaos:
    def __init__(self, args: argparse.Namespace, stack: Stack, nc: Client, watch: JobWatch, job: str) -> None:
        self.args = args
        self.stack = stack
        self.nc = nc
        self.watch = watch
        self.job = job
        self.rng = random.Random(args.seed)
        self.faults: list[Fault] = []
        self.wedged = False
        self.longest_stall_s = 0.0
        self._since = time.time()
        self.last_kill_generation = 0
        self.stall_allowed_s = WEDGE_S
        """The longest a step may be missing before the run counts as wedged (longer for an outage
        that is meant to last)."""
        self.last_kill_t = 0.0
        self.touched: set[str] = set()
        """Members a fault signalled: a verdict on any other member is false."""
        self.unheard_s_max = 0.0
        self.clock_file = Path(args.clock_file) if args.clock_file else None
        self.durable_dir = Path(args.durable_dir) if args.durable_dir else None

    # ------------------------------------------------------------------ helpers

    def _pid(self, member: str) -> int:
        view = self.watch.members.get(member)
        if view is None or not view.pid:
            raise LookupError(f"no pid known for member {member}")
        return view.pid

    def _kill(self, member: str, sig: signal.Signals = signal.SIGKILL) -> str:
        """Signal a member; remembers the generation it was in, since training resumes only in a newer one."""
        pid = self._pid(member)
        self.touched.add(member)
        self.last_kill_t = time.time()
        self.last_kill_generation = self.watch.rebuild.generation if self.watch.rebuild else 0
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return f"{member} (pid {pid}) already gone"
        return f"{sig.name} {member} (pid {pid})"

    def _ranks(self) -> list[str]:
        assert self.watch.rebuild is not None
        return list(self.watch.rebuild.ranks)

    async def _next_rebuild(self, after: int, timeout_s: float = 10.0) -> Rebuild | None:
        try:
            await asyncio.wait_for(
                self.watch.wait_for(lambda: self.watch.rebuild is not None and self.watch.rebuild.generation > after),
                timeout_s,
            )
        except TimeoutError:
            return None
        return self.watch.rebuild

    async def _status(self) -> dict[str, Any]:
        try:
            reply = await self.nc.request(SWAPPER_STATUS, self.job.encode(), timeout=2.0)
            body: dict[str, Any] = json.loads(reply.data)
            return body
        except Exception:
            return {}

    async def poll_status(self) -> None:
        """Keep the longest wait of an event in the leader's job worker (until cancelled)."""
        while True:
            status = await self._status()
            self.unheard_s_max = max(self.unheard_s_max, float(status.get("unheard_s_max", 0.0) or 0.0))
            await asyncio.sleep(STATUS_POLL_S)

    async def ready_spares(self) -> int:
        """Spares the swapper holds that have warmed up (their heartbeats name no section)."""
        held = set((await self._status()).get("spares", []))
        return len(held & set(self.watch.ready_spares(time.time())))

    async def _leader_swapper(self) -> str | None:
        instance = (await self._status()).get("leader", "")
        pid = instance.split("-")[-2] if instance.count("-") >= 2 else ""
        for name in self.stack.names("swapper"):
            if str(self.stack.processes[name].pid) == pid:
                return name
        return None

    # ------------------------------------------------------------------ the faults

    async def inject(self, kind: str) -> tuple[str, dict[str, Any]]:
        rng = self.rng
        ranks = self._ranks()
        generation = self.watch.rebuild.generation if self.watch.rebuild else 0
        if kind == "kill":
            return self._kill(rng.choice(ranks)), {}
        if kind == "stop":
            return self._kill(rng.choice(ranks), signal.SIGSTOP), {}
        if kind in ("kill2", "kill_in_recovery"):  # two ranks, at once or the second during the recovery
            first, second = rng.sample(ranks, 2)
            gap_s = rng.uniform(0.0, 0.015) if kind == "kill2" else rng.uniform(0.05, 0.5)
            detail = self._kill(first)
            await asyncio.sleep(gap_s)
            return f"{detail}; {self._kill(second)} {gap_s * 1000:.0f} ms later", {"gap_s": gap_s}
        if kind in ("spare_takeover", "rendezvous_host"):
            victim = rng.choice(ranks)
            detail = self._kill(victim)
            rebuild = await self._next_rebuild(generation)
            if rebuild is None:
                return f"{detail}; no rebuild seen", {}
            if kind == "spare_takeover":
                target = rebuild.ranks[ranks.index(victim)]
                delay_s = rng.uniform(0.0, 0.2)
            else:
                target = rebuild.rendezvous_member
                delay_s = rng.uniform(0.0, 0.1)
            await asyncio.sleep(delay_s)
            second = self._kill(target)
            return f"{detail}; then {second} {delay_s * 1000:.0f} ms into the takeover", {"delay_s": delay_s}
        if kind == "swapper":
            name = await self._leader_swapper()
            if name is None:
                name = rng.choice(self.stack.names("swapper"))
            pid = self.stack.kill(name)
            return f"SIGKILL {name} (pid {pid}, the leader)", {}
        if kind == "detector":
            name = rng.choice(self.stack.names("detector"))
            pid = self.stack.kill(name)
            return f"SIGKILL {name} (pid {pid})", {}
        if kind == "nats":
            assert self.stack.cluster is not None
            server = rng.choice(self.stack.cluster.servers)
            server.kill()
            return f"SIGKILL NATS server {server.name}", {}
        if kind in STORE_KINDS:
            status = await self._status()
            placed = sorted({n for names in status.get("placement", []) for n in names})
            name = rng.choice(placed or self.stack.names("store"))
            before = {s["store"]: s.get("incarnation", "") for s in status.get("stores", [])}
            extra = {"store": name, "incarnation": before.get(name, ""), "version": status.get("placement_version")}
            if kind == "store_kill":
                pid = self.stack.kill(name)
                return f"SIGKILL {name} (pid {pid})", extra
            process = self.stack.processes[name]
            process.send_signal(signal.SIGSTOP)  # silent, connections hang: a host whose link went down
            placed_elsewhere = await self._wait_healed(extra, HEAL_WAIT_S)
            process.send_signal(signal.SIGKILL)
            process.wait()
            return f"SIGSTOP {name} (pid {process.pid}), SIGKILL once placed elsewhere ({placed_elsewhere})", extra
        if kind == "corrupt":
            victim = rng.choice(ranks)
            rank = ranks.index(victim)
            placement = (await self._status()).get("placement", [])
            store = placement[rank][0] if rank < len(placement) and placement[rank] else "store-0"
            body = json.dumps({"job": self.job, "rank": rank}).encode()
            try:
                reply = json.loads((await self.nc.request(f"deadpool.store.{store}.corrupt", body, timeout=2.0)).data)
            except Exception as exc:
                reply = {"corrupted": [], "error": repr(exc)}
            detail = self._kill(victim)
            return f"flipped bytes of rank {rank} steps {reply['corrupted']} on {store}; {detail}", {"store": store}
        if kind == "replicas_lost":
            victim = rng.choice(ranks)
            rank = ranks.index(victim)
            placement = (await self._status()).get("placement", [])
            lost = placement[rank] if rank < len(placement) else []
            for name in lost:
                self.stack.kill(name)
            return f"SIGKILL {', '.join(lost)} (every copy of rank {rank}); {self._kill(victim)}", {"stores": lost}
        if kind == "all_stores":
            names = self.stack.names("store")
            self.stack.hold(*names)
            for name in names:
                self.stack.kill(name)
            await asyncio.sleep(rng.uniform(*ALL_STORES_DOWN_S))
            victim = self._kill(rng.choice(ranks))
            await self._next_rebuild(generation)
            self.stack.release(*names)  # the supervisor starts them again a moment later
            return f"SIGKILL every store ({', '.join(names)}); then {victim}; stores started again", {}
        if kind == "stale_stores":
            swappers = [self.stack.processes[n] for n in self.stack.names("swapper")]
            for process in swappers:
                process.send_signal(signal.SIGSTOP)
            frozen_s = rng.uniform(*STALE_STORES_S)
            await asyncio.sleep(rng.uniform(0.1, 0.5))
            victim = self._kill(rng.choice(ranks))
            await asyncio.sleep(frozen_s)
            for process in swappers:
                process.send_signal(signal.SIGCONT)
            return f"SIGSTOP both swappers; {victim}; SIGCONT after {frozen_s:.1f} s", {"frozen_s": frozen_s}
        if kind == "jetstream_outage":
            assert self.stack.cluster is not None and len(self.stack.cluster.servers) >= 3
            down = rng.sample(self.stack.cluster.servers, 2)
            keys = [f"nats-{server.name}" for server in down]
            outage_s = rng.uniform(*JETSTREAM_OUTAGE_S)
            self.stall_allowed_s = outage_s + WEDGE_S
            self.stack.hold(*keys)
            started = time.time()
            for server in down:
                server.kill()
            await asyncio.sleep(rng.uniform(1.0, 3.0))
            victim = self._kill(rng.choice(ranks))
            await asyncio.sleep(max(0.0, outage_s - (time.time() - started)))
            self.stack.release(*keys)
            servers = ", ".join(server.name for server in down)
            detail = f"SIGKILL NATS {servers} for {outage_s:.0f} s (no JetStream quorum); {victim}"
            return detail, {"outage_s": outage_s}
        if kind == "disk_full":
            return await self._fill_disk()
        if kind == "clock_step":
            if self.clock_file is None:
                raise ValueError("clock_step needs --clock-file (set before the stack starts)")
            self.clock_file.write_text("3600\n")
            await asyncio.sleep(rng.uniform(1.0, 2.0))
            self.clock_file.write_text("-3600\n")
            await asyncio.sleep(rng.uniform(1.0, 2.0))
            victim = self._kill(rng.choice(ranks))
            self.clock_file.write_text("0\n")
            return f"wall clocks +1 h, then -1 h; {victim}", {}
        raise ValueError(f"unknown fault kind {kind!r}")

    async def _fill_disk(self) -> tuple[str, dict[str, Any]]:
        """Fill the durable tier's tmpfs until a persist fails, then free it and wait for a persist."""
        if self.durable_dir is None:
            raise ValueError("disk_full needs the durable tier on a tmpfs (--durable-every-steps > 0, as root)")
        filler = self.durable_dir / "filler"
        before = _newest_complete_step(self.durable_dir, NPROC)
        free = os.statvfs(self.durable_dir)
        # Unbuffered: a buffered file's close() flushed what ENOSPC had left in its buffer, and raised
        # ENOSPC again outside the suppress (seen once, ending a 50-fault run at its 45th fault).
        with contextlib.suppress(OSError), open(filler, "wb", buffering=0) as f:  # until ENOSPC
            f.write(bytes(max(0, free.f_bavail * free.f_frsize - 4096)))
            chunk = bytes(64 * 1024)
            while True:
                f.write(chunk)
        full_at = _newest_complete_step(self.durable_dir, NPROC)
        await asyncio.sleep(self.rng.uniform(2.0, 4.0))  # persists fail meanwhile (every 5 steps)
        filler.unlink(missing_ok=True)
        t_freed = time.time()
        deadline = t_freed + 60.0
        while _newest_complete_step(self.durable_dir, NPROC) <= full_at and time.time() < deadline:
            await asyncio.sleep(0.1)
        after = _newest_complete_step(self.durable_dir, NPROC)
        persisted_again_s = round(time.time() - t_freed, 3) if after > full_at else None
        if persisted_again_s is None:
            print("  NOT PERSISTED AGAIN: no newer complete step within 60 s of freeing the disk", flush=True)
        extra = {"persisted_again_s": persisted_again_s, "steps": [before, full_at, after]}
        return f"durable disk full (newest complete step {full_at}), freed; persisted again: step {after}", extra

    async def _healed(self, extra: dict[str, Any]) -> bool:
        """The swapper knows the store is gone (a new placement without it, or the store back with a new
        incarnation) and every rank's committed step has its replicas again."""
        status = await self._status()
        if not status or status.get("replicas_short", 1) != 0:
            return False
        name = extra["store"]
        placed = {n for names in status.get("placement", []) for n in names}
        back = any(s["store"] == name and s.get("incarnation", "") != extra["incarnation"] for s in status["stores"])
        return back or (name not in placed and status.get("placement_version") != extra["version"])

    async def _heal_view(self) -> str:
        """What a heal that did not come waited on (for the log: a CI run once saw one, never again)."""
        status = await self._status()
        if not status:
            return "no status"
        stores = [(s["store"], s.get("incarnation", ""), s.get("heard_s_ago")) for s in status.get("stores", [])]
        keys = ("committed_step", "replicas_short", "commit_lag_steps", "placement", "placement_version", "finished")
        return json.dumps({k: status.get(k) for k in keys} | {"stores": stores})

    async def _wait_protected(self, timeout_s: float) -> bool:
        """Stores are back and hold every rank's committed step again: the job is protected."""
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            status = await self._status()
            if status and status.get("unprotected") is None and status.get("replicas_short", 1) == 0:
                return True
            await asyncio.sleep(0.1)
        return False

    async def _wait_healed(self, extra: dict[str, Any], timeout_s: float) -> bool:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if await self._healed(extra):
                return True
            await asyncio.sleep(0.02)
        return False

    # ------------------------------------------------------------------ the loop

    async def _wait(self, predicate: Any, timeout_s: float, what: str) -> bool:
        """Wait for `predicate` (a function, or a coroutine function); False (and wedged) if no rank
        completed a step for `WEDGE_S` meanwhile."""
        deadline = time.time() + timeout_s
        while True:
            ok = predicate()
            if asyncio.iscoroutine(ok):
                ok = await ok
            if ok:
                break
            now = time.time()
            stall = now - max(self.watch.last_step_t(), self.faults[-1].t if self.faults else 0.0, self._since)
            self.longest_stall_s = max(self.longest_stall_s, stall)
            if stall > self.stall_allowed_s:
                print(f"  WEDGED: no step for {stall:.1f} s while waiting for {what}", flush=True)
                self.wedged = True
                return False
            if now > deadline:  # the job or the control plane did not come back: that is a wedge too
                print(f"  WEDGED: gave up waiting for {what} after {timeout_s:.0f} s", flush=True)
                self.wedged = True
                return False
            if self.watch.finished.is_set():
                return False
            await asyncio.sleep(0.05)
        return True

    def time_to_finish_s(self, steps: int) -> float:
        """A bound on the rest of the run: twice the steps left at the recent pace, plus two minutes."""
        done = self.watch.steps_done[-200:]
        if len(done) < 2:
            return 600.0
        pace = (done[-1].t - done[0].t) / max(1, done[-1].step - done[0].step)
        return 2 * max(0, steps - done[-1].step) * pace + 120.0

    def _services_up(self) -> bool:
        if any(p.poll() is not None for p in self.stack.processes.values()):
            return False
        return self.stack.cluster is None or all(s.running() for s in self.stack.cluster.servers)

    async def run(self, kinds: list[str], count: int) -> None:
        self._since = time.time() + 120.0  # forming may take long: warm-up imports on 2 cores
        await self._wait(lambda: self.watch.resumed_at(0.0) is not None, 180.0, "the job to form")
        self._since = time.time()
        nats_back_t = 0.0
        for index in range(count):
            kind = self.args.sequence[index % len(self.args.sequence)] if self.args.sequence else self.rng.choice(kinds)
            need = SPARES_NEEDED.get(kind, 0)

            async def ready(need: int = need) -> bool:
                return self._services_up() and (need == 0 or await self.ready_spares() >= need)

            settle = self.rng.uniform(*SETTLE_S)
            if nats_back_t:
                settle = max(settle, NATS_SETTLE_S - (time.time() - nats_back_t))
            while True:  # ready, then a random pause, and still ready (a rebuild may have taken a spare)
                ok = await self._wait(ready, SPARE_WAIT_S, f"{need} ready spare(s) and every service up")
                if not ok:
                    return
                await asyncio.sleep(settle)
                if await ready():
                    break
            if self.watch.finished.is_set():
                print("  the job finished before every fault was injected (raise --steps-per-fault)", flush=True)
                return
            generation = self.watch.rebuild.generation if self.watch.rebuild else 0
            steps_index = max(0, len(self.watch.steps_done) - 64)
            t = time.time()
            self.stall_allowed_s = WEDGE_S
            detail, extra = await self.inject(kind)
            if kind in KILL_LATER:  # the fault begins before the kill it leads to: downtime counts from the kill
                extra["t_began"] = round(t, 3)
                t = max(t, self.last_kill_t)
            fault = Fault(index, kind, t, detail, generation, steps_index, extra=extra)
            self.faults.append(fault)
            # After the last kill, training resumes only in a generation newer than the one it hit.
            min_generation = max(generation, self.last_kill_generation) + 1 if kind in NEW_GENERATION else generation

            def back(t: float = t, g: int = min_generation, since: int = steps_index) -> float | None:
                return self.watch.resumed_at(t, g, since)

            resumed = await self._wait(lambda: back() is not None, self.stall_allowed_s * 2, "recovery")
            if resumed:
                fault.t_resumed = back() or 0.0
                fault.downtime_s = fault.t_resumed - t
            if kind in STORE_KINDS:
                healed = await self._wait_healed(extra, HEAL_WAIT_S)
                fault.extra["heal_s"] = round(time.time() - t, 4) if healed else None
                if not healed:
                    print(f"  NOT HEALED: {extra['store']}'s copies not made again in {HEAL_WAIT_S:.0f} s", flush=True)
                    print(f"  the swapper's view then: {await self._heal_view()}", flush=True)
            if kind == "all_stores":
                healed = await self._wait_protected(HEAL_WAIT_S)
                fault.extra["heal_s"] = round(time.time() - t, 4) if healed else None
                if not healed:
                    print(f"  NOT HEALED: the job still unprotected {HEAL_WAIT_S:.0f} s after its stores came back")
            if kind in ("nats", "jetstream_outage"):
                await self._wait(self._services_up, 30.0, "the NATS server to restart")
                nats_back_t = time.time()
            down = f"{fault.downtime_s:.3f} s" if fault.downtime_s is not None else "NOT RECOVERED"
            if "heal_s" in fault.extra:
                down += f", replicas again after {fault.extra['heal_s']} s"
            gen = self.watch.rebuild.generation if self.watch.rebuild else 0
            print(
                f"{time.strftime('%H:%M:%S', time.localtime(t))} fault {index:2d} {kind:>16}: downtime {down} "
                f"(generation {generation} -> {gen}) {detail}",
                flush=True,
            )
            if not resumed:
                return


def _newest_complete_step(directory: Path, ranks: int) -> int:
    """The newest step of the durable tier whose every rank's manifest is written (-1: none)."""
    steps = [
        int(p.name.split("_")[1])
        for p in directory.glob("step_*")
        if all((p / f"rank_{r:05d}.json").exists() for r in range(ranks))
    ]
    return max(steps, default=-1)


def durable_dir_of(out: Path) -> Path:
    return out.parent / f"durable-{out.name}"


@contextlib.contextmanager
def tmpfs(directory: Path, size_bytes: int) -> Any:
    """A small tmpfs mounted at `directory` for the run (the disk_full fault fills it); unmounted after."""
    directory.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(directory)], check=True)
    try:
        yield directory
    finally:
        subprocess.run(["umount", "--lazy", str(directory)], check=False)


async def launch(
    nats_args: list[str], job: str, args: argparse.Namespace, steps: int, out: Path, log: Path, *, reference: bool
) -> Any:
    """The chaos job, or (`reference`) the same training as a plain job: no spares, respawns or durable
    tier, which meet no fault there and change no weight, but cost it a quarter of its time and CPU
    (measured: 630 steps took 61.7 s and 118 CPU-s with them, 47.5 s and 89 CPU-s without)."""
    spares, respawns = (0, 0) if reference else (SPARES, 4 * args.faults + 4)
    command = [sys.executable, "-m", "deadpool_cli", "launch", *nats_args, "--job", job]
    command += ["--nproc", str(NPROC), "--spares", str(spares), "--respawns", str(respawns)]
    command += ["--collective-timeout-s", str(COLLECTIVE_TIMEOUT_S)]
    command += ["--snapshot-budget", str(args.snapshot_budget), "--snapshot-every", args.snapshot_every]
    if args.durable_every_steps and not reference:
        durable = str(durable_dir_of(out))
        command += ["--durable-dir", durable, "--durable-every-steps", str(args.durable_every_steps)]
    command += [args.script, "--steps", str(steps), "--model-size", args.model_size, "--seed", str(args.seed)]
    command += ["--out", str(out)]
    env = {k: v for k, v in os.environ.items() if k != CLOCK_STEP_FILE_ENV}  # the training host's clock stays
    with open(log, "wb") as sink:
        return await asyncio.create_subprocess_exec(*command, stdout=sink, stderr=subprocess.STDOUT, env=env)


def summarise(faults: list[Fault], incidents: list[Incident]) -> dict[str, Any]:
    """Per fault kind: its faults, recoveries, downtimes, and the most steps its incidents lost (an
    incident belongs to the newest fault injected before it was detected)."""
    injected = sorted((f.t, f.kind) for f in faults)
    lost: dict[str, int] = {}
    for incident in incidents:
        before = [kind for t, kind in injected if t <= incident.t_detected]
        if before:
            lost[before[-1]] = max(lost.get(before[-1], 0), incident.lost_steps)
    by_kind: dict[str, Any] = {}
    for kind in KINDS:
        rows = [f for f in faults if f.kind == kind]
        if not rows:
            continue
        downs = [f.downtime_s for f in rows if f.downtime_s is not None]
        by_kind[kind] = {
            "faults": len(rows),
            "recovered": len(downs),
            "downtime_s_p50": round(statistics.median(downs), 4) if downs else None,
            "downtime_s_p99": round(percentile(downs, 99), 4) if downs else None,
            "downtime_s_max": round(max(downs), 4) if downs else None,
            "lost_steps_max": lost.get(kind),
        }
    return by_kind


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="deadpool-chaos-"))
    if workdir.exists() and any(workdir.iterdir()):
        raise SystemExit(f"{workdir} is not empty: a run starts from an empty NATS (no JetStream state of an old run)")
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"work dir {workdir}", flush=True)
    args.sequence = [k for k in args.sequence.split(",") if k]
    kinds = args.sequence or [k for k in args.kinds.split(",") if k]
    unknown = set(kinds) - set(KINDS)
    if unknown:
        raise SystemExit(f"unknown fault kinds: {sorted(unknown)} (choose from {', '.join(KINDS)})")
    steps = args.warm_up_steps + args.faults * args.steps_per_fault
    if "corrupt" in kinds:  # the stores' byte-flipping endpoint (and the members' signals) are armed
        os.environ["DEADPOOL_FAULT_INJECTION"] = "1"
    args.clock_file, args.durable_dir = "", ""
    if "clock_step" in kinds:  # every service started from here on reads its wall clock's step there
        clock_file = workdir / "clock-step"
        clock_file.write_text("0\n")
        os.environ[CLOCK_STEP_FILE_ENV] = args.clock_file = str(clock_file)
    mounts = contextlib.ExitStack()
    if "disk_full" in kinds:
        if not args.durable_every_steps:
            raise SystemExit("disk_full needs the durable tier (--durable-every-steps > 0)")
        args.durable_dir = str(mounts.enter_context(tmpfs(durable_dir_of(workdir / "chaos"), DURABLE_TMPFS_BYTES)))
    with mounts:
        return await run_chaos(args, workdir, kinds, steps)


async def run_chaos(args: argparse.Namespace, workdir: Path, kinds: list[str], steps: int) -> dict[str, Any]:
    config = StackConfig(
        workdir=workdir,
        nats_nodes=args.nats_nodes,
        stores=STORES,
        swappers=2,
        detectors=2,
        heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
        hang_floor_s=HANG_FLOOR_S,
        restart_after_s=RESTART_AFTER_S,
    )
    started = time.time()
    token = secrets.token_hex(3)
    async with Stack(config) as stack:

        async def quiet(_exc: Exception) -> None:
            return None  # the watcher's own reconnections during a NATS fault are expected

        nc = await stack.connect(max_reconnect_attempts=-1, reconnect_time_wait=0.2, error_cb=quiet)
        job = f"chaos-{args.seed}-{token}"
        watch = JobWatch(nc, job, get_logger(job=job))
        await watch.start()
        print(
            f"training {steps} steps with {args.faults} faults (seed {args.seed}, kinds {','.join(kinds)})", flush=True
        )
        launcher = await launch(
            stack.nats_args, job, args, steps, workdir / "chaos", workdir / "logs" / "chaos-run.log", reference=False
        )
        chaos = Chaos(args, stack, nc, watch, job)
        poller = asyncio.create_task(chaos.poll_status())
        try:
            await chaos.run(kinds, args.faults)
            if chaos.wedged:
                launcher.send_signal(signal.SIGTERM)
            try:
                returncode = await asyncio.wait_for(launcher.wait(), chaos.time_to_finish_s(steps))
            except TimeoutError:
                print("  WEDGED: the job did not finish in time", flush=True)
                chaos.wedged, returncode = True, -1
        finally:
            poller.cancel()
            if launcher.returncode is None:
                launcher.kill()
                await launcher.wait()
        chaos_wall_s = time.time() - started
        incidents = list(watch.incidents)
        reference_wall_s = 0.0
        identical, tensors, diffs = False, 0, ["no reference run"]
        if returncode == 0 and not args.no_reference:
            print("reference: the same job without faults ...", flush=True)
            ref_started = time.time()
            ref_job = f"chaos-ref-{args.seed}-{token}"
            ref_log = workdir / "logs" / "ref-run.log"
            ref = await launch(stack.nats_args, ref_job, args, steps, workdir / "ref", ref_log, reference=True)
            ref_code = await ref.wait()
            reference_wall_s = time.time() - ref_started
            if ref_code == 0:
                identical, tensors, diffs = compare_final_states(workdir / "chaos", workdir / "ref")
        restarts = dict(stack.restarts)
        await nc.close()
    rebuilds = [{"t": t, **to_fields(r)} for t, r in watch.rebuilds]
    (workdir / "rebuilds.json").write_text(json.dumps(rebuilds, indent=1))
    faults = chaos.faults
    by_kind = summarise(faults, incidents)
    overlap = [f.downtime_s for f in faults if f.kind in OVERLAPPING and f.downtime_s is not None]
    recovered = sum(f.downtime_s is not None for f in faults)
    heals = [f.extra.get("heal_s") for f in faults if f.kind in (*STORE_KINDS, "all_stores")]
    healed = [h for h in heals if h is not None]
    # Committed steps that could not be restored: restores that went below the committed step (to the
    # durable tier), and restores that found nothing at all (the job ended).
    lost_committed = sum(int(i.evidence.get("lost_committed_steps", "0")) for i in incidents)
    lost_committed += sum(f.cause is MemberErrorCause.SNAPSHOT_UNAVAILABLE for f in watch.failures)
    links = [i.evidence.get("restore_link", "") for i in incidents]
    stuck = sorted({f.member for f in watch.failures if f.cause is MemberErrorCause.STUCK_COLLECTIVE})
    false_verdicts = sorted({f.member for f in watch.failures if f.member not in chaos.touched} - set(stuck))
    disk_faults = [f for f in faults if f.kind == "disk_full"]
    result = {
        "faults": len(faults),
        "recovered": recovered,
        "bit_identical": identical,
        "tensors_compared": tensors,
        "wedged": int(chaos.wedged or recovered < len(faults) or returncode != 0),
        "downtime_s_p50": {k: v["downtime_s_p50"] for k, v in by_kind.items()},
        "downtime_s_p99": {k: v["downtime_s_p99"] for k, v in by_kind.items()},
        "overlap_downtime_s_p99": round(percentile(overlap, 99), 4) if overlap else None,
        "lost_steps_max": max((i.lost_steps for i in incidents), default=0),
        "lost_steps_max_by_kind": {k: v["lost_steps_max"] for k, v in by_kind.items()},
        "lost_steps_max_process_kill": max(
            (v["lost_steps_max"] or 0 for k, v in by_kind.items() if k in PROCESS_KILLS), default=0
        ),
        "lost_steps_max_ram": max(
            (i.lost_steps for i in incidents if i.evidence.get("restore_link") != "durable"), default=0
        ),
        "unheard_s_max": round(chaos.unheard_s_max, 4),
        "false_verdicts": len(false_verdicts),
        "false_verdict_members": false_verdicts[:10],
        "stuck_exits": len(stuck),
        "disk_full_faults": len(disk_faults),
        "disk_full_not_persisted_again": sum(f.extra.get("persisted_again_s") is None for f in disk_faults),
        "lost_committed": lost_committed,
        "snapshot_budget": args.snapshot_budget,
        "snapshot_every": args.snapshot_every,
        "snapshot_every_max": watch.snapshot_every_max,
        "store_ingest_mb_s": args.store_ingest_mb_s or None,
        "restore_links": {link: links.count(link) for link in sorted(set(links))},
        "store_faults": len(heals),
        "store_not_healed": len(heals) - len(healed),
        "heal_s_p50": round(statistics.median(healed), 4) if healed else None,
        "heal_s_max": round(max(healed), 4) if healed else None,
        "incidents": len(incidents),
        "generations": watch.rebuild.generation if watch.rebuild else 0,
        "longest_stall_s": round(chaos.longest_stall_s, 3),
        "wedge_s": WEDGE_S,
        "launcher_returncode": returncode,
        "steps": steps,
        "seed": args.seed,
        "chaos_wall_s": round(chaos_wall_s, 1),
        "reference_wall_s": round(reference_wall_s, 1),
        "service_restarts": restarts,
        "by_kind": by_kind,
        "differences": diffs[:5],
        "work_dir": str(workdir),
    }
    result["goal"] = GOAL
    result["goal_met"] = (
        result["faults"] >= GOAL["faults"]
        and result["wedged"] == 0
        and lost_committed == 0
        and result["store_not_healed"] == 0
        and identical
        and (result["overlap_downtime_s_p99"] or 0.0) <= GOAL["overlap_downtime_s_p99_max"]
        and result["unheard_s_max"] <= GOAL["unheard_s_max"]
        and result["false_verdicts"] == 0
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--faults", type=int, default=50)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, from: {', '.join(KINDS)}")
    parser.add_argument(
        "--sequence", default="", help="faults in this order (comma-separated, repeated as needed) instead of drawn"
    )
    parser.add_argument("--script", default=str(default_script()), help="the training script (the example's args)")
    parser.add_argument("--model-size", default="tiny")
    parser.add_argument("--steps-per-fault", type=int, default=120)
    parser.add_argument("--warm-up-steps", type=int, default=30)
    parser.add_argument("--nats-nodes", type=int, default=3)
    parser.add_argument("--workdir", default="")
    parser.add_argument("--no-reference", action="store_true")
    parser.add_argument(
        "--snapshot-budget", type=float, default=0.01, help="as deadpool launch (the job's K adapts within it)"
    )
    parser.add_argument("--snapshot-every", default="auto", help="as deadpool launch: auto, or a forced interval")
    parser.add_argument(
        "--store-ingest-mb-s",
        type=float,
        default=0.0,
        help="stores that ingest no faster than this (MB/s, 0: as fast as they can): a data plane slower than "
        "the steps, so that the job streams every K-th step (K > 1) while the faults come",
    )
    parser.add_argument(
        "--durable-every-steps", type=int, default=5, help="the chaos job's durable tier (0: none; not the reference)"
    )
    args = parser.parse_args()
    if args.store_ingest_mb_s > 0:  # every store started from here on inherits it, restarted ones too
        os.environ[INGEST_LIMIT_ENV] = str(int(args.store_ingest_mb_s * 1e6))
    result = asyncio.run(main_async(args))
    print("")
    print(
        f"{'kind':>16} {'faults':>6} {'recovered':>9} {'downtime p50 (s)':>16} {'p99 (s)':>8} {'max (s)':>8} "
        f"{'lost steps max':>14}"
    )
    for kind, row in result["by_kind"].items():
        p50, p99, top = (
            row[k] if row[k] is not None else float("nan")
            for k in ("downtime_s_p50", "downtime_s_p99", "downtime_s_max")
        )
        lost = "-" if row["lost_steps_max"] is None else str(row["lost_steps_max"])
        print(f"{kind:>16} {row['faults']:>6} {row['recovered']:>9} {p50:>16.3f} {p99:>8.3f} {top:>8.3f} {lost:>14}")
    print(
        f"faults {result['faults']}, recovered {result['recovered']}, wedged {result['wedged']}, "
        f"bit-identical {result['bit_identical']} ({result['tensors_compared']} tensors), "
        f"overlapping-fault downtime p99 {result['overlap_downtime_s_p99']} s, "
        f"lost steps max {result['lost_steps_max']} (process kills {result['lost_steps_max_process_kill']})"
    )
    print(
        f"snapshots: every {result['snapshot_every']} step(s) within a budget of {result['snapshot_budget']:g} "
        f"of a step; the longest interval a rank named: {result['snapshot_every_max']}"
    )
    print(
        f"store faults {result['store_faults']}, not healed {result['store_not_healed']}, heal p50 "
        f"{result['heal_s_p50']} s, max {result['heal_s_max']} s; lost committed {result['lost_committed']}"
    )
    print(
        f"longest wait of an event in a job worker {result['unheard_s_max']} s; false verdicts "
        f"{result['false_verdicts']} (and {result['stuck_exits']} stuck in gloo's pending send); disk-full faults "
        f"{result['disk_full_faults']}, not persisted again "
        f"{result['disk_full_not_persisted_again']}"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
