"""A job launched with `--hold-without-stores-s` holds training while every store is lost, and resumes,
bit-identical, when one returns.

Real processes: NATS, a detector, a swapper, one store (so losing it loses every store), the example
job with 2 ranks. The store is SIGKILLed and kept down: every rank stops (its generation voided) and
no step completes; the store comes back: the ranks agree on the newest step all of them hold in their
own buffers, go on from there, and the job's final weights equal an uninterrupted run's.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

from deadpool_cli.stack import Stack, StackConfig
from deadpool_cli.weights_check import compare_final_states

from .jobs import SCRIPT, every_rank_at, finish, rank_steps, run_to_end, stop_all, tail, until, watcher

JOB = "held"
STEPS = 120
HELD_S = 6.0
"""How long the test keeps the store away once training is held."""


def launch_command(nats_args: list[str], job: str, out: Path, hold: bool) -> list[str]:
    command = [sys.executable, "-m", "deadpool_cli", "launch", *nats_args, "--job", job, "--nproc", "2"]
    command += ["--collective-timeout-s", "20", *(["--hold-without-stores-s", "120"] if hold else [])]
    return [*command, str(SCRIPT), "--steps", str(STEPS), "--model-size", "tiny", "--out", str(out)]


async def test_training_holds_while_every_store_is_lost_and_resumes_bit_identical(tmp_path: Path) -> None:
    config = StackConfig(workdir=tmp_path, stores=1, replication=1, heartbeat_timeout_s=2.0, hang_floor_s=3.0)
    async with Stack(config) as stack:
        nc, watch = await watcher(stack, JOB)
        log = tmp_path / "held.log"
        with open(log, "wb") as sink:
            launcher = await asyncio.create_subprocess_exec(
                *launch_command(stack.nats_args, JOB, tmp_path / "held", hold=True), stdout=sink, stderr=sink
            )
        try:
            await until(watch, lambda: every_rank_at(watch, 10), log, "training")
            stack.hold("store-0")
            stack.kill("store-0")
            await until(watch, lambda: any("held" in v.reason for v in watch.voids), log, "the generation voided: held")
            await asyncio.sleep(1.0)  # the ranks out of their step
            held_at = max(rank_steps(watch))
            await asyncio.sleep(HELD_S)
            assert max(rank_steps(watch)) == held_at, "a rank trained while every store was lost"
            generation = watch.rebuild.generation if watch.rebuild else 0
            t_back = time.time()
            stack.release("store-0")
            stack._start("store-0")
            await until(
                watch,
                lambda: watch.resumed_at(t_back, generation + 1) is not None,
                log,
                "training resumed once the store was back",
            )
            assert watch.rebuild is not None and watch.rebuild.local
            assert await finish(launcher, log) == 0, tail(log)
        finally:
            stop_all(launcher)
            await nc.close()
        reference = tmp_path / "reference"
        command = launch_command(stack.nats_args, "held-ref", reference, hold=False)
        assert await run_to_end(command, tmp_path / "reference.log") == 0
    identical, tensors, differences = compare_final_states(tmp_path / "held", reference)
    assert identical and tensors > 0, differences[:5]
