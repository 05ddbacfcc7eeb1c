"""A rank that holds the others back is reported as a straggler, with evidence, and not swapped."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path
from typing import Any

from deadpool_cli.job_watch import JobWatch
from deadpool_cli.stack import Stack, StackConfig
from deadpool_protocol import Straggler, Subjects, decode
from deadpool_runtime.logs import get_logger

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py"
RUN_TIMEOUT_S = 180.0
WINDOW_HEARTBEATS = 100
"""The detector's straggler window, 10 s at 10 Hz (its default, 300, is 30 s): the test waits a window
of slow steps, and then the rest of the run, at 0.2 s a step."""
STEPS = 100
"""The run: some 25 s once rank 1 is slow, over twice the window."""


async def test_a_slow_rank_is_reported_as_a_straggler_and_nobody_is_swapped(tmp_path: Path) -> None:
    async with Stack(
        StackConfig(workdir=tmp_path, stores=1, replication=1, straggler_window=WINDOW_HEARTBEATS)
    ) as stack:
        nc = await stack.connect()
        watch = JobWatch(nc, "slow", get_logger(test="straggler"))
        await watch.start()
        stragglers: asyncio.Queue[Straggler] = asyncio.Queue()

        async def on_straggler(msg: Any) -> None:
            await stragglers.put(decode(msg.data, Straggler))

        await nc.subscribe(Subjects.for_job("slow").straggler, cb=on_straggler)
        command = [sys.executable, "-m", "deadpool_cli", "launch", *stack.nats_args, "--job", "slow"]
        command += ["--nproc", "3", "--spares", "0", str(SCRIPT), "--steps", str(STEPS), "--model-size", "tiny"]
        env = {**os.environ, "DEADPOOL_FAULT_INJECTION": "1"}
        with open(tmp_path / "launch.log", "wb") as log:
            launcher = await asyncio.create_subprocess_exec(*command, stdout=log, stderr=log, env=env)
        try:
            await asyncio.wait_for(watch.wait_for(lambda: _rank_step(watch, 1) >= 5), 120)
            member = watch.holder_of(1)
            assert member is not None
            os.kill(watch.members[member].pid, signal.SIGWINCH)  # rank 1: every step 0.2 s late from now
            event = await asyncio.wait_for(stragglers.get(), 120)  # a window of slow steps
            returncode = await asyncio.wait_for(launcher.wait(), RUN_TIMEOUT_S)
        finally:
            if launcher.returncode is None:
                launcher.kill()
        assert (event.rank, event.member) == (1, member)
        assert float(event.evidence["busy_share"]) > float(event.evidence["others_median_busy_share"])
        assert returncode == 0 and watch.failures == [] and watch.incidents == []
        await nc.close()


def _rank_step(watch: JobWatch, rank: int) -> int:
    member = watch.holder_of(rank)
    view = watch.members.get(member or "")
    return view.step if view is not None else -1
