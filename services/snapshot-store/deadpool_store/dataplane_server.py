"""The store's end of the data plane: an asyncio TCP server speaking `deadpool_protocol.dataplane`.

A connection carries any number of uploads and fetches, one after the other. A malformed header
closes the connection (framing is lost); a refused upload is answered at its Seal with the reason.
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
    PutChunk,
    Reply,
    Seal,
    decode_frame_header,
    encode_frame,
)
from deadpool_store.memory import SnapshotKey, SnapshotMemory, StoredSnapshot, StoreError

__all__ = ["DataPlaneServer"]

OnSealed = Callable[[StoredSnapshot], Awaitable[None]]


class DataPlaneServer:
    def __init__(self, memory: SnapshotMemory, on_sealed: OnSealed, log: Any) -> None:
        self.memory = memory
        self.on_sealed = on_sealed
        self.log = log
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> int:
        """Listen on (host, port); returns the port (useful with port 0)."""
        self._server = await asyncio.start_server(self._serve, host, port)
        return int(self._server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        refused: dict[SnapshotKey, str] = {}
        try:
            while True:
                try:
                    (length,) = FRAME_LENGTH.unpack(await reader.readexactly(FRAME_LENGTH.size))
                except asyncio.IncompleteReadError:
                    return  # the client closed the connection
                if length > HEADER_BYTES_MAX:
                    raise ProtocolError(f"frame header of {length} bytes exceeds {HEADER_BYTES_MAX}")
                frame = decode_frame_header(await reader.readexactly(length))
                if isinstance(frame, PutChunk):
                    payload = await reader.readexactly(frame.nbytes)
                    key = (frame.job, frame.rank, frame.step)
                    try:
                        self.memory.put_chunk(frame, payload)
                    except StoreError as exc:
                        refused.setdefault(key, str(exc))
                elif isinstance(frame, Seal):
                    await self._seal(frame, refused, writer)
                elif isinstance(frame, Fetch):
                    await self._fetch(frame, writer)
                else:
                    raise ProtocolError(f"a client may not send {frame.OP} frames")
        except (ProtocolError, asyncio.IncompleteReadError) as exc:
            self.log.warning("data plane connection dropped", peer=str(peer), reason=str(exc))
        except ConnectionError as exc:
            self.log.info("data plane peer went away", peer=str(peer), reason=str(exc))
        finally:
            writer.close()

    async def _seal(self, seal: Seal, refused: dict[SnapshotKey, str], writer: asyncio.StreamWriter) -> None:
        key = (seal.job, seal.rank, seal.step)
        error = refused.pop(key, "")
        snap: StoredSnapshot | None = None
        if not error:
            try:
                snap = self.memory.seal(seal)
            except StoreError as exc:
                error = str(exc)
        if snap is None:
            self.log.warning("snapshot refused", job=seal.job, rank=seal.rank, step=seal.step, reason=error)
            writer.write(encode_frame(Reply(ok=False, error=error)))
        else:
            writer.write(encode_frame(Reply(ok=True, error="")))
        await writer.drain()
        if snap is not None:
            await self.on_sealed(snap)

    async def _fetch(self, fetch: Fetch, writer: asyncio.StreamWriter) -> None:
        try:
            snap = self.memory.get(fetch.job, fetch.rank, fetch.step)
        except StoreError as exc:
            writer.write(encode_frame(FetchReply(False, str(exc), 0, "", 0, 0, [], b"")))
            await writer.drain()
            return
        data = snap.data  # held by reference: a commit freeing it now does not cut the transfer short
        writer.write(
            encode_frame(
                FetchReply(
                    True,
                    "",
                    snap.generation,
                    snap.member,
                    snap.total_bytes,
                    snap.chunk_bytes,
                    snap.crcs,
                    snap.meta,
                )
            )
        )
        writer.write(memoryview(data))
        await writer.drain()
        self.log.info("snapshot served", job=fetch.job, rank=fetch.rank, step=fetch.step, nbytes=snap.total_bytes)
