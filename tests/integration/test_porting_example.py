"""docs/porting.md's port holds: `examples/porting/train_deadpool.py` (a torchrun script changed in 14
lines, none re-indented, no `with job.step()`) has rank 1 SIGKILLed mid-run, a spare takes its rank,
and every rank's weights and optimizer state end equal to a run without the kill (`torch.equal`)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from deadpool_cli.stack import Stack, StackConfig
from deadpool_cli.weights_check import compare_final_states
from tests.integration.jobs import every_rank_at, finish, kill, stop_all, tail, until, watcher

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "porting" / "train_deadpool.py"
STEPS = 64
"""About 2 s of training: the kill, sent when the watch sees every rank at step 6, lands mid-run (with
16 steps, half a second, the job had once finished before the kill reached its rank)."""


async def start(
    nats_args: list[str], job: str, workdir: Path, spares: int = 1
) -> tuple[asyncio.subprocess.Process, Path, Path]:
    out, log = workdir / job, workdir / f"{job}.log"
    command = [sys.executable, "-m", "deadpool_cli", "launch", *nats_args, "--job", job, "--nproc", "2"]
    command += ["--spares", str(spares), "--collective-timeout-s", "20", str(SCRIPT), "--steps", str(STEPS)]
    command += ["--out", str(out)]
    with open(log, "wb") as sink:
        process = await asyncio.create_subprocess_exec(*command, stdout=sink, stderr=sink)
    return process, out, log


async def test_the_ported_torchrun_script_survives_a_sigkill_bit_identical(tmp_path: Path) -> None:
    async with Stack(StackConfig(workdir=tmp_path, stores=2)) as stack:
        reference, reference_out, reference_log = await start(stack.nats_args, "port-ref", tmp_path, spares=0)
        try:
            assert await finish(reference, reference_log) == 0, tail(reference_log)
        finally:
            stop_all(reference)
        nc, watch = await watcher(stack, "port-swap")
        swapped, swapped_out, log = await start(stack.nats_args, "port-swap", tmp_path)
        try:
            await until(watch, lambda: every_rank_at(watch, 6), log, "every rank at step 6")
            victim = watch.holder_of(1)
            assert victim is not None
            kill(watch, victim)
            assert await finish(swapped, log) == 0, tail(log)
        finally:
            stop_all(swapped)
            await nc.close()
    assert watch.incidents and watch.incidents[0].member == victim, tail(log)
    identical, count, differences = compare_final_states(reference_out, swapped_out)
    assert identical and count > 0, differences[:8]
