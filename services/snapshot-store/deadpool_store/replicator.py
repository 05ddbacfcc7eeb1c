"""Store to store: copy one sealed snapshot to another store over the data plane.

The copy is an ordinary upload, as the member that took the snapshot made it: the same generation,
member, chunk size, checksums and layout. So the receiving store verifies every chunk against the
original manifest, and a copy that went bad in this store's memory is refused there instead of being
spread. The swapper asks for copies after a store was lost (`Replicate`); it asks again until the
target reports the snapshot complete, so a copy that fails here is only logged.
"""

from __future__ import annotations

import asyncio
import ssl

from deadpool_protocol import ProtocolError, StoreAddress
from deadpool_protocol.dataplane import (
    FRAME_LENGTH,
    HEADER_BYTES_MAX,
    PutChunk,
    Reply,
    Seal,
    chunk_spans,
    decode_frame_header,
    encode_frame,
)
from deadpool_protocol.errors import DeadPoolError
from deadpool_store.memory import StoredSnapshot

__all__ = ["ReplicaRefusedError", "push_snapshot"]

CONNECT_TIMEOUT_S = 2.0


class ReplicaRefusedError(DeadPoolError, RuntimeError):
    """The target store refused the copy (the text is its reason)."""


async def push_snapshot(
    snap: StoredSnapshot, target: StoreAddress, token: bytes, tls: ssl.SSLContext | None = None
) -> None:
    """Upload `snap` to `target` with the job's `token` and wait for its seal; over TLS with a client
    `tls` context (the target's certificate must name its address). The caller bounds the whole call."""
    server_hostname = target.host if tls is not None else None
    connecting = asyncio.open_connection(target.host, target.port, ssl=tls, server_hostname=server_hostname)
    reader, writer = await asyncio.wait_for(connecting, CONNECT_TIMEOUT_S)
    snap.readers += 1  # a commit freeing the snapshot meanwhile neither cuts this short nor reuses it
    try:
        data = memoryview(snap.data)
        for offset, nbytes in chunk_spans(snap.total_bytes, snap.chunk_bytes):
            header = PutChunk(
                snap.job, snap.generation, snap.rank, snap.member, snap.step, offset, nbytes, snap.total_bytes, token
            )
            writer.write(encode_frame(header))
            writer.write(data[offset : offset + nbytes])
            await writer.drain()
        seal = Seal(
            snap.job,
            snap.generation,
            snap.rank,
            snap.member,
            snap.step,
            snap.total_bytes,
            snap.chunk_bytes,
            list(snap.checksums),
            snap.meta,
            token,
            snap.signature,  # the uploader's: the copy is theirs, passed on
        )
        writer.write(encode_frame(seal))
        await writer.drain()
        (length,) = FRAME_LENGTH.unpack(await reader.readexactly(FRAME_LENGTH.size))
        if not 0 < length <= HEADER_BYTES_MAX:
            raise ProtocolError(f"reply header of {length} bytes")
        reply = decode_frame_header(await reader.readexactly(length), Reply)
        assert isinstance(reply, Reply)
        if not reply.ok:
            raise ReplicaRefusedError(reply.error)
    finally:
        snap.readers -= 1
        writer.close()
