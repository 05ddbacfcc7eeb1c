"""The hook's end of the snapshot data plane: blocking TCP to a store, on the snapshot thread.

Uploads send each chunk straight from the snapshot buffer (a memoryview, no copy) together with its
small msgpack header in one `sendmsg`; fetches receive straight into the destination buffer with
`recv_into` and verify every chunk's checksum before the caller may use the bytes.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable
from dataclasses import dataclass

from deadpool_protocol import ProtocolError, StoreAddress
from deadpool_protocol.dataplane import (
    FRAME_LENGTH,
    HEADER_BYTES_MAX,
    Fetch,
    FetchReply,
    Frame,
    PutChunk,
    Reply,
    Seal,
    chunk_checksum,
    chunk_spans,
    decode_frame_header,
    encode_frame,
)

__all__ = ["FetchedSnapshot", "SnapshotCancelledError", "StoreClientError", "StoreConnection", "UploadKey"]

CONNECT_TIMEOUT_S = 2.0
"""Connecting to a store, at most: a host that was lost (its link down) answers nothing, and a
connect in progress cannot be broken from another thread. Stores are a hop or two away."""


class StoreClientError(RuntimeError):
    """A store refused or failed an upload or fetch; the text says which and why."""


class SnapshotCancelledError(RuntimeError):
    """An upload was abandoned because its snapshot became obsolete (a rebuild happened)."""


@dataclass(frozen=True)
class UploadKey:
    job: str
    generation: int
    rank: int
    member: str
    step: int


@dataclass(frozen=True)
class FetchedSnapshot:
    generation: int
    member: str
    meta: bytes
    total_bytes: int


class StoreConnection:
    """One persistent connection to one store; reconnects on the next call after an error."""

    def __init__(self, address: StoreAddress, timeout_s: float = 30.0, token: bytes = b"") -> None:
        self.address = address
        self.token = token
        """The job's data-plane token, from the swapper's answer to this member's hello."""
        self.timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self._aborted = False

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def abort(self) -> None:
        """Break the upload or fetch in progress, from any thread: its socket is shut down, so the call
        blocked on it fails at once (the owner closes it), and no later call connects again."""
        self._aborted = True
        sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def _connected(self) -> socket.socket:
        if self._aborted:
            raise ConnectionAbortedError("the connection was aborted")
        if self._sock is None:
            sock = socket.create_connection((self.address.host, self.address.port), timeout=CONNECT_TIMEOUT_S)
            sock.settimeout(self.timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock = sock
        return self._sock

    def upload(
        self, key: UploadKey, data: memoryview, chunk_bytes: int, meta: bytes, cancelled: Callable[[], bool]
    ) -> None:
        """Send snapshot `key` (the bytes of `data`) and wait for the store to seal it."""
        try:
            sock = self._connected()
            checksums: list[int] = []
            for offset, nbytes in chunk_spans(len(data), chunk_bytes):
                if cancelled():
                    raise SnapshotCancelledError(f"upload of step {key.step} cancelled")
                chunk = data[offset : offset + nbytes]
                header = PutChunk(
                    key.job, key.generation, key.rank, key.member, key.step, offset, nbytes, len(data), self.token
                )
                _send_all(sock, [memoryview(encode_frame(header)), chunk])
                checksums.append(chunk_checksum(chunk))  # while the store drains the socket
            seal = Seal(
                key.job,
                key.generation,
                key.rank,
                key.member,
                key.step,
                len(data),
                chunk_bytes,
                checksums,
                meta,
                self.token,
            )
            sock.sendall(encode_frame(seal))
            reply = self._read_frame(sock, Reply)
        except (OSError, ProtocolError, SnapshotCancelledError) as exc:
            self.close()  # the stream may be mid-frame: start clean next time
            if isinstance(exc, SnapshotCancelledError):
                raise
            raise StoreClientError(f"upload to store {self.address.store} failed: {exc}") from exc
        assert isinstance(reply, Reply)
        if not reply.ok:
            raise StoreClientError(f"store {self.address.store} refused step {key.step}: {reply.error}")

    def fetch(
        self,
        job: str,
        rank: int,
        step: int,
        destination: Callable[[bytes, int], memoryview],
        generation: int = 0,
        traceparent: str = "",
    ) -> FetchedSnapshot:
        """Fetch (job, rank, step). `destination(meta, total_bytes)` returns the buffer to fill (and
        may raise StoreClientError to refuse the snapshot before any byte of it is received).

        `generation`, if not 0, is the only generation whose copy is valid (the one that committed the
        step); a store holding another's is refused. Every chunk's checksum is verified; a mismatch
        raises and the buffer must not be used.
        """
        try:
            sock = self._connected()
            sock.sendall(encode_frame(Fetch(job, rank, step, self.token, traceparent)))
            reply = self._read_frame(sock, FetchReply)
            assert isinstance(reply, FetchReply)
            if not reply.ok:
                raise StoreClientError(f"store {self.address.store}: {reply.error}")
            if generation and reply.generation != generation:
                raise StoreClientError(
                    f"store {self.address.store} holds generation {reply.generation}'s copy of step {step}, "
                    f"not the committed one of generation {generation} (an abandoned timeline)"
                )
            target = destination(reply.meta, reply.total_bytes)
            if len(target) != reply.total_bytes:
                raise StoreClientError("destination buffer does not match the snapshot's size")
            spans = chunk_spans(reply.total_bytes, reply.chunk_bytes)
            if len(spans) != len(reply.checksums):
                raise StoreClientError("fetch reply lists the wrong number of checksums")
            for (offset, nbytes), checksum in zip(spans, reply.checksums, strict=True):
                chunk = target[offset : offset + nbytes]
                _recv_exactly(sock, chunk)
                if chunk_checksum(chunk) != checksum:
                    raise StoreClientError(f"store {self.address.store}: chunk at {offset} fails its checksum")
        except (OSError, ProtocolError) as exc:
            self.close()
            raise StoreClientError(f"fetch from store {self.address.store} failed: {exc}") from exc
        except StoreClientError:
            self.close()
            raise
        return FetchedSnapshot(reply.generation, reply.member, reply.meta, reply.total_bytes)

    @staticmethod
    def _read_frame(sock: socket.socket, expected: type[Frame]) -> Frame:
        head = bytearray(FRAME_LENGTH.size)
        _recv_exactly(sock, memoryview(head))
        (length,) = FRAME_LENGTH.unpack(head)
        if length > HEADER_BYTES_MAX:
            raise ProtocolError(f"frame header of {length} bytes exceeds {HEADER_BYTES_MAX}")
        body = bytearray(length)
        _recv_exactly(sock, memoryview(body))
        return decode_frame_header(bytes(body), expected)


def _send_all(sock: socket.socket, pieces: list[memoryview]) -> None:
    """Send every byte of `pieces`, gathered into as few system calls as the kernel allows."""
    while pieces:
        sent = sock.sendmsg(pieces)
        while pieces and sent >= len(pieces[0]):
            sent -= len(pieces[0])
            pieces.pop(0)
        if pieces and sent:
            pieces[0] = pieces[0][sent:]


def _recv_exactly(sock: socket.socket, into: memoryview) -> None:
    got = 0
    while got < len(into):
        n = sock.recv_into(into[got:])
        if n == 0:
            raise ConnectionError("the store closed the connection")
        got += n
