"""HSDP under the job: 4 ranks shard a model with `fully_shard` on a 2 x 2 mesh (2 replicas of 2
shards). Each rank snapshots only its half of its shards (the other replica of them snapshots the
other half); rank 2 is SIGKILLed mid-step, a spare takes its rank, the ranks of each replica group
exchange their halves, and every rank's weight and optimizer shards end equal to a run without the
kill (`torch.equal`): once restoring from the host's crash copy, once from the stores."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from deadpool_cli.stack import Stack, StackConfig
from deadpool_cli.weights_check import compare_final_states
from tests.integration.jobs import run_to_end, tail

SCRIPT = Path(__file__).resolve().parent / "scripts" / "hsdp_loop.py"
RUN_TIMEOUT_S = 240.0


async def run(nats_args: list[str], job: str, workdir: Path, kill_step: int, *flags: str) -> tuple[Path, Path]:
    out, log, flag = workdir / job, workdir / f"{job}.log", workdir / f"{job}.killed"
    command = [sys.executable, "-m", "deadpool_cli", "launch", *nats_args, "--job", job, "--nproc", "4", *flags]
    spares = "1" if kill_step >= 0 else "0"  # the reference needs none
    command += ["--spares", spares, "--collective-timeout-s", "20", str(SCRIPT), "--steps", "10"]
    command += ["--kill-step", str(kill_step), "--flag", str(flag), "--out", str(out)]
    assert await run_to_end(command, log, RUN_TIMEOUT_S) == 0, tail(log)
    assert flag.exists() == (kill_step >= 0), tail(log)
    return out, log


async def test_hsdp_snapshots_half_of_each_shard_per_replica_and_survives_a_swap_bit_identical(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stats = tmp_path / "stats"
    monkeypatch.setenv("DEADPOOL_STATS_DIR", str(stats))
    async with Stack(StackConfig(workdir=tmp_path, stores=2)) as stack:
        reference, _ = await run(stack.nats_args, "hsdp-ref", tmp_path, kill_step=-1)
        swapped = {
            "host_copy": await run(stack.nats_args, "hsdp-swap", tmp_path, 5),
            "store": await run(stack.nats_args, "hsdp-swap-stores", tmp_path, 5, "--no-host-copy"),
        }
    for source, (out, log) in swapped.items():
        rebuilt = [
            json.loads(line) for line in log.read_text(errors="replace").splitlines() if '"rebuild done"' in line
        ]
        spare = [r for r in rebuilt if r["generation"] > 1 and r["rank"] == 2]
        assert [r["source"] for r in spare] == [source], tail(log)  # its half of shard 0, from there
        identical, count, differences = compare_final_states(reference, out)
        assert identical and count > 0, (source, differences[:8])

    # The two replicas of a shard hold each of its tensors once between them (with 24-wide layers, the
    # state tree and the alignment of each tensor add a little): not twice, as unpartitioned.
    records = [json.loads(p.read_text()) for p in stats.glob("*.json")]
    sizes = {(r["rank"], r["member"]): (r["snapshot_bytes"], r["snapshot_bytes_whole"]) for r in records}
    by_rank = {rank: size for (rank, _), size in sorted(sizes.items()) if rank is not None and rank >= 0 and size[0]}
    assert sorted(by_rank) == [0, 1, 2, 3], sizes
    for shard in range(2):
        (mine, whole), (peers, _) = by_rank[shard], by_rank[shard + 2]
        pair = (mine + peers) / whole
        assert pair < 1.25, f"shard {shard}'s two replicas snapshotted {pair:.2f} times its bytes, not about once"
