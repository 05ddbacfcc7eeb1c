"""A real store process under a flood of bad connections on loopback: it writes a bounded number of
refusal lines (a flood once wrote 9,000 lines in 30 s), says how many it suppressed, and keeps
serving an honest client."""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

from nats.aio.client import Client

from deadpool_protocol import StoreStatus, decode
from deadpool_protocol.subjects import STORE_STATUS
from deadpool_runtime.log_limit import REFUSAL_LINES_PER_PERIOD

from .conftest import SpawnService
from .test_store_dataplane_limits import upload

BAD_CONNECTIONS = 1500
AT_ONCE = 50
"""Bad connections open at a time (under the store's per-peer bound, and over it at times)."""
REFUSAL_EVENTS = {"data plane connection refused", "data plane connection dropped", "data plane peer went away"}
STOP_WAIT_S = 10.0


async def bad_connection(port: int) -> None:
    """A frame header announced at 4 GiB: the store refuses it and drops the connection."""
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return
    try:
        writer.write(b"\xff\xff\xff\xff")
        await writer.drain()
        await asyncio.wait_for(reader.read(1), 5.0)
    except (OSError, TimeoutError):
        pass
    finally:
        writer.close()


async def test_a_flooded_store_logs_a_bounded_number_of_refusals_and_keeps_serving(
    nc: Client, spawn_service: SpawnService, tmp_path: Path
) -> None:
    statuses: asyncio.Queue[StoreStatus] = asyncio.Queue()

    async def on_status(msg: object) -> None:
        await statuses.put(decode(msg.data, StoreStatus))  # type: ignore[attr-defined]

    sub = await nc.subscribe(STORE_STATUS, cb=on_status)
    store = spawn_service("store", "--id", "s0", "--capacity-bytes", str(64 * 1024 * 1024))
    port = (await asyncio.wait_for(statuses.get(), 30)).port
    await sub.unsubscribe()

    for first in range(0, BAD_CONNECTIONS, AT_ONCE):
        await asyncio.gather(*(bad_connection(port) for _ in range(first, first + AT_ONCE)))
    assert await upload(port, step=1), "an honest upload after the flood was not sealed"

    store.send_signal(signal.SIGTERM)  # a stop writes the count of what it suppressed
    assert await asyncio.to_thread(store.wait, STOP_WAIT_S) == 0
    lines = [json.loads(line) for line in (tmp_path / "store-0.log").read_text().splitlines() if line.startswith("{")]
    refusals = [line for line in lines if line["event"] in REFUSAL_EVENTS]
    suppressed = sum(line.get("suppressed", 0) for line in lines if line["event"].endswith("more refusals suppressed"))
    # each kind of refusal: its lines per period, and the flood takes less than two periods
    assert 0 < len(refusals) <= 2 * len(REFUSAL_EVENTS) * REFUSAL_LINES_PER_PERIOD, len(refusals)
    assert suppressed >= BAD_CONNECTIONS - len(refusals)
