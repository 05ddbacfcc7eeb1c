"""A member sends each snapshot once: to the first store of its placement, which passes it on to the
next (`chain_forward`). Where the chain stops short, the member uploads to the stores it missed itself,
so every placed store still holds a verified copy.

Real data-plane servers on loopback, the member's own snapshot worker and its stream thread.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from structlog.testing import capture_logs

from deadpool.snapshot_worker import SnapshotWorker
from deadpool.store_client import UploadKey
from deadpool_protocol import StoreAddress, StoreStatus
from deadpool_runtime.logs import get_logger
from deadpool_store.chain_forward import StoreDirectory
from deadpool_store.dataplane_server import DataPlaneServer
from deadpool_store.memory import SnapshotMemory, StoredSnapshot

from .test_snapshot_worker import model_and_plan
from .test_store_replication import fetch

WAIT_S = 20.0


async def test_the_member_sends_each_snapshot_once_and_uploads_itself_to_the_stores_a_chain_missed() -> None:
    sealed: dict[str, list[int]] = {"s0": [], "s1": []}

    def on_sealed(store: str) -> Callable[[StoredSnapshot], Awaitable[None]]:
        async def record(snap: StoredSnapshot) -> None:
            sealed[store].append(snap.step)

        return record

    directory = StoreDirectory("s0")
    head = DataPlaneServer(SnapshotMemory(64 << 20), on_sealed("s0"), get_logger(store="s0"), directory=directory)
    tail = DataPlaneServer(SnapshotMemory(64 << 20), on_sealed("s1"), get_logger(store="s1"))
    s0 = StoreAddress("s0", "127.0.0.1", await head.start("127.0.0.1", 0))
    s1 = StoreAddress("s1", "127.0.0.1", await tail.start("127.0.0.1", 0))
    _, sources, layout = model_and_plan()
    worker = SnapshotWorker(get_logger(test="chain"), chunk_bytes=4096)
    size = layout.total_bytes

    async def streamed(step: int) -> None:
        request = worker.capture(UploadKey("j", 1, 0, "m", step), layout, sources, b"meta", [s0, s1])
        assert request is not None
        assert await asyncio.to_thread(request.done.wait, WAIT_S), f"step {step} not streamed"
        assert request.sealed_on == ["s0", "s1"], request.sealed_on

    try:
        with capture_logs() as logs:
            await streamed(1)  # s0 has not heard of s1: the chain stops at once, the member uploads to s1
        (stopped,) = [e for e in logs if e["event"] == "snapshot chain stopped short"]
        assert "s1 is not a store this one has heard from" in stopped["reason"]
        assert worker.sent_bytes == 2 * size and sealed == {"s0": [1], "s1": [1]}

        directory.heard(StoreStatus("s1", s1.host, s1.port, 0, 64 << 20, 0, time.time()), time.monotonic())
        await streamed(2)
        assert worker.sent_bytes == 3 * size, "the chain's copy was sent by the member"
        assert sealed == {"s0": [1, 2], "s1": [1, 2]}
        copies = [(await asyncio.to_thread(fetch, address, "j", 0, 2))[0] for address in (s0, s1)]
        assert copies[0] == copies[1] and len(copies[0]) == size  # each whole, verified, and served
    finally:
        worker.close()
        await head.stop()
        await tail.stop()
