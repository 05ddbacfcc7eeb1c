"""Recovery per failure class, phase by phase: crash, hang, lost host and broken group, N faults each.

    .venv/bin/python bench/recovery.py --trials 5

One control plane (embedded NATS, detector, swapper, two stores; heartbeat timeout 2 s, hang floor
3 s, hang factor 10, collective timeout 20 s) serves every trial. Each trial trains the example GPT
('tiny': 4 ranks, 2 warm spares) and injects one fault half-way through step `--fault-step`:

- crash: SIGKILL of rank 2 (seen by its launcher's waitpid);
- hang: rank 2's training thread stuck in Python (`DEADPOOL_FAULT_INJECTION`, SIGUSR1), heartbeats
  going on: found from step progress, fenced (SIGKILL by its launcher), then swapped;
- host: two launchers play two hosts (ranks 0-1 on one, ranks 2-3 and the spares on the other); the
  first launcher is SIGKILLed with its children: heartbeat silence only, both ranks swapped together;
- group: rank 2's process-group connections reset (SIGURG), every process alive: every rank leaves
  its step, and after the heartbeat timeout the same members regroup (no spare, no fence).

Per class: p50/p95 of detect_s (fault -> verdict), of each phase, and of downtime_s (fault -> every rank
training again), and the maximum of lost_steps. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from measures import percentile
from nats.aio.client import Client

from deadpool_cli.demo import Kill, default_script, incident_report, inject_fault_mid_step
from deadpool_cli.job_watch import JobWatch
from deadpool_cli.stack import Stack, StackConfig
from deadpool_protocol.timeouts import HEARTBEAT_PERIOD_S_DEFAULT, TimeoutHierarchy
from deadpool_runtime.logs import get_logger

HEARTBEAT_TIMEOUT_S = 2.0
HANG_FLOOR_S = 3.0
HANG_FACTOR = 10.0
COLLECTIVE_TIMEOUT_S = 20.0
TRIAL_TIMEOUT_S = 180.0
CLASSES = ("crash", "hang", "host", "group")
INJECTED = {"crash": "kill", "hang": "hang", "group": "reset"}
"""The demo's fault for each class injected into one rank (a lost host is its launcher's SIGKILL)."""
PHASES = ("detect", "decide", "fence", "abort", "notify", "restore", "rendezvous", "apply")
GOALS = {"crash_downtime_s_p50_max": 1.0, "hang_downtime_over_threshold_s_p50_max": 1.0, "lost_steps_max": 1}


async def launch(
    nats_args: list[str],
    job: str,
    host: str,
    nproc: int,
    rank_offset: int,
    spares: int,
    args: argparse.Namespace,
    log: Path,
) -> asyncio.subprocess.Process:
    command = [sys.executable, "-m", "deadpool_cli", "launch", *nats_args, "--job", job]
    command += ["--nproc", str(nproc), "--world-size", "4", "--rank-offset", str(rank_offset), "--run-id", job]
    command += ["--spares", str(spares), "--collective-timeout-s", str(COLLECTIVE_TIMEOUT_S)]
    command += [str(default_script()), "--steps", str(args.steps), "--model-size", args.model_size]
    env = {**os.environ, "DEADPOOL_HOST": host, "DEADPOOL_FAULT_INJECTION": "1"}
    with open(log, "wb") as sink:
        return await asyncio.create_subprocess_exec(*command, stdout=sink, stderr=subprocess.STDOUT, env=env)


async def run_trial(
    nc: Client, nats_args: list[str], kind: str, index: int, args: argparse.Namespace, workdir: Path
) -> dict[str, Any]:
    job = f"recovery-{kind}-{index}-{secrets.token_hex(2)}"
    watch = JobWatch(nc, job, get_logger(job=job))
    await watch.start()
    if kind == "host":
        lost = await launch(nats_args, job, "hosta", 2, 0, 0, args, workdir / f"{job}-a.log")
        keeper = await launch(nats_args, job, "hostb", 2, 2, 2, args, workdir / f"{job}-b.log")
        launchers = [lost, keeper]
    else:
        keeper = await launch(nats_args, job, "hosta", 4, 0, 2, args, workdir / f"{job}.log")
        launchers = [keeper]
    try:
        if kind == "host":
            await asyncio.wait_for(watch.wait_for(lambda: _all_ranks_at(watch, args.fault_step)), TRIAL_TIMEOUT_S)
            lost.send_signal(signal.SIGKILL)
            kill = Kill(0, "hosta", lost.pid, args.fault_step, time.time(), "host")
            expected = 2
        else:
            fault = INJECTED[kind]
            injected = inject_fault_mid_step(watch, 2, args.fault_step, args.steps, fault)
            injected_kill = await asyncio.wait_for(injected, TRIAL_TIMEOUT_S)
            if injected_kill is None:
                raise RuntimeError(f"rank 2 was first seen past step {args.fault_step} in its last step: no fault")
            kill = injected_kill
            expected = 1
        await asyncio.wait_for(watch.wait_for(lambda: len(watch.incidents) >= expected), TRIAL_TIMEOUT_S)
        returncode = await asyncio.wait_for(keeper.wait(), TRIAL_TIMEOUT_S)
    finally:
        for process in launchers:
            if process.returncode is None:
                process.kill()
                await process.wait()
    reports = [incident_report(i, kill if kind != "host" else None) for i in watch.incidents]
    if kind == "host":  # the fault is the launcher's kill, for both ranks
        for report, incident in zip(reports, watch.incidents, strict=True):
            report["detect_s"] = round(incident.t_detected - kill.t, 4)
            report["downtime_s"] = round(incident.t_resumed - kill.t, 4)
    return {
        "kind": kind,
        "job": job,
        "returncode": returncode,
        "generations": sorted({r["generation"] for r in reports}),
        "detect_s": min(r["detect_s"] for r in reports),
        "downtime_s": max(r["downtime_s"] for r in reports),
        "lost_steps": max(r["lost_steps"] for r in reports),
        "phases": {p: max(r["phases"].get(p, 0.0) for r in reports) for p in PHASES},
        "reasons": sorted({r["reason"] for r in reports}),
        "hang_threshold_s": max((float(r["evidence"].get("hang_threshold_s", 0) or 0) for r in reports), default=0.0),
    }


def _all_ranks_at(watch: JobWatch, step: int) -> bool:
    if watch.rebuild is None:
        return False
    views = [watch.members.get(m) for m in watch.rebuild.ranks]
    return all(v is not None and v.step >= step for v in views)


def summarise(trials: list[dict[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for kind in CLASSES:
        rows = [t for t in trials if t["kind"] == kind]
        if not rows:
            continue
        summary: dict[str, Any] = {"trials": len(rows), "ok": sum(t["returncode"] == 0 for t in rows)}
        for key in ("detect_s", "downtime_s"):
            values = [t[key] for t in rows]
            summary[f"{key}_p50"] = round(statistics.median(values), 4)
            summary[f"{key}_p95"] = round(percentile(values, 95), 4)
        for phase in PHASES:  # "phase_detect" is the detector's own share: verdict - fault as it dates it
            values = [t["phases"][phase] for t in rows]
            summary[f"phase_{phase}_s_p50"] = round(statistics.median(values), 4)
            summary[f"phase_{phase}_s_p95"] = round(percentile(values, 95), 4)
        summary["lost_steps_max"] = max(t["lost_steps"] for t in rows)
        summary["generations_per_fault_max"] = max(len(t["generations"]) for t in rows)
        summary["reasons"] = sorted({r for t in rows for r in t["reasons"]})
        if kind == "hang":
            summary["hang_threshold_s"] = round(statistics.median(t["hang_threshold_s"] for t in rows), 3)
        result[kind] = summary
    crash, hang = result.get("crash", {}), result.get("hang", {})
    result["goals"] = GOALS
    result["goals_met"] = (
        crash.get("downtime_s_p50", 99) <= GOALS["crash_downtime_s_p50_max"]
        and hang.get("downtime_s_p50", 99)
        <= hang.get("hang_threshold_s", 0) + GOALS["hang_downtime_over_threshold_s_p50_max"]
        and all(result[k]["lost_steps_max"] <= GOALS["lost_steps_max"] for k in CLASSES if k in result)
    )
    return result


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    TimeoutHierarchy(HEARTBEAT_PERIOD_S_DEFAULT, HEARTBEAT_TIMEOUT_S, HANG_FLOOR_S, COLLECTIVE_TIMEOUT_S).check()
    workdir = Path(tempfile.mkdtemp(prefix="deadpool-recovery-"))
    print(f"work dir {workdir}", flush=True)
    config = StackConfig(
        workdir=workdir,
        stores=2,
        heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
        hang_floor_s=HANG_FLOOR_S,
        hang_factor=HANG_FACTOR,
    )
    trials = []
    async with Stack(config) as stack:
        nc = await stack.connect()
        try:
            for index in range(args.trials):
                for kind in args.classes:
                    trial = await run_trial(nc, stack.nats_args, kind, index, args, workdir)
                    trials.append(trial)
                    phases = " ".join(f"{p} {trial['phases'][p] * 1000:.0f}" for p in PHASES)
                    print(
                        f"{kind:>5} #{index}: detect {trial['detect_s']:.3f} s, downtime {trial['downtime_s']:.3f} s, "
                        f"lost {trial['lost_steps']}, generations {trial['generations']}, exit {trial['returncode']}"
                        f"  | {phases} (ms)",
                        flush=True,
                    )
        finally:
            await nc.close()
    return summarise(trials)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=5, help="faults per class")
    parser.add_argument("--classes", nargs="+", default=list(CLASSES), choices=CLASSES)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--fault-step", type=int, default=15)
    parser.add_argument("--model-size", default="tiny")
    args = parser.parse_args()
    result = asyncio.run(main_async(args))
    print("")
    print(f"{'class':>5} {'detect p50/p95 (s)':>19} {'downtime p50/p95 (s)':>21} {'lost max':>8}")
    for kind in CLASSES:
        r = result.get(kind)
        if r:
            print(
                f"{kind:>5} {r['detect_s_p50']:>9.3f}/{r['detect_s_p95']:<9.3f} {r['downtime_s_p50']:>10.3f}/"
                f"{r['downtime_s_p95']:<10.3f} {r['lost_steps_max']:>8}"
            )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
