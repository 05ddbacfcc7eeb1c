"""The store's end of the data plane: an asyncio TCP server speaking `deadpool_protocol.dataplane`.

Each connection is an `asyncio.BufferedProtocol`: the event loop `recv_into`s straight into whatever
the connection waits for next (a length prefix, a header, or a chunk's slice of the snapshot's own
memory), so a chunk's bytes are copied once, by the kernel, and then checksummed in place. A chunk's
bytes go to an ingest thread instead (`ingest_thread`, one per core by default; not over TLS): the
connection's reads are paused, the thread receives into the same slice and checksums as the bytes
arrive, then hands the chunk back, so uploads on several connections are received on as many cores. A
connection carries any number of uploads and fetches, one after the other. A malformed header closes
the connection (framing is lost); a refused upload is answered at its Seal with the reason.

Nothing a peer sends can hold the store: at most `connections_max` connections, `per_peer_max` of
them from one address; frame headers in memory at once are bounded by `header_budget_bytes` over all
connections (one peer announcing 16 MiB headers on many connections, and sending nothing, held that
much each), and a connection's headers are small until one of its frames carried an accepted token
(`unauthorised_header_bytes`); a connection that stops in the middle of a frame for `frame_idle_s` is dropped, and so is
one that has sent no authorised frame `first_frame_s` after it connected (a member sends its first at
once; 256 idle sockets from strangers once held every slot and locked every member out). A connection
sends one upload at a time: one it leaves unsealed (closing, going on to another, or idle for
`unsealed_idle_s`) is freed at once, not after the store's `unsealed_max_s` (one 14-byte frame once
reserved a store's whole capacity for 60 s, repeatably). Between frames an authorised connection may
idle up to `idle_s`: members keep theirs open from one snapshot to the next.
Refusals are logged at a bounded rate (`RefusalLog`): a flood of bad connections once wrote 9,000
lines in 30 s.
"""

from __future__ import annotations

import asyncio
import ctypes
import mmap
import os
import socket
import ssl
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
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
    job_token,
    token_matches,
)
from deadpool_runtime.log_limit import RefusalLog
from deadpool_runtime.tracing import Tracing
from deadpool_store.chain_forward import ChainForward, StoreDirectory
from deadpool_store.ingest_thread import Received, receive_into
from deadpool_store.memory import SnapshotKey, SnapshotMemory, StoredSnapshot, StoreError

__all__ = ["DataPlaneServer"]

OnSealed = Callable[[StoredSnapshot], Awaitable[None]]

DISCARD_BYTES = 1024 * 1024
"""Scratch space that a refused chunk's bytes are read into and dropped, a piece at a time."""
REFUSED_KEPT_MAX = 1024
"""Refused uploads a connection may have open (each waits for its Seal to be answered); past that the
connection is closed."""
SEND_PIECE_BYTES = 1024 * 1024
"""A fetch writes at most this much before checking the transport's flow control."""
THREAD_WAIT_S = 0.05
"""How long an ingest thread waits for a stalled sender's next bytes before handing the chunk back to
the loop: a few stalled senders must not hold every thread."""
HELD_FOR_THREAD = "an ingest thread receives the chunk"


@dataclass(frozen=True)
class ConnectionLimits:
    connections_max: int = 256
    per_peer_max: int = 64
    """Connections from one address (a host runs a member per GPU, and each member one per store)."""
    header_budget_bytes: int = 64 * 1024 * 1024
    """Frame headers being received, over all connections (a Seal of a 10^5-tensor model is ~5 MB)."""
    unauthorised_header_bytes: int = 64 * 1024
    """The largest header a connection may announce before one of its frames carried an accepted token.
    An honest connection's first frame is a chunk or a fetch (about 200 bytes, the token inside); only a
    Seal's layout is large, and it follows its chunks. So strangers hold at most `connections_max` times
    this of the budget (16 MiB of 64 MiB): four sockets announcing 16 MiB headers once took it all."""
    frame_idle_s: float = 30.0
    """How long a connection may send nothing in the middle of a frame."""
    first_frame_s: float = 2.0
    """How long a new connection may go without an authorised frame (one whose job token the store
    accepts; any frame, on a store without a key): a member sends its first at once."""
    unsealed_idle_s: float = 10.0
    """How long a connection may send nothing while an upload it began is unsealed: then it is dropped
    and the upload freed (a member streams its chunks back to back)."""
    idle_s: float = 600.0
    """How long an authorised connection may idle between frames with nothing unsealed (members keep
    theirs open from one snapshot to the next, and reconnect after this)."""
    sweep_s: float = 1.0
    """How often stalled connections are looked for."""


class DataPlaneServer:
    def __init__(
        self,
        memory: SnapshotMemory,
        on_sealed: OnSealed,
        log: Any,
        limits: ConnectionLimits | None = None,
        key: bytes = b"",
        tracing: Tracing | None = None,
        ingest_bytes_per_s: float = 0.0,
        tls: ssl.SSLContext | None = None,
        directory: StoreDirectory | None = None,
        client_tls: ssl.SSLContext | None = None,
        forward_reply_wait_s: float = 5.0,
        ingest_threads: int | None = None,
    ) -> None:
        self.memory = memory
        threads = len(os.sched_getaffinity(0)) if ingest_threads is None else ingest_threads
        self.ingest_pool = ThreadPoolExecutor(threads, thread_name_prefix="ingest") if threads and tls is None else None
        """Threads that receive and checksum every chunk's bytes (`ingest_thread`; by default one per core
        the store may run on), so that uploads on several connections use as many cores. None: every
        byte is received on the loop, always so over TLS (only the loop's transport decrypts)."""
        self.thread_chunks = 0
        """Chunks received whole by an ingest thread, so far."""
        self.thread_handbacks = 0
        """Chunks an ingest thread handed back to the loop, its sender stalled, so far."""
        self.directory = directory
        """Where a chained upload's next store is (`chain_forward`); None: this store forwards nothing."""
        self.client_tls = client_tls
        """What this store verifies the next store of a chain with (None: TLS off)."""
        self.forward_reply_wait_s = forward_reply_wait_s
        """How long the answer to a chained upload's Seal waits for the next store's, for each store
        from there to the chain's end (then the member uploads to the rest itself). A few seconds: the
        next store holds the chunks already, bar the last buffer's worth, and only checks and seals."""
        self.tls = tls
        """With a context, connections speak TLS (`deadpool_runtime.tls`); a handshake that has not ended
        `first_frame_s` after connecting is dropped, before the connection takes a slot."""
        self.ingest_bytes_per_s = ingest_bytes_per_s
        """Above 0, the store reads uploads no faster than this over all connections: a slow data plane
        on demand, for tests and benchmarks (`DEADPOOL_STORE_INGEST_BYTES_PER_S`)."""
        self.ingest_free_at = 0.0
        """With an ingest limit: when the bytes read so far will have been paid for (monotonic)."""
        self.tracing = tracing or Tracing("deadpool-store", env={})
        self.key = key
        """With a key, every upload and fetch must carry its job's token (`job_token`)."""
        self.on_sealed = on_sealed
        self.log = log
        self.refusals = RefusalLog(log)
        """Every refusal of a connection, a frame or a request goes through it."""
        self.limits = limits or ConnectionLimits()
        self._server: asyncio.Server | None = None
        self._connections: set[_Connection] = set()
        self._per_peer: Counter[str] = Counter()
        self.header_bytes = 0
        """Bytes of frame headers allocated and not yet decoded, over all connections."""
        self._sweeper: asyncio.Task[None] | None = None
        self._prefault_sizes: list[int] = []
        self._prefaulting: asyncio.Task[None] | None = None

    async def start(self, host: str, port: int) -> int:
        """Listen on (host, port); returns the port (useful with port 0)."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _Connection(self),
            host,
            port,
            ssl=self.tls,
            ssl_handshake_timeout=self.limits.first_frame_s if self.tls is not None else None,
        )
        self._sweeper = loop.create_task(self._sweep())
        return int(self._server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._prefaulting is not None:
            self._prefaulting.cancel()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        if self.ingest_pool is not None:
            self.ingest_pool.shutdown(wait=False, cancel_futures=True)
        self.refusals.flush()

    def prefault(self) -> None:
        """Fault in the pool buffers the memory wants (a rank's first upload here asks for its next
        steps'), one at a time on a thread of their own, beside the uploads."""
        self._prefault_sizes += self.memory.prefault_wanted()
        if self._prefault_sizes and (self._prefaulting is None or self._prefaulting.done()):
            self._prefaulting = asyncio.get_running_loop().create_task(self._fault_in_pool())

    async def _fault_in_pool(self) -> None:
        while self._prefault_sizes:
            nbytes = self._prefault_sizes.pop(0)
            if not self.memory.room_for_pooled(nbytes) or not self.memory.host_room_for(nbytes):
                continue  # the capacity, or the host's memory, is taken
            started = time.monotonic()
            data = await asyncio.to_thread(_faulted_in, nbytes)
            kept = self.memory.offer_pooled(data)
            self.log.info(
                "pool buffer faulted in", nbytes=nbytes, kept=kept, took_s=round(time.monotonic() - started, 3)
            )

    def token_for(self, job: str) -> bytes:
        """The token this store's own uploads of `job` carry (replication); b'' without a key."""
        return job_token(self.key, job) if self.key else b""

    def refusal(self, job: str, token: bytes) -> str:
        """Why a frame of `job` carrying `token` is refused ('' if it is allowed)."""
        if not self.key:
            return ""
        if not token:
            return "unauthenticated: the frame carries no job token"
        if not token_matches(self.key, job, token):
            return f"unauthorised: the token is not job {job}'s"
        return ""

    def admit(self, conn: _Connection) -> str:
        """Register a new connection; returns why it is refused ('' if admitted). At a bound, the oldest
        connection that has sent no authorised frame yet makes way for it: a member sends its token at
        once, so it is refused only when every slot holds an authorised peer. (Strangers re-opening
        sockets as fast as they were dropped once kept every slot full, and 15 of 15 members' uploads
        failed; a member sharing an address with them was locked out by the per-address bound.)"""
        if self._per_peer[conn.peer_host] >= self.limits.per_peer_max and not self._make_way(conn.peer_host):
            return f"{conn.peer_host} already has {self._per_peer[conn.peer_host]} authorised connections"
        if len(self._connections) >= self.limits.connections_max and not self._make_way(""):
            return f"the store already has {len(self._connections)} authorised connections"
        self._connections.add(conn)
        self._per_peer[conn.peer_host] += 1
        return ""

    def _make_way(self, peer_host: str) -> bool:
        """Drop the oldest connection (of `peer_host`; '' any) that has sent no authorised frame; False
        if there is none."""
        waiting = [c for c in self._connections if not c.authorised and (not peer_host or c.peer_host == peer_host)]
        if not waiting:
            return False
        oldest = min(waiting, key=lambda c: c.connected_t)
        reason = "made way for a new connection: it sent no authorised frame"
        self.refusals.warning("data plane connection dropped", peer=oldest.peer, reason=reason)
        self.forget(oldest)
        if oldest.transport is not None:
            oldest.transport.abort()
        return True

    def forget(self, conn: _Connection) -> None:
        if conn in self._connections:
            self._connections.discard(conn)
            self._per_peer[conn.peer_host] -= 1
            if self._per_peer[conn.peer_host] <= 0:
                del self._per_peer[conn.peer_host]

    @property
    def connections(self) -> int:
        return len(self._connections)

    async def _sweep(self) -> None:
        """Drop connections stalled in the middle of a frame (slow loris), or never authorised."""
        while True:
            await asyncio.sleep(self.limits.sweep_s)
            now = time.monotonic()
            for conn in list(self._connections):
                conn.drop_if_stalled(now, self.limits)


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
        self.peer_host = ""
        self._header_held = 0
        """Bytes of header buffer this connection holds against the server's budget."""
        self._last_rx = self.connected_t = time.monotonic()
        self.authorised = False
        """Whether a frame of this connection carried a token the store accepts (an honest peer's)."""
        self._length = bytearray(FRAME_LENGTH.size)
        self._discard = bytearray(0)
        self._target = memoryview(self._length)
        self._filled = 0
        self._on_full: Callable[[], None] = self._length_read
        self._refused: dict[SnapshotKey, str] = {}
        self._upload: SnapshotKey | None = None
        """The upload this connection is sending and has not sealed: one at a time, freed if the
        connection closes or goes on to another."""
        self._chunk: PutChunk | None = None
        self._chunk_left = 0
        self._replies: asyncio.Task[None] | None = None
        self._can_write = asyncio.Event()
        self._can_write.set()
        self._forward: ChainForward | None = None
        """The current upload's chain to the next store, if it names one."""
        self._forward_error = ""
        """Why the current upload's chain could not begin ('' if it did, or names none)."""
        self._held: set[str] = set()
        """Why reading this connection is paused (an ingest limit, a chain's connection or backlog, an
        ingest thread)."""
        self._thread_wanted = False
        """The chunk being received goes to an ingest thread once nothing else holds the reads."""
        self._thread_running = False
        self._thread_socket: socket.socket | None = None
        """The connection's socket on its own descriptor, for ingest threads (opened at the first)."""
        self._chunk_checksum: int | None = None
        """The chunk's checksum, when a thread took it as its bytes arrived."""
        self._receiving: StoredSnapshot | None = None
        """The upload whose buffer the current chunk is being received into: counted among its readers
        until the chunk is in, so a buffer freed meanwhile (the upload replaced, expired or its job
        ended) is never given to another upload while bytes still land in it."""
        self._lost = False

    # ------------------------------------------------------------ asyncio callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        peername = transport.get_extra_info("peername")
        self.peer = str(peername)
        self.peer_host = str(peername[0]) if isinstance(peername, tuple) and peername else self.peer
        refused = self.server.admit(self)
        if refused:
            self.server.refusals.warning("data plane connection refused", peer=self.peer, reason=refused)
            transport.abort()

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._target[self._filled :]

    def mid_frame(self) -> bool:
        """Whether a frame has begun and not ended (between frames a connection may idle)."""
        return self._filled > 0 or self._on_full != self._length_read

    def drop_if_stalled(self, now: float, limits: ConnectionLimits) -> None:
        if self.transport is None:
            return
        idle_s = now - self._last_rx
        if self.mid_frame() and idle_s > limits.frame_idle_s:
            reason = f"no bytes for {limits.frame_idle_s} s mid-frame"
        elif not self.authorised and now - self.connected_t > limits.first_frame_s:
            reason = f"no authorised frame {limits.first_frame_s} s after connecting"
        elif self._upload is not None and idle_s > limits.unsealed_idle_s:
            reason = f"no bytes for {limits.unsealed_idle_s} s with an upload unsealed"
        elif idle_s > limits.idle_s:
            reason = f"idle for {limits.idle_s} s"
        else:
            return
        self.server.refusals.warning("data plane connection dropped", peer=self.peer, reason=reason)
        self.transport.abort()

    def _refusal(self, job: str, token: bytes) -> str:
        """The server's `refusal`; a frame it allows authorises this connection."""
        refused = self.server.refusal(job, token)
        self.authorised = self.authorised or not refused
        return refused

    def buffer_updated(self, nbytes: int) -> None:
        self._last_rx = time.monotonic()
        self._filled += nbytes
        if self._filled < len(self._target):
            return
        try:
            self._on_full()
        except ProtocolError as exc:
            self.server.refusals.warning("data plane connection dropped", peer=self.peer, reason=str(exc))
            assert self.transport is not None
            self.transport.abort()

    def eof_received(self) -> bool | None:
        return None  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        if not self._thread_running:
            self._done_receiving()
        if exc is not None:
            self.server.refusals.info("data plane peer went away", peer=self.peer, reason=str(exc))
        if self._thread_socket is not None:
            if self._thread_running:
                self._thread_socket.shutdown(socket.SHUT_RDWR)  # wakes the thread: it returns, then closes it
            else:
                self._close_thread_socket()
        self._abandon_upload()
        self._release_header()
        self.server.forget(self)
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
        if not self.authorised and length > self.server.limits.unauthorised_header_bytes:
            raise ProtocolError(
                f"a {length}-byte header before any authorised frame "
                f"(allowed: up to {self.server.limits.unauthorised_header_bytes})"
            )
        budget = self.server.limits.header_budget_bytes
        if self.server.header_bytes + length > budget:
            raise ProtocolError(f"a {length}-byte header would take the store's headers past {budget} bytes")
        self.server.header_bytes += length
        self._header_held = length
        self._expect(memoryview(bytearray(length)), self._header_read)

    def _release_header(self) -> None:
        self.server.header_bytes -= self._header_held
        self._header_held = 0

    def _header_read(self) -> None:
        self._release_header()
        frame = decode_frame_header(bytes(self._target))
        if isinstance(frame, PutChunk):
            self._chunk_started(frame)
        elif isinstance(frame, Seal | Fetch):
            chain: tuple[ChainForward | None, str] = (None, "")
            if isinstance(frame, Seal) and self._upload == (frame.job, frame.rank, frame.step):
                self._upload = None  # its seal is answered next: no longer this connection's to free
                chain = (self._forward, self._forward_error)
                self._forward, self._forward_error = None, ""
            self._reply(frame, chain)
            self._expect(memoryview(self._length), self._length_read)
        else:
            raise ProtocolError(f"a client may not send {frame.OP} frames")

    def _chunk_started(self, chunk: PutChunk) -> None:
        self._chunk = chunk
        key = (chunk.job, chunk.rank, chunk.step)
        try:
            refused = self._refusal(chunk.job, chunk.token)
            if refused:
                raise StoreError(refused)
            new_upload = self._upload != key
            if new_upload:
                self._abandon_upload()
            target = self.server.memory.chunk_target(chunk, writer=self)
            if new_upload:  # not per chunk: only an upload's first chunk can make a new entry
                self.server.prefault()
                if chunk.forward:
                    self._start_forward(chunk)
            self._upload = key
            self._receiving = self.server.memory.entry(key)
        except StoreError as exc:
            if key not in self._refused and len(self._refused) >= REFUSED_KEPT_MAX:
                raise ProtocolError(f"{REFUSED_KEPT_MAX} refused uploads left unsealed on one connection") from None
            self._refused.setdefault(key, str(exc))
            self._chunk_left = chunk.nbytes
            self._discard_next()
            return
        if self._receiving is not None:
            self._receiving.readers += 1
        self._expect(target, self._chunk_read)
        if self.server.ingest_pool is not None and len(target) > 0:
            self._thread_wanted = True
            self._hold(HELD_FOR_THREAD)
            self._start_thread()

    def _done_receiving(self) -> None:
        """The chunk's bytes are in (or the connection is gone): its buffer may be reused again."""
        if self._receiving is not None:
            self._receiving.readers -= 1
            self._receiving = None

    def _start_thread(self) -> None:
        """Hand the rest of the chunk to an ingest thread, once nothing else holds this connection's reads
        (a chain being opened must be up before any chunk arrives)."""
        pool = self.server.ingest_pool
        if not self._thread_wanted or self._held != {HELD_FOR_THREAD} or self._lost or pool is None:
            return
        assert self.transport is not None
        if self.transport.is_closing():
            return
        if self._thread_socket is None:
            descriptor = os.dup(self.transport.get_extra_info("socket").fileno())
            self._thread_socket = socket.socket(fileno=descriptor)
            self._thread_socket.setblocking(False)  # as the loop's: they share one open file
        self._thread_wanted, self._thread_running = False, True
        whole = self._filled == 0  # else the thread's checksum would be of the chunk's rest only
        view = self._target[self._filled :]
        received = asyncio.get_running_loop().run_in_executor(
            pool, receive_into, self._thread_socket, view, THREAD_WAIT_S, self._bytes_seen
        )
        received.add_done_callback(lambda done: self._thread_done(done, whole))

    def _bytes_seen(self, now: float) -> None:
        self._last_rx = now  # from the thread: one attribute, for the idle sweep

    def _thread_done(self, done: asyncio.Future[Received], whole: bool) -> None:
        self._thread_running = False
        if self._lost or done.cancelled():
            self._done_receiving()  # not before: the thread wrote into the buffer until now
            self._close_thread_socket()
            return
        assert self.transport is not None
        try:
            received = done.result()
            self._filled += received.nbytes
            if received.ended:
                self.server.refusals.info("data plane peer went away", peer=self.peer, reason=received.ended)
                self.transport.abort()
                return
            if self._filled == len(self._target):
                self.server.thread_chunks += whole
                self._chunk_checksum = received.checksum if whole else None
                self.buffer_updated(0)  # the chunk is full: on as if the loop had read it
            else:
                self.server.thread_handbacks += 1  # a stalled sender: the loop reads the rest
            self._release(HELD_FOR_THREAD)
        except Exception:  # a connection left paused would wait for its idle bound: close it now
            self.log.exception("data plane chunk receive failed", peer=self.peer)
            self.transport.abort()

    def _close_thread_socket(self) -> None:
        if self._thread_socket is not None:
            self._thread_socket.close()
            self._thread_socket = None

    def _chunk_read(self) -> None:
        assert self._chunk is not None
        checksum, self._chunk_checksum = self._chunk_checksum, None
        self._done_receiving()
        self.server.memory.chunk_received(self._chunk, checksum, into=self._target.obj)
        if self._forward is not None:
            self._forward.send_chunk(self._chunk, self._target)
            if self._forward.backlogged:
                self._hold(_held_for(self._forward))
        self._throttle(self._chunk.nbytes)
        self._chunk = None
        self._expect(memoryview(self._length), self._length_read)

    def _throttle(self, nbytes: int) -> None:
        """With an ingest limit, stop reading this connection until the store's budget has paid for
        the chunk (the sender's socket fills, so its stream slows down as behind a slow link)."""
        rate = self.server.ingest_bytes_per_s
        if rate <= 0 or self.transport is None:
            return
        now = time.monotonic()
        free_at = max(now, self.server.ingest_free_at) + nbytes / rate
        self.server.ingest_free_at = free_at
        self._last_rx = free_at  # the store holds the bytes back: no idle clock runs until it reads again
        self._hold("throttle")
        asyncio.get_running_loop().call_later(free_at - now, self._release, "throttle")

    def _abandon_upload(self) -> None:
        if self._upload is not None and self.server.memory.abandon(self._upload, self):
            job, rank, step = self._upload
            self.server.refusals.info("unsealed upload freed", peer=self.peer, job=job, rank=rank, step=step)
        self._upload = None
        self._drop_forward()

    def _drop_forward(self) -> None:
        if self._forward is not None:
            self._forward.close()
            self._release(_held_for(self._forward))
            self._forward = None
        self._forward_error = ""

    def _start_forward(self, chunk: PutChunk) -> None:
        """A new upload names stores down its chain: connect to the next, holding this connection's
        reads until the connection is up (or failed), so no chunk arrives before it can go on."""
        name, rest = chunk.forward[0], chunk.forward[1:]
        directory = self.server.directory
        address = directory.address_of(name, time.monotonic()) if directory is not None else None
        if address is None:
            self._forward_error = f"store {name} is not a store this one has heard from"
            return
        token = self.server.token_for(chunk.job)
        forward = ChainForward(address, rest, token, lambda: self._release(_held_for(forward)))
        self._forward = forward
        self._hold(_held_for(forward))
        opened = asyncio.get_running_loop().create_task(forward.open(self.server.client_tls))
        opened.add_done_callback(lambda _: self._release(_held_for(forward)))

    def _hold(self, why: str) -> None:
        if not self._held and self.transport is not None:
            self.transport.pause_reading()
        self._held.add(why)

    def _release(self, why: str) -> None:
        if why not in self._held:
            return
        self._held.discard(why)
        if self._held == {HELD_FOR_THREAD} and self._thread_wanted:
            self._start_thread()
        elif not self._held and self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()

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

    def _reply(self, frame: Frame, chain: tuple[ChainForward | None, str] = (None, "")) -> None:
        previous = self._replies
        self._replies = asyncio.get_running_loop().create_task(self._answer(frame, previous, chain))

    async def _answer(
        self, frame: Frame, previous: asyncio.Task[None] | None, chain: tuple[ChainForward | None, str]
    ) -> None:
        if previous is not None:
            await previous
        try:
            if isinstance(frame, Seal):
                await self._seal(frame, *chain)
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

    async def _seal(self, seal: Seal, forward: ChainForward | None, forward_error: str) -> None:
        """Seal the upload; with a chain, send the Seal on and answer once the next store has (the
        member uploads to the stores the chain missed itself)."""
        key = (seal.job, seal.rank, seal.step)
        error = self._refused.pop(key, "") or self._refusal(seal.job, seal.token)
        snap: StoredSnapshot | None = None
        if not error:
            try:
                snap = self.server.memory.seal(seal)
            except StoreError as exc:
                error = str(exc)
        if snap is None:
            if forward is not None:
                forward.close()
            self.server.refusals.warning("snapshot refused", job=seal.job, rank=seal.rank, step=seal.step, reason=error)
            await self._write(encode_frame(Reply(ok=False, error=error)))
            return
        await self.server.on_sealed(snap)
        forwarded: list[str] = []
        if forward is not None:
            snap.readers += 1  # its chunks may still wait in the chain's buffer: not to be reused
            try:
                forwarded, forward_error = await forward.finish(seal, self.server.forward_reply_wait_s)
            finally:
                snap.readers -= 1
        if forward_error:
            self.server.refusals.warning(
                "snapshot chain stopped", job=seal.job, rank=seal.rank, step=seal.step, reason=forward_error
            )
        await self._write(encode_frame(Reply(ok=True, error="", forwarded=forwarded, forward_error=forward_error)))

    async def _fetch(self, fetch: Fetch) -> None:
        started = time.time()
        try:
            refused = self._refusal(fetch.job, fetch.token)
            if refused:
                self.server.refusals.warning(
                    "fetch refused", peer=self.peer, job=fetch.job, rank=fetch.rank, reason=refused
                )
                raise StoreError(refused)
            snap = self.server.memory.get(fetch.job, fetch.rank, fetch.step)
        except StoreError as exc:
            await self._write(encode_frame(FetchReply(False, str(exc), 0, "", 0, 0, [], b"")))
            return
        reply = FetchReply(
            True,
            "",
            snap.generation,
            snap.member,
            snap.total_bytes,
            snap.chunk_bytes,
            snap.checksums,
            snap.meta,
            snap.signature,
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
            attrs = {"job": fetch.job, "rank": fetch.rank, "step": fetch.step, "bytes": snap.total_bytes}
            self.server.tracing.record("serve_restore", fetch.traceparent, started, time.time(), attrs)


def _held_for(forward: ChainForward) -> str:
    """The reason a connection's reads are held for one chain (its connecting, or its backlog)."""
    return f"chain {id(forward)}"


FAULT_SLICE_BYTES = 16 * 1024 * 1024


def _faulted_in(nbytes: int) -> mmap.mmap:
    """Anonymous memory of `nbytes`, every page touched, without holding the GIL: `mmap` with
    MAP_POPULATE holds it for the whole populate (1 GiB held the store's event loop 0.3 s warm, 3 s
    cold, and the swapper took both stores of a 1 GiB-per-rank job for lost), `ctypes.memset` drops it
    (the loop's longest gap: 2.5 ms)."""
    data = mmap.mmap(-1, nbytes)
    anchor = ctypes.c_char.from_buffer(data)  # exports the buffer: released below, before anyone closes it
    try:
        address = ctypes.addressof(anchor)
        for offset in range(0, nbytes, FAULT_SLICE_BYTES):
            ctypes.memset(address + offset, 0, min(FAULT_SLICE_BYTES, nbytes - offset))
    finally:
        del anchor
    return data
