"""TLS as one setting (`DEADPOOL_TLS`), with certificates the test makes (trustme).

The cluster's routes are mutual TLS under an authority of their own: a rogue server once joined a
node's cluster port with no credentials at all, and its anonymous client read a swapper command. With
the setting on, clients speak TLS from their first byte, stores serve the data plane over TLS, and a
whole recovery (a SIGKILL, a spare restoring from a store) ends bit-identical.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest
import trustme
from nats.aio.client import Client
from nats.aio.msg import Msg

from deadpool.store_client import StoreClientError, StoreConnection, UploadKey
from deadpool_cli.nats_auth import authorization_config, create_credentials
from deadpool_cli.nats_server import NatsCluster, NatsServer, free_port
from deadpool_cli.stack import Stack, StackConfig
from deadpool_protocol import Subjects
from deadpool_protocol.dataplane import job_token
from deadpool_runtime.credentials import dataplane_key_file, nkey_file, read_dataplane_key
from deadpool_runtime.tls import TLS_ENV, TlsFiles

from .demo_runs import DemoRun
from .test_auth import store_address
from .tls_files import make_tls_files, write_identity

ROUTE_REFUSED = "TLS route handshake error"
"""What a node logs when a would-be route fails the handshake (no TLS, or a certificate it does not trust)."""
CROSS_WAIT_S = 20.0
"""How long a message published on one node may take to reach a subscriber on a routed one."""
COMMAND = Subjects.for_job("victim").rebuild
"""What the finding's rogue read and forged: a swapper command to a job's members."""


@pytest.fixture
def tls_files(tmp_path: Path) -> TlsFiles:
    return make_tls_files(tmp_path / "tls")


@pytest.fixture
def tls_on(tls_files: TlsFiles, monkeypatch: pytest.MonkeyPatch) -> Iterator[TlsFiles]:
    """The setting on for this process and every one it starts."""
    monkeypatch.setenv(TLS_ENV, str(tls_files.directory))
    yield tls_files


async def crosses(publisher: Client, subscriber: Client, wait_s: float) -> bool:
    """Whether a message published on `publisher`'s server reaches `subscriber` on its server within
    `wait_s` (published again every 0.1 s: interest takes a moment to travel along a route)."""
    got = asyncio.Event()

    async def on_message(_msg: Msg) -> None:
        got.set()

    sub = await subscriber.subscribe(COMMAND, cb=on_message)
    await subscriber.flush()
    deadline = time.monotonic() + wait_s
    try:
        while not got.is_set() and time.monotonic() < deadline:
            await publisher.publish(COMMAND, b"a swapper command")
            await publisher.flush()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(got.wait(), 0.1)
    finally:
        await sub.unsubscribe()
    return got.is_set()


def log_count(server: NatsServer, text: str) -> int:
    return (server.workdir / "nats-server.log").read_text(errors="replace").count(text)


async def until_logged(server: NatsServer, text: str, more_than: int, wait_s: float = 20.0) -> None:
    """Wait for `server` to log `text` more than `more_than` times (its log is the only event there is)."""
    deadline = time.monotonic() + wait_s
    while log_count(server, text) <= more_than:
        assert time.monotonic() < deadline, f"{server.name} never logged {text!r}"
        await asyncio.sleep(0.05)


def rogue_routes_files(directory: Path, tls_files: TlsFiles) -> TlsFiles:
    """What a rogue holding a store's certificate would bring to a cluster port: the routes' authority's
    public certificate (so it would trust the nodes), but a certificate of the clients' authority."""
    rogue = TlsFiles(directory)
    shutil.copytree(tls_files.directory, directory, ignore=shutil.ignore_patterns("routes"))
    rogue.routes.directory.mkdir(parents=True)
    shutil.copy(tls_files.routes.ca, rogue.routes.ca)
    shutil.copy(tls_files.cert, rogue.routes.cert)
    shutil.copy(tls_files.key, rogue.routes.key)
    return rogue


async def test_a_rogue_server_joins_a_plain_cluster_and_no_route_without_the_routes_certificate(
    tmp_path: Path, tls_files: TlsFiles
) -> None:
    credentials = tmp_path / "credentials"
    create_credentials(credentials)
    admin_seed = nkey_file(credentials, "admin")
    authorization = authorization_config(credentials)

    # As the finding was made: a cluster without TLS on its routes takes in a server with no users.
    plain = NatsCluster(tmp_path / "plain", 2, authorization=authorization)
    plain.start()
    # Routed to both nodes by name: a route the rogue only learns of (to the admin's node, through the
    # other) is tried once and never again (nats-server's `connect_retries` is 0 for discovered routes),
    # so one attempt lost on a busy machine left the control waiting in vain.
    routes = [server.cluster_port for server in plain.servers]
    rogue = NatsServer(tmp_path / "rogue-plain", cluster_port=free_port(), routes=routes)
    try:
        rogue.start()
        admin = await nats.connect(plain.servers[1].url, nkeys_seed=admin_seed)
        stranger = await nats.connect(rogue.url)  # no credentials: the rogue has no users
        assert await crosses(admin, stranger, CROSS_WAIT_S), "the control: a plain cluster's route takes a rogue in"
        await admin.close()
        await stranger.close()
    finally:
        rogue.stop()
        plain.stop()

    # With the setting: the nodes' routes form (mutual TLS), and neither rogue gets one.
    cluster = NatsCluster(tmp_path / "tls", 2, authorization=authorization, tls=tls_files)
    cluster.start()
    node = cluster.servers[0]
    context = ssl.create_default_context(cafile=str(tls_files.ca))
    rogues = [
        NatsServer(tmp_path / "rogue-no-tls", cluster_port=free_port(), routes=[node.cluster_port]),
        NatsServer(
            tmp_path / "rogue-store-cert",
            cluster_port=free_port(),
            routes=[node.cluster_port],
            tls=rogue_routes_files(tmp_path / "rogue-tls", tls_files),
        ),
    ]
    try:
        first = await nats.connect(node.url, nkeys_seed=admin_seed, tls=context, tls_handshake_first=True)
        second = await nats.connect(
            cluster.servers[1].url, nkeys_seed=admin_seed, tls=context, tls_handshake_first=True
        )
        assert await crosses(first, second, CROSS_WAIT_S), "the nodes' own routes did not form over TLS"
        for rogue in rogues:
            refused = log_count(node, ROUTE_REFUSED)
            rogue.start()
            await until_logged(node, ROUTE_REFUSED, refused)
            rogue_tls = {"tls": context, "tls_handshake_first": True} if rogue.tls is not None else {}
            stranger = await nats.connect(rogue.url, **rogue_tls)
            assert not await crosses(first, stranger, 1.0), f"{rogue.name} read a command"
            assert not await crosses(stranger, second, 1.0), f"{rogue.name} injected a command"
            await stranger.close()
            rogue.stop()
        await first.close()
        await second.close()
    finally:
        for rogue in rogues:
            rogue.stop()
        cluster.stop()


async def test_with_tls_on_strangers_in_plain_text_are_refused_and_snapshots_travel_encrypted(
    tmp_path: Path, tls_on: TlsFiles
) -> None:
    config = StackConfig(workdir=tmp_path / "stack", stores=1, replication=1)
    async with Stack(config) as stack:
        assert stack.credentials is not None
        admin_seed = nkey_file(stack.credentials, "admin")
        with pytest.raises(Exception):  # noqa: B017 (nats.py raises what its transport met)
            await nats.connect(stack.url, nkeys_seed=admin_seed, allow_reconnect=False, connect_timeout=2)
        admin = await stack.connect()  # the setting's options: TLS first, the deployment's authority
        address = await store_address(admin)
        await admin.close()
        token = job_token(read_dataplane_key(dataplane_key_file(stack.credentials)), "tls-job")
        data = os.urandom(2 * 1024 * 1024 + 5)

        def round_trip() -> bytes:
            conn = StoreConnection(address, token=token)
            got = bytearray()

            def into(_meta: bytes, nbytes: int) -> memoryview:
                got.extend(bytes(nbytes))
                return memoryview(got)

            try:
                conn.upload(UploadKey("tls-job", 1, 0, "m-0", 3), memoryview(data), 1 << 20, b"layout", lambda: False)
                conn.fetch("tls-job", 0, 3, into)
            finally:
                conn.close()
            return bytes(got)

        assert await asyncio.to_thread(round_trip) == data

        def plain_text_frame() -> bytes:
            """A plain frame on the store's port: the TLS handshake fails and the store hangs up."""
            with socket.create_connection((address.host, address.port), timeout=10) as sock:
                sock.sendall(b"\x00\x00\x00\x10" + b"x" * 16)
                return sock.recv(4096)

        answer = await asyncio.to_thread(plain_text_frame)
        assert not answer.startswith(b"\x00"), "the store answered a frame in plain text"

        def impostor_authority() -> None:
            """A member that trusts another authority refuses the store (as it would a rogue store)."""
            other = TlsFiles(tmp_path / "other-authority")
            write_identity(other, trustme.CA())
            conn = StoreConnection(address, token=token)
            conn.tls = ssl.create_default_context(cafile=str(other.ca))
            try:
                conn.fetch("tls-job", 0, 3, lambda _m, n: memoryview(bytearray(n)))
            finally:
                conn.close()

        with pytest.raises((StoreClientError, ssl.SSLError)):
            await asyncio.to_thread(impostor_authority)


def test_with_tls_on_a_killed_rank_restores_from_a_store_and_training_ends_bit_identical(
    tmp_path: Path, tls_files: TlsFiles
) -> None:
    """`deadpool demo` with the setting in its environment: every process it starts inherits it (the
    NATS server, the services, the launcher and its members, the stores' data plane)."""
    # 24 steps of ~70 ms: the demo sees a rank's step only in its launcher's beats, every quarter second
    # (several steps here, more on a loaded machine); it needs steps left after it sees the kill step.
    args = ["--model-size", "tiny", "--steps", "24", "--kill-step", "3", "--kill-rank", "1", "--no-host-copy"]
    run = DemoRun(tmp_path, args, env={**os.environ, TLS_ENV: str(tls_files.directory)})
    context = run.context()
    assert run.result.returncode == 0, context
    assert run.report["recovered"] is True, context
    assert run.report["bit_identical"] is True, context
    (incident,) = run.report["incidents"]
    assert incident["evidence"]["restore_link"] == "committed", context  # from a store, not a host's copy
    store_logs = "".join(p.read_text(errors="replace") for p in (run.run_dir / "logs").glob("store-*.log"))
    assert f'"rank": {incident["rank"]}, "step": {incident["restore_step"]}' in store_logs, context
    nats_logs = "".join(p.read_text(errors="replace") for p in (run.run_dir).rglob("nats-server.log"))
    assert 'Clients that are not using "TLS Handshake First" option will fail to connect' in nats_logs, context
