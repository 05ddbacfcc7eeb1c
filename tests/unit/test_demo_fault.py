"""The demo's fault lands mid-run: in the step asked for or the first the watch sees after it, never in
the run's last step, where it would race the run's end (CI once saw a kill at step 3 of 8 land in step 8:
the rank died after it said it was done, and the run ended one rank short with no swap)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any, cast

import pytest
import structlog

from deadpool_cli.demo import inject_fault_mid_step
from deadpool_cli.job_watch import JobWatch
from deadpool_protocol import Heartbeat, Rebuild
from deadpool_protocol.messages import MemberPhase

pytestmark = pytest.mark.unit

STEPS = 8
NO_MSG = cast(Any, None)


@pytest.fixture
def rank_process() -> Iterator[subprocess.Popen[bytes]]:
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield process
    process.kill()
    process.wait()


async def watch_seeing(pid: int, step: int) -> JobWatch:
    """A watch whose job gave rank 0 to member 'm0', whose last beat says it is inside step `step`+1."""
    watch = JobWatch(cast(Any, None), "j", structlog.get_logger())
    rebuild = Rebuild("j", 1, 1, ["m0"], [], "m0", "127.0.0.1", 4000, -1, [], [[]], "", time.time())
    await watch._on_rebuild(rebuild, NO_MSG)
    now = time.time()
    beat = Heartbeat("j", 1, "m0", 0, pid, step, True, now, now, phase=MemberPhase.TRAINING)
    await watch._on_heartbeat(beat, NO_MSG)
    return watch


async def test_a_rank_first_seen_in_the_last_step_is_left_alone(rank_process: subprocess.Popen[bytes]) -> None:
    watch = await watch_seeing(rank_process.pid, STEPS - 1)
    kill = await asyncio.wait_for(inject_fault_mid_step(watch, 0, 3, STEPS), 5.0)
    assert kill is None
    assert rank_process.poll() is None


async def test_a_rank_first_seen_after_the_kill_step_is_killed_in_the_step_it_is_in(
    rank_process: subprocess.Popen[bytes],
) -> None:
    watch = await watch_seeing(rank_process.pid, 5)
    kill = await asyncio.wait_for(inject_fault_mid_step(watch, 0, 3, STEPS), 5.0)
    assert kill is not None and kill.step == 6 and kill.pid == rank_process.pid
    assert rank_process.wait(5.0) == -9
