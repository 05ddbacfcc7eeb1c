"""The store's ingest threads (`deadpool_store.ingest_thread`) over real loopback sockets: uploads on
several connections at once are received on threads and sealed whole; a sender that stalls in the
middle of a chunk gets it handed back to the loop (it holds no thread: with one thread, another
member's upload goes on) and seals when it goes on, and sixteen that never go on are dropped; one that
closes mid-chunk has its upload freed; a buffer is not handed on while a chunk still lands in it."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator

import pytest

from deadpool.store_client import StoreConnection, UploadKey
from deadpool_protocol import StoreAddress
from deadpool_protocol.dataplane import (
    FRAME_LENGTH,
    PutChunk,
    Reply,
    Seal,
    chunk_checksum,
    decode_frame_header,
    encode_frame,
)
from deadpool_runtime.logs import get_logger
from deadpool_store.dataplane_server import ConnectionLimits, DataPlaneServer
from deadpool_store.memory import SnapshotMemory

from .test_store_dataplane_limits import no_op, until

CHUNK_BYTES = 256 * 1024
UPLOADS = 4
UPLOAD_BYTES = 16 * CHUNK_BYTES + 1000
STALLED = 16
WAIT_S = 5.0


@pytest.fixture
async def one_thread() -> AsyncIterator[tuple[DataPlaneServer, int]]:
    server = DataPlaneServer(
        SnapshotMemory(64 << 20), no_op, get_logger(test="ingest"), ConnectionLimits(sweep_s=0.05), ingest_threads=1
    )
    port = await server.start("127.0.0.1", 0)
    yield server, port
    await server.stop()


async def member_upload(port: int, key: UploadKey, data: memoryview) -> None:
    """A member's upload on a connection of its own, as its worker makes it (`StoreConnection`)."""
    conn = StoreConnection(StoreAddress("s", "127.0.0.1", port))
    try:
        await asyncio.to_thread(conn.upload, key, data, CHUNK_BYTES, b"", lambda: False)
    finally:
        conn.close()


async def read_reply(reader: asyncio.StreamReader) -> Reply:
    (length,) = FRAME_LENGTH.unpack(await reader.readexactly(FRAME_LENGTH.size))
    reply = decode_frame_header(await reader.readexactly(length), Reply)
    assert isinstance(reply, Reply)
    return reply


async def test_uploads_on_several_connections_at_once_are_received_on_threads_and_sealed_whole() -> None:
    server = DataPlaneServer(SnapshotMemory(256 << 20), no_op, get_logger(test="ingest"), ingest_threads=2)
    port = await server.start("127.0.0.1", 0)
    payloads = [os.urandom(UPLOAD_BYTES) for _ in range(UPLOADS)]
    try:
        await asyncio.gather(
            *(
                member_upload(port, UploadKey("j", 1, rank, f"m{rank}", 1), memoryview(data))
                for rank, data in enumerate(payloads)
            )
        )
        for rank, data in enumerate(payloads):
            stored = server.memory.get("j", rank, 1)
            assert stored.sealed and bytes(memoryview(stored.data)[: stored.total_bytes]) == data
        assert server.thread_chunks == UPLOADS * 17, "every chunk went through a thread"
    finally:
        await server.stop()


async def test_a_sender_stalling_mid_chunk_holds_no_thread_and_seals_when_it_goes_on(
    one_thread: tuple[DataPlaneServer, int],
) -> None:
    server, port = one_thread
    data = os.urandom(CHUNK_BYTES)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(encode_frame(PutChunk("j", 1, 0, "slow", 1, 0, len(data), len(data))) + data[:1000])
    await writer.drain()
    await until(lambda: server.thread_handbacks == 1)  # the thread gave the chunk back to the loop

    other = memoryview(os.urandom(UPLOAD_BYTES))
    # the only thread is free for another member's upload, while the slow one is still mid-chunk
    await member_upload(port, UploadKey("j", 1, 1, "m1", 1), other)
    assert bytes(memoryview(server.memory.get("j", 1, 1).data)[: len(other)]) == other

    writer.write(data[1000:])  # the slow sender goes on: the loop reads the rest and checksums it
    writer.write(encode_frame(Seal("j", 1, 0, "slow", 1, len(data), len(data), [chunk_checksum(data)], b"meta")))
    await writer.drain()
    assert (await read_reply(reader)).ok
    assert bytes(memoryview(server.memory.get("j", 0, 1).data)[: len(data)]) == data
    writer.close()


async def test_a_sender_closing_mid_chunk_has_its_upload_freed_and_the_store_serves_on(
    one_thread: tuple[DataPlaneServer, int],
) -> None:
    server, port = one_thread
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(encode_frame(PutChunk("j", 1, 0, "gone", 1, 0, CHUNK_BYTES, CHUNK_BYTES)) + b"z" * 1000)
    await writer.drain()
    await until(lambda: server.memory.unsealed == 1)
    writer.close()
    await until(lambda: server.memory.unsealed == 0 and server.connections == 0)
    assert server.memory.used_bytes == 0

    await member_upload(port, UploadKey("j", 1, 0, "m0", 2), memoryview(os.urandom(UPLOAD_BYTES)))
    assert server.memory.get("j", 0, 2).sealed


async def test_a_buffer_freed_while_a_chunk_lands_in_it_is_not_given_to_another_upload() -> None:
    """An upload replaced mid-chunk (a newer generation's upload of its step) frees its buffer; bytes
    of the old chunk still arrive into it. The buffer must not be pooled for the newer upload meanwhile,
    or those bytes would land in the newer snapshot after it was checked (the store's capacity here
    leaves room for one buffer, so a pooled one is the one the newer upload gets)."""
    memory = SnapshotMemory(CHUNK_BYTES + 500, job_unsealed_share=1.0)
    server = DataPlaneServer(memory, no_op, get_logger(test="ingest"), ConnectionLimits(sweep_s=0.05), ingest_threads=1)
    port = await server.start("127.0.0.1", 0)
    old = os.urandom(CHUNK_BYTES)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(encode_frame(PutChunk("j", 1, 0, "old", 1, 0, len(old), len(old))) + old[:1000])
        await writer.drain()
        await until(lambda: server.thread_handbacks == 1)  # mid-chunk, on the loop now

        newer = memoryview(os.urandom(CHUNK_BYTES))
        await member_upload(port, UploadKey("j", 2, 0, "new", 1), newer)
        writer.write(old[1000:])  # the old chunk's rest arrives into its own, freed, buffer
        writer.write(encode_frame(Seal("j", 1, 0, "old", 1, len(old), len(old), [chunk_checksum(old)], b"meta")))
        await writer.drain()
        assert not (await read_reply(reader)).ok, "the replaced upload is not sealed"

        stored = server.memory.get("j", 0, 1)
        assert stored.generation == 2 and bytes(memoryview(stored.data)[: len(newer)]) == newer
    finally:
        writer.close()
        await server.stop()


async def test_many_senders_stalled_mid_chunk_hold_no_thread_and_are_dropped_while_a_member_uploads() -> None:
    """The adversary with a job's token, or senders frozen mid-chunk: 16 connections each stop in the
    middle of a chunk, against one ingest thread. Each gives it back within its bound, a member's upload
    goes through meanwhile, and the stalled ones are dropped at `frame_idle_s` with their uploads freed."""
    limits = ConnectionLimits(frame_idle_s=1.0, sweep_s=0.05)
    server = DataPlaneServer(SnapshotMemory(64 << 20), no_op, get_logger(test="ingest"), limits, ingest_threads=1)
    port = await server.start("127.0.0.1", 0)
    stalled = []
    try:
        for rank in range(STALLED):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(encode_frame(PutChunk("j", 1, rank, f"s{rank}", 1, 0, CHUNK_BYTES, CHUNK_BYTES)) + b"s" * 1000)
            await writer.drain()
            stalled.append((reader, writer))
        await until(lambda: server.thread_handbacks == STALLED)

        data = memoryview(os.urandom(UPLOAD_BYTES))
        await member_upload(port, UploadKey("j", 1, 99, "m", 1), data)
        assert bytes(memoryview(server.memory.get("j", 99, 1).data)[: len(data)]) == data

        for reader, _ in stalled:
            assert await asyncio.wait_for(reader.read(1), WAIT_S) == b"", "a stalled sender is dropped"
        await until(lambda: server.memory.unsealed == 0)
    finally:
        for _, writer in stalled:
            writer.close()
        await server.stop()
