"""A restore is verified before anything is applied: a store's copy with flipped bytes is refused
(its chunk checksums no longer match the manifest), the next replica is used, and the final weights
still equal an uninterrupted run's, bit for bit.

Real stores with their fault-injection endpoint armed flip the bytes of every snapshot they hold of
the rank that is then SIGKILLed; the spare that replaces it tries that store first.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

import pytest

from deadpool_cli.job_watch import JobWatch
from deadpool_cli.stack import Stack, StackConfig
from deadpool_cli.weights_check import compare_final_states
from deadpool_protocol import SWAPPER_STATUS
from deadpool_runtime.logs import get_logger

from .jobs import every_rank_at

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py"
STEPS = 24
RUN_TIMEOUT_S = 180.0
SETTLE_S = 0.3
"""After freezing the ranks, time for snapshots already on the wire to be sealed and committed."""


async def launch(nats_args: list[str], job: str, out: Path, log: Path, spares: int = 1) -> asyncio.subprocess.Process:
    command = [sys.executable, "-m", "deadpool_cli", "launch", *nats_args, "--job", job, "--nproc", "2"]
    command += ["--spares", str(spares), "--collective-timeout-s", "20", "--no-host-copy"]  # the store path
    command += [str(SCRIPT), "--steps", str(STEPS)]
    command += ["--model-size", "tiny", "--out", str(out)]
    with open(log, "wb") as sink:
        return await asyncio.create_subprocess_exec(*command, stdout=sink, stderr=sink)


async def test_a_corrupt_replica_is_refused_and_the_other_one_restores_bit_identically(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DEADPOOL_FAULT_INJECTION", "1")  # the stores' byte-flipping endpoint
    async with Stack(StackConfig(workdir=tmp_path, stores=2, heartbeat_timeout_s=2.0, hang_floor_s=3.0)) as stack:
        nc = await stack.connect()
        job = "verified-restore"
        watch = JobWatch(nc, job, get_logger(test=job))
        await watch.start()
        log = tmp_path / "run.log"
        launcher = await launch(stack.nats_args, job, tmp_path / "swap", log)
        try:
            await asyncio.wait_for(watch.wait_for(lambda: every_rank_at(watch, 8)), 120)
            assert watch.rebuild is not None
            pids = [watch.members[m].pid for m in watch.rebuild.ranks]
            for pid in pids:  # no new snapshot may be sealed (and committed) after the bytes are flipped
                os.kill(pid, signal.SIGSTOP)
            try:
                await asyncio.sleep(SETTLE_S)
                status = json.loads((await nc.request(SWAPPER_STATUS, job.encode(), timeout=5)).data)
                first_store = status["placement"][1][0]
                body = json.dumps({"job": job, "rank": 1}).encode()
                corrupt = f"deadpool.store.{first_store}.corrupt"
                reply = json.loads((await nc.request(corrupt, body, timeout=5)).data)
                assert status["committed_step"] in reply["corrupted"], (status["committed_step"], reply)
                os.kill(pids[1], signal.SIGKILL)
            finally:
                os.kill(pids[0], signal.SIGCONT)
            returncode = await asyncio.wait_for(launcher.wait(), RUN_TIMEOUT_S)
        finally:
            if launcher.returncode is None:
                launcher.kill()
                await launcher.wait()
        text = log.read_text(errors="replace")
        assert returncode == 0, text[-3000:]
        (incident,) = watch.incidents
        assert incident.rank == 1 and incident.restore_step in reply["corrupted"], (incident, reply)
        refused = [json.loads(line) for line in text.splitlines() if "store's copy refused" in line]
        assert refused and all(r["store"] == first_store and "checksum" in r["reason"] for r in refused), refused
        fetched = [json.loads(line) for line in text.splitlines() if '"snapshot fetched"' in line]
        assert fetched and fetched[-1]["store"] != first_store, fetched

        reference = await launch(stack.nats_args, f"{job}-ref", tmp_path / "reference", tmp_path / "ref.log", spares=0)
        assert await asyncio.wait_for(reference.wait(), RUN_TIMEOUT_S) == 0
        await nc.close()
    identical, tensors, differences = compare_final_states(tmp_path / "swap", tmp_path / "reference")
    assert identical and tensors > 0, differences[:5]
