"""The detector watches only members a rebuild or the job record named (issue 24, finding 9: 5,000 forged
heartbeats of invented members became 5,000 stored failure events). A spare accepted after the last
rebuild is named by the job record, which the detector reads when it hears of it: its silence is a
verdict. An invented member's silence is nothing."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

from nats.aio.client import Client
from nats.aio.msg import Msg

from deadpool_cli.stack import Stack, StackConfig
from deadpool_protocol import Failure, Heartbeat, HelloReply, MemberHello, Subjects, decode, encode

from .runs import RUN, start_run

JOB = "named"
S = Subjects.for_job(JOB)
HEARTBEAT_TIMEOUT_S = 1.0
INVENTED = 200


async def watched(nc: Client) -> dict[str, object]:
    reply = await nc.request("deadpool.detector.status", b"", timeout=2.0)
    members: dict[str, object] = json.loads(reply.data).get(JOB, {}).get("watched", {})
    return members


async def test_a_late_spare_is_watched_from_the_job_record_and_invented_members_never(tmp_path: Path) -> None:
    config = StackConfig(workdir=tmp_path, stores=1, replication=1, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)
    async with Stack(config) as stack:
        admin = await stack.connect()
        failures: asyncio.Queue[Failure] = asyncio.Queue()

        async def on_failure(msg: Msg) -> None:
            failures.put_nowait(decode(msg.data, Failure))

        await admin.subscribe(S.failure, cb=on_failure)
        assert (await start_run(admin, JOB, 1)).accepted
        beating = {"rank-0", "late-spare", *(f"invented-{n}" for n in range(INVENTED))}

        async def beats() -> None:
            while True:
                for member in list(beating):
                    rank = 0 if member == "rank-0" else -1
                    await admin.publish(
                        S.heartbeat, encode(Heartbeat(JOB, 1, member, rank, 1, 1, False, 0.0, time.time()))
                    )
                await asyncio.sleep(0.1)

        task = asyncio.create_task(beats())
        try:
            for member, port in (("rank-0", 29500), ("late-spare", 29501)):  # formation, then a spare
                hello = MemberHello(
                    JOB, 0, member, "host-a", os.getpid(), "", 0, 1, "127.0.0.1", port, time.time(), run=RUN
                )
                reply = decode((await admin.request(S.hello, encode(hello), timeout=30)).data, HelloReply)
                assert reply.accepted, reply.reason
            deadline = time.monotonic() + 30
            while "late-spare" not in await watched(admin):  # polling a status: naming publishes nothing
                assert time.monotonic() < deadline, "the late spare was never named"
                await asyncio.sleep(0.1)
            assert not any(m.startswith("invented-") for m in await watched(admin))
            beating.difference_update({"late-spare", *(f"invented-{n}" for n in range(INVENTED))})
            failure = await asyncio.wait_for(failures.get(), 30)
            assert (failure.member, failure.reason) == ("late-spare", "heartbeat"), failure
            await asyncio.sleep(2 * HEARTBEAT_TIMEOUT_S)  # silent as long as the spare, whose verdict came
            later = [failures.get_nowait() for _ in range(failures.qsize())]
            assert {f.member for f in later} <= {"late-spare"}, later  # its verdict repeated, nothing invented
        finally:
            task.cancel()
            await admin.close()
