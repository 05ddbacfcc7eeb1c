"""The state real loops keep survives a swap, bit for bit: a rank SIGKILLed mid-step is replaced by a
spare, and every rank's weights, optimizer state, LR scheduler, GradScaler, StatefulDataLoader (with
worker processes) and EMA end equal to a run without the kill (`torch.equal`, `==`).

One loop script (`scripts/stateful_loop.py`), shaped like a torchrun script, run with the optimizers
whose state is not plain tensors (SparseAdam, LBFGS), with the job's ZeRO optimizer whose scheduler
is built for each generation, and with the user's AdamW under `wrap=deadpool.ddp` and no
`with job.step()`. SGD with momentum and a tensor learning rate are restored exactly in
`tests/unit/test_state_tree.py`. One control plane serves every case (CI time).
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from deadpool_cli.stack import Stack, StackConfig
from deadpool_cli.weights_check import compare_final_states
from tests.integration.jobs import run_to_end, tail

SCRIPT = Path(__file__).resolve().parent / "scripts" / "stateful_loop.py"
STEPS = 12
KILL_STEP = 6
RUN_TIMEOUT_S = 240.0


pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    async with Stack(StackConfig(workdir=tmp_path_factory.mktemp("stack"), stores=2)) as running:
        yield running


async def run(nats_args: list[str], job: str, workdir: Path, kill_step: int, *flags: str) -> tuple[Path, Path]:
    out, log, flag = workdir / job, workdir / f"{job}.log", workdir / f"{job}.killed"
    spares = "1" if kill_step >= 0 else "0"  # the reference needs none
    command = [sys.executable, "-m", "deadpool_cli", "launch", *nats_args, "--job", job, "--nproc", "2"]
    command += ["--spares", spares, "--collective-timeout-s", "20", str(SCRIPT), "--steps", str(STEPS)]
    command += ["--kill-step", str(kill_step), "--flag", str(flag), "--out", str(out)]
    command += list(flags)
    assert await run_to_end(command, log, RUN_TIMEOUT_S) == 0, tail(log)
    assert flag.exists() == (kill_step >= 0), tail(log)
    return out, log


@pytest.mark.parametrize(
    ("optimizer", "step_context"),
    [
        ("adamw", False),  # wrap=deadpool.ddp, the loop body not under `with job.step()` (noting_group)
        ("zero", True),
        ("sparse-adam", True),
        ("lbfgs", True),
    ],
)
async def test_user_state_and_every_kind_of_optimizer_state_survive_a_swap_bit_identical(
    stack: Stack, tmp_path: Path, optimizer: str, step_context: bool
) -> None:
    flags = ["--optimizer", optimizer] + ([] if step_context else ["--no-step-context"])
    reference, _ = await run(stack.nats_args, f"{optimizer}-ref", tmp_path, -1, *flags)
    swapped, log = await run(stack.nats_args, f"{optimizer}-swap", tmp_path, KILL_STEP, *flags)
    assert '"rebuild done"' in log.read_text(errors="replace"), tail(log)
    identical, count, differences = compare_final_states(reference, swapped)
    assert identical and count > 0, differences[:8]
