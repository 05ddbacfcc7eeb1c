"""A rank SIGKILLed while every snapshot store is lost heals from the crash copy it left on its host.

Real processes: NATS, a detector, a swapper, one store (losing it loses every store), and `deadpool
launch` with 2 ranks and a spare. The store is SIGKILLed and kept down; the job trains on, unprotected.
Then rank 1 is SIGKILLed: its spare, on the same launcher, takes the dead member's snapshot buffers from
the host's shared memory, the ranks agree on the newest step they all hold, and training goes on from
there, losing at most the step the rank was in. The final weights equal an uninterrupted run's, bit
for bit, and nothing of the job is left in /dev/shm once its launcher exits.
"""

from __future__ import annotations

import signal
from pathlib import Path

from deadpool.host_copy_dir import DIR_PREFIX, SHM_ROOT
from deadpool_cli.stack import Stack, StackConfig

from .jobs import (
    assert_same_as_uninterrupted,
    every_rank_at,
    finish,
    kill,
    launch,
    rank_steps,
    stop_all,
    tail,
    until,
    watcher,
)

JOB = "crash-copy"
STEPS = 60


async def test_a_rank_killed_with_every_store_lost_heals_from_its_hosts_crash_copy_bit_identical(
    tmp_path: Path,
) -> None:
    config = StackConfig(workdir=tmp_path, stores=1, replication=1, heartbeat_timeout_s=2.0, hang_floor_s=3.0)
    async with Stack(config) as stack:
        nc, watch = await watcher(stack, JOB)
        log = tmp_path / "job.log"
        launcher = await launch(stack.nats_args, JOB, log, steps=STEPS, nproc=2, spares=1, out=tmp_path / "job")
        try:
            await until(watch, lambda: every_rank_at(watch, 5), log, "training")
            stack.hold("store-0")
            stack.kill("store-0")
            lost_at = max(rank_steps(watch))
            await until(watch, lambda: every_rank_at(watch, lost_at + 3), log, "training on, unprotected")
            victim = watch.holder_of(1)
            assert victim is not None
            kill(watch, victim, signal.SIGKILL)
            await until(watch, lambda: bool(watch.incidents), log, "the rank swapped")
            incident = watch.incidents[0]
            assert incident.evidence.get("restore_link") == "local", incident.evidence
            assert incident.restore_step > lost_at, "restored a step trained after every store was lost"
            assert incident.lost_steps <= 1, incident
            assert watch.rebuild is not None and watch.rebuild.local
            assert await finish(launcher, log) == 0, tail(log)
        finally:
            stop_all(launcher)
            await nc.close()
        assert not list(SHM_ROOT.glob(f"{DIR_PREFIX}{JOB}-*")), "the job's crash copies outlived its launcher"
        stack.release("store-0")
        stack._start("store-0")
        await assert_same_as_uninterrupted(stack, JOB, tmp_path / "job", tmp_path, steps=STEPS, spares=1)
