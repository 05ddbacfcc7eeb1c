"""The state real loops keep survives a swap, bit for bit: a rank SIGKILLed mid-step is replaced by a
spare, and every rank's weights, optimizer state, LR scheduler, GradScaler, StatefulDataLoader (with
worker processes) and EMA end equal to a run without the kill (`torch.equal`, `==`).

One loop script (`scripts/stateful_loop.py`), shaped like a torchrun script, run with each kind of
optimizer whose state is not plain tensors, and with the job's ZeRO optimizer whose scheduler is
built for each generation.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from deadpool_cli.stack import Stack, StackConfig
from deadpool_cli.weights_check import compare_final_states
from tests.integration.jobs import tail

SCRIPT = Path(__file__).resolve().parent / "scripts" / "stateful_loop.py"
STEPS = 12
KILL_STEP = 6
RUN_TIMEOUT_S = 240.0


async def run(url: str, job: str, workdir: Path, kill_step: int, *flags: str) -> tuple[Path, Path]:
    out, log, flag = workdir / job, workdir / f"{job}.log", workdir / f"{job}.killed"
    command = [sys.executable, "-m", "deadpool_cli", "launch", "--nats", url, "--job", job, "--nproc", "2"]
    command += ["--spares", "1", "--collective-timeout-s", "20", str(SCRIPT), "--steps", str(STEPS)]
    command += ["--kill-step", str(kill_step), "--flag", str(flag), "--out", str(out)]
    command += list(flags)
    with open(log, "wb") as sink:
        process = await asyncio.create_subprocess_exec(*command, stdout=sink, stderr=sink)
    try:
        code = await asyncio.wait_for(process.wait(), RUN_TIMEOUT_S)
    finally:
        if process.returncode is None:
            process.kill()
    assert code == 0, tail(log)
    assert flag.exists() == (kill_step >= 0), tail(log)
    return out, log


@pytest.mark.parametrize(
    ("optimizer", "step_context"),
    [
        ("adamw", True),
        ("adamw", False),  # wrap=deadpool.ddp, the loop body not under `with job.step()` (noting_group)
        ("zero", True),
        ("sgd-momentum", True),
        ("sparse-adam", True),
        ("lbfgs", True),
        ("adam-tensor-lr", True),
    ],
)
async def test_user_state_and_every_kind_of_optimizer_state_survive_a_swap_bit_identical(
    tmp_path: Path, optimizer: str, step_context: bool
) -> None:
    flags = ["--optimizer", optimizer] + ([] if step_context else ["--no-step-context"])
    async with Stack(StackConfig(workdir=tmp_path, stores=2)) as stack:
        reference, _ = await run(stack.url, f"{optimizer}-ref", tmp_path, -1, *flags)
        swapped, log = await run(stack.url, f"{optimizer}-swap", tmp_path, KILL_STEP, *flags)
    assert '"rebuild done"' in log.read_text(errors="replace"), tail(log)
    identical, count, differences = compare_final_states(reference, swapped)
    assert identical and count > 0, differences[:8]
