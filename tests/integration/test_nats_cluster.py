"""The control plane on a real 3-node NATS cluster (JetStream replicas 3) survives the loss of a node.

Mid-training, one NATS server is SIGKILLed (and comes back), then the server leading the job-records
KV stream is SIGKILLed: every client moves to the servers left, JetStream elects new stream leaders,
nobody is declared dead, training goes on; and a rank SIGKILLed after that still heals.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import nats.errors
from nats.aio.client import Client

from deadpool_cli.stack import Stack, StackConfig
from deadpool_protocol.job_record import JOBS_BUCKET

from .jobs import every_rank_at, finish, kill, launch, rank_steps, stop_all, tail, until, watcher


async def kv_leader(nc: Client, timeout_s: float = 30.0) -> str:
    """The server leading the job records' stream (asked again while the cluster is still electing)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            info = await nc.jetstream(timeout=2.0).stream_info(f"KV_{JOBS_BUCKET}")
            if info.cluster is not None and info.cluster.leader:
                return info.cluster.leader
        except (nats.errors.Error, TimeoutError):
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"no leader for KV_{JOBS_BUCKET} within {timeout_s} s")
        await asyncio.sleep(0.2)


STEPS_DURING_OUTAGE = 60
"""About 5 s of training: longer than JetStream takes to elect new stream leaders."""


async def test_losing_a_nats_node_then_the_kv_leader_declares_nobody_and_a_kill_still_heals(tmp_path: Path) -> None:
    config = StackConfig(
        workdir=tmp_path,
        nats_nodes=3,
        stores=2,
        swappers=2,
        detectors=2,
        heartbeat_timeout_s=2.0,
        hang_floor_s=3.0,
    )
    async with Stack(config) as stack:
        assert stack.cluster is not None
        nc, watch = await watcher(stack, "cluster")
        log = tmp_path / "launch.log"
        launcher = await launch(stack.nats_args, "cluster", log, steps=100_000, spares=1)
        try:
            await until(watch, lambda: every_rank_at(watch, 10), log, "training")
            for round_ in ("any node", "the KV stream's leader"):
                if round_ == "any node":
                    victim = stack.cluster.servers[1]
                else:
                    victim = stack.cluster.by_name(await kv_leader(nc))
                target = max(rank_steps(watch)) + STEPS_DURING_OUTAGE

                def trained(target: int = target) -> bool:
                    return every_rank_at(watch, target)

                victim.kill()
                await until(watch, trained, log, f"training without {round_}")
                await asyncio.to_thread(victim.start)  # it comes back and catches up
                await asyncio.sleep(2.0)
            assert watch.failures == [], [(f.member, f.reason, f.evidence) for f in watch.failures]
            assert watch.rebuild is not None
            generation, victim_member = watch.rebuild.generation, watch.rebuild.ranks[2]
            kill(watch, victim_member)
            await until(watch, lambda: len(watch.incidents) >= 1, log, "the kill healed")
            step = max(rank_steps(watch))
            await until(watch, lambda: every_rank_at(watch, step + 5), log, "training after the swap")
        finally:
            stop_all(launcher)
        # Two detectors: the verdict may come twice; the swapper acts on it once.
        assert {f.member for f in watch.failures} == {victim_member}, tail(log)
        (incident,) = watch.incidents
        assert incident.generation == generation + 1
        await finish(launcher, log)
        await nc.close()
