"""An ingest thread's receive (`deadpool_store.ingest_thread`) over a real socket pair: a chunk
received whole carries the data plane's checksum of it; a sender that stalls gets the chunk handed back
with what arrived so far; one that closes mid-chunk ends the connection."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator

import pytest

from deadpool_protocol.dataplane import chunk_checksum
from deadpool_store.ingest_thread import receive_into

WAIT_S = 0.05


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    receiver, sender = socket.socketpair()
    receiver.setblocking(False)  # as the store's: it shares the event loop's open file
    yield receiver, sender
    receiver.close()
    sender.close()


def test_a_chunk_received_whole_carries_its_checksum(pair: tuple[socket.socket, socket.socket]) -> None:
    receiver, sender = pair
    payload = os.urandom(3 * 65536 + 17)  # more than one read's worth
    target = memoryview(bytearray(len(payload)))
    seen: list[float] = []
    sender.sendall(payload[:1000])  # the rest comes while the receiver waits

    def send_rest() -> None:
        sender.sendall(payload[1000:])

    writer = threading.Thread(target=send_rest)
    writer.start()
    got = receive_into(receiver, target, 5.0, seen.append)
    writer.join()

    assert (got.nbytes, got.ended) == (len(payload), "")
    assert got.checksum == chunk_checksum(payload) and bytes(target) == payload
    assert seen and seen == sorted(seen), "each read is seen, in order, for the idle clock"


def test_a_sender_that_stalls_gets_the_chunk_handed_back_with_what_arrived(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    receiver, sender = pair
    target = memoryview(bytearray(100))
    sender.sendall(b"x" * 40)

    got = receive_into(receiver, target, WAIT_S, lambda _t: None)

    assert (got.nbytes, got.checksum, got.ended) == (40, None, "")
    assert bytes(target[:40]) == b"x" * 40


def test_a_sender_that_closes_mid_chunk_ends_the_connection(pair: tuple[socket.socket, socket.socket]) -> None:
    receiver, sender = pair
    sender.sendall(b"y" * 10)
    sender.shutdown(socket.SHUT_WR)

    got = receive_into(receiver, memoryview(bytearray(100)), 5.0, lambda _t: None)

    assert got.nbytes == 10 and got.checksum is None and "closed" in got.ended
