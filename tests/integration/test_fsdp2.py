"""FSDP2 under the job: 4 ranks shard a model with `fully_shard` over each generation's group; rank 2
is SIGKILLed mid-step, a spare takes its rank, reshards a fresh copy of the model over the new group
and loads the dead rank's shards; every rank's weight and optimizer shards end equal to a run without
the kill (`torch.equal`). The same under HSDP, each rank snapshotting half of its shards."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from deadpool_cli.stack import Stack, StackConfig
from deadpool_cli.weights_check import compare_final_states
from tests.integration.jobs import run_to_end, tail

SCRIPT = Path(__file__).resolve().parent / "scripts" / "fsdp_loop.py"
RUN_TIMEOUT_S = 240.0


async def run(
    nats_args: list[str], job: str, workdir: Path, kill_step: int, *flags: str, replicas: int = 1
) -> tuple[Path, Path]:
    """Run the script to its end: `flags` go to `deadpool launch`, `replicas` to the script."""
    out, log, flag = workdir / job, workdir / f"{job}.log", workdir / f"{job}.killed"
    command = [sys.executable, "-m", "deadpool_cli", "launch", *nats_args, "--job", job, "--nproc", "4", *flags]
    # One spare for the kill, and one respawn: a survivor caught in a collective with the killed rank
    # that its broken gloo group cannot release exits (`MemberErrorCause.STUCK_COLLECTIVE`) to be swapped
    # in its turn. With the one spare taken, the job waited for another until the run's timeout (once
    # in CI, HSDP). The reference needs none.
    spares = ["--spares", "1", "--respawns", "1"] if kill_step >= 0 else ["--spares", "0"]
    command += [*spares, "--collective-timeout-s", "20", str(SCRIPT), "--steps", "10"]
    command += ["--kill-step", str(kill_step), "--flag", str(flag), "--out", str(out), "--replicas", str(replicas)]
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


async def test_hsdp_snapshots_half_of_each_shard_per_replica_and_survives_a_swap_bit_identical(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """HSDP: the same 4 ranks as 2 replicas of 2 shards. Each rank snapshots only its half of its
    shards (the other replica of them snapshots the other half); after the kill the ranks of each
    replica group exchange their halves, and every rank's shards end bit-identical: once restoring from
    the host's crash copy, once from the stores."""
    stats = tmp_path / "stats"
    monkeypatch.setenv("DEADPOOL_STATS_DIR", str(stats))
    async with Stack(StackConfig(workdir=tmp_path, stores=2)) as stack:
        reference, _ = await run(stack.nats_args, "hsdp-ref", tmp_path, -1, replicas=2)
        swapped = {
            "host_copy": await run(stack.nats_args, "hsdp-swap", tmp_path, 5, replicas=2),
            "store": await run(stack.nats_args, "hsdp-swap-stores", tmp_path, 5, "--no-host-copy", replicas=2),
        }
    for source, (out, log) in swapped.items():
        rebuilt = [
            json.loads(line) for line in log.read_text(errors="replace").splitlines() if '"rebuild done"' in line
        ]
        spare = sorted((r for r in rebuilt if r["generation"] > 1 and r["rank"] == 2), key=lambda r: r["generation"])
        assert spare and spare[0]["source"] == source, tail(log)  # its half of shard 0, from there
        identical, count, differences = compare_final_states(reference, out)
        assert identical and count > 0, (source, differences[:8])

    # The two replicas of a shard hold each of its tensors once between them (with 24-wide layers, the
    # state tree and the alignment of each tensor add a little): not twice, as unpartitioned.
    records = [json.loads(p.read_text()) for p in stats.glob("*.json")]
    ranked = [r for r in records if r["rank"] is not None]  # not the respawned spare, never given a rank
    sizes = {(r["rank"], r["member"]): (r["snapshot_bytes"], r["snapshot_bytes_whole"]) for r in ranked}
    by_rank = {rank: size for (rank, _), size in sorted(sizes.items()) if rank >= 0 and size[0]}
    assert sorted(by_rank) == [0, 1, 2, 3], sizes
    for shard in range(2):
        (mine, whole), (peers, _) = by_rank[shard], by_rank[shard + 2]
        pair = (mine + peers) / whole
        assert pair < 1.25, f"shard {shard}'s two replicas snapshotted {pair:.2f} times its bytes, not about once"
