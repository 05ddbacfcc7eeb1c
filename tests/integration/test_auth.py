"""Credentials on by default: the shipped NATS authorization refuses strangers and keeps each role to its
own subjects, and each job's key (its launchers' and members') to its own job; stores serve a job's
snapshots only to holders of that job's token, which the swapper hands to the job's accepted members."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from deadpool.store_client import StoreClientError, StoreConnection, UploadKey
from deadpool_cli.health import answers_from_host
from deadpool_cli.nats_auth import (
    PERMISSIONS,
    authorization_config,
    create_credentials,
    create_job_credentials,
    create_store_credentials,
)
from deadpool_cli.nats_server import NatsServer
from deadpool_cli.stack import Stack, StackConfig
from deadpool_protocol import (
    ChildExit,
    FailureReason,
    FenceRequest,
    HelloReply,
    MemberDone,
    MemberError,
    MemberErrorCause,
    MemberHello,
    Placement,
    Rebuild,
    Reserve,
    RunStart,
    StoreAddress,
    StoreStatus,
    Subjects,
    decode,
    encode,
)
from deadpool_protocol.dataplane import job_token
from deadpool_protocol.events import EVENTS_STREAM
from deadpool_protocol.job_record import JOBS_BUCKET, unpack_record
from deadpool_protocol.messages import Failure, Heartbeat
from deadpool_protocol.placement_delta import placement_notice
from deadpool_protocol.rebuild_delta import notice_of
from deadpool_protocol.subjects import (
    PING_INBOX,
    STORE_STATUS,
    service_inbox,
    store_announce,
    store_replicate,
    store_reserve,
)
from deadpool_runtime.credentials import (
    dataplane_key_file,
    job_nkey_path,
    nkey_file,
    read_dataplane_key,
    store_nkey_path,
)
from deadpool_runtime.job_record_kv import read_record

from .runs import RUN, start_run

JOB = "secured"
S = Subjects.for_job(JOB)
OTHER = Subjects.for_job("another-job")
"""A job the key of `JOB` must not act for."""
FORGED_REBUILD = Rebuild(
    JOB, 1 << 40, 1, ["attacker-0"], [], "attacker-0", "127.0.0.1", 1, 0, [], [[]], "", time.time()
)
FORGED_PLACEMENT = encode(placement_notice(Placement(JOB, 1 << 40, 1, [], [[]], "forged")))
"""A placement every member would go to hear whole."""
FORGED_FENCE = FenceRequest(JOB, 1, "victim-0", "forged")
FORGED_FAILURE = Failure(JOB, 0, "victim-0", 0, FailureReason.HEARTBEAT, {}, time.time(), time.time())
SQUATTED_RUN = RunStart("another-job", 0, "squatter", 1, "squatter", time.time())
"""A job's key starting a run of another job's name, to hold the name before the real job comes."""
FORGED_ERROR = MemberError("another-job", 1, "victim-0", 0, "forged", time.time(), MemberErrorCause.USER_CODE)
"""One of these once ended any job: the detector copied the cause into its verdict."""
FORGED_DONE = MemberDone("another-job", 1, "victim-0", 0, 5)
FORGED_RESERVE = Reserve(JOB, 1, "store-0", [0], [1 << 40])  # a store told to fault in a TiB
FORGED_EXIT = ChildExit("another-job", 1, "launcher-b", "victim-0", 1234, -9, time.time())


def heartbeat(member: str) -> Heartbeat:
    return Heartbeat(JOB, 0, member, 0, 1, 1, False, 0.0, time.time())


@pytest.fixture
def secured_nats(tmp_path: Path) -> Iterator[tuple[NatsServer, Path]]:
    credentials = tmp_path / "credentials"
    create_credentials(credentials)
    create_job_credentials(credentials, JOB)
    create_store_credentials(credentials, "store-0")
    server = NatsServer(tmp_path / "nats", authorization=authorization_config(credentials))
    server.start()
    yield server, credentials
    server.stop()


async def connect_as(url: str, credentials: Path, role: str, violations: asyncio.Queue[str]) -> Client:
    """Connect with `role`'s key, or with `JOB`'s own key for role "job" (its launchers' and members')."""

    async def on_error(exc: Exception) -> None:
        violations.put_nowait(str(exc))

    if role == "job":
        seed, inbox = str(job_nkey_path(credentials, JOB)), S.inbox
    elif role == "store":
        seed, inbox = str(store_nkey_path(credentials, "store-0")), service_inbox("store", "store-0")
    else:
        seed, inbox = nkey_file(credentials, role), "_INBOX"
    return await nats.connect(url, nkeys_seed=seed, error_cb=on_error, inbox_prefix=inbox)


def test_no_key_is_shared_by_every_job() -> None:
    """Every user the servers admit either serves the deployment (a service, admin) or speaks for one job:
    no key that every training host holds may publish a job's member or launcher subjects for every job."""
    assert set(PERMISSIONS) == {"admin", "swapper", "detector"}
    for role, permissions in PERMISSIONS.items():
        if role != "admin":
            for subject in permissions["publish"]:
                assert (".member." not in subject and ".launcher." not in subject) or subject.endswith(".fence"), (
                    role,
                    subject,
                )


async def test_a_client_without_credentials_is_refused(secured_nats: tuple[NatsServer, Path]) -> None:
    server, _ = secured_nats
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await nats.connect(server.url, allow_reconnect=False, max_reconnect_attempts=0)


FORBIDDEN: list[tuple[str, str, bytes]] = [
    ("job", S.rebuild, encode(FORGED_REBUILD)),
    ("job", S.rebuild_delta, encode(notice_of(FORGED_REBUILD))),
    ("job", S.placement_delta, FORGED_PLACEMENT),
    ("job", S.fence("launcher-a"), encode(FORGED_FENCE)),
    ("job", S.failure, encode(FORGED_FAILURE)),
    ("job", store_announce("store-0"), b"forged"),
    ("job", S.snapshot_complete_by("store-0"), b"forged"),
    ("job", OTHER.run_start, encode(SQUATTED_RUN)),
    ("job", OTHER.member_error, encode(FORGED_ERROR)),
    ("job", OTHER.member_done, encode(FORGED_DONE)),
    ("job", OTHER.hello, b"forged"),
    ("job", OTHER.child_exit, encode(FORGED_EXIT)),
    ("job", OTHER.heartbeat_batch, b"forged"),
    ("job", OTHER.rebuild_ack, b"forged"),
    ("job", store_reserve("store-0"), encode(FORGED_RESERVE)),
    ("job", store_replicate("store-0"), b"forged"),
    ("swapper", S.failure, encode(FORGED_FAILURE)),
    ("swapper", store_announce("store-0"), b"forged"),
    ("swapper", S.snapshot_complete_by("store-0"), b"forged"),
    ("swapper", S.hello, b"forged"),
    ("swapper", S.member_error, encode(FORGED_ERROR)),
    ("store", S.rebuild, encode(FORGED_REBUILD)),
    ("store", S.rebuild_delta, encode(notice_of(FORGED_REBUILD))),
    ("store", S.placement_delta, FORGED_PLACEMENT),
    ("store", store_announce("store-1"), b"forged"),  # another store's name
    ("store", S.snapshot_complete_by("store-1"), b"forged"),  # another store's copies
    ("store", S.hello, b"forged"),
    ("store", store_reserve("store-1"), encode(FORGED_RESERVE)),
    ("detector", S.rebuild, encode(FORGED_REBUILD)),
    ("detector", S.rebuild_delta, encode(notice_of(FORGED_REBUILD))),
    ("detector", S.placement_delta, FORGED_PLACEMENT),
    ("detector", S.fence("launcher-a"), encode(FORGED_FENCE)),
    ("detector", store_reserve("store-0"), encode(FORGED_RESERVE)),
    ("detector", f"$JS.API.STREAM.PURGE.KV_{JOBS_BUCKET}", b"{}"),  # once purged a running job's record
    ("detector", f"$JS.API.STREAM.DELETE.{EVENTS_STREAM}", b""),
    ("detector", f"$JS.API.STREAM.MSG.DELETE.KV_{JOBS_BUCKET}", b"{}"),
    ("detector", f"$KV.{JOBS_BUCKET}.{JOB}", b"forged"),
    ("store", f"$JS.API.STREAM.PURGE.{EVENTS_STREAM}", b"{}"),
]


async def test_each_role_is_refused_what_is_not_its_to_say(secured_nats: tuple[NatsServer, Path]) -> None:
    """Forged commands, fences, verdicts and store announcements are dropped by the server; a heartbeat
    published after them by the same member arrives, so they would have arrived before it."""
    server, credentials = secured_nats
    admin = await connect_as(server.url, credentials, "admin", asyncio.Queue())
    seen: list[str] = []
    control = asyncio.Event()

    async def on_msg(msg: Msg) -> None:
        seen.append(msg.subject)
        if msg.subject == S.heartbeat:
            control.set()

    await admin.subscribe("deadpool.>", cb=on_msg)
    await admin.flush()
    for role in ("job", "store", "detector", "swapper"):
        violations: asyncio.Queue[str] = asyncio.Queue()
        client = await connect_as(server.url, credentials, role, violations)
        forbidden = [(subject, data) for r, subject, data in FORBIDDEN if r == role]
        for subject, data in forbidden:
            await client.publish(subject, data)
        await client.flush()
        if role == "job":  # the job's own subject still works, after the refused ones
            await client.publish(S.heartbeat, encode(heartbeat("m-0")))
            await client.flush()
            await asyncio.wait_for(control.wait(), 10)
        reported = [await asyncio.wait_for(violations.get(), 10) for _ in forbidden]  # the server's -ERR each
        await client.close()
        for (subject, _), report in zip(forbidden, reported, strict=True):
            assert f'permissions violation for publish to "{subject}"'.lower() in report.lower(), (role, report)
    await admin.flush()
    assert seen == [S.heartbeat], seen
    await admin.close()


async def test_only_the_swapper_may_command(secured_nats: tuple[NatsServer, Path]) -> None:
    server, credentials = secured_nats
    member = await connect_as(server.url, credentials, "job", asyncio.Queue())
    rebuilds: asyncio.Queue[bytes] = asyncio.Queue()

    async def on_rebuild(msg: Msg) -> None:
        await rebuilds.put(msg.data)

    await member.subscribe(S.rebuild, cb=on_rebuild)
    await member.flush()
    swapper_violations: asyncio.Queue[str] = asyncio.Queue()
    swapper = await connect_as(server.url, credentials, "swapper", swapper_violations)
    await swapper.publish(S.rebuild, encode(FORGED_REBUILD))
    assert decode(await asyncio.wait_for(rebuilds.get(), 10), Rebuild) == FORGED_REBUILD
    assert swapper_violations.empty()
    await swapper.close()
    await member.close()


async def test_a_job_of_its_own_speaks_and_hears_for_that_job_alone(secured_nats: tuple[NatsServer, Path]) -> None:
    """A job's own key, admitted by reloading the running server: the server refuses it another job's
    commands and replies (and every reply subject but its job's: a shared member key once read every
    job's hello replies, and their data-plane tokens), and any subject it may not publish; what another
    job is sent never reaches it, what its job is sent does."""
    server, credentials = secured_nats
    job = "third-job"
    create_job_credentials(credentials, job)
    await asyncio.to_thread(server.reload, authorization_config(credentials))
    other, mine = Subjects.for_job("another-job"), Subjects.for_job(job)
    violations: asyncio.Queue[str] = asyncio.Queue()
    received: asyncio.Queue[str] = asyncio.Queue()

    async def on_error(exc: Exception) -> None:
        violations.put_nowait(str(exc))

    async def on_msg(msg: Msg) -> None:
        received.put_nowait(msg.subject)

    member = await nats.connect(
        server.url, nkeys_seed=str(job_nkey_path(credentials, job)), error_cb=on_error, inbox_prefix=mine.inbox
    )
    refused_reads = [other.rebuild, f"{other.inbox}.>", "_INBOX.>", "deadpool.>", other.fence("launcher-a")]
    for subject in [*refused_reads, mine.rebuild, f"{mine.inbox}.>"]:
        await member.subscribe(subject, cb=on_msg)
    refused_writes = [other.heartbeat, other.hello, other.launcher_heartbeat("host-a"), mine.rebuild]
    for subject in refused_writes:
        await member.publish(subject, b"forged")
    await member.flush()
    reports = [await asyncio.wait_for(violations.get(), 10) for _ in refused_reads + refused_writes]
    for subject in refused_reads:  # (the client library reports the server's text in lower case)
        assert f'permissions violation for subscription to "{subject.lower()}"' in str(reports), subject
    for subject in refused_writes:
        assert f'permissions violation for publish to "{subject.lower()}"' in str(reports), subject

    admin = await connect_as(server.url, credentials, "admin", asyncio.Queue())
    for subject in (other.rebuild, f"{other.inbox}.x", mine.rebuild, f"{mine.inbox}.x"):  # in this order
        await admin.publish(subject, b"")
    await admin.flush()
    assert await asyncio.wait_for(received.get(), 10) == mine.rebuild
    assert await asyncio.wait_for(received.get(), 10) == f"{mine.inbox}.x"
    assert received.empty()  # what went to the other job, published first, never came
    await admin.close()
    await member.close()


async def store_address(nc: Client) -> StoreAddress:
    statuses: asyncio.Queue[StoreStatus] = asyncio.Queue()

    async def on_status(msg: Msg) -> None:
        await statuses.put(decode(msg.data, StoreStatus))

    sub = await nc.subscribe(STORE_STATUS, cb=on_status)
    status = await asyncio.wait_for(statuses.get(), 30)
    await sub.unsubscribe()
    return StoreAddress(status.store, status.host, status.port)


def never() -> bool:
    return False


async def test_a_job_reads_and_writes_only_its_own_snapshots(tmp_path: Path) -> None:
    """Through a whole stack with its default credentials and the job's own member key: the swapper
    gives an accepted member its job's token; with it the member stores and fetches its snapshot;
    without it, with another job's, or with a made-up one, the store refuses both."""
    config = StackConfig(workdir=tmp_path, stores=1, replication=1, jobs=(JOB,))
    async with Stack(config) as stack:
        assert stack.credentials is not None
        key = read_dataplane_key(dataplane_key_file(stack.credentials))
        admin = await stack.connect()
        address = await store_address(admin)
        await admin.close()

        # The job's own member key: its hello's reply comes to the job's inbox, the one place it may read.
        member = await nats.connect(
            stack.url, nkeys_seed=str(job_nkey_path(stack.credentials, JOB)), inbox_prefix=S.inbox
        )
        admin = await stack.connect()
        assert (await start_run(admin, JOB, 2)).accepted  # as the job's launcher would
        await admin.close()
        hello = MemberHello(JOB, 0, "m-0", "host-a", os.getpid(), "", 0, 2, "127.0.0.1", 29500, time.time(), run=RUN)
        reply = decode((await member.request(S.hello, encode(hello), timeout=30)).data, HelloReply)
        await member.close()
        assert reply.accepted, reply.reason
        assert reply.store_token == job_token(key, JOB)

        data = os.urandom(3 * 1024 * 1024 + 17)

        def upload(job: str, token: bytes) -> None:
            conn = StoreConnection(address, token=token)
            try:
                conn.upload(UploadKey(job, 1, 0, "m-0", 5), memoryview(data), 1024 * 1024, b"layout", never)
            finally:
                conn.close()

        def fetch(job: str, token: bytes) -> bytes:
            got = bytearray()

            def into(_meta: bytes, nbytes: int) -> memoryview:
                got.extend(bytes(nbytes))
                return memoryview(got)

            conn = StoreConnection(address, token=token)
            try:
                conn.fetch(job, 0, 5, into)
            finally:
                conn.close()
            return bytes(got)

        await asyncio.to_thread(upload, JOB, reply.store_token)
        assert await asyncio.to_thread(fetch, JOB, reply.store_token) == data

        other = job_token(key, "another-job")
        for token, why in ((b"", "unauthenticated"), (other, "unauthorised"), (os.urandom(32), "unauthorised")):
            with pytest.raises(StoreClientError, match=why):
                await asyncio.to_thread(fetch, JOB, token)
            with pytest.raises(StoreClientError, match=why):
                await asyncio.to_thread(upload, JOB, token)
        with pytest.raises(StoreClientError, match="unauthorised"):  # a member's token opens its own job only
            await asyncio.to_thread(upload, "another-job-2", reply.store_token)
        assert await asyncio.to_thread(fetch, JOB, reply.store_token) == data  # untouched by the refused uploads

        # The services' health check: this host's instance answers its ping, with the service's own role.
        seed = str(store_nkey_path(stack.credentials, "store-0"))
        store_role = await nats.connect(stack.url, nkeys_seed=seed, inbox_prefix=PING_INBOX)
        assert await answers_from_host(store_role, "deadpool-store")
        assert not await answers_from_host(store_role, "deadpool-store", host="another-host", wait_s=0.5)
        await store_role.close()
        ping = [sys.executable, "-m", "deadpool_cli", "ping", *stack.nats_args, "--role", "detector"]
        healthy = await asyncio.create_subprocess_exec(*ping, "deadpool-detector")
        assert await asyncio.wait_for(healthy.wait(), 60) == 0

        # An operator's view, with the admin credentials `--credentials` names; live until Ctrl-C.
        status = [sys.executable, "-m", "deadpool_cli", "status", *stack.nats_args, JOB]
        once = await asyncio.create_subprocess_exec(*status, stdout=asyncio.subprocess.PIPE)
        out, _ = await asyncio.wait_for(once.communicate(), 60)
        assert once.returncode == 0 and out.decode().startswith(f"job {JOB}: generation"), out
        watch = await asyncio.create_subprocess_exec(
            *status, "--watch", "--interval-s", "0.2", stdout=asyncio.subprocess.PIPE
        )
        assert watch.stdout is not None
        views = 0
        while views < 2:  # redrawn: the screen is cleared before each view
            line = await asyncio.wait_for(watch.stdout.readline(), 60)
            assert line, "status --watch ended by itself"
            views += line.startswith(b"\x1b[H\x1b[2Jjob " + JOB.encode())
        watch.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(watch.wait(), 30) == 0


async def test_a_jobs_key_cannot_speak_for_another_job_by_naming_it_in_the_payload(tmp_path: Path) -> None:
    """The server lets job A's key publish on A's subjects alone; a payload that names job B there is
    refused by the services. A hello for B sent on A's subject once came back accepted, with B's
    data-plane token (and now it would carry B's seal key); an error report for B on A's subject once
    reached the detector as B's. Both are refused; A's own report, published after, is taken."""
    config = StackConfig(workdir=tmp_path, stores=1, replication=1, jobs=("job-a",))
    async with Stack(config) as stack:
        assert stack.credentials is not None
        a = Subjects.for_job("job-a")
        admin = await stack.connect()
        assert (await start_run(admin, "job-b", 2)).accepted  # B is a real job, waiting for its ranks
        failures: asyncio.Queue[Failure] = asyncio.Queue()

        async def on_failure(msg: Msg) -> None:
            failures.put_nowait(decode(msg.data, Failure))

        await admin.subscribe("deadpool.*.failure", cb=on_failure)
        await admin.flush()
        seed = str(job_nkey_path(stack.credentials, "job-a"))
        key_a = await nats.connect(stack.url, nkeys_seed=seed, inbox_prefix=a.inbox)
        hello = MemberHello(
            "job-b", 0, "m-0", "host-a", os.getpid(), "", 0, 2, "127.0.0.1", 29500, time.time(), run=RUN
        )
        answer = await key_a.request(a.hello, encode(hello), timeout=30)
        assert answer.headers is not None and "another job's subject" in answer.headers["Nats-Service-Error"]
        # A's own member a-0, accepted (before formation: named by A's job record only, which the detector
        # reads when it hears of a member no rebuild named).
        assert (await start_run(admin, "job-a", 2)).accepted
        own_hello = MemberHello(
            "job-a", 0, "a-0", "host-a", os.getpid(), "", 0, 2, "127.0.0.1", 29501, time.time(), run=RUN
        )
        assert decode((await key_a.request(a.hello, encode(own_hello), timeout=30)).data, HelloReply).accepted
        records = await admin.jetstream(timeout=10).key_value(JOBS_BUCKET)
        deadline = time.monotonic() + 30
        while True:  # the swapper writes the record as it accepts the hello; polling it is the only way
            stored = await read_record(records, "job-a", 5.0)
            if stored is not None and "a-0" in unpack_record(stored.record)[0].hosts:
                break
            assert time.monotonic() < deadline, "a-0 never reached job-a's record"
            await asyncio.sleep(0.1)
        js = key_a.jetstream(timeout=10)
        forged = MemberError("job-b", 1, "m-0", 0, "forged", time.time(), MemberErrorCause.USER_CODE)
        await js.publish(a.member_error, encode(forged))  # stored: A's key may publish on A's subject
        own = MemberError("job-a", 1, "a-0", 0, "A's own error", time.time())
        await js.publish(a.member_error, encode(own))
        first = await asyncio.wait_for(failures.get(), 30)  # events are read in order: B's would be first
        assert (first.job, first.member) == ("job-a", "a-0"), first
        assert failures.empty()
        await key_a.close()
        await admin.close()
