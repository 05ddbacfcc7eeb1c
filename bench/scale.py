"""Snapshots at real bytes per step: what they cost a job whose ranks hold GBs of state.

    cd bench && ../.venv/bin/python scale.py [--state-gb 1] [--step-s 1 5] [--steps 12] [--device cuda]

Each scenario is a job of `--ranks` ranks (`bench/scale_train.py`), each holding `--state-gb` GiB of
state (fp32 parameters and AdamW moments, every byte changed every step, no state shared between
ranks), whose step stands in for a GPU step of `--step-s` seconds: it leaves the host's cores to the
snapshot path. The default scenarios are the issue's: 1 GiB per rank with 1 s steps (the bytes per
second of step of an 8B model on 64 GPUs) and with 5 s steps (70B on 512). Per scenario, three rounds,
each on a control plane of its own (NATS, a detector, a swapper, `--stores` stores at `--replication`):

1. snapshots off (`DEADPOOL_SNAPSHOT_EVERY=0`: hooks attached, heartbeats running, no capture);
2. snapshots on as `deadpool launch` takes them by default: every step captured into the host's crash
   copy, every K-th streamed to the stores and committed, K chosen by the job within its budget
   (`--snapshot-every` and `--snapshot-budget` are passed on as launch options);
3. the same with a warm spare, and rank 1 SIGKILLed half-way through step `steps - 3`: the spare, on the
   same launcher, restores from the crash copy the dead member left in the host's shared memory;
4. the same kill with `deadpool launch --no-host-copy`: the spare restores from the stores, as it would
   after a lost host.

Reported per scenario, as a table and then one JSON line:
- `step_time_ratio`: median step (past `--warm-up-steps`) with snapshots on, over off; and
  `step_time_ratio_settled`, the same over the round's second half (at 1 GiB the first steps pay for
  the first touch of the stores' memory, and K settles);
- `hook_time_share`: the on-round's time the training thread spent inside DeadPool's hooks (its capture
  and the optimizer step's wait for the copy; `stall_s` in the stats files) over its step time, past
  the warm-up: what the budget bounds. The rest of a ratio above 1 is the snapshot path's threads and
  the stores taking host cores the step itself uses (here the optimizer's update runs on the CPU);
- `snapshot_every_steps`: the longest interval K the job streamed at past the warm-up (the ranks' stats
  files say from which step each K held: `snapshot_intervals`), and `snapshot_every_final`;
- `snapshots_skipped`, `snapshot_waits`, `stream_skips`: captures dropped, captures that found the stream
  busy, and due streams skipped because it still was after the budget's wait (not streamed; K follows
  what the streamed ones take);
- `commit_lag_s` (p50, max): from the end of the step a snapshot holds to its commit notice;
- `lost_steps_bound_host`: the most completed steps a lost host at the worst moment of round 2 would
  have cost (newest completed step minus newest committed one, the swapper's `lost_steps`);
  `lost_steps_bound_crash`: for a process crash, whose host keeps its crash copy: 1 (the step it was in)
  while every completed step's capture finished before the next optimizer step, as the fence makes it,
  and none was skipped; else the host's bound;
- `cpu_ms_per_mb` against a plain memcpy's in the same run: the copy's CPU (into the crash copy, with
  its checksums) per MB captured, plus the stream's and the store's ingest per MB streamed (every step
  is captured, every K-th streamed); `cpu_ms_per_snapshot` splits it: copy per capture, stream and
  ingest per streamed snapshot;
- `sender_bytes_per_snapshot_byte`: bytes the members sent to stores (their stats files'
  `snapshot_sent_bytes`) per byte snapshotted: 1 where each snapshot leaves its member once (a chain:
  the first store passes it on to the others), R where the member uploads every copy itself
  (`DEADPOOL_SNAPSHOT_CHAIN=0`); `wire_bytes_per_snapshot_byte`: every byte over the loopback (every
  part runs on this host: the members' uploads, the stores' copies down a chain, the bus's few KB a
  step) per byte snapshotted, R either way;
- `store_ingest_gb_per_cpu_s`: those bytes per second of the stores' CPU (their capacity), and
  `store_ingest_gb_per_s`: per second of the round (what the job asked of them);
- `restore_s_local`: round 3's restore phase, the spare taking the crash copy (moving its files, checking
  its checksums; the load into the model follows in `apply`); `restore_s_remote` (and GB/s): round 4's,
  the spare fetching the rank's snapshot from the stores; and each round's downtime (the kill to every
  rank's first step after it), lost steps and phases;
- `store_ram_gb_per_rank`: the stores' peak resident memory in round 2, above their start, per rank.

Goals (issue 23): step_time_ratio <= 1.02 in each scenario (1.01 on a GPU), a process crash loses at most
1 step (both the bound of round 2 and round 3's kill), and with 5 s steps K = 1 (a snapshot streamed
every step) once settled: `snapshot_every_final`, the interval at the round's end (the first snapshots
of a round pay for the first touch of the stores' memory, 10 s and more at 1 GiB, and K rises for them;
`--steps` long enough lets it come down).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from bisect import bisect_right
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from measures import cpu_seconds, memcpy_ms_per_mb, percentile

from deadpool_cli.demo import incident_report, inject_fault_mid_step
from deadpool_cli.job_watch import JobWatch
from deadpool_cli.stack import Stack, StackConfig
from deadpool_protocol import Commit, decode
from deadpool_protocol.subjects import Subjects
from deadpool_runtime.logs import get_logger
from deadpool_store import host_memory
from deadpool_store.service import INGEST_LIMIT_ENV

SCRIPT = Path(__file__).resolve().with_name("scale_train.py")
GOALS = {"step_time_ratio_max": 1.02, "step_time_ratio_max_gpu": 1.01, "lost_steps_crash_max": 1}
SLOW_STEP_S = 5.0
"""Scenarios with steps at least this long must snapshot every step (the issue's 70B job)."""
COMMIT_GRACE_S = 10.0
"""How long after the launcher exits the last commit notice may still come (a GB stream's tail)."""
ROUND_TIMEOUT_S_PER_STEP = 20.0
"""A round is given up after this many seconds per step (plus its start): a wedged job ends the run."""
SAMPLE_PERIOD_S = 0.2


@dataclass(frozen=True)
class Scenario:
    state_gb: float
    step_s: float


def loopback_bytes() -> int:
    """Bytes sent over this host's loopback so far (/proc/net/dev): every part of the run is on it, so
    each byte a member sends to a store crosses it once (the bus's messages too, a few KB a step)."""
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, counters = line.partition(":")
        if name.strip() == "lo":
            return int(counters.split()[8])  # transmit bytes
    raise RuntimeError("no loopback interface in /proc/net/dev")


def resident_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


async def sample_peak_rss(pids: list[int], peak: dict[int, int], stop: asyncio.Event) -> None:
    while not stop.is_set():
        for pid in pids:
            peak[pid] = max(peak.get(pid, 0), resident_bytes(pid))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), SAMPLE_PERIOD_S)


async def run_round(
    stack: Stack, args: argparse.Namespace, workdir: Path, scenario: Scenario, kind: str
) -> dict[str, Any]:
    """One job: `kind` is off (no snapshots), on (a snapshot every step) or swap (on, plus a kill)."""
    job = f"scale-{scenario.step_s * 1000:.0f}ms-{kind}-{secrets.token_hex(2)}"
    stats_dir = workdir / job
    nc = await stack.connect()
    commit_t: dict[int, float] = {}
    last_committed = asyncio.Event()

    async def on_commit(msg: Any) -> None:
        step = decode(msg.data, Commit).step
        commit_t.setdefault(step, time.time())
        if step >= args.steps:
            last_committed.set()

    await nc.subscribe(Subjects.for_job(job).commit, cb=on_commit)
    watch = JobWatch(nc, job, get_logger(job=job))
    await watch.start()
    env = {
        **os.environ,
        "DEADPOOL_SNAPSHOT_EVERY": "0" if kind == "off" else args.snapshot_every,
        "DEADPOOL_SNAPSHOT_BUDGET": str(args.snapshot_budget),
        "DEADPOOL_STATS_DIR": str(stats_dir),
        "OMP_NUM_THREADS": "1",
    }
    swap = kind.startswith("swap")
    command = [sys.executable, "-m", "deadpool_cli", "launch", *stack.nats_args, "--job", job]
    command += ["--nproc", str(args.ranks), "--spares", "1" if swap else "0"]
    command += ["--no-host-copy"] if kind == "swap-remote" else []
    command += ["--gpus", args.gpus if args.device == "cuda" else "none"]
    command += [str(SCRIPT), "--steps", str(args.steps), "--state-gb", str(scenario.state_gb)]
    command += ["--step-s", str(scenario.step_s), "--device", args.device]
    stores = [stack.processes[name].pid for name in stack.names("store")]
    sent_before = loopback_bytes()
    store_cpu_before = sum(cpu_seconds(pid) for pid in stores)
    rss_before = {pid: resident_bytes(pid) for pid in stores}
    peak: dict[int, int] = {}
    stop_sampling = asyncio.Event()
    sampler = asyncio.create_task(sample_peak_rss(stores, peak, stop_sampling))
    timeout_s = ROUND_TIMEOUT_S_PER_STEP * args.steps + 120.0
    started = time.monotonic()
    with open(workdir / f"{job}.log", "wb") as log:
        launcher = await asyncio.create_subprocess_exec(*command, stdout=log, stderr=subprocess.STDOUT, env=env)
    killer = None
    if swap:
        killer = asyncio.create_task(inject_fault_mid_step(watch, 1, args.steps - 3, args.steps, "kill"))
    try:
        returncode = await asyncio.wait_for(launcher.wait(), timeout_s)
    except TimeoutError:
        launcher.send_signal(signal.SIGTERM)
        await launcher.wait()
        raise RuntimeError(f"round {job} did not end within {timeout_s:.0f} s; see {workdir / f'{job}.log'}") from None
    wall_s = time.monotonic() - started
    if kind != "off":
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(last_committed.wait(), COMMIT_GRACE_S)
    stop_sampling.set()
    await sampler
    sent = loopback_bytes() - sent_before
    store_cpu_s = sum(cpu_seconds(pid) for pid in stores) - store_cpu_before
    incidents = list(watch.incidents)
    await nc.close()
    if returncode != 0:
        raise RuntimeError(f"round {job} failed (exit {returncode}); see {workdir / f'{job}.log'}")
    members = [json.loads(path.read_text()) for path in sorted(stats_dir.glob("*.json"))]
    incident = None
    if killer is not None:
        kill = killer.result() if killer.done() and killer.exception() is None else None
        if kill is None or not incidents:
            raise RuntimeError(f"round {job}: the kill or its incident is missing; see {workdir / f'{job}.log'}")
        incident = incident_report(incidents[0], kill)
    return {
        "job": job,
        "kind": kind,
        "wall_s": wall_s,
        "members": [m for m in members if m.get("rank") is not None and m["steps"]],
        "commit_t": commit_t,
        "store_cpu_s": store_cpu_s,
        "sent_bytes": sent,
        "store_ram_growth_bytes": sum(peak.get(pid, 0) - rss_before[pid] for pid in stores),
        "incident": incident,
    }


def steps_past_warm_up(round_: dict[str, Any], warm_up: int) -> list[dict[str, Any]]:
    return [s for m in round_["members"] for s in m["steps"] if s["step"] >= warm_up]


def lost_steps_bound(on: dict[str, Any], warm_up: int) -> int:
    """The swapper's `lost_steps` (newest completed step minus newest committed) at the worst moment of the
    round: just before each step's completion is followed by its commit, i.e. at each completion."""
    commits = sorted((t, step) for step, t in on["commit_t"].items())
    times = [t for t, _ in commits]
    newest: list[int] = []
    for _, step in commits:
        newest.append(max(step, newest[-1]) if newest else step)
    worst = 0
    for member in on["members"]:
        for s in member["steps"]:
            if s["step"] < warm_up:
                continue
            i = bisect_right(times, s["t_completed"])
            committed = newest[i - 1] if i else -1
            worst = max(worst, s["step"] - committed)
    return worst


def interval_spans(member: dict[str, Any], warm_up: int) -> list[tuple[int, int]]:
    """(step, K) for each interval the member streamed at past the warm-up: the one it had entered the
    warm-up's end with, and each one after."""
    changes = [tuple(c) for c in member.get("snapshot_intervals", [])]
    before = [c for c in changes if c[0] <= warm_up][-1:]
    return [(int(s), int(k)) for s, k in before + [c for c in changes if c[0] > warm_up]]


def summarise(
    scenario: Scenario,
    rounds: dict[str, dict[str, Any]],
    args: argparse.Namespace,
    memcpy: float,
) -> dict[str, Any]:
    off, on = rounds["off"], rounds["on"]
    warm_up = args.warm_up_steps
    step_off = statistics.median(s["step_s"] for s in steps_past_warm_up(off, warm_up))
    step_on = statistics.median(s["step_s"] for s in steps_past_warm_up(on, warm_up))
    settled = args.steps // 2  # the round's second half: the first touches of GBs are over, K has settled
    settled_off = statistics.median(s["step_s"] for s in steps_past_warm_up(off, settled))
    settled_on = statistics.median(s["step_s"] for s in steps_past_warm_up(on, settled))
    measured_on = steps_past_warm_up(on, warm_up)
    hook_share = sum(s.get("stall_s", 0.0) for s in measured_on) / sum(s["step_s"] for s in measured_on)
    snapshot_bytes = on["members"][0]["snapshot_bytes"]  # the full state's (the first holds no moments yet)
    streamed = sum(m.get("snapshots_streamed", 0) for m in on["members"]) or 1
    streamed_bytes = sum(m["snapshot_streamed_bytes"] for m in on["members"]) or 1
    captures = sum(s["captured"] for m in on["members"] for s in m["steps"]) or 1
    done: dict[int, float] = {}  # each step's completion by its last rank
    for member in on["members"]:
        for step in member["steps"]:
            done[step["step"]] = max(done.get(step["step"], 0.0), step["t_completed"])
    lags = [t - done[step - 1] for step, t in on["commit_t"].items() if step - 1 in done]  # snapshot s follows step s-1
    copy_s = sum(m.get("snapshot_copy_cpu_s", 0.0) for m in on["members"])
    stream_s = sum(m.get("snapshot_stream_cpu_s", 0.0) for m in on["members"])
    copy_ms_per_mb = 1000 * copy_s / (captures * snapshot_bytes / 1e6)
    cpu_ms_per_mb = copy_ms_per_mb + 1000 * (stream_s + on["store_cpu_s"]) / (streamed_bytes / 1e6)
    lost = lost_steps_bound(on, warm_up)
    skipped = sum(m.get("snapshots_skipped", 0) for m in on["members"])
    intervals = [every for m in on["members"] for _, every in interval_spans(m, warm_up)]
    local, remote = rounds["swap"]["incident"], rounds["swap-remote"]["incident"]
    restore_s = remote["phases"].get("restore")
    result = {
        "state_gb_per_rank": scenario.state_gb,
        "step_s": scenario.step_s,
        "snapshot_bytes_per_rank": snapshot_bytes,
        "step_s_off_median": round(step_off, 4),
        "step_s_on_median": round(step_on, 4),
        "step_time_ratio": round(step_on / step_off, 4),
        "step_time_ratio_settled": round(settled_on / settled_off, 4),
        "hook_time_share": round(hook_share, 4),
        "snapshot_every_steps": max(intervals, default=0),
        "snapshot_every_final": max((m.get("snapshot_every", 0) for m in on["members"]), default=0),
        "snapshot_intervals_rank0": on["members"][0].get("snapshot_intervals", []),
        "stream_skips": sum(m.get("snapshot_stream_skips", 0) for m in on["members"]),
        "snapshots_captured": captures,
        "snapshots_streamed": streamed,
        "snapshots_skipped": skipped,
        "snapshot_waits": sum(m.get("snapshot_waits", 0) for m in on["members"]),
        "committed": len(on["commit_t"]),
        "commit_lag_s_p50": round(percentile(lags, 50), 3) if lags else None,
        "commit_lag_s_max": round(max(lags), 3) if lags else None,
        "lost_steps_bound_crash": 1 if skipped == 0 else lost,
        "lost_steps_bound_host": lost,
        "cpu_ms_per_mb": round(cpu_ms_per_mb, 3),
        "memcpy_ms_per_mb": round(memcpy, 3),
        "cpu_over_memcpy": round(cpu_ms_per_mb / memcpy, 2),
        "cpu_ms_per_snapshot": {
            "copy": round(1000 * copy_s / captures, 1),
            "stream": round(1000 * stream_s / streamed, 1),
            "store_ingest": round(1000 * on["store_cpu_s"] / streamed, 1),
        },
        "sender_bytes_per_snapshot_byte": round(
            sum(m.get("snapshot_sent_bytes", 0) for m in on["members"]) / streamed_bytes, 3
        ),
        "wire_bytes_per_snapshot_byte": round(on["sent_bytes"] / streamed_bytes, 3),
        "store_ingest_gb_per_cpu_s": round(on["sent_bytes"] / 1e9 / on["store_cpu_s"], 2)
        if on["store_cpu_s"]
        else None,
        "store_ingest_gb_per_s": round(on["sent_bytes"] / 1e9 / on["wall_s"], 3),
        "store_ram_gb_per_rank": round(on["store_ram_growth_bytes"] / 2**30 / args.ranks, 2),
        "restore_s_remote": restore_s,
        "restore_gb_per_s_remote": round(snapshot_bytes / 1e9 / restore_s, 2) if restore_s else None,
        "restore_s_local": local["phases"].get("restore"),
        "swap_downtime_s": local["downtime_s"],
        "swap_lost_steps": local["lost_steps"],
        "swap_restore_link": local["evidence"].get("restore_link"),
        "swap_phases_s": local["phases"],
        "swap_remote_downtime_s": remote["downtime_s"],
        "swap_remote_lost_steps": remote["lost_steps"],
        "swap_remote_restore_link": remote["evidence"].get("restore_link"),
        "swap_remote_phases_s": remote["phases"],
    }
    return result


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="deadpool-scale-"))
    print(f"work dir {workdir}", flush=True)
    memcpy = memcpy_ms_per_mb()
    scenarios = [Scenario(args.state_gb, step_s) for step_s in args.step_s]
    results = []
    for scenario in scenarios:
        rounds = {}
        for kind in ("off", "on", "swap", "swap-remote"):
            # A fresh control plane per round, so no round inherits another's: a store's pooled buffers
            # would spare the next round the first touch of its memory that a new job pays.
            config = StackConfig(
                workdir=workdir / f"stack-{scenario.step_s * 1000:.0f}ms-{kind}",
                stores=args.stores,
                replication=args.replication,
                store_capacity_bytes=int(args.store_gb * 2**30),
            )
            async with Stack(config) as stack:
                r = await run_round(stack, args, workdir, scenario, kind)
            steps = [s["step_s"] for s in steps_past_warm_up(r, args.warm_up_steps)]
            print(
                f"{scenario.state_gb:g} GiB/rank, {scenario.step_s:g} s steps, {kind:>11}: "
                f"median step {statistics.median(steps):.3f} s, committed {len(r['commit_t'])}, "
                f"wall {r['wall_s']:.1f} s",
                flush=True,
            )
            rounds[kind] = r
        results.append(summarise(scenario, rounds, args, memcpy))
        print(f"scenario: {json.dumps(results[-1])}", flush=True)  # kept if a later scenario fails
    ratio_max = GOALS["step_time_ratio_max_gpu" if args.device == "cuda" else "step_time_ratio_max"]
    goals_met = all(
        r["step_time_ratio"] <= ratio_max
        and max(r["lost_steps_bound_crash"], r["swap_lost_steps"]) <= GOALS["lost_steps_crash_max"]
        and (r["step_s"] < SLOW_STEP_S or r["snapshot_every_final"] == 1)
        for r in results
    )
    return {
        "device": args.device,
        "store_ingest_mb_s": args.store_ingest_mb_s or None,
        "snapshot_budget": args.snapshot_budget,
        "ranks": args.ranks,
        "stores": args.stores,
        "store_gb": args.store_gb,
        "replication": args.replication,
        "steps_per_round": args.steps,
        "scenarios": results,
        "goals": {"step_time_ratio_max": ratio_max, "lost_steps_crash_max": GOALS["lost_steps_crash_max"]},
        "goals_met": goals_met,
    }


def print_table(result: dict[str, Any]) -> None:
    print("")
    print(
        f"{result['ranks']} ranks on {result['device']}, {result['stores']} store(s) at replication "
        f"{result['replication']}, {result['steps_per_round']} steps per round, snapshot budget "
        f"{result['snapshot_budget']:g}"
        + (f", stores limited to {result['store_ingest_mb_s']:g} MB/s" if result["store_ingest_mb_s"] else "")
    )
    for r in result["scenarios"]:
        cpu = r["cpu_ms_per_snapshot"]
        print(f"  {r['state_gb_per_rank']:g} GiB per rank, {r['step_s']:g} s steps:")
        print(
            f"    step {r['step_s_off_median']:.3f} s off, {r['step_s_on_median']:.3f} s on: ratio "
            f"{r['step_time_ratio']:.4f} (goal <= {result['goals']['step_time_ratio_max']}), over the second half "
            f"{r['step_time_ratio_settled']:.4f}; the training thread in DeadPool's hooks "
            f"{100 * r['hook_time_share']:.2f} % of the step time; "
            f"streamed every {r['snapshot_every_steps']} step(s) at most (at the end: {r['snapshot_every_final']}; "
            f"rank 0's [step, K]: {r['snapshot_intervals_rank0']})"
        )
        print(
            f"    captured {r['snapshots_captured']}, streamed {r['snapshots_streamed']}, skipped "
            f"{r['snapshots_skipped']}, found the stream busy "
            f"{r['snapshot_waits']}, streams skipped {r['stream_skips']}; committed {r['committed']}; "
            f"commit lag p50 {r['commit_lag_s_p50']} s, max {r['commit_lag_s_max']} s"
        )
        print(
            f"    lost-work bound: {r['lost_steps_bound_crash']} step(s) on a process crash, "
            f"{r['lost_steps_bound_host']} on a lost host"
        )
        print(
            f"    CPU per MB {r['cpu_ms_per_mb']:.3f} ms against a memcpy's {r['memcpy_ms_per_mb']:.3f} "
            f"({r['cpu_over_memcpy']:.1f}x); per snapshot: copy {cpu['copy']} ms, stream {cpu['stream']} ms, "
            f"store ingest {cpu['store_ingest']} ms"
        )
        print(
            f"    sent {r['sender_bytes_per_snapshot_byte']} bytes per snapshot byte; store ingest "
            f"{r['store_ingest_gb_per_cpu_s']} GB per CPU-second, {r['store_ingest_gb_per_s']} GB/s asked; "
            f"store RAM {r['store_ram_gb_per_rank']} GiB per rank"
        )
        print(
            f"    a SIGKILL, the spare on its host: restore {r['restore_s_local']} s from the crash copy, downtime "
            f"{r['swap_downtime_s']} s, lost {r['swap_lost_steps']} step(s), link {r['swap_restore_link']}"
        )
        print("      phases (s): " + "  ".join(f"{k} {v:.3f}" for k, v in r["swap_phases_s"].items()))
        print(
            f"    the same with --no-host-copy: restore {r['restore_s_remote']} s from the stores "
            f"({r['restore_gb_per_s_remote']} GB/s), downtime {r['swap_remote_downtime_s']} s, lost "
            f"{r['swap_remote_lost_steps']} step(s), link {r['swap_remote_restore_link']}"
        )
        print("      phases (s): " + "  ".join(f"{k} {v:.3f}" for k, v in r["swap_remote_phases_s"].items()))


STORE_SNAPSHOTS_PER_RANK = 4
"""Snapshots of one rank a store holds at most in steady state: two committed, one being received, one
pooled for the next."""
MEMBER_STATES_PER_RANK = 4
"""A member's memory, in its state's size: the state itself and its three crash-copy slots in /dev/shm."""
SPARE_STATES = 2
"""A warm spare's: its model and optimizer, and its landing."""


def store_gb(args: argparse.Namespace) -> float:
    """Each store's capacity: what the job's snapshots need on it (`STORE_SNAPSHOTS_PER_RANK` per rank it
    holds a copy of), within the memory this machine has left once the members (and a spare) have
    theirs. Two 8 GiB stores on a 23 GB machine once met the OOM killer: a store that asks the host
    before it takes memory cannot stop the members' own growth after it."""
    per_store_ranks = args.ranks * args.replication / args.stores
    need = per_store_ranks * args.state_gb * 1.1 * STORE_SNAPSHOTS_PER_RANK
    available_bytes = host_memory.available_bytes()
    if available_bytes is None:
        raise RuntimeError("this machine's available memory is unknown (/proc/meminfo): give --store-gb")
    available = available_bytes / 2**30
    members = (args.ranks * MEMBER_STATES_PER_RANK + SPARE_STATES) * args.state_gb
    share = max(0.5, (available - members) * 0.9 / args.stores)
    chosen = float(round(min(need, share), 2))
    print(
        f"stores: {chosen} GiB each ({need:.2f} GiB needed per store, {share:.2f} GiB left per store of the "
        f"{available:.1f} GiB available once the members have {members:.1f})",
        flush=True,
    )
    return chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--state-gb", type=float, default=1.0, help="GiB of state per rank")
    parser.add_argument("--step-s", type=float, nargs="+", default=[1.0, 5.0], help="one scenario per step time")
    parser.add_argument("--steps", type=int, default=12, help="training steps per round")
    parser.add_argument("--warm-up-steps", type=int, default=3, help="steps of each round not measured")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--stores", type=int, default=1)
    parser.add_argument("--replication", type=int, default=1)
    parser.add_argument(
        "--store-gb",
        type=float,
        default=None,
        help="each store's capacity, GiB (default: what the job needs, within what this machine has: store_gb)",
    )
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--snapshot-every", default="auto", help="as deadpool launch (auto: the job's K)")
    parser.add_argument(
        "--store-ingest-mb-s",
        type=float,
        default=0.0,
        help="stores that ingest no faster than this (MB/s, 0: as fast as they can): a data plane slower "
        "than the steps, to see the job's K rise and its step time stay",
    )
    parser.add_argument("--snapshot-budget", type=float, default=0.01, help="as deadpool launch")
    parser.add_argument(
        "--gpus", default="auto", help="with --device cuda: as deadpool launch --gpus (0,0,0 shares one)"
    )
    args = parser.parse_args()
    if args.steps < args.warm_up_steps + 4:
        parser.error("--steps must leave at least 4 measured steps, the kill's among them")
    if args.store_gb is None:
        args.store_gb = store_gb(args)
    if args.store_ingest_mb_s > 0:  # the stores of every round's stack inherit it
        os.environ[INGEST_LIMIT_ENV] = str(int(args.store_ingest_mb_s * 1e6))
    result = asyncio.run(main_async(args))
    print_table(result)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
