"""The durable tier end to end: a job persists every 6 steps as `torch.distributed.checkpoint` files
while it trains; a second job resumes from them (`deadpool launch --resume-from`) and ends with the
same weights as the run that never stopped. The newest persisted step has a corrupt file on one rank,
so the ranks must agree on the older step that both have intact.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from deadpool.durable_tier import complete_steps, rank_files
from deadpool_cli.stack import Stack, StackConfig
from deadpool_cli.weights_check import compare_final_states

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py"
STEPS = 20
RUN_TIMEOUT_S = 180.0


async def launch(nats_args: list[str], job: str, out: Path, log: Path, *flags: str) -> int:
    command = [sys.executable, "-m", "deadpool_cli", "launch", *nats_args, "--job", job, "--nproc", "2"]
    command += ["--spares", "0", *flags, str(SCRIPT), "--steps", str(STEPS), "--model-size", "tiny"]
    command += ["--out", str(out)]
    with open(log, "wb") as sink:
        process = await asyncio.create_subprocess_exec(*command, stdout=sink, stderr=sink)
        return await asyncio.wait_for(process.wait(), RUN_TIMEOUT_S)


async def test_a_job_resumed_from_the_durable_tier_ends_as_the_run_that_never_stopped(tmp_path: Path) -> None:
    durable = tmp_path / "durable"
    async with Stack(StackConfig(workdir=tmp_path, stores=2)) as stack:
        first_log = tmp_path / "first.log"
        flags = ("--durable-dir", str(durable), "--durable-every-steps", "6", "--durable-keep", "3")
        code = await launch(stack.nats_args, "durable-first", tmp_path / "first", first_log, *flags)
        assert code == 0, first_log.read_text(errors="replace")[-3000:]
        assert complete_steps(durable, 2) == [18, 12, 6]

        # Standard tools read a rank's files; the manifest has a checksum per tensor.
        checkpoint, manifest = rank_files(durable, 18, 0)
        dcp_to_torch_save(str(checkpoint), str(tmp_path / "rank0.pt"))
        tensors = torch.load(tmp_path / "rank0.pt")
        checksums = json.loads(manifest.read_text())["checksums"]
        assert "param.0" in tensors and set(checksums) == set(tensors)

        broken, _ = rank_files(durable, 18, 1)
        (data_file,) = broken.glob("*.distcp")
        raw = bytearray(data_file.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        data_file.write_bytes(bytes(raw))

        resumed_log = tmp_path / "resumed.log"
        code = await launch(
            stack.nats_args, "durable-resumed", tmp_path / "resumed", resumed_log, "--resume-from", str(durable)
        )
        text = resumed_log.read_text(errors="replace")
        assert code == 0, text[-3000:]
    lines = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    resumed = [line for line in lines if line.get("event") == "resumed from the durable tier"]
    assert sorted(line["rank"] for line in resumed) == [0, 1] and {line["step"] for line in resumed} == {12}
    refused = [line for line in lines if line.get("event") == "persisted step refused"]
    assert refused and all(
        "fails its checksum" in line["reason"] or "cannot be read" in line["reason"] for line in refused
    )
    identical, count, differences = compare_final_states(tmp_path / "first", tmp_path / "resumed")
    assert identical and count > 0, differences[:5]
