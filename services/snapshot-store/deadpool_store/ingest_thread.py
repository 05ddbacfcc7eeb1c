"""A chunk's bytes received on a worker thread, checksummed as they arrive.

A store's event loop runs every connection on one thread, and most of a store's ingest CPU is the
kernel's copy out of the socket and the checksum. Both release the GIL (`recv_into`, xxh3's `update`),
so a chunk's payload is received by a pool thread straight into the snapshot's memory, and uploads on
several connections are received on as many cores. The loop keeps the framing, the bookkeeping and the
replies: a thread only fills a view it was given and says how far it got.

A thread waits at most `wait_s` for the next bytes: a sender that stalls mid-chunk hands the rest of
the chunk back to the loop, which has its own idle rules, instead of holding one of a few threads.
"""

from __future__ import annotations

import select
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from deadpool_protocol.dataplane import chunk_hasher

__all__ = ["Received", "receive_into"]


@dataclass(frozen=True)
class Received:
    nbytes: int
    """Bytes received into the view, from its start."""
    checksum: int | None
    """The view's `chunk_checksum`, once it is full; None if it is not."""
    ended: str
    """Why the connection can go on no further ('' if it can): the peer closed it, or an error."""


def receive_into(sock: socket.socket, view: memoryview, wait_s: float, on_bytes: Callable[[float], None]) -> Received:
    """Receive into `view` until it is full, the peer closes, or no bytes come for `wait_s`.

    `sock` is non-blocking (it shares its open file with the event loop's socket); `on_bytes(monotonic_time)` is
    called after each read, so the loop's idle clock sees the bytes the thread takes."""
    hasher = chunk_hasher()
    filled, total = 0, len(view)
    poller: select.poll | None = None
    while filled < total:
        try:
            nbytes = sock.recv_into(view[filled:])
        except BlockingIOError:
            if poller is None:
                poller = select.poll()
                poller.register(sock, select.POLLIN)
            if not poller.poll(wait_s * 1000):  # the GIL is released while it waits
                return Received(filled, None, "")
            continue
        except OSError as exc:
            return Received(filled, None, f"receive failed: {exc}")
        if nbytes == 0:
            return Received(filled, None, "the peer closed the connection mid-chunk")
        hasher.update(view[filled : filled + nbytes])
        filled += nbytes
        on_bytes(time.monotonic())
    return Received(filled, int(hasher.intdigest()), "")
