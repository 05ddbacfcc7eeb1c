"""Swapper failover: how long until a standby leads after the leader's SIGKILL, mid-rebuild included.

    .venv/bin/python bench/failover.py --trials 10

Two swappers (one leads), one detector, two stores, the example job ('tiny', 4 ranks, 2 warm spares,
respawns); each killed swapper comes back 1 s later, as a standby. Each trial alternates:

- idle: the leader SIGKILLed while the job trains;
- mid-rebuild: a rank SIGKILLed, and the leader SIGKILLed the moment the rebuild that replaces it is
  on the bus (its acks not all in yet).

takeover_s: from the leader's SIGKILL to the first answer of the other instance as leader (the status
endpoint polled every 20 ms, each request bounded to 0.1 s). For mid-rebuild trials also downtime_s:
from the rank's kill to the first step completed by every rank of the new generation. The goal
(issue 8): takeover within 2 s. The last line is one JSON object.
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

from deadpool_cli.demo import default_script
from deadpool_cli.job_watch import JobWatch
from deadpool_cli.stack import Stack, StackConfig
from deadpool_protocol import SWAPPER_STATUS
from deadpool_runtime.logs import get_logger

POLL_S = 0.02
REQUEST_S = 0.1
TRIAL_TIMEOUT_S = 60.0
GOAL_TAKEOVER_S = 2.0


async def leader(nc: Any, job: str) -> str:
    try:
        reply = await nc.request(SWAPPER_STATUS, job.encode(), timeout=REQUEST_S)
    except Exception:
        return ""
    name: str = json.loads(reply.data).get("leader", "")
    return name


def process_of(stack: Stack, instance: str) -> str:
    pid = instance.split("-")[-2] if instance.count("-") >= 2 else ""
    return next(n for n in stack.names("swapper") if str(stack.processes[n].pid) == pid)


async def wait(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        await asyncio.sleep(POLL_S)


async def trial(stack: Stack, nc: Any, watch: JobWatch, job: str, mid_rebuild: bool) -> dict[str, Any]:
    async def both_up() -> bool:
        return all(stack.processes[n].poll() is None for n in stack.names("swapper")) and bool(await leader(nc, job))

    async def spares() -> bool:
        return len(watch.ready_spares(time.time())) >= 1

    await wait(both_up, TRIAL_TIMEOUT_S, "both swappers up and one leading")
    await wait(spares, TRIAL_TIMEOUT_S, "a warm spare")
    await asyncio.sleep(2.0)  # the restarted instance has settled as a standby
    old = await leader(nc, job)
    result: dict[str, Any] = {"kind": "mid-rebuild" if mid_rebuild else "idle"}
    t_fault = time.time()
    since = len(watch.steps_done)
    generation = watch.rebuild.generation if watch.rebuild else 0
    if mid_rebuild:
        assert watch.rebuild is not None
        os.kill(watch.members[watch.rebuild.ranks[2]].pid, signal.SIGKILL)

        async def rebuilt() -> bool:
            return watch.rebuild is not None and watch.rebuild.generation > generation

        await wait(rebuilt, TRIAL_TIMEOUT_S, "the rebuild")
    killed = time.monotonic()
    stack.kill(process_of(stack, old))

    async def new_leader() -> bool:
        now = await leader(nc, job)
        return bool(now) and now != old

    await wait(new_leader, TRIAL_TIMEOUT_S, "a new leader")
    result["takeover_s"] = round(time.monotonic() - killed, 4)
    if mid_rebuild:

        async def resumed() -> bool:
            return watch.resumed_at(t_fault, generation + 1, since) is not None

        await wait(resumed, TRIAL_TIMEOUT_S, "training in the new generation")
        result["downtime_s"] = round((watch.resumed_at(t_fault, generation + 1, since) or 0.0) - t_fault, 4)
    return result


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="deadpool-failover-"))
    print(f"work dir {workdir}", flush=True)
    config = StackConfig(
        workdir=workdir, stores=2, swappers=2, heartbeat_timeout_s=2.0, hang_floor_s=3.0, restart_after_s=1.0
    )
    job = f"failover-{secrets.token_hex(2)}"
    results = []
    async with Stack(config) as stack:
        nc = await stack.connect()
        watch = JobWatch(nc, job, get_logger(job=job))
        await watch.start()
        command = [sys.executable, "-m", "deadpool_cli", "launch", *stack.nats_args, "--job", job, "--nproc", "4"]
        command += ["--spares", "2", "--respawns", str(2 * args.trials), "--collective-timeout-s", "20"]
        command += [str(default_script()), "--steps", "1000000", "--model-size", "tiny"]
        with open(workdir / "logs" / "launch.log", "wb") as log:
            launcher = await asyncio.create_subprocess_exec(*command, stdout=log, stderr=subprocess.STDOUT)
        try:

            async def formed() -> bool:
                return watch.resumed_at(0.0) is not None

            await wait(formed, 180.0, "the job to form")
            for index in range(args.trials):
                row = await trial(stack, nc, watch, job, mid_rebuild=index % 2 == 1)
                results.append(row)
                print(
                    f"trial {index:2d} {row['kind']:>11}: takeover {row['takeover_s']:.3f} s"
                    + (f", downtime {row['downtime_s']:.3f} s" if "downtime_s" in row else ""),
                    flush=True,
                )
        finally:
            launcher.kill()
            await launcher.wait()
            await nc.close()
    takeovers = [r["takeover_s"] for r in results]
    mid = [r for r in results if r["kind"] == "mid-rebuild"]
    summary = {
        "trials": len(results),
        "takeover_s_p50": round(statistics.median(takeovers), 4),
        "takeover_s_max": round(max(takeovers), 4),
        "takeover_s_p99": round(percentile(takeovers, 99), 4),
        "mid_rebuild_takeover_s_max": round(max((r["takeover_s"] for r in mid), default=0.0), 4),
        "mid_rebuild_downtime_s_p50": round(statistics.median(r["downtime_s"] for r in mid), 4) if mid else None,
        "mid_rebuild_downtime_s_max": round(max((r["downtime_s"] for r in mid), default=0.0), 4),
        "goal_takeover_s_max": GOAL_TAKEOVER_S,
    }
    summary["goal_met"] = summary["takeover_s_max"] <= GOAL_TAKEOVER_S
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=10)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(main_async(args))))


if __name__ == "__main__":
    main()
