"""The detector alone at N members: its launchers' beat batches made beforehand and replayed at their rate.

    cd bench && ../.venv/bin/python detector_scale.py --members 8192 16384

`control_plane_scale.py` plays every member as an asyncio task beside the services. At 16,384 members
that simulation wants more than a core of its own, and on 2 cores either it or the services starve
(docs/performance.md §5), so the detector's own cost there cannot be read off it. Here each host's
batches are made before the clock starts, by the same code (`real_beats.real_beat`, the launcher's own
`BeatCompaction`: forward, backward waiting, optimizer step, a step every `--step-s`), and
`--processes` replay processes publish them, already encoded, at their rate: a batch per host of 8
every `--batch-s`, each host at its own phase. The detector (a real `deadpool detector` process, with
nats-server, no swapper) watches a job of `--members` ranks named by one rebuild.

Reported per size: the detector's CPU over the window (% of one core) and per member and second,
its verdicts while every member beats (none expected: one means the detector or the replay fell
behind), the replay's lateness (how long after its time a batch went out, p99 and max) and the share
of the batches it sent, the whole beats per member and second, and the CPU of what runs beside the
detector on the same 2 cores (the replays and nats-server): the detector's CPU time grows with it
(caches and cores shared), so a figure is read with its neighbours'. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import nats
from measures import cpu_seconds, percentile
from nats.aio.msg import Msg
from real_beats import real_beat

from deadpool.beat_compaction import BeatCompaction
from deadpool_cli.stack import Stack, StackConfig
from deadpool_protocol import Failure, Heartbeat, Rebuild, encode
from deadpool_protocol.codec import decode
from deadpool_protocol.subjects import Subjects
from deadpool_runtime.bus import publish
from deadpool_runtime.credentials import nkey_file
from deadpool_runtime.event_loop import IO_WAIT_MIN_S

JOB = "replay"
HOST_MEMBERS = 8
"""A launcher's members (a host of 8 GPUs); `--host-members` more plays a batch per pod of hosts."""
HEARTBEAT_PERIOD_S = 0.1
"""A member beats to its launcher this often (`deadpool.control_link`)."""
GOALS = {"detector_cpu_pct_max": 50.0, "verdicts_max": 0}
"""At 16,384 members (issue 26)."""
REPLAY_TICK_S = 0.001
"""A replay wakes at most this often and sends every batch due by then: at 4,100 batches a second
each, a wake-up per batch cost the replays 117-126 % of a core between them, on the detector's 2 cores."""
START_MARGIN_S = 0.3
"""Between the rebuild's publication and the replay's start: the detector reads the rebuild first, and
watches its members from then on, so the first batches must follow well within the heartbeat timeout."""


def member_name(i: int) -> str:
    return f"sim-{i:05d}"


def host_batches(
    host: int,
    members: int,
    periods: int,
    batch_s: float = 0.25,
    step_s: float = 2.0,
    t0: float = 0.0,
    host_members: int = HOST_MEMBERS,
) -> list[tuple[float, bytes, int]]:
    """Host `host`'s batches for `periods` periods: (seconds after `t0` it is due, its bytes, the beats
    it holds whole). Its
    members beat every `HEARTBEAT_PERIOD_S`, each at its own phase; a batch holds each one's newest beat,
    compacted as the launcher does. `t0` is the wall-clock start the beats' times count from."""
    first = host * host_members
    names = [(member_name(i), i) for i in range(first, min(first + host_members, members))]
    phase = (host * 0.6180339887) % 1.0 * batch_s  # hosts spread over the period, none in step
    beat_phases = {name: (rank * 0.381966) % 1.0 * HEARTBEAT_PERIOD_S for name, rank in names}
    compaction = BeatCompaction()
    out: list[tuple[float, bytes, int]] = []
    for period in range(periods):
        at = phase + period * batch_s
        received: dict[str, tuple[Heartbeat, float]] = {}
        for name, rank in names:
            sent = at - (at - beat_phases[name]) % HEARTBEAT_PERIOD_S  # its newest beat by `at`
            step, into = int(sent / step_s), (sent % step_s) / step_s
            beat = real_beat(JOB, 1, name, rank, 1000 + rank, f"host-{host}", step, into, step_s, t0, t0 + sent)
            received[name] = (beat, sent)
        batch = compaction.batch(JOB, 1, f"l-host-{host}", received, at)
        out.append((at, encode(batch), len(batch.beats)))
    return out


def replay_periods(args: argparse.Namespace) -> int:
    """The batch periods each host's replay covers: the warm-up, the window and a second more (the replay
    processes make that many, and the share sent is counted against it)."""
    return int((args.warm_s + args.seconds + 1.0) / args.batch_s)


async def replay_main(args: argparse.Namespace) -> None:
    """A replay process: make its hosts' batches, say so, take the start time from stdin, publish each
    batch at its time, and print what it sent and how late."""
    members = args.members[0]
    hosts = range(args.worker, -(-members // args.host_members), args.processes)
    periods = replay_periods(args)
    t0_wall = time.time()
    planned = sorted(
        (
            batch
            for host in hosts
            for batch in host_batches(host, members, periods, args.batch_s, args.step_s, t0_wall, args.host_members)
        ),
        key=lambda batch: batch[0],
    )
    whole = sum(batch[2] for batch in planned)
    nc = await nats.connect(args.url, nkeys_seed=args.nkey or None)
    subject = Subjects.for_job(JOB).heartbeat_batch
    print(json.dumps({"ready": len(planned)}), flush=True)
    start = float(sys.stdin.readline())
    start_mono = time.monotonic() + (start - time.time())
    late: list[float] = []
    i = 0
    while i < len(planned):
        now = time.monotonic() - start_mono
        while i < len(planned) and planned[i][0] <= now:
            late.append(now - planned[i][0])
            await nc.publish(subject, planned[i][1])
            i += 1
        if i < len(planned):  # to the next batch's time, or the next tick if that comes first
            await asyncio.sleep(max(planned[i][0] - now, REPLAY_TICK_S - now % REPLAY_TICK_S))
    await nc.flush()
    await nc.close()
    print(json.dumps({"sent": len(late), "late_p99_s": percentile(late, 99), "late_max_s": max(late, default=0.0),
                      "whole": whole}), flush=True)  # fmt: skip


def cpu_of(processes: dict[str, list[int]]) -> dict[str, float]:
    """Each named group's CPU seconds so far, its processes' together."""
    return {name: sum(map(cpu_seconds, pids)) for name, pids in processes.items()}


def job_rebuild(members: int) -> Rebuild:
    """Generation 1 of a job of `members` ranks, no spares, no stores: what the detector watches."""
    ranks = [member_name(i) for i in range(members)]
    placement: list[list[str]] = [[] for _ in ranks]
    return Rebuild(JOB, 1, members, ranks, [], ranks[0], "127.0.0.1", 29_500, -1, [], placement, "", time.time())


async def run_size(members: int, args: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix=f"deadpool-detector-{members}-"))
    config = StackConfig(
        workdir=workdir,
        stores=0,
        swappers=0,
        detectors=1,
        heartbeat_timeout_s=args.timeout_s,
        detector_io_wait_min_s=args.io_wait_min_s,
    )
    async with Stack(config) as stack:
        nkey = nkey_file(stack.credentials or "", "admin")
        nc = await nats.connect(stack.url, nkeys_seed=nkey or None)
        verdicts: list[tuple[str, str, float]] = []

        async def on_failure(msg: Msg) -> None:
            failure = decode(msg.data, Failure)
            verdicts.append((failure.member, str(failure.reason), time.monotonic()))

        await nc.subscribe(Subjects.for_job(JOB).failure, cb=on_failure)
        command = [sys.executable, __file__, "--url", stack.url, "--nkey", nkey, "--members", str(members)]
        command += ["--seconds", str(args.seconds), "--warm-s", str(args.warm_s), "--batch-s", str(args.batch_s)]
        command += ["--step-s", str(args.step_s), "--processes", str(args.processes)]
        command += ["--host-members", str(args.host_members)]
        replays = [
            subprocess.Popen([*command, "--worker", str(w)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            for w in range(args.processes)
        ]
        made = time.monotonic()
        for replay in replays:
            assert replay.stdout is not None
            line = await asyncio.to_thread(replay.stdout.readline)
            if not line.startswith(b'{"ready"'):
                raise RuntimeError(f"a replay process did not start: {line!r}")
        made_s = time.monotonic() - made
        rebuild = job_rebuild(members)
        start = time.time() + START_MARGIN_S
        for replay in replays:
            assert replay.stdin is not None
            replay.stdin.write(f"{start!r}\n".encode())
            replay.stdin.flush()
        await publish(nc, Subjects.for_job(JOB).rebuild, rebuild)
        await nc.flush()
        detector = stack.processes["detector"].pid
        server = stack.nats.process.pid if stack.nats is not None and stack.nats.process is not None else 0
        beside = {"replays": [r.pid for r in replays], "nats_server": [server] if server else []}
        await asyncio.sleep(START_MARGIN_S + args.warm_s)
        cpu0, t0 = cpu_seconds(detector), time.monotonic()
        beside0 = cpu_of(beside)
        await asyncio.sleep(args.seconds)
        cpu1, t1 = cpu_seconds(detector), time.monotonic()
        beside1 = cpu_of(beside)
        summaries = []
        for replay in replays:
            out, _ = await asyncio.to_thread(replay.communicate, timeout=60)
            summaries.append(json.loads(out.decode().splitlines()[-1]))
        during = [(member, reason) for member, reason, at in verdicts if at <= t1]
        await nc.close()
    window = t1 - t0
    cpu_pct = 100 * (cpu1 - cpu0) / window
    hosts = -(-members // args.host_members)
    periods = replay_periods(args)
    return {
        "members": members,
        "heartbeat_timeout_ms": args.timeout_s * 1000,
        "batch_s": args.batch_s,
        "io_wait_min_s": args.io_wait_min_s,
        "host_members": args.host_members,
        "step_s": args.step_s,
        "window_s": round(window, 1),
        "batches_made_s": round(made_s, 1),
        "detector_cpu_pct": round(cpu_pct, 1),
        "detector_us_per_member_s": round(1e6 * (cpu1 - cpu0) / window / members, 2),
        "replays_cpu_pct": round(100 * (beside1["replays"] - beside0["replays"]) / window, 1),
        "nats_server_cpu_pct": round(100 * (beside1["nats_server"] - beside0["nats_server"]) / window, 1),
        "verdicts": len(during),
        "verdict_members": sorted({member for member, _ in during})[:10],
        "verdict_reasons": dict(Counter(reason for _, reason in during)),
        "replay_late_ms_p99": round(1000 * max(s["late_p99_s"] for s in summaries), 1),
        "replay_late_ms_max": round(1000 * max(s["late_max_s"] for s in summaries), 1),
        "replay_sent_share": round(sum(s["sent"] for s in summaries) / (hosts * periods), 3),
        "whole_beats_per_member_s": round(sum(s["whole"] for s in summaries) / (members * periods * args.batch_s), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--members", type=int, nargs="+", default=[16384])
    parser.add_argument("--seconds", type=float, default=30.0, help="the measurement window")
    parser.add_argument("--warm-s", type=float, default=5.0, help="replayed before the window opens")
    parser.add_argument("--timeout-s", type=float, default=1.0, help="the detector's heartbeat timeout")
    parser.add_argument("--batch-s", type=float, default=0.25, help="a host's batch every this long")
    parser.add_argument("--step-s", type=float, default=2.0, help="the members' step")
    parser.add_argument("--processes", type=int, default=2, help="replay processes")
    parser.add_argument(
        "--io-wait-min-s",
        type=float,
        default=IO_WAIT_MIN_S,
        help="the detector's loop waits for I/O at most once per this (0: asyncio's own loop)",
    )
    parser.add_argument(
        "--host-members", type=int, default=HOST_MEMBERS, help="members per launcher batch (more: a batch per pod)"
    )
    parser.add_argument("--worker", type=int, default=-1, help=argparse.SUPPRESS)
    parser.add_argument("--url", default="", help=argparse.SUPPRESS)
    parser.add_argument("--nkey", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker >= 0:
        asyncio.run(replay_main(args))
        return
    results = []
    for members in args.members:
        print(f"size {members}: making the batches", flush=True)
        r = asyncio.run(run_size(members, args))
        results.append(r)
        print(
            f"size {members}: detector CPU {r['detector_cpu_pct']} % ({r['detector_us_per_member_s']} µs per member "
            f"and second), verdicts {r['verdicts']}; the replay: {r['replay_sent_share']} of the batches, late p99 "
            f"{r['replay_late_ms_p99']} ms, max {r['replay_late_ms_max']} ms; beside it the replays "
            f"{r['replays_cpu_pct']} % and nats-server {r['nats_server_cpu_pct']} %",
            flush=True,
        )
    last = results[-1]
    out: dict[str, Any] = dict(last)
    out["sizes"] = results
    out["goals"] = GOALS
    out["goals_met"] = (
        last["detector_cpu_pct"] <= GOALS["detector_cpu_pct_max"] and last["verdicts"] <= GOALS["verdicts_max"]
        if last["members"] >= 16384
        else None
    )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
