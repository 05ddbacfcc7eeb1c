"""A real store process: snapshots streamed over TCP are verified, announced on NATS and served back."""

from __future__ import annotations

import asyncio
import os
import socket
import urllib.request

import pytest
from nats.aio.client import Client

from deadpool.store_client import StoreClientError, StoreConnection, UploadKey
from deadpool_cli.nats_server import free_port
from deadpool_protocol import (
    Commit,
    JobFinished,
    Reserve,
    SnapshotComplete,
    StoreAddress,
    StoreStatus,
    Subjects,
    decode,
    encode,
)
from deadpool_protocol.dataplane import FRAME_LENGTH, PutChunk, Reply, Seal, decode_frame_header, encode_frame
from deadpool_protocol.subjects import STORE_STATUS, store_reserve

from .conftest import SpawnService


async def start_store(nc: Client, spawn_service: SpawnService, store_id: str = "s0") -> StoreAddress:
    statuses: asyncio.Queue[StoreStatus] = asyncio.Queue()

    async def on_status(msg: object) -> None:
        await statuses.put(decode(msg.data, StoreStatus))  # type: ignore[attr-defined]

    sub = await nc.subscribe(STORE_STATUS, cb=on_status)
    spawn_service("store", "--id", store_id, "--capacity-bytes", str(64 * 1024 * 1024))
    status = await asyncio.wait_for(statuses.get(), 30)
    await sub.unsubscribe()
    return StoreAddress(status.store, status.host, status.port)


def never() -> bool:
    return False


async def test_a_streamed_snapshot_is_sealed_announced_and_served_back(nc: Client, spawn_service: SpawnService) -> None:
    address = await start_store(nc, spawn_service)
    completes: asyncio.Queue[SnapshotComplete] = asyncio.Queue()

    async def on_complete(msg: object) -> None:
        await completes.put(decode(msg.data, SnapshotComplete))  # type: ignore[attr-defined]

    await nc.subscribe(Subjects.for_job("j").snapshot_complete, cb=on_complete)
    await nc.flush()
    data = os.urandom(5 * 1024 * 1024 + 123)
    key = UploadKey("j", 1, 3, "member-a", 7)

    def upload() -> None:
        conn = StoreConnection(address)
        conn.upload(key, memoryview(data), 1024 * 1024, b"layout", never)
        conn.close()

    await asyncio.to_thread(upload)
    complete = await asyncio.wait_for(completes.get(), 10)
    assert (complete.ranks, complete.step, complete.nbytes, complete.store) == ([3], 7, [len(data)], "s0")

    received = bytearray()

    def fetch() -> bytes:
        conn = StoreConnection(address)

        def destination(meta: bytes, total: int) -> memoryview:
            assert meta == b"layout"
            received.extend(bytes(total))
            return memoryview(received)

        got = conn.fetch("j", 3, 7, destination)
        conn.close()
        return got.meta

    assert await asyncio.to_thread(fetch) == b"layout"
    assert bytes(received) == data


async def test_a_corrupted_upload_is_refused_with_its_reason_and_the_store_keeps_serving(
    nc: Client, spawn_service: SpawnService
) -> None:
    address = await start_store(nc, spawn_service)

    def corrupt_then_garbage() -> tuple[Reply, bytes]:
        with socket.create_connection((address.host, address.port), timeout=10) as sock:
            sock.sendall(encode_frame(PutChunk("j", 1, 0, "m", 1, 0, 4, 4)) + b"abcd")
            sock.sendall(encode_frame(Seal("j", 1, 0, "m", 1, 4, 4, [12345], b"")))
            (length,) = FRAME_LENGTH.unpack(sock.recv(FRAME_LENGTH.size, socket.MSG_WAITALL))
            reply = decode_frame_header(sock.recv(length, socket.MSG_WAITALL), Reply)
            sock.sendall(FRAME_LENGTH.pack(3) + b"\xc1\xc1\xc1")  # not msgpack: the store hangs up
            return reply, sock.recv(1)  # type: ignore[return-value]

    reply, after_garbage = await asyncio.to_thread(corrupt_then_garbage)
    assert not reply.ok and "checksum" in reply.error
    assert after_garbage == b""  # connection closed

    def fetch_missing() -> str:
        try:
            StoreConnection(address).fetch("j", 0, 1, lambda meta, n: memoryview(bytearray(n)))
        except StoreClientError as exc:
            return str(exc)
        return ""

    assert "no complete snapshot" in await asyncio.to_thread(fetch_missing)


async def test_a_commit_on_the_bus_frees_old_snapshots_and_bad_messages_are_ignored(
    nc: Client, spawn_service: SpawnService
) -> None:
    address = await start_store(nc, spawn_service)

    def upload(step: int) -> None:
        conn = StoreConnection(address)
        conn.upload(UploadKey("j", 1, 0, "m", step), memoryview(b"x" * 100), 64, b"", never)
        conn.close()

    for step in range(1, 5):
        await asyncio.to_thread(upload, step)
    await nc.publish(Subjects.for_job("j").commit, b"\x00not a message")
    await nc.publish(Subjects.for_job("j").commit, encode(Commit("j", 1, 2)))
    await nc.publish(Subjects.for_job("j").commit, encode(Commit("j", 1, 3)))
    await nc.flush()
    import json

    async def snapshots() -> int:
        msg = await nc.request("deadpool.store.s0.status", b"", timeout=5)
        return int(json.loads(msg.data)["snapshots"])

    # Requests travel after the commits on the same connection, so the store has applied them.
    assert await snapshots() == 3  # steps 2 and 3 (committed) and 4 (newer); step 1 freed


async def test_a_full_store_refuses_with_a_clear_error_and_keeps_what_is_committed(
    nc: Client, spawn_service: SpawnService
) -> None:
    address = await start_store(nc, spawn_service)  # capacity 64 MiB
    # Two ranks of 20 MiB: one job's uploads in progress may hold at most half the store.
    first = os.urandom(20 * 1024 * 1024)

    def upload(rank: int, step: int, data: bytes) -> str:
        conn = StoreConnection(address)
        try:
            conn.upload(UploadKey("j", 1, rank, "m", step), memoryview(data), 4 * 1024 * 1024, b"", never)
        except StoreClientError as exc:
            return str(exc)
        finally:
            conn.close()
        return ""

    assert await asyncio.to_thread(upload, 0, 1, first) == ""
    assert await asyncio.to_thread(upload, 1, 1, bytes(20 * 1024 * 1024)) == ""
    await nc.publish(Subjects.for_job("j").commit, encode(Commit("j", 1, 1)))
    await nc.flush()
    error = await asyncio.to_thread(upload, 0, 2, bytes(30 * 1024 * 1024))
    assert "store full" in error and "--capacity-bytes" in error

    def fetch(step: int) -> bytes:
        received = bytearray()

        def destination(meta: bytes, total: int) -> memoryview:
            received.extend(bytes(total))
            return memoryview(received)

        StoreConnection(address).fetch("j", 0, step, destination)
        return bytes(received)

    assert await asyncio.to_thread(fetch, 1) == first  # committed data survived the refusal
    assert "no complete snapshot" in await asyncio.to_thread(lambda: _fetch_error(address, 2))


async def test_a_finished_job_leaves_room_for_the_next_one(nc: Client, spawn_service: SpawnService) -> None:
    """Seen at GBs per rank (`bench/scale.py`): the store kept an ended job's last commits until it
    restarted, and the next job's snapshots were refused, the store full."""
    address = await start_store(nc, spawn_service)  # capacity 64 MiB

    def upload(job: str, generation: int, nbytes: int, rank: int = 0) -> str:
        conn = StoreConnection(address)
        try:
            key = UploadKey(job, generation, rank, "m", 1)
            conn.upload(key, memoryview(bytes(nbytes)), 4 * 1024 * 1024, b"", never)
        except StoreClientError as exc:
            return str(exc)
        finally:
            conn.close()
        return ""

    # Two ranks of 20 MiB: one job's uploads in progress may hold at most half the store.
    assert await asyncio.to_thread(upload, "first", 3, 20 * 1024 * 1024, 0) == ""
    assert await asyncio.to_thread(upload, "first", 3, 20 * 1024 * 1024, 1) == ""
    await nc.publish(Subjects.for_job("first").commit, encode(Commit("first", 3, 1)))
    await nc.flush()
    assert "store full" in await asyncio.to_thread(upload, "next", 1, 30 * 1024 * 1024)
    await nc.publish(Subjects.for_job("first").finished, b"\x00not a message")
    await nc.publish(Subjects.for_job("first").finished, encode(JobFinished("first", 2, 1)))  # an older run's
    await nc.request("deadpool.store.s0.status", b"", timeout=5)  # after the notices on this connection
    assert "store full" in await asyncio.to_thread(upload, "next", 1, 30 * 1024 * 1024), "a newer run's stays"
    await nc.publish(Subjects.for_job("first").finished, encode(JobFinished("first", 3, 1)))
    await nc.request("deadpool.store.s0.status", b"", timeout=5)
    assert await asyncio.to_thread(upload, "next", 1, 30 * 1024 * 1024) == ""


def _fetch_error(address: StoreAddress, step: int) -> str:
    try:
        StoreConnection(address).fetch("j", 0, step, lambda meta, n: memoryview(bytearray(n)))
    except StoreClientError as exc:
        return str(exc)
    return ""


async def test_a_store_serves_its_memory_metrics_on_a_prometheus_endpoint(
    nc: Client, spawn_service: SpawnService, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = free_port()
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "prometheus")
    monkeypatch.setenv("OTEL_EXPORTER_PROMETHEUS_PORT", str(port))
    await start_store(nc, spawn_service)  # it announced itself: its endpoint is up

    def scrape() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
            return str(answer.read().decode())

    text = await asyncio.to_thread(scrape)
    capacity = [line for line in text.splitlines() if line.startswith("deadpool_store_memory_capacity_bytes{")]
    assert capacity and 'store="s0"' in capacity[0] and float(capacity[0].rsplit(" ", 1)[1]) == 64 * 1024 * 1024
    assert any(line.startswith("deadpool_store_memory_used_bytes{") for line in text.splitlines()), text[:2000]


async def test_a_rank_placed_on_a_store_is_reserved_there_and_its_first_upload_lands_in_a_faulted_in_buffer(
    nc: Client, spawn_service: SpawnService, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The swapper's `Reserve` (sent twice: one reservation) has the store fault in the rank's buffers
    before it uploads: its first upload takes one of them from the pool instead of fresh memory."""
    port = free_port()
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "prometheus")
    monkeypatch.setenv("OTEL_EXPORTER_PROMETHEUS_PORT", str(port))
    address = await start_store(nc, spawn_service)
    nbytes = 4 * 1024 * 1024

    def gauge(name: str) -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
            lines = answer.read().decode().splitlines()
        (line,) = [line for line in lines if line.startswith(f"deadpool_store_memory_{name}_bytes{{")]
        return float(line.rsplit(" ", 1)[1])

    for _ in range(2):
        await nc.publish(store_reserve("s0"), encode(Reserve("j", 1, "s0", [3], [nbytes])))
    await nc.flush()
    deadline = asyncio.get_running_loop().time() + 30
    while await asyncio.to_thread(gauge, "pooled") < 3 * nbytes:  # faulted in on the store's own thread
        assert asyncio.get_running_loop().time() < deadline, "the reserved buffers were not faulted in"
        await asyncio.sleep(0.1)

    def upload() -> None:
        conn = StoreConnection(address)
        conn.upload(UploadKey("j", 1, 3, "member-a", 7), memoryview(os.urandom(nbytes)), 1024 * 1024, b"m", never)
        conn.close()

    await asyncio.to_thread(upload)
    assert await asyncio.to_thread(gauge, "used") == nbytes
    assert await asyncio.to_thread(gauge, "pooled") == 2 * nbytes, "the upload took a reserved buffer"
