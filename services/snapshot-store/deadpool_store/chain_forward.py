"""One upload passed on to the next store of its chain, chunk by chunk, as its chunks arrive.

A member uploads a rank's snapshot to the first store of its placement only, naming the others in
each chunk (`PutChunk.forward`); that store opens a connection to the next one and writes each chunk
to it as soon as the chunk is in its own memory, naming the rest of the chain, so R copies cost the
member one upload and the copies are made in a pipeline. The receiving store's connection is held
back (`Backlog`) while the forward connection's buffer is full: the member's stream then slows to
the chain's pace instead of this store buffering a snapshot's worth of copies. At the Seal, the
member's manifest and signature go on unchanged (with this store's token): the next store verifies
every chunk against them itself, and reports its own copy complete.

The next store is found by its name among the stores' own announcements (`StoreDirectory`), never at
an address a client gave: a member cannot make a store connect anywhere else. Every step is bounded:
the connection (`CONNECT_TIMEOUT_S`), the write buffer (`BUFFER_BYTES`), how long the member may
be held back by it (`BACKLOG_WAIT_S`: a next store lost mid-stream takes no more bytes and answers
nothing), the reply (`reply_wait_s` per store still down the chain), the reply's size
(`HEADER_BYTES_MAX`). A chain that stops (the next store unknown, unreachable,
refusing, or too slow) stops quietly: the reply to the member says so (`forward_error`), and the
member uploads to the stores the chain missed itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Callable
from dataclasses import dataclass, replace

from deadpool_protocol import ProtocolError, StoreAddress, StoreStatus
from deadpool_protocol.dataplane import (
    FRAME_LENGTH,
    HEADER_BYTES_MAX,
    PutChunk,
    Reply,
    Seal,
    decode_frame_header,
    encode_frame,
)

__all__ = ["BACKLOG_WAIT_S", "BUFFER_BYTES", "CONNECT_TIMEOUT_S", "ChainForward", "StoreDirectory"]

CONNECT_TIMEOUT_S = 2.0
BUFFER_BYTES = 16 * 1024 * 1024
"""Bytes waiting in the forward connection's buffer past which the member's connection is held back."""
BACKLOG_WAIT_S = 3.0
"""The longest the member's connection is held back for one backlog: the next store must take the
buffer down to its low mark (a quarter) by then, 12 MiB at 4 MiB/s, or the chain stops here and the
member goes on (it uploads to the stores the chain missed itself). A store lost mid-stream takes no
bytes at all, and without this bound it would hold the member until its socket's timeout."""
PEER_STORE_TTL_S = 5.0
"""A store not heard announcing itself for this long is not forwarded to (it announces every 0.5 s)."""


@dataclass(frozen=True)
class _Heard:
    address: StoreAddress
    at: float


class StoreDirectory:
    """The stores this store has heard announce themselves (each with its own key, on its own subject):
    where a chain's next store is."""

    def __init__(self, own: str, ttl_s: float = PEER_STORE_TTL_S) -> None:
        self.own = own
        self.ttl_s = ttl_s
        self._stores: dict[str, _Heard] = {}

    def heard(self, status: StoreStatus, now: float) -> None:
        if status.store != self.own:
            self._stores[status.store] = _Heard(StoreAddress(status.store, status.host, status.port), now)

    def address_of(self, store: str, now: float) -> StoreAddress | None:
        heard = self._stores.get(store)
        return heard.address if heard is not None and now - heard.at <= self.ttl_s else None


class ChainForward(asyncio.Protocol):
    """The connection to the next store of one upload's chain (`open`, then `send_chunk` per chunk,
    then `finish` with the Seal; `close` to give up). `on_drained` is called once the buffer that
    held the member back has drained."""

    def __init__(self, target: StoreAddress, rest: list[str], token: bytes, on_drained: Callable[[], None]) -> None:
        self.target = target
        self.rest = rest
        self.token = token
        self.on_drained = on_drained
        self.failed = ""
        """Why the chain stopped here ('' while it goes on)."""
        self.backlogged = False
        """The forward connection's buffer is past `BUFFER_BYTES`: hold the member back."""
        self.transport: asyncio.Transport | None = None
        self._inbound = bytearray()
        self._reply: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self._backlog_due: asyncio.TimerHandle | None = None

    async def open(self, tls: ssl.SSLContext | None) -> None:
        """Connect to the next store (bounded); on failure `failed` says why."""
        loop = asyncio.get_running_loop()
        hostname = self.target.host if tls is not None else None
        try:
            connecting = loop.create_connection(
                lambda: self, self.target.host, self.target.port, ssl=tls, server_hostname=hostname
            )
            await asyncio.wait_for(connecting, CONNECT_TIMEOUT_S)
        except (OSError, TimeoutError, ssl.SSLError) as exc:
            self._fail(f"store {self.target.store} unreachable: {exc!r}")

    def send_chunk(self, chunk: PutChunk, data: memoryview) -> None:
        """Pass one chunk on (its bytes as this store received them; the next store checks them)."""
        if self.failed or self.transport is None:
            return
        header = replace(chunk, token=self.token, forward=self.rest)
        self.transport.write(encode_frame(header))
        self.transport.write(data)  # sent now or copied into the transport's buffer: `data` may be reused

    async def finish(self, seal: Seal, reply_wait_s: float) -> tuple[list[str], str]:
        """Send the Seal and wait for the next store's reply (`reply_wait_s` for each store from the
        next to the chain's end: each waits for its own next before it answers): the stores down the
        chain that sealed their copy, and why the chain stopped short ('' if it did not)."""
        if not self.failed and self.transport is not None:
            self.transport.write(encode_frame(replace(seal, token=self.token)))
            wait_s = reply_wait_s * (1 + len(self.rest))
            try:
                reply = await asyncio.wait_for(asyncio.shield(self._reply), wait_s)
            except TimeoutError:
                self._fail(f"store {self.target.store} did not answer the seal within {wait_s} s")
            except ConnectionError:
                pass  # `failed` says why
            else:
                if not reply.ok:
                    self._fail(f"store {self.target.store} refused the copy: {reply.error}")
                else:
                    self.close()
                    return [self.target.store, *reply.forwarded], reply.forward_error
        self.close()
        return [], self.failed

    def close(self) -> None:
        self._stop_backlog_clock()
        if self.transport is not None:
            self.transport.abort()
            self.transport = None

    # ------------------------------------------------------------ asyncio callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.set_write_buffer_limits(high=BUFFER_BYTES)

    def data_received(self, data: bytes) -> None:
        """The next store's reply to the Seal (nothing else comes): one frame, bounded."""
        self._inbound += data
        if self._reply.done() or len(self._inbound) < FRAME_LENGTH.size:
            return
        (length,) = FRAME_LENGTH.unpack_from(self._inbound)
        if not 0 < length <= HEADER_BYTES_MAX:
            self._fail(f"store {self.target.store} sent a reply header of {length} bytes")
            return
        if len(self._inbound) < FRAME_LENGTH.size + length:
            return
        try:
            frame = decode_frame_header(bytes(self._inbound[FRAME_LENGTH.size : FRAME_LENGTH.size + length]), Reply)
        except ProtocolError as exc:
            self._fail(f"store {self.target.store} sent a malformed reply: {exc}")
            return
        assert isinstance(frame, Reply)
        self._reply.set_result(frame)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if not self._reply.done():
            self._fail(f"store {self.target.store} closed the chain's connection: {exc!r}")

    def pause_writing(self) -> None:
        self.backlogged = True
        self._stop_backlog_clock()
        self._backlog_due = asyncio.get_running_loop().call_later(BACKLOG_WAIT_S, self._backlog_too_long)

    def resume_writing(self) -> None:
        self._drained()

    def _backlog_too_long(self) -> None:
        self._backlog_due = None
        if self.backlogged:
            self._fail(f"store {self.target.store} took too few bytes: its backlog held for {BACKLOG_WAIT_S} s")

    def _stop_backlog_clock(self) -> None:
        if self._backlog_due is not None:
            self._backlog_due.cancel()
            self._backlog_due = None

    def _drained(self) -> None:
        self._stop_backlog_clock()
        if self.backlogged:
            self.backlogged = False
            self.on_drained()

    def _fail(self, why: str) -> None:
        if not self.failed:
            self.failed = why
        if not self._reply.done():
            self._reply.set_exception(ConnectionError(why))
            self._reply.exception()  # retrieved: nobody may be waiting for it
        with contextlib.suppress(Exception):
            self.close()
        self._drained()  # a member held back for this chain goes on
