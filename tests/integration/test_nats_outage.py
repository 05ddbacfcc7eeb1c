"""NATS goes away mid-training and comes back: training goes on meanwhile, nobody is declared dead.

The data plane and the process group do not use NATS, so the ranks keep stepping; heartbeats cannot
reach the detector, which must not read that silence as deaths (`DetectorCore.grace`). The outage
(3 s) is longer than the heartbeat timeout (1 s) and the hang floor (2 s) on purpose.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

from deadpool_cli.job_watch import JobWatch
from deadpool_cli.stack import Stack, StackConfig
from deadpool_runtime.logs import get_logger

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py"
OUTAGE_S = 3.0
"""How long the server stays down: the fault's size, not a synchronisation."""
RUN_TIMEOUT_S = 240.0


async def test_training_survives_a_nats_restart_without_any_member_declared_dead(tmp_path: Path) -> None:
    config = StackConfig(workdir=tmp_path, stores=1, replication=1, heartbeat_timeout_s=1.0, hang_floor_s=2.0)
    async with Stack(config) as stack:
        assert stack.nats is not None
        nc = await stack.connect(max_reconnect_attempts=-1, reconnect_time_wait=0.2)
        watch = JobWatch(nc, "outage", get_logger(test="outage"))
        await watch.start()
        command = [sys.executable, "-m", "deadpool_cli", "launch", *stack.nats_args, "--job", "outage"]
        command += ["--nproc", "2", "--spares", "1", "--collective-timeout-s", "20", str(SCRIPT)]
        command += ["--steps", "400", "--model-size", "tiny"]
        with open(tmp_path / "launch.log", "wb") as log:
            launcher = await asyncio.create_subprocess_exec(*command, stdout=log, stderr=log)
        try:
            await asyncio.wait_for(watch.wait_for(lambda: min_step(watch) >= 20), 120)
            step_before = max_step(watch)
            stack.nats.stop()
            await asyncio.sleep(OUTAGE_S)
            stack.nats.start()  # same port, same JetStream data
            restarted_t = time.time()
            # A fresh beat (a step completed after the restart): beats buffered during the outage
            # arrive first on reconnection and tell of steps early in it.
            await asyncio.wait_for(watch.wait_for(lambda: fresh_step(watch, restarted_t) > step_before), 60)
            step_after = fresh_step(watch, restarted_t)
            returncode = await asyncio.wait_for(launcher.wait(), RUN_TIMEOUT_S)
        finally:
            if launcher.returncode is None:
                launcher.kill()
        log_text = (tmp_path / "launch.log").read_text(errors="replace")[-3000:]
        assert returncode == 0, log_text
        assert step_after > step_before + 10, "the ranks should have kept training while NATS was down"
        status = await nc.request("deadpool.detector.status", b"", timeout=10)
        declared = json.loads(status.data)["outage"]["declared"]
        assert declared == [] and watch.failures == [] and watch.incidents == [], (declared, watch.failures)
        detector_log = (tmp_path / "logs" / "detector.log").read_text()
        assert "detector missed time" in detector_log
        await nc.close()


def min_step(watch: JobWatch) -> int:
    ranked = [v.step for v in watch.members.values() if v.step >= 0]
    return min(ranked) if len(ranked) >= 2 else -1


def fresh_step(watch: JobWatch, since_t: float) -> int:
    return max((v.step for v in watch.members.values() if v.step_completed_t > since_t), default=-1)


def max_step(watch: JobWatch) -> int:
    return max((v.step for v in watch.members.values()), default=-1)
