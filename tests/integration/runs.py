"""Starting a run of a job on the bus, as `deadpool launch` does before its members say hello."""

from __future__ import annotations

import time

from nats.aio.client import Client

from deadpool_protocol import RunReply, RunStart, Subjects, decode, encode

RUN = "run-1"
"""The run tests start their jobs in (members name it in their hellos)."""


async def start_run(
    nc: Client, job: str, world_size: int, run: str = RUN, launcher: str = "l0", timeout_s: float = 30.0
) -> RunReply:
    """Ask the swapper to start `run` of `job`, asking again until a swapper leads and answers."""
    request = encode(RunStart(job, 0, run, world_size, launcher, time.time()))
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return decode((await nc.request(Subjects.for_job(job).run_start, request, timeout=2.0)).data, RunReply)
        except Exception:
            if time.monotonic() > deadline:
                raise
