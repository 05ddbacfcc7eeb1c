"""A whole host lost: its launcher and every process on it SIGKILLed at once, no exit reports.

Two launchers play two hosts (`DEADPOOL_HOST`): host a runs ranks 0 and 1, host b runs ranks 2 and 3
and two warm spares. Killing host a's launcher takes its children with it (PDEATHSIG). The detector
sees only heartbeat silence; both ranks must be swapped in one generation, and the final weights must
equal an uninterrupted run's, bit for bit.

Twice: with stores that keep up (K = 1), and with stores slower than the steps
(`DEADPOOL_STORE_INGEST_BYTES_PER_S`), where the job streams every K-th step (K >= 2) and a lost host,
its crash copies gone with it, rolls back to a committed step up to 2K-1 steps old: the survivors,
whose own buffers hold only their newest steps, fetch that step from the stores like the newcomers.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest

from deadpool_cli.job_watch import JobWatch
from deadpool_cli.stack import Stack, StackConfig
from deadpool_cli.weights_check import compare_final_states
from deadpool_store.service import INGEST_LIMIT_ENV

from .jobs import watcher

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py"
RUN_TIMEOUT_S = 180.0
STEPS = 30
SLOW_STEPS = 120
SLOW_INGEST_BYTES_PER_S = 4_000_000
"""As in `test_slow_stores`: a tiny GPT rank's snapshot (about 0.2 MB) then takes several steps to stream."""


async def launch(
    nats_args: list[str],
    job: str,
    host: str,
    rank_offset: int,
    spares: int,
    out: Path,
    log: Path,
    steps: int,
    nproc: int = 2,
    world_size: int = 4,
) -> asyncio.subprocess.Process:
    command = [sys.executable, "-m", "deadpool_cli", "launch", *nats_args, "--job", job, "--nproc", str(nproc)]
    command += ["--world-size", str(world_size), "--rank-offset", str(rank_offset), "--spares", str(spares)]
    command += ["--run-id", job]
    command += ["--collective-timeout-s", "20", str(SCRIPT), "--steps", str(steps), "--model-size", "tiny"]
    command += ["--out", str(out)]
    env = {**os.environ, "DEADPOOL_HOST": host}
    with open(log, "wb") as sink:
        return await asyncio.create_subprocess_exec(*command, stdout=sink, stderr=sink, env=env)


def two_hosts_stack(workdir: Path) -> StackConfig:
    """The control plane of this module's jobs. Heartbeat timeout 2 s, not less: on 2 busy cores (six
    members importing torch at once) a member's beats were once late by a second during formation, and
    1 s declared a healthy host lost."""
    return StackConfig(workdir=workdir, stores=2, heartbeat_timeout_s=2.0, hang_floor_s=3.0)


@pytest.mark.parametrize("slow_stores", [False, True], ids=["stores-keep-up", "slow-stores"])
async def test_a_lost_host_is_replaced_in_one_generation_and_training_ends_bit_identical(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, slow_stores: bool
) -> None:
    steps, kill_at = (SLOW_STEPS, 60) if slow_stores else (STEPS, 8)
    if slow_stores:  # the stores inherit it; the members ignore it
        monkeypatch.setenv(INGEST_LIMIT_ENV, str(SLOW_INGEST_BYTES_PER_S))
    async with Stack(two_hosts_stack(tmp_path)) as stack:
        nc, watch = await watcher(stack, "lost-host")
        out = tmp_path / "swap"
        host_a = await launch(stack.nats_args, "lost-host", "hosta", 0, 0, out, tmp_path / "a.log", steps)
        host_b = await launch(stack.nats_args, "lost-host", "hostb", 2, 2, out, tmp_path / "b.log", steps)
        try:
            await asyncio.wait_for(watch.wait_for(lambda: min_rank_step(watch) >= kill_at), 120)
            assert watch.failures == [], [(f.member, f.reason, f.evidence) for f in watch.failures]
            if slow_stores:
                assert watch.snapshot_every_max >= 2, "the stores kept up: this run tests nothing past K = 1"
            host_a.send_signal(signal.SIGKILL)  # the host is gone: no exit report will come
            returncode = await asyncio.wait_for(host_b.wait(), RUN_TIMEOUT_S)
        finally:
            for process in (host_a, host_b):
                if process.returncode is None:
                    process.kill()
        assert returncode == 0, (tmp_path / "b.log").read_text(errors="replace")[-3000:]
        assert sorted(i.rank for i in watch.incidents) == [0, 1]
        assert {i.reason for i in watch.incidents} == {"heartbeat"}
        assert {i.evidence.get("restore_link") for i in watch.incidents} == {"committed"}, watch.incidents
        assert len({i.generation for i in watch.incidents}) == 1, "both ranks should move in one generation"
        # A lost host restores from the stores: at most the K-1 steps since the last streamed step, and
        # K more if that one was still streaming (at K = 1, the interval stores that keep up allow: 1).
        bound = 2 * watch.snapshot_every_max - 1
        assert all(i.lost_steps <= bound for i in watch.incidents), (bound, watch.incidents)
        # The members' phases, as their heartbeats told them (`MemberPhase`): each spare that took a
        # rank warmed up, waited, and trained; the ranks formed the job in a rebuild first.
        takers = {i.replacement for i in watch.incidents}
        for member in takers:
            assert in_order(watch.members[member].phases, ["warming", "spare", "training"]), watch.members[member]
        formed = [m for m, view in watch.members.items() if m not in takers and "training" in view.phases]
        assert formed and all(
            in_order([p.split(":")[0] for p in watch.members[m].phases], ["rebuilding", "training"]) for m in formed
        ), {m: watch.members[m].phases for m in formed}

        reference = tmp_path / "reference"
        solo = await launch(stack.nats_args, "lost-host-ref", "hosta", 0, 0, reference, tmp_path / "ref-a.log", steps)
        solo_b = await launch(stack.nats_args, "lost-host-ref", "hostb", 2, 0, reference, tmp_path / "ref-b.log", steps)
        assert await asyncio.wait_for(solo.wait(), RUN_TIMEOUT_S) == 0
        assert await asyncio.wait_for(solo_b.wait(), RUN_TIMEOUT_S) == 0
        await nc.close()
    identical, tensors, differences = compare_final_states(out, reference)
    assert identical and tensors > 0, differences[:5]


async def test_a_member_alone_on_its_host_hung_is_fenced_by_its_launcher_before_its_spare_goes(tmp_path: Path) -> None:
    """A host that runs one member: when that member goes silent (stopped), its launcher still sends a
    batch every period, empty, so the detector does not take the host for lost. The swapper then waits
    for the launcher to kill the member before its spare takes the rank. (Where the launcher goes
    silent too, the host is lost, and nobody waits for a fence it cannot answer: `test_multi_node.py`.)
    Without the empty batches the verdict said this host lost."""
    async with Stack(two_hosts_stack(tmp_path)) as stack:
        nc, watch = await watcher(stack, "alone")
        out = tmp_path / "out"
        host_a = await launch(stack.nats_args, "alone", "hosta", 0, 0, out, tmp_path / "a.log", STEPS, 1, 2)
        host_b = await launch(stack.nats_args, "alone", "hostb", 1, 1, out, tmp_path / "b.log", STEPS, 1, 2)
        try:
            await asyncio.wait_for(watch.wait_for(lambda: min_rank_step(watch) >= 8), 120)
            assert watch.rebuild is not None
            alone = watch.rebuild.ranks[0]  # host a's one member (`--rank-offset 0 --nproc 1`)
            os.kill(watch.members[alone].pid, signal.SIGSTOP)  # silent; its launcher alive beside it
            await asyncio.wait_for(watch.wait_for(lambda: bool(watch.incidents)), RUN_TIMEOUT_S)
            (failure,) = [f for f in watch.failures if f.member == alone]
            assert (failure.reason, failure.lost_host) == ("heartbeat", ""), failure
            (incident,) = watch.incidents
            assert incident.phases["fence"] > 0, incident.phases  # the spare waited for the kill
            # The job ends on host b; host a's launcher, its one member killed, ends too (not cleanly).
            assert await asyncio.wait_for(host_b.wait(), RUN_TIMEOUT_S) == 0, (tmp_path / "b.log").read_text()[-3000:]
            assert await asyncio.wait_for(host_a.wait(), RUN_TIMEOUT_S) != 0
        finally:
            for process in (host_a, host_b):
                if process.returncode is None:
                    process.kill()
        await nc.close()


def in_order(seen: list[str], wanted: list[str]) -> bool:
    """`wanted` appears in `seen` in this order (not necessarily next to each other)."""
    rest = iter(seen)
    return all(any(s == w for s in rest) for w in wanted)


def min_rank_step(watch: JobWatch) -> int:
    if watch.rebuild is None:
        return -1
    steps = [watch.members[m].step for m in watch.rebuild.ranks if m in watch.members]
    return min(steps) if len(steps) == len(watch.rebuild.ranks) else -1
