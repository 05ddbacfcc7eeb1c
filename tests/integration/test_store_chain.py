"""Real store processes: a member's one upload, passed on store to store down its chain as its chunks
arrive, leaves a verified copy on every store of the chain; a chain that cannot go on (a store that is
unknown, dead or refusing) stops with its reason, and the stores before it keep theirs.

The chain's next store is found by name among the stores' own announcements on the bus.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time

from nats.aio.client import Client
from nats.aio.msg import Msg

from deadpool.store_client import Chained, StoreConnection, UploadKey
from deadpool_protocol import StoreAddress, StoreStatus, decode
from deadpool_protocol.subjects import STORE_STATUS
from deadpool_store.chain_forward import BUFFER_BYTES

from .conftest import SpawnService
from .test_store_replication import WAIT_S, fetch, start_stores

JOB = "chain"
DATA = os.urandom(3 * 1024 * 1024 + 17)
"""A snapshot of 13 chunks, the last one short."""
CHUNK_BYTES = 256 * 1024
SOCKET_TIMEOUT_S = 30.0
"""The member's socket timeout (`StoreConnection`'s default)."""


def chained_upload(head: StoreAddress, step: int, forward: list[str], data: bytes = DATA) -> Chained:
    conn = StoreConnection(head, timeout_s=SOCKET_TIMEOUT_S)
    try:
        return conn.upload(
            UploadKey(JOB, 1, 0, "m0", step), memoryview(data), CHUNK_BYTES, b"layout", lambda: False, forward
        )
    finally:
        conn.close()


async def test_one_upload_leaves_a_verified_copy_on_every_store_of_its_chain(
    nc: Client, spawn_service: SpawnService
) -> None:
    s0, s1, s2 = await start_stores(nc, spawn_service, count=3)
    await known_to_each_other(nc, ["s0", "s1", "s2"])
    chained = await asyncio.to_thread(chained_upload, s0, 1, ["s1", "s2"])
    assert chained == Chained(["s1", "s2"], ""), chained
    for store in (s0, s1, s2):
        data, generation, member = await asyncio.to_thread(fetch, store, JOB, 0, 1)
        assert data == DATA and (generation, member) == (1, "m0"), store.store


async def test_a_chain_stops_at_a_store_unknown_refusing_or_dead_and_the_stores_before_keep_their_copy(
    nc: Client, spawn_service: SpawnService
) -> None:
    s0, s1 = await start_stores(nc, spawn_service, count=2)
    small = spawn_service("store", "--id", "s2", "--capacity-bytes", str(4 * 1024 * 1024))  # room for no copy
    await known_to_each_other(nc, ["s0", "s1", "s2"])

    unknown = await asyncio.to_thread(chained_upload, s0, 1, ["s9"])
    assert unknown.sealed == [] and "s9 is not a store this one has heard from" in unknown.stopped, unknown
    assert (await asyncio.to_thread(fetch, s0, JOB, 0, 1))[0] == DATA

    refused = await asyncio.to_thread(chained_upload, s0, 2, ["s1", "s2"])
    assert refused.sealed == ["s1"] and "s2 refused the copy" in refused.stopped, refused
    for store in (s0, s1):
        assert (await asyncio.to_thread(fetch, store, JOB, 0, 2))[0] == DATA, store.store

    small.kill()
    small.wait()
    dead = await asyncio.to_thread(chained_upload, s1, 3, ["s2"])  # heard less than 5 s ago: still listed
    assert dead.sealed == [] and "s2 unreachable" in dead.stopped, dead
    assert (await asyncio.to_thread(fetch, s1, JOB, 0, 3))[0] == DATA


async def test_a_next_store_that_stops_mid_chain_stops_the_chain_in_bounded_time_and_the_member_goes_on(
    nc: Client, spawn_service: SpawnService
) -> None:
    """A next store frozen (SIGSTOP: its host hangs; the kernel still accepts and buffers) neither
    drains the chain's backlog nor answers the Seal: the head gives up on it after its bounds, seals
    its own copy, and answers the member, which would otherwise hang until its socket's timeout."""
    spawned: list[subprocess.Popen[bytes]] = []

    def spawn(command: str, *args: str) -> subprocess.Popen[bytes]:
        spawned.append(spawn_service(command, *args))
        return spawned[-1]

    s0, _ = await start_stores(nc, spawn, "--capacity-bytes", str(256 * 1024 * 1024), count=2)
    frozen = spawned[1]
    large = os.urandom(BUFFER_BYTES * 3)  # past the chain's buffer and both sockets' kernel buffers
    for step, data, why in ((1, large, "its backlog held"), (2, DATA, "did not answer the seal")):
        await known_to_each_other(nc, ["s0", "s1"])  # frozen below: listed for 5 s more
        frozen.send_signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            chained = await asyncio.to_thread(chained_upload, s0, step, ["s1"], data)
            took_s = time.monotonic() - started
        finally:
            frozen.send_signal(signal.SIGCONT)
        assert chained.sealed == [] and why in chained.stopped, chained
        assert took_s < SOCKET_TIMEOUT_S, f"the member was held {took_s:.1f} s"
        assert (await asyncio.to_thread(fetch, s0, JOB, 0, step))[0] == data


async def known_to_each_other(nc: Client, stores: list[str]) -> None:
    """Until every store has heard every other announce itself: each subscribes before it first
    announces, so once all have announced, the announcements after that reach all of them. Two
    rounds after that one, so that each store has had its own copy of the round the test saw."""
    rounds: list[set[str]] = [set()]
    done = asyncio.Event()

    async def on_status(msg: Msg) -> None:
        store = decode(msg.data, StoreStatus).store
        rounds[-1].add(store)
        if rounds[-1] >= set(stores):
            rounds.append(set())
            if len(rounds) > 3:
                done.set()

    sub = await nc.subscribe(STORE_STATUS, cb=on_status)
    try:
        await asyncio.wait_for(done.wait(), WAIT_S)
    finally:
        await sub.unsubscribe()
