"""Launching the example job under a test's control plane, and waiting on what the bus says about it.

Every wait is bounded: a run that never gets there fails the test with the launcher's log, instead of
hanging until pytest's own timeout.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nats.aio.client import Client

from deadpool_cli.job_watch import JobWatch
from deadpool_cli.stack import Stack
from deadpool_cli.weights_check import compare_final_states
from deadpool_runtime.logs import get_logger

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py"
WAIT_S = 120.0


async def watcher(stack: Stack, job: str) -> tuple[Client, JobWatch]:
    """A NATS client (reconnecting quietly, to any server of a cluster) and a watch of `job`."""

    async def quiet(_exc: Exception) -> None:
        return None

    nc = await stack.connect(max_reconnect_attempts=-1, reconnect_time_wait=0.2, error_cb=quiet)
    watch = JobWatch(nc, job, get_logger(test=job))
    await watch.start()
    return nc, watch


async def launch(
    nats_args: list[str],
    job: str,
    log: Path,
    *,
    steps: int,
    nproc: int = 4,
    spares: int = 2,
    respawns: int = 0,
    out: Path | None = None,
    script: Path = SCRIPT,
    env: dict[str, str] | None = None,
    launch_args: tuple[str, ...] = (),
) -> asyncio.subprocess.Process:
    command = [sys.executable, "-m", "deadpool_cli", "launch", *nats_args, "--job", job, "--nproc", str(nproc)]
    command += ["--spares", str(spares), "--respawns", str(respawns), "--collective-timeout-s", "20", *launch_args]
    command += [str(script), "--steps", str(steps), "--model-size", "tiny"]
    if out is not None:
        command += ["--out", str(out)]
    with open(log, "wb") as sink:
        return await asyncio.create_subprocess_exec(
            *command, stdout=sink, stderr=sink, env={**os.environ, **(env or {})}
        )


async def assert_same_as_uninterrupted(
    stack: Stack,
    job: str,
    out: Path,
    workdir: Path,
    *,
    steps: int,
    spares: int,
    env: dict[str, str] | None = None,
) -> None:
    """Run `job` again as `<job>-ref`, 2 ranks and no fault, and check that the final weights the faulted
    run left in `out` equal its own, bit for bit (`torch.equal` on every tensor)."""
    reference, ref_log = workdir / "reference", workdir / "ref.log"
    plain = await launch(
        stack.nats_args, f"{job}-ref", ref_log, steps=steps, nproc=2, spares=spares, out=reference, env=env
    )
    try:
        assert await finish(plain, ref_log) == 0, tail(ref_log)
    finally:
        stop_all(plain)
    identical, tensors, differences = compare_final_states(out, reference)
    assert identical and tensors > 0, differences[:5]


def rank_steps(watch: JobWatch) -> list[int]:
    """Each rank's last reported step in the newest generation (-1 where unknown)."""
    if watch.rebuild is None:
        return []
    return [watch.members[m].step if m in watch.members else -1 for m in watch.rebuild.ranks]


def every_rank_at(watch: JobWatch, step: int) -> bool:
    steps = rank_steps(watch)
    return bool(steps) and min(steps) >= step


async def until(
    watch: JobWatch, predicate: Callable[[], bool], log: Path, what: str, timeout_s: float = WAIT_S
) -> None:
    try:
        await asyncio.wait_for(watch.wait_for(predicate), timeout_s)
    except TimeoutError:
        raise AssertionError(f"{what}: not within {timeout_s} s\n{tail(log)}") from None


async def finish(process: asyncio.subprocess.Process, log: Path, timeout_s: float = 240.0) -> int:
    try:
        return await asyncio.wait_for(process.wait(), timeout_s)
    except TimeoutError:
        process.send_signal(signal.SIGTERM)
        await process.wait()
        raise AssertionError(f"the launcher did not finish within {timeout_s} s\n{tail(log)}") from None


async def run_to_end(command: list[str], log: Path, timeout_s: float = 240.0) -> int:
    """Run `command` (its output to `log`) to its end; its exit code. Fails the test if it runs longer."""
    with open(log, "wb") as sink:
        process = await asyncio.create_subprocess_exec(*command, stdout=sink, stderr=sink)
    try:
        return await finish(process, log, timeout_s)
    finally:
        stop_all(process)


def kill(watch: JobWatch, member: str, sig: signal.Signals = signal.SIGKILL) -> int:
    pid = watch.members[member].pid
    os.kill(pid, sig)
    return pid


def tail(log: Path, lines: int = 40) -> str:
    if not log.exists():
        return f"({log} missing)"
    noise = ('"heartbeat', "reducer.cpp", "UserWarning", "_conversion_method_template")
    kept = [line for line in log.read_text(errors="replace").splitlines() if not any(n in line for n in noise)]
    return "\n".join(kept[-lines:])


def stop_all(*processes: Any) -> None:
    for process in processes:
        if process is not None and process.returncode is None:
            process.kill()
