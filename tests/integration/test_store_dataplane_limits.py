"""The store's data-plane server under hostile peers, over real loopback sockets: connections beyond
its bounds are refused, a peer stalled in the middle of a frame is dropped (slow loris), so is one that
sends no authorised frame (a stranger's idle socket), headers in memory are bounded over all
connections, and honest uploads go on meanwhile."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

import pytest

from deadpool.store_client import StoreConnection, UploadKey
from deadpool_protocol import StoreAddress
from deadpool_protocol.bounds import TOKEN_BYTES
from deadpool_protocol.dataplane import (
    FRAME_LENGTH,
    PutChunk,
    Reply,
    Seal,
    chunk_checksum,
    decode_frame_header,
    encode_frame,
    job_token,
)
from deadpool_runtime.logs import get_logger
from deadpool_store.dataplane_server import ConnectionLimits, DataPlaneServer
from deadpool_store.memory import SnapshotMemory, StoredSnapshot

LIMITS = ConnectionLimits(
    connections_max=6, per_peer_max=4, header_budget_bytes=4096, frame_idle_s=0.3, first_frame_s=0.3, sweep_s=0.05
)
KEY = bytes(range(32))
FLOOD_SOCKETS = 2000
MEMBER_UPLOADS = 15
CLOSED_WAIT_S = 5.0


async def no_op(_snap: StoredSnapshot) -> None:
    return None


@pytest.fixture
async def server() -> AsyncIterator[tuple[DataPlaneServer, int]]:
    running = DataPlaneServer(SnapshotMemory(1 << 20), no_op, get_logger(test="limits"), LIMITS)
    port = await running.start("127.0.0.1", 0)
    yield running, port
    await running.stop()


async def closed_by_server(reader: asyncio.StreamReader) -> bool:
    """Whether the server closes the connection (EOF or reset) within the wait."""
    try:
        return await asyncio.wait_for(reader.read(1), CLOSED_WAIT_S) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:  # still open (this once counted as closed, and no test here could fail on it)
        return False


async def upload(port: int, step: int) -> bool:
    """An honest upload of 8 bytes on a connection of its own; True if the store sealed it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    sealed = await upload_on(reader, writer, step)
    writer.close()
    return sealed


async def upload_on(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, step: int, token: bytes = b"") -> bool:
    """An upload of 8 bytes on this connection, carrying `token`; True if the store sealed it."""
    data = bytes(range(8))
    writer.write(encode_frame(PutChunk("j", 1, 0, "m", step, 0, 8, 8, token)) + data)
    writer.write(encode_frame(Seal("j", 1, 0, "m", step, 8, 8, [chunk_checksum(data)], b"meta", token)))
    await writer.drain()
    (length,) = FRAME_LENGTH.unpack(await reader.readexactly(FRAME_LENGTH.size))
    reply = decode_frame_header(await reader.readexactly(length), Reply)
    return isinstance(reply, Reply) and reply.ok


async def test_a_peer_stalled_mid_frame_is_dropped_and_one_idle_between_frames_is_not(
    server: tuple[DataPlaneServer, int],
) -> None:
    _, port = server
    loris_r, loris_w = await asyncio.open_connection("127.0.0.1", port)
    loris_w.write(FRAME_LENGTH.pack(1000) + b"\x81")  # a header of 1000 bytes, 1 of them sent
    await loris_w.drain()
    idle_r, idle_w = await asyncio.open_connection("127.0.0.1", port)  # a member between snapshots
    assert await upload_on(idle_r, idle_w, 5)
    assert await closed_by_server(loris_r)
    with pytest.raises(TimeoutError):  # still open well past frame_idle_s and first_frame_s
        await asyncio.wait_for(idle_r.read(1), 3 * max(LIMITS.frame_idle_s, LIMITS.first_frame_s))
    assert await upload(port, 1)
    loris_w.close()
    idle_w.close()


async def test_connections_beyond_the_bounds_are_refused_and_freed_slots_serve_again(
    server: tuple[DataPlaneServer, int],
) -> None:
    running, port = server
    held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(LIMITS.per_peer_max)]
    for step, (reader, writer) in enumerate(held):  # authorised: each has sent a frame the store took
        assert await upload_on(reader, writer, 100 + step)
    extra_r, extra_w = await asyncio.open_connection("127.0.0.1", port)
    assert await closed_by_server(extra_r)  # one peer address may not hold more
    assert running.connections == LIMITS.per_peer_max
    for _, writer in held:
        writer.close()
    for _ in range(100):  # the server notices the closes on its own loop
        if running.connections == 0:
            break
        await asyncio.sleep(0.02)
    assert running.connections == 0
    assert await upload(port, 2)
    extra_w.close()


async def test_headers_in_memory_are_bounded_over_all_connections(server: tuple[DataPlaneServer, int]) -> None:
    running, port = server
    first_r, first_w = await asyncio.open_connection("127.0.0.1", port)
    first_w.write(FRAME_LENGTH.pack(3000) + b"\x81")  # holds 3000 of the 4096 budget, stalls
    await first_w.drain()
    for _ in range(100):
        if running.header_bytes == 3000:
            break
        await asyncio.sleep(0.02)
    assert running.header_bytes == 3000
    second_r, second_w = await asyncio.open_connection("127.0.0.1", port)
    second_w.write(FRAME_LENGTH.pack(3000))  # would take headers past the budget
    await second_w.drain()
    assert await closed_by_server(second_r)
    assert await closed_by_server(first_r)  # then the stalled one is dropped, and its budget returned
    assert running.header_bytes == 0
    assert await upload(port, 3)
    first_w.close()
    second_w.close()


async def test_a_connection_that_sends_no_authorised_frame_is_dropped_and_an_honest_idle_one_is_not() -> None:
    """Strangers' idle sockets once held every connection slot of a store and locked its members out."""
    keyed = DataPlaneServer(SnapshotMemory(1 << 20), no_op, get_logger(test="limits"), LIMITS, key=KEY)
    port = await keyed.start("127.0.0.1", 0)
    try:
        silent_r, silent_w = await asyncio.open_connection("127.0.0.1", port)  # sends nothing
        forger_r, forger_w = await asyncio.open_connection("127.0.0.1", port)
        assert not await upload_on(forger_r, forger_w, 1, b"x" * TOKEN_BYTES), "a wrong token is refused"
        member_r, member_w = await asyncio.open_connection("127.0.0.1", port)
        assert await upload_on(member_r, member_w, 2, job_token(KEY, "j"))
        assert await closed_by_server(silent_r) and await closed_by_server(forger_r)
        with pytest.raises(TimeoutError):  # the member's connection idles between snapshots
            await asyncio.wait_for(member_r.read(1), 3 * LIMITS.first_frame_s)
        assert keyed.connections == 1
        for writer in (silent_w, forger_w, member_w):
            writer.close()
    finally:
        await keyed.stop()


async def test_a_header_before_any_authorised_frame_is_small_and_takes_no_budget_past_that() -> None:
    """Four sockets announcing 16 MiB headers, and trickling, once took a store's whole header budget and
    its members' Seals were refused: before a frame of it carried an accepted token, a connection may
    announce a small header only. After, a member's Seal carries a layout as large as it needs."""
    limits = replace(  # only the pre-token bound can close the stranger within the wait
        LIMITS, header_budget_bytes=1 << 20, unauthorised_header_bytes=1024, frame_idle_s=60, first_frame_s=60
    )
    keyed = DataPlaneServer(SnapshotMemory(1 << 20), no_op, get_logger(test="limits"), limits, key=KEY)
    port = await keyed.start("127.0.0.1", 0)
    try:
        stranger_r, stranger_w = await asyncio.open_connection("127.0.0.1", port)
        stranger_w.write(FRAME_LENGTH.pack(limits.unauthorised_header_bytes + 1) + b"\x81")
        await stranger_w.drain()
        assert await closed_by_server(stranger_r)
        assert keyed.header_bytes == 0
        member_r, member_w = await asyncio.open_connection("127.0.0.1", port)
        token, data = job_token(KEY, "j"), bytes(range(8))
        layout = b"L" * (64 * 1024)  # a large model's layout: past the pre-token bound, within the budget
        member_w.write(encode_frame(PutChunk("j", 1, 0, "m", 1, 0, 8, 8, token)) + data)
        member_w.write(encode_frame(Seal("j", 1, 0, "m", 1, 8, 8, [chunk_checksum(data)], layout, token)))
        await member_w.drain()
        (length,) = FRAME_LENGTH.unpack(await member_r.readexactly(FRAME_LENGTH.size))
        reply = decode_frame_header(await member_r.readexactly(length), Reply)
        assert isinstance(reply, Reply) and reply.ok, reply
        assert keyed.memory.get("j", 0, 1).meta == layout
        stranger_w.close()
        member_w.close()
    finally:
        await keyed.stop()


async def test_strangers_reopening_sockets_as_fast_as_they_are_dropped_never_lock_a_member_out() -> None:
    """A flood of 2,000 sockets from the member's own address (the finding: 15 of 15 uploads failed): at
    each bound the oldest connection that sent no authorised frame makes way, so every member upload,
    each on a connection of its own, is sealed while the flood goes on."""
    keyed = DataPlaneServer(SnapshotMemory(1 << 20), no_op, get_logger(test="limits"), LIMITS, key=KEY)
    port = await keyed.start("127.0.0.1", 0)
    opened = 0
    flooding = True

    async def flood() -> None:
        nonlocal opened
        held: list[asyncio.StreamWriter] = []
        while flooding and opened < FLOOD_SOCKETS:
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                continue
            opened += 1
            held.append(writer)
            if opened % 50 == 0:
                await asyncio.sleep(0)  # let the store's loop (the same one) run
        for writer in held:
            writer.close()

    flooder = asyncio.create_task(flood())
    try:
        token = job_token(KEY, "j")
        sealed = 0
        for step in range(MEMBER_UPLOADS):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            sealed += await upload_on(reader, writer, step, token)
            writer.close()
        assert sealed == MEMBER_UPLOADS
        assert opened > 2 * LIMITS.connections_max, f"the flood opened {opened} sockets only"
    finally:
        flooding = False
        await flooder
        await keyed.stop()


async def test_an_upload_left_unsealed_holds_what_it_sent_and_only_while_its_connection_sends() -> None:
    """One 14-byte frame once reserved a store's whole capacity for 60 s, repeatably, with any job's
    token: every other job's upload was refused. Now it holds the byte it sent; the store frees it at
    once when its connection closes, or sends nothing for `unsealed_idle_s`."""
    limits = replace(LIMITS, unsealed_idle_s=0.5)
    keyed = DataPlaneServer(SnapshotMemory(1 << 20), no_op, get_logger(test="limits"), limits, key=KEY)
    port = await keyed.start("127.0.0.1", 0)
    try:
        hogs = []
        for step in (1, 2):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            hog = PutChunk("other", 1, 0, "hog", step, 0, 1, 1 << 20, job_token(KEY, "other"))
            writer.write(encode_frame(hog) + b"x")  # announces the whole capacity, sends one byte
            await writer.drain()
            hogs.append((reader, writer))
        await until(lambda: keyed.memory.unsealed == 2)
        assert keyed.memory.used_bytes == 2
        member_r, member_w = await asyncio.open_connection("127.0.0.1", port)
        assert await upload_on(member_r, member_w, 7, job_token(KEY, "j")), "another job's upload fits"
        hogs[0][1].close()  # closed: its upload is freed at once
        await until(lambda: keyed.memory.unsealed == 1)
        assert await closed_by_server(hogs[1][0])  # silent with an upload unsealed: dropped, upload freed
        assert keyed.memory.unsealed == 0 and keyed.memory.used_bytes == 8
        member_w.close()
        hogs[1][1].close()
    finally:
        await keyed.stop()


async def test_a_connection_idle_past_its_bound_is_closed_and_the_member_reconnects_by_itself() -> None:
    limits = replace(LIMITS, idle_s=0.3)
    running = DataPlaneServer(SnapshotMemory(1 << 20), no_op, get_logger(test="limits"), limits)
    port = await running.start("127.0.0.1", 0)
    conn = StoreConnection(StoreAddress("s", "127.0.0.1", port))
    try:
        data = memoryview(bytes(range(200)))
        await asyncio.to_thread(conn.upload, UploadKey("j", 1, 0, "m", 1), data, 64, b"", lambda: False)
        await until(lambda: running.connections == 0)  # dropped while it idled
        await asyncio.to_thread(conn.upload, UploadKey("j", 1, 0, "m", 2), data, 64, b"", lambda: False)
        assert [s.step for s in running.memory.sealed_of("j", 0)] == [1, 2]
    finally:
        conn.close()
        await running.stop()


async def until(condition: Callable[[], bool], wait_s: float = CLOSED_WAIT_S) -> None:
    """Wait for `condition`, which the server's own loop makes true (checked every 20 ms)."""
    deadline = asyncio.get_running_loop().time() + wait_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "not within the wait"
        await asyncio.sleep(0.02)
