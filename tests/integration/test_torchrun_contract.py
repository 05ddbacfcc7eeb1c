"""The torchrun contract: `deadpool launch -m module` runs a module, sets WORLD_SIZE,
LOCAL_WORLD_SIZE and LOCAL_RANK for every member and RANK for those started holding a rank (a spare
has none), gives every member a GPU of its own when told of devices (spares too: `--gpus`), and a
loop left early with `break` ends the job cleanly: the spare is released and the launcher exits 0,
long before any wait for the last step could run out. Its body, not under `with job.step()`, still
makes one step per pass."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from deadpool.job import FINISH_WAIT_S
from deadpool_cli.stack import Stack, StackConfig
from tests.integration.jobs import run_to_end, tail

MODULE = "tests.integration.scripts.early_stop"
RUN_TIMEOUT_S = 120.0


async def test_a_module_launched_like_torchrun_sees_its_variables_and_ends_cleanly_when_its_loop_breaks(
    tmp_path: Path,
) -> None:
    out, log = tmp_path / "out", tmp_path / "launch.log"
    async with Stack(StackConfig(workdir=tmp_path, stores=1, replication=1)) as stack:
        command = [sys.executable, "-m", "deadpool_cli", "launch", *stack.nats_args, "--job", "early"]
        command += [
            "--nproc-per-node",
            "2",
            "--spares",
            "1",
            "--gpus",
            "5,6,7",
            "-m",
            MODULE,
            "--stop-at",
            "3",
            "--out",
            str(out),
        ]
        started = time.monotonic()
        code = await run_to_end(command, log, RUN_TIMEOUT_S)
        took_s = time.monotonic() - started
    assert code == 0, tail(log)
    assert took_s < FINISH_WAIT_S, "the job waited for a last step that never came"
    reports = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    assert len(reports) == 3, tail(log)  # two ranks and the released spare
    ranks = sorted((r for r in reports if r["rank"] is not None), key=lambda r: r["rank"])
    (spare,) = [r for r in reports if r["rank"] is None]
    assert [r["last_step"] for r in ranks] == [2, 2]
    assert [r["env"]["RANK"] for r in ranks] == ["0", "1"] and spare["env"]["RANK"] is None
    assert {r["env"]["WORLD_SIZE"] for r in reports} == {"2"}
    assert {r["env"]["LOCAL_WORLD_SIZE"] for r in reports} == {"2"}
    assert sorted(r["env"]["LOCAL_RANK"] for r in reports) == ["0", "1", "2"]
    assert {r["env"]["CUDA_VISIBLE_DEVICES"] for r in reports} == {"5,6,7"}  # none shared: as with torchrun,
    assert all(r["env"]["DEADPOOL_DEVICE"] == r["env"]["LOCAL_RANK"] for r in reports)  # cuda:LOCAL_RANK
