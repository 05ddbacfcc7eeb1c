"""The control plane at scale: the real detector and swapper against thousands of simulated members.

    .venv/bin/python bench/control_plane_scale.py --members 1024 [--members 128 512 1024 4096]

For each size: an embedded nats-server, the detector (heartbeat timeout `--timeout-s`, default 1 s),
the swapper and one store, as separate processes; `--processes` worker processes simulate the
members, each member a light asyncio task: it registers with the swapper (the real hello), heartbeats
every 100 ms, steps every 0.5 s, acks every rebuild that names it and answers fence requests, like a
member and its launcher would. `--spares` of them are spares. After the job forms, `--failures` members
holding ranks go silent one at a time; each silence must become a `failure` and then a `rebuild`.

Reported per size: detection latency (last heartbeat sent -> failure published by the detector, both
stamped on this machine's clock) p50/p99, the swapper's failure -> rebuild time (as this bench receives
them, and on the swapper's own clock) p50/p99, detector and swapper CPU (% of one core over the
measurement window), and heartbeat messages per second. By default the members' heartbeats travel in batches of their
(simulated) host's 8 members, one message per period, as `deadpool launch` sends them; `--no-batching`
has every member publish its own. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import nats
from measures import cpu_seconds, percentile
from nats.aio.client import Client
from nats.aio.msg import Msg

from deadpool_cli.stack import Stack, StackConfig
from deadpool_protocol import (
    NO_RANK,
    Failure,
    FenceReply,
    FenceRequest,
    Heartbeat,
    HeartbeatBatch,
    HelloReply,
    MemberHello,
    Rebuild,
    RebuildAck,
    RebuildMarks,
    RestoreSource,
    RunReply,
    RunStart,
    Subjects,
    decode,
    encode,
)
from deadpool_runtime.credentials import nkey_file

JOB = "scale"
RUN = "simulated"
HEARTBEAT_PERIOD_S = 0.1
STEP_PERIOD_S = 0.5
HELLO_CONCURRENCY = 64
GOALS = {"detect_ms_p99_over_timeout_max": 200.0, "decide_ms_p99_max": 100.0, "detector_cpu_pct_max": 25.0}


# ----------------------------------------------------------------------------- worker process
class SimulatedMember:
    def __init__(self, name: str, rank_hint: int, launcher: str) -> None:
        self.name = name
        self.rank_hint = rank_hint
        self.launcher = launcher
        self.rank = NO_RANK
        self.generation = 0
        self.silent_at = 0.0
        self.step = 0
        self.sent = 0
        self.last_beat = 0.0


async def worker_main(
    url: str, nkey: str, index: int, members: list[tuple[str, int]], world_size: int, batching: bool
) -> None:
    nc = await nats.connect(url, max_reconnect_attempts=-1, nkeys_seed=nkey or None)
    subjects = Subjects.for_job(JOB)
    launcher = f"worker-{index}"
    sim = {name: SimulatedMember(name, hint, launcher) for name, hint in members}
    hosts = {name: f"host-{i // 8}-{index}" for i, name in enumerate(sim)}  # 8 members per simulated host

    async def on_rebuild(msg: Msg) -> None:
        rebuild = decode(msg.data, Rebuild)
        for member in sim.values():
            if member.silent_at or rebuild.generation <= member.generation:
                continue
            member.generation, member.rank = rebuild.generation, rebuild.rank_of(member.name)
            if member.rank != NO_RANK:
                now = time.time()
                marks = RebuildMarks(received=now, begin=now, restored=now, rendezvous=now, ready=now)
                ack = RebuildAck(
                    JOB,
                    rebuild.generation,
                    member.name,
                    member.rank,
                    rebuild.restore_step,
                    member.step,
                    RestoreSource.LOCAL,
                    marks,
                    now,
                )
                await nc.publish(subjects.rebuild_ack, encode(ack))

    async def on_fence(msg: Msg) -> None:
        request = decode(msg.data, FenceRequest)
        reply = FenceReply(JOB, request.generation, request.member, True, "simulated SIGKILL", time.time())
        await msg.respond(encode(reply))

    async def on_silence(msg: Msg) -> None:
        member = sim.get(msg.data.decode())
        if member is not None and not member.silent_at:
            member.silent_at = time.time()
            await nc.publish("bench.silenced", json.dumps({"member": member.name, "t": member.last_beat}).encode())

    await nc.subscribe(subjects.rebuild, cb=on_rebuild)
    await nc.subscribe(subjects.fence(launcher), cb=on_fence)
    await nc.subscribe("bench.silence", cb=on_silence)

    gate = asyncio.Semaphore(HELLO_CONCURRENCY)
    start = RunStart(JOB, 0, RUN, world_size, launcher, time.time())
    while True:  # every simulated launcher starts the one run, as a job's launchers do
        try:
            if decode((await nc.request(subjects.run_start, encode(start), timeout=5)).data, RunReply).accepted:
                break
        except Exception:
            pass
        await asyncio.sleep(0.2)

    async def hello(member: SimulatedMember) -> None:
        async with gate:
            message = MemberHello(
                JOB,
                0,
                member.name,
                hosts[member.name],
                os.getpid(),
                launcher,
                member.rank_hint,
                world_size,
                "127.0.0.1",
                1,
                time.time(),
                run=RUN,
            )
            while True:
                try:
                    reply = decode((await nc.request(subjects.hello, encode(message), timeout=5)).data, HelloReply)
                    if reply.accepted:
                        return
                except Exception:
                    await asyncio.sleep(0.2)

    await asyncio.gather(*(hello(m) for m in sim.values()))

    def next_beat(member: SimulatedMember, started: float, now: float) -> Heartbeat:
        """The member's heartbeat at `now`: a step every STEP_PERIOD_S since `started` (monotonic)."""
        member.step = int((time.monotonic() - started) / STEP_PERIOD_S)
        return Heartbeat(
            JOB,
            member.generation,
            member.name,
            member.rank,
            os.getpid(),
            member.step,
            True,
            now,
            now,
            host=hosts[member.name],
        )

    async def beat(member: SimulatedMember) -> None:
        await asyncio.sleep(random.random() * HEARTBEAT_PERIOD_S)  # spread the members over the period
        started = time.monotonic()
        while not member.silent_at:
            now = time.time()
            await nc.publish(subjects.heartbeat, encode(next_beat(member, started, now)))
            member.last_beat = now
            member.sent += 1
            await asyncio.sleep(HEARTBEAT_PERIOD_S)

    async def beat_host(host: str, members: list[SimulatedMember]) -> None:
        """A launcher's batching: the beats of its (non-silent) members, one message per period."""
        await asyncio.sleep(random.random() * HEARTBEAT_PERIOD_S)
        started = time.monotonic()
        while any(not m.silent_at for m in members):
            now = time.time()
            beats = []
            for member in members:
                if member.silent_at:
                    continue
                beats.append(next_beat(member, started, now))
                member.last_beat = now
                member.sent += 1
            await nc.publish(subjects.heartbeat_batch, encode(HeartbeatBatch(JOB, 0, f"l-{host}", beats)))
            await asyncio.sleep(HEARTBEAT_PERIOD_S)

    if batching:
        by_host: dict[str, list[SimulatedMember]] = {}
        for member in sim.values():
            by_host.setdefault(hosts[member.name], []).append(member)
        tasks = [asyncio.create_task(beat_host(h, ms)) for h, ms in by_host.items()]
    else:
        tasks = [asyncio.create_task(beat(m)) for m in sim.values()]

    async def report() -> None:
        while True:
            await asyncio.sleep(1.0)
            sent = sum(m.sent for m in sim.values())
            await nc.publish("bench.sent", json.dumps({"worker": index, "sent": sent}).encode())

    tasks.append(asyncio.create_task(report()))
    await asyncio.gather(*tasks)


# ----------------------------------------------------------------------------- controller


async def run_size(members: int, args: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix=f"deadpool-scale-{members}-"))
    spares = args.spares
    world_size = members - spares
    config = StackConfig(
        workdir=workdir,
        stores=1,
        replication=1,
        heartbeat_timeout_s=args.timeout_s,
        hang_floor_s=max(3.0, 2 * args.timeout_s),
    )
    async with Stack(config) as stack:
        nc: Client = await stack.connect()
        subjects = Subjects.for_job(JOB)
        failures: dict[str, tuple[Failure, float]] = {}
        rebuilds: dict[int, tuple[Rebuild, float]] = {}
        silenced: dict[str, float] = {}
        sent: dict[int, int] = {}

        async def on_failure(msg: Msg) -> None:
            failure = decode(msg.data, Failure)
            failures[failure.member] = (failure, time.time())

        async def on_rebuild(msg: Msg) -> None:
            rebuild = decode(msg.data, Rebuild)
            rebuilds.setdefault(rebuild.generation, (rebuild, time.time()))

        async def on_silenced(msg: Msg) -> None:
            body = json.loads(msg.data)
            silenced[body["member"]] = body["t"]

        async def on_sent(msg: Msg) -> None:
            body = json.loads(msg.data)
            sent[body["worker"]] = body["sent"]

        for subject, cb in (
            (subjects.failure, on_failure),
            (subjects.rebuild, on_rebuild),
            ("bench.silenced", on_silenced),
            ("bench.sent", on_sent),
        ):
            await nc.subscribe(subject, cb=cb)
        names = [(f"sim-{i:05d}", i if i < world_size else -1) for i in range(members)]
        workers = []
        for w in range(args.processes):
            share = names[w :: args.processes]
            spec = json.dumps([[n, h] for n, h in share])
            workers.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        __file__,
                        "--worker",
                        str(w),
                        "--url",
                        stack.url,
                        "--nkey",  # a worker plays launchers and members both: the admin role
                        nkey_file(stack.credentials or "", "admin"),
                        "--world-size",
                        str(world_size),
                        "--spec",
                        spec,
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=open(workdir / f"worker-{w}.log", "wb"),  # noqa: SIM115
                )
            )
        try:
            deadline = time.monotonic() + 120 + members / 20
            while 1 not in rebuilds:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the job of {members} simulated members did not form; see {workdir}")
                await asyncio.sleep(0.1)
            formed_t = time.monotonic()
            print(f"  {members} members: formed in {formed_t - (deadline - 120 - members / 20):.1f} s", flush=True)
            await asyncio.sleep(args.warm_s)
            detector_pid = stack.processes["detector"].pid
            swapper_pid = stack.processes["swapper"].pid
            cpu0 = (cpu_seconds(detector_pid), cpu_seconds(swapper_pid), time.monotonic())
            sent0 = sum(sent.values())
            victims: list[str] = []
            for _ in range(args.failures):
                latest = rebuilds[max(rebuilds)][0]
                candidates = [m for m in latest.ranks if m not in victims]
                victim = random.Random(len(victims)).choice(candidates)
                victims.append(victim)
                await nc.publish("bench.silence", victim.encode())
                wait_until = time.monotonic() + args.timeout_s + 5
                while victim not in failures and time.monotonic() < wait_until:
                    await asyncio.sleep(0.02)
                await asyncio.sleep(args.gap_s)
            cpu1 = (cpu_seconds(detector_pid), cpu_seconds(swapper_pid), time.monotonic())
            sent1 = sum(sent.values())
        finally:
            for p in workers:
                p.terminate()
            for p in workers:
                p.wait(10)
            await nc.close()

    window = cpu1[2] - cpu0[2]
    detect_ms, decide_ms, decide_own_ms = [], [], []
    for victim in victims:
        if victim not in failures or victim not in silenced:
            continue
        failure, received = failures[victim]
        detect_ms.append((failure.t_detected - silenced[victim]) * 1000)
        later = [(g, r) for g, r in rebuilds.items() if victim not in r[0].ranks and g > 1]
        if later:
            _, (rebuild, rebuild_received) = min(later)
            decide_ms.append((rebuild_received - received) * 1000)
            decide_own_ms.append((rebuild.t_decided - failure.t_detected) * 1000)
    return {
        "members": members,
        "world_size": world_size,
        "heartbeat_timeout_ms": args.timeout_s * 1000,
        "failures_injected": len(victims),
        "failures_detected": len(detect_ms),
        "rebuilds_seen": len(decide_ms),
        "detect_ms_p50": round(statistics.median(detect_ms), 1) if detect_ms else None,
        "detect_ms_p99": round(percentile(detect_ms, 99), 1) if detect_ms else None,
        "decide_ms_p50": round(statistics.median(decide_ms), 1) if decide_ms else None,
        "decide_ms_p99": round(percentile(decide_ms, 99), 1) if decide_ms else None,
        "decide_swapper_clock_ms_p99": round(percentile(decide_own_ms, 99), 1) if decide_own_ms else None,
        "detector_cpu_pct": round(100 * (cpu1[0] - cpu0[0]) / window, 1),
        "swapper_cpu_pct": round(100 * (cpu1[1] - cpu0[1]) / window, 1),
        "heartbeats_per_s": round((sent1 - sent0) / window),
        "heartbeat_messages_per_s": round((sent1 - sent0) / window / (1 if args.no_batching else 8)),
        "batching": not args.no_batching,
        "window_s": round(window, 1),
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    results = []
    for members in args.members:
        print(f"size {members}: starting", flush=True)
        results.append(await run_size(members, args))
        r = results[-1]
        print(
            f"size {members}: detect p50 {r['detect_ms_p50']} p99 {r['detect_ms_p99']} ms; failure->rebuild p50 "
            f"{r['decide_ms_p50']} p99 {r['decide_ms_p99']} ms; detector CPU {r['detector_cpu_pct']} %, swapper CPU "
            f"{r['swapper_cpu_pct']} %; {r['heartbeats_per_s']} heartbeats/s",
            flush=True,
        )
    main_result = next((r for r in results if r["members"] == 1024), results[-1])
    out: dict[str, Any] = dict(main_result)
    out["sizes"] = results
    out["goals"] = GOALS
    timeout_ms = args.timeout_s * 1000
    out["goals_met"] = bool(
        main_result["detect_ms_p99"] is not None
        and main_result["detect_ms_p99"] <= timeout_ms + GOALS["detect_ms_p99_over_timeout_max"]
        and main_result["decide_ms_p99"] is not None
        and main_result["decide_ms_p99"] <= GOALS["decide_ms_p99_max"]
        and main_result["detector_cpu_pct"] <= GOALS["detector_cpu_pct_max"]
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--members", type=int, nargs="+", default=[1024])
    parser.add_argument("--spares", type=int, default=24)
    parser.add_argument("--failures", type=int, default=20)
    parser.add_argument("--timeout-s", type=float, default=1.0, help="the detector's heartbeat timeout")
    parser.add_argument("--processes", type=int, default=4, help="worker processes simulating members")
    parser.add_argument("--warm-s", type=float, default=3.0)
    parser.add_argument("--gap-s", type=float, default=0.3, help="pause after each detected failure")
    parser.add_argument(
        "--no-batching", action="store_true", help="every member publishes its own heartbeats (no launcher batching)"
    )
    parser.add_argument("--worker", type=int, default=-1, help=argparse.SUPPRESS)
    parser.add_argument("--url", default="", help=argparse.SUPPRESS)
    parser.add_argument("--nkey", default="", help=argparse.SUPPRESS)
    parser.add_argument("--world-size", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--spec", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker >= 0:
        members = [(str(n), int(h)) for n, h in json.loads(args.spec)]
        asyncio.run(worker_main(args.url, args.nkey, args.worker, members, args.world_size, not args.no_batching))
        return
    result = asyncio.run(main_async(args))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
