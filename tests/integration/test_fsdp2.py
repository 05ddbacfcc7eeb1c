"""FSDP2 under the job: 4 ranks shard a model with `fully_shard` over each generation's group; rank 2
is SIGKILLed mid-step, a spare takes its rank, reshards a fresh copy of the model over the new group
and loads the dead rank's shards; every rank's weight and optimizer shards end equal to a run without
the kill (`torch.equal`)."""

from __future__ import annotations

import sys
from pathlib import Path

from deadpool_cli.stack import Stack, StackConfig
from deadpool_cli.weights_check import compare_final_states
from tests.integration.jobs import run_to_end, tail

SCRIPT = Path(__file__).resolve().parent / "scripts" / "fsdp_loop.py"
RUN_TIMEOUT_S = 240.0


async def run(nats_args: list[str], job: str, workdir: Path, kill_step: int) -> tuple[Path, Path]:
    out, log, flag = workdir / job, workdir / f"{job}.log", workdir / f"{job}.killed"
    command = [sys.executable, "-m", "deadpool_cli", "launch", *nats_args, "--job", job, "--nproc", "4"]
    spares = "1" if kill_step >= 0 else "0"  # the reference needs none
    command += ["--spares", spares, "--collective-timeout-s", "20", str(SCRIPT), "--steps", "10"]
    command += ["--kill-step", str(kill_step), "--flag", str(flag), "--out", str(out)]
    assert await run_to_end(command, log, RUN_TIMEOUT_S) == 0, tail(log)
    assert flag.exists() == (kill_step >= 0), tail(log)
    return out, log


async def test_a_fully_sharded_model_survives_a_swap_bit_identical(tmp_path: Path) -> None:
    async with Stack(StackConfig(workdir=tmp_path, stores=2)) as stack:
        reference, _ = await run(stack.nats_args, "fsdp-ref", tmp_path, kill_step=-1)
        swapped, log = await run(stack.nats_args, "fsdp-swap", tmp_path, kill_step=5)
    assert '"rebuild done"' in log.read_text(errors="replace"), tail(log)
    identical, count, differences = compare_final_states(reference, swapped)
    assert identical and count > 0, differences[:8]
