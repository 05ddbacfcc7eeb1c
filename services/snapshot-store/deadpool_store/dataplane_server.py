"""The store's end of the data plane: an asyncio TCP server speaking `deadpool_protocol.dataplane`.

Each connection is an `asyncio.BufferedProtocol`: the event loop `recv_into`s straight into whatever
the connection waits for next (a length prefix, a header, or a chunk's slice of the snapshot's own
memory), so a chunk's bytes are copied once, by the kernel, and then checksummed in place. A
connection carries any number of uploads and fetches, one after the other. A malformed header closes
the connection (framing is lost); a refused upload is answered at its Seal with the reason.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from deadpool_protocol import ProtocolError
from deadpool_protocol.dataplane import (
    FRAME_LENGTH,
    HEADER_BYTES_MAX,
    Fetch,
    FetchReply,
    Frame,
    PutChunk,
    Reply,
    Seal,
    decode_frame_header,
    encode_frame,
)
from deadpool_store.memory import SnapshotKey, SnapshotMemory, StoredSnapshot, StoreError

__all__ = ["DataPlaneServer"]

OnSealed = Callable[[StoredSnapshot], Awaitable[None]]

DISCARD_BYTES = 1024 * 1024
"""Scratch space that a refused chunk's bytes are read into and dropped, a piece at a time."""
SEND_PIECE_BYTES = 1024 * 1024
"""A fetch writes at most this much before checking the transport's flow control."""


class DataPlaneServer:
    def __init__(self, memory: SnapshotMemory, on_sealed: OnSealed, log: Any) -> None:
        self.memory = memory
        self.on_sealed = on_sealed
        self.log = log
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> int:
        """Listen on (host, port); returns the port (useful with port 0)."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), host, port)
        return int(self._server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


class _Connection(asyncio.BufferedProtocol):
    """One client connection: a small state machine fed by `buffer_updated`.

    `_target` is the memory the next bytes belong in and `_on_full` what to do once it is full.
    Replies are written by tasks chained one after the other, so they leave in request order.
    """

    def __init__(self, server: DataPlaneServer) -> None:
        self.server = server
        self.log = server.log
        self.transport: asyncio.Transport | None = None
        self.peer = ""
        self._length = bytearray(FRAME_LENGTH.size)
        self._discard = bytearray(0)
        self._target = memoryview(self._length)
        self._filled = 0
        self._on_full: Callable[[], None] = self._length_read
        self._refused: dict[SnapshotKey, str] = {}
        self._chunk: PutChunk | None = None
        self._chunk_left = 0
        self._replies: asyncio.Task[None] | None = None
        self._can_write = asyncio.Event()
        self._can_write.set()

    # ------------------------------------------------------------ asyncio callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.peer = str(transport.get_extra_info("peername"))

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._target[self._filled :]

    def buffer_updated(self, nbytes: int) -> None:
        self._filled += nbytes
        if self._filled < len(self._target):
            return
        try:
            self._on_full()
        except ProtocolError as exc:
            self.log.warning("data plane connection dropped", peer=self.peer, reason=str(exc))
            assert self.transport is not None
            self.transport.abort()

    def eof_received(self) -> bool | None:
        return None  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        if exc is not None:
            self.log.info("data plane peer went away", peer=self.peer, reason=str(exc))
        self._can_write.set()  # a fetch waiting to write sees the closed transport and stops

    def pause_writing(self) -> None:
        self._can_write.clear()

    def resume_writing(self) -> None:
        self._can_write.set()

    # ------------------------------------------------------------ reading frames

    def _expect(self, target: memoryview, on_full: Callable[[], None]) -> None:
        self._target, self._filled, self._on_full = target, 0, on_full

    def _length_read(self) -> None:
        (length,) = FRAME_LENGTH.unpack(self._length)
        if not 0 < length <= HEADER_BYTES_MAX:
            raise ProtocolError(f"frame header of {length} bytes (allowed: 1 to {HEADER_BYTES_MAX})")
        self._expect(memoryview(bytearray(length)), self._header_read)

    def _header_read(self) -> None:
        frame = decode_frame_header(bytes(self._target))
        if isinstance(frame, PutChunk):
            self._chunk_started(frame)
        elif isinstance(frame, Seal | Fetch):
            self._reply(frame)
            self._expect(memoryview(self._length), self._length_read)
        else:
            raise ProtocolError(f"a client may not send {frame.OP} frames")

    def _chunk_started(self, chunk: PutChunk) -> None:
        self._chunk = chunk
        try:
            target = self.server.memory.chunk_target(chunk)
        except StoreError as exc:
            self._refused.setdefault((chunk.job, chunk.rank, chunk.step), str(exc))
            self._chunk_left = chunk.nbytes
            self._discard_next()
            return
        self._expect(target, self._chunk_read)

    def _chunk_read(self) -> None:
        assert self._chunk is not None
        self.server.memory.chunk_received(self._chunk)
        self._chunk = None
        self._expect(memoryview(self._length), self._length_read)

    def _discard_next(self) -> None:
        """Read (and drop) the rest of a refused chunk, a scratch buffer at a time."""
        if self._chunk_left == 0:
            self._chunk = None
            self._expect(memoryview(self._length), self._length_read)
            return
        if not self._discard:
            self._discard = bytearray(DISCARD_BYTES)
        piece = min(self._chunk_left, len(self._discard))
        self._chunk_left -= piece
        self._expect(memoryview(self._discard)[:piece], self._discard_next)

    # ------------------------------------------------------------ replies

    def _reply(self, frame: Frame) -> None:
        previous = self._replies
        self._replies = asyncio.get_running_loop().create_task(self._answer(frame, previous))

    async def _answer(self, frame: Frame, previous: asyncio.Task[None] | None) -> None:
        if previous is not None:
            await previous
        try:
            if isinstance(frame, Seal):
                await self._seal(frame)
            elif isinstance(frame, Fetch):
                await self._fetch(frame)
        except Exception:
            self.log.exception("data plane reply failed", peer=self.peer, op=frame.OP)
            if self.transport is not None:
                self.transport.abort()

    async def _write(self, data: bytes | memoryview) -> bool:
        """Write `data` respecting flow control; False if the connection is gone."""
        assert self.transport is not None
        view = memoryview(data)
        for start in range(0, len(view), SEND_PIECE_BYTES):
            await self._can_write.wait()
            if self.transport.is_closing():
                return False
            self.transport.write(view[start : start + SEND_PIECE_BYTES])
        return not self.transport.is_closing()

    async def _seal(self, seal: Seal) -> None:
        key = (seal.job, seal.rank, seal.step)
        error = self._refused.pop(key, "")
        snap: StoredSnapshot | None = None
        if not error:
            try:
                snap = self.server.memory.seal(seal)
            except StoreError as exc:
                error = str(exc)
        if snap is None:
            self.log.warning("snapshot refused", job=seal.job, rank=seal.rank, step=seal.step, reason=error)
            await self._write(encode_frame(Reply(ok=False, error=error)))
            return
        await self._write(encode_frame(Reply(ok=True, error="")))
        await self.server.on_sealed(snap)

    async def _fetch(self, fetch: Fetch) -> None:
        try:
            snap = self.server.memory.get(fetch.job, fetch.rank, fetch.step)
        except StoreError as exc:
            await self._write(encode_frame(FetchReply(False, str(exc), 0, "", 0, 0, [], b"")))
            return
        reply = FetchReply(
            True, "", snap.generation, snap.member, snap.total_bytes, snap.chunk_bytes, snap.checksums, snap.meta
        )
        snap.readers += 1  # a commit freeing the snapshot meanwhile neither cuts this short nor reuses it
        try:
            sent = await self._write(encode_frame(reply)) and await self._write(
                memoryview(snap.data)[: snap.total_bytes]
            )
        finally:
            snap.readers -= 1
        if sent:
            self.log.info("snapshot served", job=fetch.job, rank=fetch.rank, step=fetch.step, nbytes=snap.total_bytes)
