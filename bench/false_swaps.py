"""False swaps: a failure-free job with realistic noise must see none.

    .venv/bin/python bench/false_swaps.py --minutes 10

Runs `bench/noisy_train.py` (the example GPT with a slow first step, a periodic evaluation declared with
`job.section`, GC pauses that stall every thread of the process, and occasional slow steps) under
`deadpool launch` (4 ranks, 1 spare) against the same thresholds as bench/recovery.py: heartbeat
timeout 2 s, hang floor 3 s, hang factor 10. The number of steps is sized from a short calibration run
so that training lasts about `--minutes`. Every `failure` on the bus is a false swap; `straggler`
events are counted too (they swap nothing). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from deadpool_cli.job_watch import JobWatch
from deadpool_cli.stack import Stack, StackConfig
from deadpool_protocol import Straggler, Subjects, decode
from deadpool_runtime.logs import get_logger

SCRIPT = Path(__file__).resolve().parent / "noisy_train.py"
HEARTBEAT_TIMEOUT_S = 2.0
HANG_FLOOR_S = 3.0
HANG_FACTOR = 10.0
NOISE_S_PER_STEP = 0.5 / 10 + 1.5 / 37 + 6.0 / 50
"""Average noise per step at the default settings (GC pause, slow step, evaluation)."""


async def run_job(stack: Stack, job: str, steps: int, noise: list[str], workdir: Path) -> dict[str, Any]:
    nc = await stack.connect()
    watch = JobWatch(nc, job, get_logger(job=job))
    await watch.start()
    stragglers: list[Straggler] = []

    async def on_straggler(msg: Any) -> None:
        stragglers.append(decode(msg.data, Straggler))

    await nc.subscribe(Subjects.for_job(job).straggler, cb=on_straggler)
    command = [sys.executable, "-m", "deadpool_cli", "launch", *stack.nats_args, "--job", job, "--nproc", "4"]
    command += ["--spares", "1", "--collective-timeout-s", "20", str(SCRIPT), "--steps", str(steps), *noise]
    started = time.monotonic()
    with open(workdir / f"{job}.log", "wb") as log:
        launcher = await asyncio.create_subprocess_exec(*command, stdout=log, stderr=subprocess.STDOUT, env=os.environ)
        returncode = await launcher.wait()
    wall_s = time.monotonic() - started
    await nc.flush()
    step_times = [t for view in watch.members.values() for t in view.step_times]
    await nc.close()
    return {
        "returncode": returncode,
        "wall_s": wall_s,
        "failures": [
            {"member": f.member, "rank": f.rank, "reason": f.reason, "evidence": f.evidence} for f in watch.failures
        ],
        "stragglers": [{"member": s.member, "rank": s.rank, "evidence": s.evidence} for s in stragglers],
        "median_step_s": statistics.median(step_times) if step_times else 0.0,
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="deadpool-false-swaps-"))
    print(f"work dir {workdir}", flush=True)
    config = StackConfig(
        workdir=workdir,
        stores=2,
        heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
        hang_floor_s=HANG_FLOOR_S,
        hang_factor=HANG_FACTOR,
    )
    async with Stack(config) as stack:
        quiet = ["--first-step-s", "0", "--eval-every", "0", "--gc-every", "0", "--slow-every", "0"]
        calibration = await run_job(stack, "calibration", 40, quiet, workdir)
        base_s = calibration["median_step_s"]
        steps = max(60, int((args.minutes * 60 - 8.0) / (base_s + NOISE_S_PER_STEP)))
        print(f"calibration: median step {base_s:.3f} s -> {steps} steps for ~{args.minutes} min", flush=True)
        run = await run_job(stack, "noisy", steps, [], workdir)
    result = {
        "minutes": round(run["wall_s"] / 60, 2),
        "steps": steps,
        "false_swaps": len(run["failures"]) + len(calibration["failures"]),
        "failures": run["failures"][:10],
        "straggler_events": len(run["stragglers"]),
        "stragglers": run["stragglers"][:5],
        "job_finished_cleanly": run["returncode"] == 0,
        "noise": {
            "first_step_s": 8.0,
            "evaluations": steps // 50,
            "evaluation_s": 6.0,
            "gc_pauses": steps // 10,
            "slow_steps": steps // 37,
            "slow_step_s": 1.5,
        },
        "thresholds": {
            "heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S,
            "hang_floor_s": HANG_FLOOR_S,
            "hang_factor": HANG_FACTOR,
        },
        "median_step_s": round(run["median_step_s"], 4),
        "goals": {"false_swaps_max": 0},
    }
    result["goals_met"] = result["false_swaps"] == 0 and result["job_finished_cleanly"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0)
    args = parser.parse_args()
    result = asyncio.run(main_async(args))
    print(
        f"{result['minutes']} min, {result['steps']} steps: false swaps {result['false_swaps']}, straggler events "
        f"{result['straggler_events']}, finished cleanly {result['job_finished_cleanly']}"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
