"""A data loader's worker processes are never forked inside a rebuild.

A `StatefulDataLoader` with workers forks them the first time its state is read, and then waits
without a bound for each to start. The first read used to be the formation's snapshot (SEAL), inside
the rebuild, with DeadPool's threads running: the one wait without a bound between a rank's
"rendezvous" and its "rebuild done", where a rank of `test_stateful_loops` once stayed for minutes while
its peer's first collective timed out (issue 21). A ranked member's `attach` now reads every registered
object's state before DeadPool starts a thread, and the loop's first `iter(loader)` takes that iterator;
a job resumed from the durable tier captures, in SEAL, the loader state it has just loaded, and its
loop forks the workers in its first step.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from deadpool_cli.stack import Stack, StackConfig

from .jobs import run_to_end, tail

SCRIPT = Path(__file__).resolve().parent / "scripts" / "loader_forks.py"
WORKERS = 2


def forks_of(out: Path) -> list[dict[str, int]]:
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]


async def test_a_rebuild_never_forks_the_loaders_workers_neither_at_formation_nor_at_a_resume(
    tmp_path: Path,
) -> None:
    durable = tmp_path / "durable"
    async with Stack(StackConfig(workdir=tmp_path / "stack", stores=1, replication=1)) as stack:
        for job, steps, flags in (
            ("forks", 3, ["--durable-dir", str(durable), "--durable-every-steps", "2"]),
            ("forks-resumed", 5, ["--resume-from", str(durable)]),
        ):
            command = [sys.executable, "-m", "deadpool_cli", "launch", *stack.nats_args, "--job", job, *flags]
            command += ["--nproc", "2", "--spares", "0", str(SCRIPT), "--steps", str(steps)]
            command += ["--out", str(tmp_path / job)]
            log = tmp_path / f"{job}.log"
            assert await run_to_end(command, log, 120.0) == 0, tail(log)
            assert '"rebuild done"' in log.read_text(errors="replace"), tail(log)
    # Within one epoch each rank forks its workers once: at attach, or (resumed) in its first step.
    for job in ("forks", "forks-resumed"):
        assert forks_of(tmp_path / job) == [{"total": WORKERS, "in_rebuild": 0}] * 2, job
    assert "resumed from the durable tier" in (tmp_path / "forks-resumed.log").read_text(errors="replace")
