"""The hook's end of the snapshot data plane: blocking TCP to a store, on the snapshot thread.

Uploads send each chunk straight from the snapshot buffer (a memoryview, no copy) together with its
small msgpack header in one `sendmsg`; fetches receive straight into the destination buffer with
`recv_into` and verify every chunk's checksum before the caller may use the bytes. Every fetch has a
total deadline (`FetchDeadline`).
"""

from __future__ import annotations

import contextlib
import hmac
import select
import socket
import ssl
import time
from collections.abc import Callable, Sequence
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
    seal_signature,
)
from deadpool_protocol.errors import DeadPoolError
from deadpool_runtime import tls

__all__ = [
    "Chained",
    "FetchDeadline",
    "FetchDeadlineError",
    "FetchedSnapshot",
    "SnapshotCancelledError",
    "StoreClientError",
    "StoreConnection",
    "UploadKey",
]

CONNECT_TIMEOUT_S = 2.0
"""Connecting to a store, at most: a host that was lost (its link down) answers nothing, and a
connect in progress cannot be broken from another thread. Stores are a hop or two away."""
FETCH_BASE_S = 10.0
"""What a fetch may take besides moving the snapshot's bytes: the connect (at most
`CONNECT_TIMEOUT_S`), the request, and the store's reply header (its layout, up to
`HEADER_BYTES_MAX`), with room for a busy host."""
FETCH_FLOOR_BYTES_PER_S = 16 * 1024 * 1024
"""The slowest transfer still taken for an honest one: 16 MiB/s, about 60 times below a restore on
loopback (docs/performance.md) and 7 times below a 1 Gbit/s link."""
DUE_SLACK_S = 0.01
"""A receive that timed out this close to the deadline ended because of it (clocks round)."""


class StoreClientError(DeadPoolError, RuntimeError):
    """A store refused or failed an upload or fetch; the text says which and why."""


class FetchDeadlineError(StoreClientError):
    """A fetch took longer than its `FetchDeadline` and was abandoned."""


@dataclass(frozen=True)
class FetchDeadline:
    """How long one fetch may take in all, from the connect to the last chunk: `base_s`, plus the
    snapshot's bytes at `floor_bytes_per_s` once the store's reply has said how many.

    Sized by the bytes, not one fixed bound: a rank's snapshot is kilobytes to tens of gigabytes, so a
    fixed bound either cuts a large honest restore on a slow link or lets a small one trickle for
    minutes. A store slower than the floor is as good as lost; the next copy is on another store. The
    socket's timeout cannot bound a fetch: it holds per receive, and a store that sends a byte now and
    then never trips it. The size is the store's claim, but the caller's `destination` checks it
    against its own model before the deadline grows by it (`store_restore`), so a store cannot buy a
    longer deadline than a snapshot of that model could need.
    """

    base_s: float = FETCH_BASE_S
    floor_bytes_per_s: float = FETCH_FLOOR_BYTES_PER_S

    def seconds(self, total_bytes: int) -> float:
        """The whole fetch's bound for a snapshot of `total_bytes`."""
        return self.base_s + total_bytes / self.floor_bytes_per_s


class _Due:
    """One fetch's deadline on the monotonic clock: no blocking call on its socket outlasts it."""

    def __init__(self, seconds: float, per_call_s: float) -> None:
        self.started = time.monotonic()
        self.seconds = seconds
        """From `started`; it grows once the store's reply has said how many bytes follow."""
        self.per_call_s = per_call_s
        """The socket's own timeout, which still bounds each call."""

    def left(self) -> float:
        return self.started + self.seconds - time.monotonic()

    def arm(self, sock: socket.socket) -> None:
        """Let the next call on `sock` block for what is left at most; raise if nothing is left."""
        left = self.left()
        if left <= 0:
            raise self.passed()
        wanted = min(left, self.per_call_s)
        if wanted != sock.gettimeout():  # a system call: not once per receive of a large fetch
            sock.settimeout(wanted)

    def passed(self) -> FetchDeadlineError:
        return FetchDeadlineError(f"abandoned past its deadline of {self.seconds:.1f} s")


class SnapshotCancelledError(DeadPoolError, RuntimeError):
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


@dataclass(frozen=True)
class Chained:
    """What became of an upload's chain (`StoreConnection.upload`)."""

    sealed: list[str]
    """The stores down the chain that sealed their copy (only those the upload named)."""
    stopped: str = ""
    """Why the chain stopped short of the stores it named ('' if it did not)."""


class StoreConnection:
    """One persistent connection to one store; reconnects on the next call after an error."""

    def __init__(
        self, address: StoreAddress, timeout_s: float = 30.0, token: bytes = b"", seal_key: bytes = b""
    ) -> None:
        self.address = address
        self.tls = tls.client_context(tls.from_env())
        """With TLS on (`DEADPOOL_TLS`), the store's certificate is checked against the deployment's
        authority and its announced address before the first frame."""
        self.token = token
        """The job's data-plane token, from the swapper's answer to this member's hello."""
        self.seal_key = seal_key
        """The job's seal key, from the same answer: uploads are signed with it, and a fetched copy whose
        seal it did not sign is refused before a byte is taken (b'': neither)."""
        self.timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self._aborted = False

    def close(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
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

    def _connected(self, due: _Due | None = None) -> socket.socket:
        if self._aborted:
            raise ConnectionAbortedError("the connection was aborted")
        if self._sock is not None and self._closed_by_store(self._sock):
            self.close()  # the store dropped it while it idled (`ConnectionLimits.idle_s`): a new one
        if self._sock is None:
            timeout_s = CONNECT_TIMEOUT_S if due is None else min(CONNECT_TIMEOUT_S, max(due.left(), 0.001))
            sock = socket.create_connection((self.address.host, self.address.port), timeout=timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.tls is not None:
                try:  # the handshake runs under the connect timeout
                    sock = self.tls.wrap_socket(sock, server_hostname=self.address.host)
                except BaseException:
                    sock.close()
                    raise
            sock.settimeout(self.timeout_s)
            self._sock = sock
        return self._sock

    @staticmethod
    def _closed_by_store(sock: socket.socket) -> bool:
        """Whether the store closed this idle connection: between requests it sends nothing, so a
        readable socket is at its end (or broken; over TLS, readable at all: a close alert)."""
        try:
            readable, _, _ = select.select([sock], [], [], 0)
            if isinstance(sock, ssl.SSLSocket):
                return bool(readable) or sock.pending() > 0
            return bool(readable) and sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return True

    def upload(
        self,
        key: UploadKey,
        data: memoryview,
        chunk_bytes: int,
        meta: bytes,
        cancelled: Callable[[], bool],
        forward: Sequence[str] = (),
    ) -> Chained:
        """Send snapshot `key` (the bytes of `data`) and wait for the store to seal it. With `forward`
        (stores by name), the store passes each chunk on down that chain as it arrives (`dataplane`):
        returns the stores of it that sealed their copy, and why the chain stopped short if it did."""
        chain = list(forward)
        try:
            sock = self._connected()
            checksums: list[int] = []
            for offset, nbytes in chunk_spans(len(data), chunk_bytes):
                if cancelled():
                    raise SnapshotCancelledError(f"upload of step {key.step} cancelled")
                chunk = data[offset : offset + nbytes]
                header = PutChunk(
                    key.job,
                    key.generation,
                    key.rank,
                    key.member,
                    key.step,
                    offset,
                    nbytes,
                    len(data),
                    self.token,
                    chain,
                )
                _send_all(sock, [memoryview(encode_frame(header)), chunk])
                checksums.append(chunk_checksum(chunk))  # while the store drains the socket
            fields = (key.job, key.generation, key.rank, key.member, key.step, len(data), chunk_bytes, checksums, meta)
            seal = Seal(*fields, self.token, seal_signature(self.seal_key, *fields))
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
        return Chained([name for name in reply.forwarded if name in chain], reply.forward_error)

    def fetch(
        self,
        job: str,
        rank: int,
        step: int,
        destination: Callable[[bytes, int], memoryview],
        generation: int = 0,
        traceparent: str = "",
        deadline: FetchDeadline | None = None,
    ) -> FetchedSnapshot:
        """Fetch (job, rank, step). `destination(meta, total_bytes)` returns the buffer to fill (and
        may raise StoreClientError to refuse the snapshot before any byte of it is received).

        `generation`, if not 0, is the only generation whose copy is valid (the one that committed the
        step); a store holding another's is refused. Every chunk's checksum is verified; a mismatch
        raises and the buffer must not be used. The whole fetch is bounded by `deadline` (the default
        `FetchDeadline()`): past it the socket is shut down and FetchDeadlineError raised.
        """
        bound = deadline or FetchDeadline()
        due = _Due(bound.base_s, self.timeout_s)
        try:
            sock = self._connected(due)
            due.arm(sock)
            sock.sendall(encode_frame(Fetch(job, rank, step, self.token, traceparent)))
            reply = self._read_frame(sock, FetchReply, due)
            assert isinstance(reply, FetchReply)
            if not reply.ok:
                raise StoreClientError(f"store {self.address.store}: {reply.error}")
            if generation and reply.generation != generation:
                raise StoreClientError(
                    f"store {self.address.store} holds generation {reply.generation}'s copy of step {step}, "
                    f"not the committed one of generation {generation} (an abandoned timeline)"
                )
            self._check_signature(job, rank, step, reply)
            target = destination(reply.meta, reply.total_bytes)
            if len(target) != reply.total_bytes:
                raise StoreClientError("destination buffer does not match the snapshot's size")
            due.seconds = bound.seconds(reply.total_bytes)  # only now: the size passed `destination`'s checks
            spans = chunk_spans(reply.total_bytes, reply.chunk_bytes)
            if len(spans) != len(reply.checksums):
                raise StoreClientError("fetch reply lists the wrong number of checksums")
            for (offset, nbytes), checksum in zip(spans, reply.checksums, strict=True):
                chunk = target[offset : offset + nbytes]
                _recv_exactly(sock, chunk, due)
                if chunk_checksum(chunk) != checksum:
                    raise StoreClientError(f"store {self.address.store}: chunk at {offset} fails its checksum")
            sock.settimeout(self.timeout_s)
        except FetchDeadlineError as exc:
            self.close()
            raise FetchDeadlineError(f"fetch from store {self.address.store} {exc}") from None
        except (OSError, ProtocolError) as exc:
            self.close()
            raise StoreClientError(f"fetch from store {self.address.store} failed: {exc}") from exc
        except StoreClientError:
            self.close()
            raise
        return FetchedSnapshot(reply.generation, reply.member, reply.meta, reply.total_bytes)

    def _check_signature(self, job: str, rank: int, step: int, reply: FetchReply) -> None:
        """With a seal key, the copy must be sealed by a holder of it, for exactly this job, rank and step:
        a store (or anyone with the job's token) that replaced it cannot sign."""
        if not self.seal_key:
            return
        want = seal_signature(
            self.seal_key,
            job,
            reply.generation,
            rank,
            reply.member,
            step,
            reply.total_bytes,
            reply.chunk_bytes,
            reply.checksums,
            reply.meta,
        )
        if not hmac.compare_digest(want, reply.signature):
            why = "unsigned" if not reply.signature else "signed with another key, or changed since it was signed"
            raise StoreClientError(f"store {self.address.store}: the copy of step {step} is {why}: refused")

    @staticmethod
    def _read_frame(sock: socket.socket, expected: type[Frame], due: _Due | None = None) -> Frame:
        head = bytearray(FRAME_LENGTH.size)
        _recv_exactly(sock, memoryview(head), due)
        (length,) = FRAME_LENGTH.unpack(head)
        if length > HEADER_BYTES_MAX:
            raise ProtocolError(f"frame header of {length} bytes exceeds {HEADER_BYTES_MAX}")
        body = bytearray(length)
        _recv_exactly(sock, memoryview(body), due)
        return decode_frame_header(bytes(body), expected)


def _send_all(sock: socket.socket, pieces: list[memoryview]) -> None:
    """Send every byte of `pieces`, gathered into as few system calls as the kernel allows (over TLS,
    which has no gathered send, one after the other)."""
    if isinstance(sock, ssl.SSLSocket):
        for piece in pieces:
            sock.sendall(piece)
        return
    while pieces:
        sent = sock.sendmsg(pieces)
        while pieces and sent >= len(pieces[0]):
            sent -= len(pieces[0])
            pieces.pop(0)
        if pieces and sent:
            pieces[0] = pieces[0][sent:]


def _recv_exactly(sock: socket.socket, into: memoryview, due: _Due | None = None) -> None:
    """Fill `into` from `sock`; with `due`, no receive outlasts the deadline (a trickle included)."""
    got = 0
    while got < len(into):
        if due is not None:
            due.arm(sock)
        try:
            n = sock.recv_into(into[got:])
        except TimeoutError:
            if due is not None and due.left() < DUE_SLACK_S:
                raise due.passed() from None
            raise
        if n == 0:
            raise ConnectionError("the store closed the connection")
        got += n
