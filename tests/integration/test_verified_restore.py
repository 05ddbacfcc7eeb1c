"""A restore is verified before anything is applied: a store's copy with flipped bytes is refused
(its chunk checksums no longer match the manifest), and so is one whose checksums the store rewrote
to match (its seal's signature, made by the job's member with a key no store holds, no longer does);
the next replica is used, and the final weights still equal an uninterrupted run's, bit for bit.

Real stores with their fault-injection endpoint armed flip the bytes of every snapshot they hold of
the rank that is then SIGKILLed; the spare that replaces it tries that store first. In the forged
case, a holder of the job's data-plane token also tries to replace the committed copy by uploading
its own: the store refuses it (such an upload once replaced a committed copy, and the job trained on
from poisoned weights).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

import pytest

from deadpool.store_client import StoreClientError, StoreConnection, UploadKey
from deadpool_cli.job_watch import JobWatch
from deadpool_cli.stack import Stack, StackConfig
from deadpool_cli.weights_check import compare_final_states
from deadpool_protocol import SWAPPER_STATUS, StoreAddress
from deadpool_protocol.dataplane import job_token
from deadpool_runtime.credentials import dataplane_key_file, read_dataplane_key
from deadpool_runtime.logs import get_logger

from .jobs import every_rank_at

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py"
STEPS = 120
"""Enough that the ranks are frozen mid-run: they are frozen once every rank was heard at step 8, and
with 24 steps a fast machine once finished the run in the time that took (the stores had dropped the
job's copies, and nothing was left to corrupt)."""
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


def poison(address: StoreAddress, token: bytes, job: str, member: str, generation: int, step: int) -> str:
    """Upload other bytes as `member`'s copy of rank 1 at `step` with the job's token (member names are in
    every rebuild); returns the store's refusal."""
    conn = StoreConnection(address, token=token)
    try:
        conn.upload(UploadKey(job, generation, 1, member, step), memoryview(bytes(4096)), 1024, b"x", lambda: False)
    except StoreClientError as exc:
        return str(exc)
    finally:
        conn.close()
    return ""


@pytest.mark.parametrize("forge", [False, True], ids=["flipped", "forged"])
async def test_a_corrupt_replica_is_refused_and_the_other_one_restores_bit_identically(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, forge: bool
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
                assert status["committed_step"] < STEPS - 1, f"the run ended before its ranks were frozen: {status}"
                first_store = status["placement"][1][0]
                body = json.dumps({"job": job, "rank": 1, "forge": forge}).encode()
                corrupt = f"deadpool.store.{first_store}.corrupt"
                reply = json.loads((await nc.request(corrupt, body, timeout=5)).data)
                assert status["committed_step"] in reply["corrupted"], (status["committed_step"], reply)
                if forge:
                    assert stack.credentials is not None
                    token = job_token(read_dataplane_key(dataplane_key_file(stack.credentials)), job)
                    [address] = [a for a in watch.rebuild.stores if a.store == first_store]
                    committed = (watch.rebuild.generation, status["committed_step"])  # no rebuild since
                    member = watch.rebuild.ranks[1]
                    refusal = await asyncio.to_thread(poison, address, token, job, member, *committed)
                    assert "sealed copy is never replaced" in refusal, refusal
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
        why = "changed since it was signed" if forge else "fails its checksum"
        assert refused and all(r["store"] == first_store and why in r["reason"] for r in refused), refused
        fetched = [json.loads(line) for line in text.splitlines() if '"snapshot fetched"' in line]
        assert fetched and fetched[-1]["store"] != first_store, fetched

        reference = await launch(stack.nats_args, f"{job}-ref", tmp_path / "reference", tmp_path / "ref.log", spares=0)
        assert await asyncio.wait_for(reference.wait(), RUN_TIMEOUT_S) == 0
        await nc.close()
    identical, tensors, differences = compare_final_states(tmp_path / "swap", tmp_path / "reference")
    assert identical and tensors > 0, differences[:5]
