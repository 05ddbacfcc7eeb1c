"""Real store processes: a sealed snapshot copied store to store on request, verified end to end (a
copy corrupted in the source's memory is refused by the target), and uploads never sealed freed."""

from __future__ import annotations

import asyncio
import json
import os
import socket

import pytest
from nats.aio.client import Client

from deadpool.store_client import StoreClientError, StoreConnection, UploadKey
from deadpool_protocol import Replicate, SnapshotComplete, StoreAddress, StoreStatus, Subjects, decode, encode
from deadpool_protocol.dataplane import PutChunk, encode_frame
from deadpool_protocol.subjects import STORE_STATUS, store_replicate

from .conftest import SpawnService

WAIT_S = 30.0


async def start_stores(nc: Client, spawn_service: SpawnService, *args: str, count: int = 2) -> list[StoreAddress]:
    statuses: dict[str, StoreStatus] = {}
    seen = asyncio.Event()

    async def on_status(msg: object) -> None:
        status = decode(msg.data, StoreStatus)  # type: ignore[attr-defined]
        statuses[status.store] = status
        if len(statuses) == count:
            seen.set()

    sub = await nc.subscribe(STORE_STATUS, cb=on_status)
    for i in range(count):
        spawn_service("store", "--id", f"s{i}", "--capacity-bytes", str(64 * 1024 * 1024), *args)
    await asyncio.wait_for(seen.wait(), WAIT_S)
    await sub.unsubscribe()
    return [StoreAddress(s.store, s.host, s.port) for s in sorted(statuses.values(), key=lambda s: s.store)]


def upload(address: StoreAddress, key: UploadKey, data: bytes) -> None:
    conn = StoreConnection(address)
    conn.upload(key, memoryview(data), 256 * 1024, b"layout", lambda: False)
    conn.close()


def fetch(address: StoreAddress, job: str, rank: int, step: int) -> tuple[bytes, int, str]:
    received = bytearray()

    def destination(meta: bytes, total: int) -> memoryview:
        received.extend(bytes(total))
        return memoryview(received)

    conn = StoreConnection(address)
    try:
        got = conn.fetch(job, rank, step, destination)
    finally:
        conn.close()
    return bytes(received), got.generation, got.member


async def completes_of(nc: Client, job: str) -> asyncio.Queue[SnapshotComplete]:
    queue: asyncio.Queue[SnapshotComplete] = asyncio.Queue()

    async def on_complete(msg: object) -> None:
        await queue.put(decode(msg.data, SnapshotComplete))  # type: ignore[attr-defined]

    await nc.subscribe(Subjects.for_job(job).snapshot_complete, cb=on_complete)
    await nc.flush()
    return queue


async def next_from(completes: asyncio.Queue[SnapshotComplete], store: str) -> SnapshotComplete:
    """The next report from `store` (events are delivered at least once: the source's may repeat)."""
    while True:
        complete = await completes.get()
        if complete.store == store:
            return complete


async def test_a_snapshot_is_copied_store_to_store_with_its_generation_member_and_checksums(
    nc: Client, spawn_service: SpawnService
) -> None:
    source, target = await start_stores(nc, spawn_service)
    completes = await completes_of(nc, "j")
    data = os.urandom(3 * 1024 * 1024 + 17)
    await asyncio.to_thread(upload, source, UploadKey("j", 4, 1, "member-a", 9), data)
    assert (await asyncio.wait_for(completes.get(), WAIT_S)).store == "s0"

    request = Replicate("j", 4, 1, 9, "s0", target)
    await nc.publish(store_replicate("s0"), encode(request))
    await nc.publish(store_replicate("s0"), encode(request))  # asked twice (a retransmission): one copy
    complete = await asyncio.wait_for(next_from(completes, "s1"), WAIT_S)
    assert (complete.store, complete.ranks, complete.step, complete.generation) == ("s1", [1], 9, 4)
    copied, generation, member = await asyncio.to_thread(fetch, target, "j", 1, 9)
    assert copied == data and generation == 4 and member == "member-a"

    def fetch_as_of(committed_generation: int) -> None:
        conn = StoreConnection(target)
        try:
            conn.fetch("j", 1, 9, lambda meta, total: memoryview(bytearray(total)), committed_generation)
        finally:
            conn.close()

    # A copy of another generation than the one that committed the step is an abandoned timeline's.
    with pytest.raises(StoreClientError, match="abandoned timeline"):
        await asyncio.to_thread(fetch_as_of, 5)
    await asyncio.to_thread(fetch_as_of, 4)


async def test_a_copy_corrupted_in_the_source_is_refused_by_the_target_and_fails_its_fetch(
    nc: Client, spawn_service: SpawnService, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DEADPOOL_FAULT_INJECTION", "1")
    source, target = await start_stores(nc, spawn_service)
    completes = await completes_of(nc, "j")
    await asyncio.to_thread(upload, source, UploadKey("j", 1, 0, "m", 3), os.urandom(1024 * 1024))
    await asyncio.wait_for(completes.get(), WAIT_S)

    reply = await nc.request("deadpool.store.s0.corrupt", json.dumps({"job": "j", "rank": 0}).encode(), timeout=5)
    assert json.loads(reply.data)["corrupted"] == [3]
    with pytest.raises(StoreClientError, match="fails its checksum"):
        await asyncio.to_thread(fetch, source, "j", 0, 3)

    await nc.publish(store_replicate("s0"), encode(Replicate("j", 1, 0, 3, "s0", target)))
    await nc.flush()
    with pytest.raises(TimeoutError):  # the target compared the chunks with the manifest: refused
        await asyncio.wait_for(next_from(completes, "s1"), 3.0)
    with pytest.raises(StoreClientError, match="no complete snapshot"):
        await asyncio.to_thread(fetch, target, "j", 0, 3)


async def test_an_upload_never_sealed_is_freed_after_its_bound(nc: Client, spawn_service: SpawnService) -> None:
    (address,) = await start_stores(nc, spawn_service, "--unsealed-max-s", "2.0", count=1)
    statuses: asyncio.Queue[StoreStatus] = asyncio.Queue()

    async def on_status(msg: object) -> None:
        await statuses.put(decode(msg.data, StoreStatus))  # type: ignore[attr-defined]

    await nc.subscribe(STORE_STATUS, cb=on_status)
    sock = socket.create_connection((address.host, address.port))
    try:  # one chunk of a 1 MiB snapshot, then nothing: its sender died
        sock.sendall(encode_frame(PutChunk("j", 1, 0, "m", 5, 0, 4096, 1024 * 1024)) + os.urandom(4096))

        async def until(predicate: object) -> StoreStatus:
            while True:
                status = await statuses.get()
                if predicate(status):  # type: ignore[operator]
                    return status

        opened = await asyncio.wait_for(until(lambda s: s.unsealed == 1), WAIT_S)
        assert opened.used_bytes == 4096  # what it sent, not the 1 MiB it announced
        freed = await asyncio.wait_for(until(lambda s: s.unsealed == 0), WAIT_S)
        assert freed.used_bytes == 0 and freed.snapshots == 0
    finally:
        sock.close()
