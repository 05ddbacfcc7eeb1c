"""The fallback chain end to end, for when the RAM copies of a rank's committed step are gone.

- older committed: every store's copy of rank 1's committed step is corrupted, then rank 1 is
  SIGKILLed: its spare finds no good copy, says so, and the swapper restores the committed step before
  it, which the stores keep too;
- durable: both stores holding rank 1's snapshots are SIGKILLed and at once rank 1 too: no RAM copy of
  any of its committed steps is left, and the job goes on from the durable tier's newest step.

Both end with the weights of a run that never failed, bit for bit, and the incident names the link.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client

from deadpool_cli.job_watch import JobWatch
from deadpool_cli.stack import Stack, StackConfig
from deadpool_cli.weights_check import compare_final_states
from deadpool_protocol import SWAPPER_STATUS
from deadpool_runtime.logs import get_logger

from .jobs import every_rank_at

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py"
STEPS = 30
RUN_TIMEOUT_S = 180.0
SETTLE_S = 0.3
"""After freezing the ranks, time for the snapshot reports already sent to be committed."""
SWAP_WAIT_S = 1.0
"""How long a frozen rank 0 waits for the swap of rank 1 to be decided (its heartbeat timeout is 2 s)."""


async def launch(
    nats_args: list[str], job: str, out: Path, log: Path, *flags: str, spares: int = 1
) -> asyncio.subprocess.Process:
    command = [sys.executable, "-m", "deadpool_cli", "launch", *nats_args, "--job", job, "--nproc", "2"]
    command += ["--spares", str(spares), "--collective-timeout-s", "20", "--no-host-copy", *flags]  # the stores' chain
    command += [str(SCRIPT), "--steps", str(STEPS)]
    command += ["--model-size", "tiny", "--out", str(out)]
    with open(log, "wb") as sink:
        return await asyncio.create_subprocess_exec(*command, stdout=sink, stderr=sink)


async def status(nc: Client, job: str) -> dict[str, Any]:
    body: dict[str, Any] = json.loads((await nc.request(SWAPPER_STATUS, job.encode(), timeout=5)).data)
    return body


async def run_with_fault(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stores: int, flags: tuple[str, ...], fault: Any
) -> JobWatch:
    monkeypatch.setenv("DEADPOOL_FAULT_INJECTION", "1")
    config = StackConfig(workdir=tmp_path, stores=stores, heartbeat_timeout_s=2.0, hang_floor_s=3.0)
    async with Stack(config) as stack:
        nc = await stack.connect()
        job = "chain"
        watch = JobWatch(nc, job, get_logger(test=job))
        await watch.start()
        log = tmp_path / "run.log"
        launcher = await launch(stack.nats_args, job, tmp_path / "swap", log, *flags)
        try:
            await asyncio.wait_for(watch.wait_for(lambda: every_rank_at(watch, 12)), 120)
            await fault(stack, nc, job, watch)
            returncode = await asyncio.wait_for(launcher.wait(), RUN_TIMEOUT_S)
        finally:
            if launcher.returncode is None:
                launcher.kill()
                await launcher.wait()
        assert returncode == 0, log.read_text(errors="replace")[-4000:]
        reference = await launch(stack.nats_args, f"{job}-ref", tmp_path / "reference", tmp_path / "ref.log", spares=0)
        assert await asyncio.wait_for(reference.wait(), RUN_TIMEOUT_S) == 0
        await nc.close()
    identical, tensors, differences = compare_final_states(tmp_path / "swap", tmp_path / "reference")
    assert identical and tensors > 0, differences[:5]
    return watch


async def test_with_every_copy_of_the_committed_step_corrupt_the_older_committed_step_is_restored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[str, Any] = {}

    async def corrupt_then_kill(stack: Stack, nc: Client, job: str, watch: JobWatch) -> None:
        pids = [watch.members[m].pid for m in watch.rebuild.ranks]  # type: ignore[union-attr]
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)  # the committed step stands still while the copies are spoilt
        try:
            await asyncio.sleep(SETTLE_S)
            step = -1
            while True:  # until no snapshot still on the wire commits a newer step meanwhile
                now = await status(nc, job)
                if now["committed_step"] == step:
                    break
                step = now["committed_step"]
                for store in now["placement"][1]:
                    body = json.dumps({"job": job, "rank": 1, "step": step}).encode()
                    reply = json.loads((await nc.request(f"deadpool.store.{store}.corrupt", body, timeout=5)).data)
                    assert reply["corrupted"] == [step], reply
                await asyncio.sleep(SETTLE_S)
            seen["committed"] = step
            generation = watch.rebuild.generation  # type: ignore[union-attr]
            os.kill(pids[1], signal.SIGKILL)
            # Rank 0 stays frozen until the swap is decided: its snapshot of the next step, half-streamed,
            # would otherwise complete and commit a step whose rank-1 copy was stored, and not spoilt.
            await asyncio.wait_for(watch.wait_for(lambda: watch.rebuild.generation > generation), SWAP_WAIT_S)  # type: ignore[union-attr]
        finally:
            os.kill(pids[0], signal.SIGCONT)

    # Rank 0, frozen inside a collective while rank 1 died, may be left in gloo's pending send when it
    # resumes; then it exits and is swapped too (docs/architecture.md §5): a respawned spare takes it.
    watch = await run_with_fault(tmp_path, monkeypatch, 2, ("--respawns", "2"), corrupt_then_kill)
    incident = next(i for i in watch.incidents if i.rank == 1)
    assert incident.evidence["restore_link"] == "older_committed", incident.evidence
    assert incident.restore_step < seen["committed"]


async def test_with_both_stores_of_a_rank_lost_with_it_the_job_goes_on_from_the_durable_tier(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def lose_both_copies(stack: Stack, nc: Client, job: str, watch: JobWatch) -> None:
        now = await status(nc, job)
        for store in now["placement"][1]:
            stack.kill(store)
        victim = watch.holder_of(1)
        assert victim is not None
        os.kill(watch.members[victim].pid, signal.SIGKILL)

    durable = tmp_path / "durable"
    flags = ("--durable-dir", str(durable), "--durable-every-steps", "4")
    watch = await run_with_fault(tmp_path, monkeypatch, 3, flags, lose_both_copies)
    (incident,) = watch.incidents
    assert incident.evidence["restore_link"] == "durable", incident.evidence
    assert incident.restore_step % 4 == 0 and int(incident.evidence["lost_committed_steps"]) >= 0
