"""Stores slower than the steps: the job streams every K-th step instead of waiting for them, with K the
same on every rank, and a SIGKILLed rank still heals bit-identical, losing at most the step it was in.
The swap restores the step the ranks agree on from their own buffers and the crash copy, and training
goes on while that step is stored again: each rank's first step after it is on the bus before the stores'
reports that they sealed the step for it.

Real processes: NATS, a detector, a swapper, two stores that ingest no faster than `INGEST_BYTES_PER_S`
(`DEADPOOL_STORE_INGEST_BYTES_PER_S`: a snapshot then takes several steps to stream), and `deadpool
launch` with 2 ranks and a spare, at the default adaptive interval. Each member's stats file says which
interval it streamed at from which step; the job's commits say which steps every rank streamed.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from deadpool_cli.stack import Stack, StackConfig
from deadpool_protocol import SnapshotComplete, StepResumed, Subjects
from deadpool_protocol.codec import decode
from deadpool_protocol.subjects import PREFIX
from deadpool_store.service import INGEST_LIMIT_ENV

from .jobs import assert_same_as_uninterrupted, every_rank_at, finish, kill, launch, stop_all, tail, until, watcher

JOB = "slow-stores"
STEPS = 120
INGEST_BYTES_PER_S = 1_000_000
"""A tiny GPT rank's snapshot is about 0.2 MB: with two ranks at replication 2, a stream then takes
0.4 s or more, many steps of 20-60 ms (K rises to 16 or more)."""


async def bus_order(nc: Client, job: str) -> list[tuple[str, int, int, tuple[int, ...]]]:
    """(kind, generation, step, ranks) of each rank's first step of a generation ("resumed": as its
    member sends it, to its launcher or as an event) and each store's report of the ranks it sealed
    ("sealed"), in the order the bus delivers them (one subscription: one order)."""
    subjects = Subjects.for_job(job)
    sealed_prefix = subjects.snapshot_complete.removesuffix("*")
    heard: list[tuple[str, int, int, tuple[int, ...]]] = []

    async def on_message(msg: Msg) -> None:
        to_launcher = msg.subject.startswith(f"{PREFIX}.{job}.launcher.") and msg.subject.endswith(".resumed")
        if msg.subject == subjects.step_resumed or (to_launcher and msg.subject != subjects.step_resumed_batch):
            resumed = decode(msg.data, StepResumed)
            heard.append(("resumed", resumed.generation, resumed.step, (resumed.rank,)))
        elif msg.subject.startswith(sealed_prefix):
            sealed = decode(msg.data, SnapshotComplete)
            heard.append(("sealed", sealed.generation, sealed.step, tuple(sealed.ranks)))

    await nc.subscribe(f"{PREFIX}.{job}.>", cb=on_message)
    await nc.flush()
    return heard


async def test_slow_stores_make_the_job_stream_every_kth_step_and_a_kill_still_heals_bit_identical(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(INGEST_LIMIT_ENV, str(INGEST_BYTES_PER_S))  # the stores inherit it, not the jobs
    config = StackConfig(workdir=tmp_path, stores=2, heartbeat_timeout_s=2.0, hang_floor_s=3.0)
    stats = tmp_path / "stats"
    env = {INGEST_LIMIT_ENV: "0", "DEADPOOL_STATS_DIR": str(stats)}
    async with Stack(config) as stack:
        nc, watch = await watcher(stack, JOB)
        heard = await bus_order(nc, JOB)
        log = tmp_path / "job.log"
        launcher = await launch(
            stack.nats_args, JOB, log, steps=STEPS, nproc=2, spares=1, out=tmp_path / "job", env=env
        )
        try:
            await until(watch, lambda: every_rank_at(watch, 40), log, "training")
            victim = watch.holder_of(1)
            assert victim is not None
            kill(watch, victim, signal.SIGKILL)
            await until(watch, lambda: bool(watch.incidents), log, "the rank swapped")
            incident = watch.incidents[0]
            assert incident.evidence.get("restore_link") == "local", incident.evidence
            assert incident.lost_steps <= 1, incident
            assert await finish(launcher, log) == 0, tail(log)
            g, agreed = incident.generation, incident.restore_step
            for rank in range(2):
                kinds = [kind for kind, gen, step, ranks in heard if gen == g and rank in ranks and step >= agreed]
                assert "sealed" in kinds, f"rank {rank}'s agreed step {agreed} was never stored: {heard}"
                assert kinds[0] == "resumed", f"rank {rank} waited for its agreed step to be stored: {kinds}"
        finally:
            stop_all(launcher)
            await nc.close()
        await assert_same_as_uninterrupted(stack, JOB, tmp_path / "job", tmp_path, steps=STEPS, spares=1, env=env)

    ranked = [json.loads(p.read_text()) for p in stats.glob("*.json")]
    ranked = [r for r in ranked if r.get("rank") is not None and r["rank"] >= 0]
    assert len(ranked) >= 4, "two ranks in each run wrote their stats"
    for record in ranked:
        intervals = [every for _, every in record["snapshot_intervals"]]
        assert max(intervals) >= 2, f"rank {record['rank']} streamed every step behind slow stores: {intervals}"
        assert all(every & (every - 1) == 0 for every in intervals), intervals
        captured = [s["step"] for s in record["steps"] if s["captured"]]
        assert len(captured) > STEPS // 2, "a crash copy is taken every step, streamed or not"
