"""A job name is reusable, and one run holds it at a time, through `deadpool launch` and a real stack.

Seen: job records were never deleted, so relaunching a finished job's name made its members exit 0
without a step and `launch` exit 1 with no message; and whoever registered a name first fixed its
world size. Now a second launch of a name that runs is refused with the reason (exit 2), and a launch
of a finished name starts a new run that trains, is watched by the detector (a rank frozen in it is
declared by heartbeat silence, fenced and replaced) and finishes. And the store frees an ended run's
snapshots (it kept them until it restarted, which at GBs per rank left the next job no room).
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
from pathlib import Path

from nats.aio.client import Client

from deadpool_cli.stack import Stack, StackConfig

from .jobs import SCRIPT, every_rank_at, finish, kill, launch, run_to_end, stop_all, tail, until, watcher

JOB = "reused"
FREED_WITHIN_S = 10.0


async def store_emptied(nc: Client, within_s: float) -> bool:
    """Whether the stack's one store holds no snapshot, asked until `within_s` has passed (its notice
    of the job's end comes on the swapper's connection, not in order with these requests)."""
    deadline = time.monotonic() + within_s
    while True:
        reply = await nc.request("deadpool.store.store-0.status", b"", timeout=5.0)
        if json.loads(reply.data)["snapshots"] == 0:
            return True
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.1)


async def test_a_finished_name_runs_again_and_a_running_one_refuses_a_second_run(tmp_path: Path) -> None:
    config = StackConfig(workdir=tmp_path, stores=1, replication=1, heartbeat_timeout_s=2.0, hang_floor_s=3.0)
    async with Stack(config) as stack:
        nc, watch = await watcher(stack, JOB)
        first_log = tmp_path / "first.log"
        first = await launch(stack.nats_args, JOB, first_log, steps=40, nproc=2, spares=0)
        again = None
        try:
            await until(watch, lambda: every_rank_at(watch, 2), first_log, "the first run training")
            second_log = tmp_path / "second.log"
            command = [sys.executable, "-m", "deadpool_cli", "launch", *stack.nats_args, "--job", JOB]
            command += ["--nproc", "1", str(SCRIPT), "--steps", "5", "--model-size", "tiny"]
            assert await run_to_end(command, second_log, timeout_s=60.0) == 2, tail(second_log)
            refusal = second_log.read_text(errors="replace")
            assert f"job {JOB} not started" in refusal and "a job name holds one run at a time" in refusal
            assert await finish(first, first_log) == 0, tail(first_log)
            generation = watch.rebuild.generation if watch.rebuild else 0
            # The store, with its own role's credentials, hears the run end and frees its snapshots.
            assert await store_emptied(nc, FREED_WITHIN_S), "the ended run's snapshots stayed in the store"

            again_log = tmp_path / "again.log"
            again = await launch(stack.nats_args, JOB, again_log, steps=60, nproc=2, spares=1)
            await until(
                watch,
                lambda: watch.rebuild is not None and watch.rebuild.generation > generation and every_rank_at(watch, 3),
                again_log,
                "the new run training",
            )
            assert watch.rebuild is not None
            formed = watch.rebuild.generation
            kill(watch, watch.rebuild.ranks[1], signal.SIGSTOP)  # silent: only the detector can tell
            await until(
                watch, lambda: watch.rebuild is not None and watch.rebuild.generation > formed, again_log, "a swap"
            )
            assert await finish(again, again_log) == 0, tail(again_log)
        finally:
            stop_all(first, again)
            await nc.close()
