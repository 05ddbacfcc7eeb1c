"""`deadpool store`: a snapshot store process (RAM copies of snapshots, served over the data plane).

NATS side: announces itself and its memory use on `deadpool.store.<id>.announce` (every 0.5 s: the
swapper takes a store silent for 1.5 s as lost) and hears the other stores' (where a chained upload
goes next: `chain_forward`), copies a snapshot to another store when the swapper asks on
`deadpool.store.<id>.replicate` (after a store was lost), reports each sealed
snapshot on `deadpool.<job>.snapshot.complete` (an event: stored in the events stream, retried until
the server has it, without holding up the data plane), frees old snapshots on
`deadpool.<job>.commit`, and
is a `nats.micro` service (`deadpool-store`) whose `status` endpoint answers with its contents.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import socket
import time
from dataclasses import dataclass
from typing import Any

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.micro import add_service
from nats.micro.request import Request

from deadpool_protocol import Commit, JobFinished, ProtocolError, Replicate, Reserve, StoreStatus, Subjects
from deadpool_protocol.codec import to_fields
from deadpool_protocol.subjects import STORE_STATUS, service_inbox, store_announce, store_replicate, store_reserve
from deadpool_runtime import EventPublisher, publish, run_nats_service, stopped_within, subscribe_validated, tls
from deadpool_runtime.host import host_name
from deadpool_runtime.log_limit import RefusalLog
from deadpool_runtime.metrics import Metrics
from deadpool_runtime.tracing import Tracing
from deadpool_store import fault_injection
from deadpool_store.chain_forward import StoreDirectory
from deadpool_store.dataplane_server import DataPlaneServer
from deadpool_store.memory import SnapshotMemory, StoredSnapshot, StoreError
from deadpool_store.replicator import ReplicaRefusedError, push_snapshot
from deadpool_store.sealed_reports import SealedReports

__all__ = ["StoreConfig", "main"]

VERSION = "0.2.0"
REPLICATIONS_MAX = 8
"""Copies to other stores under way at once; past it a request is dropped (the swapper asks again)."""
INGEST_LIMIT_ENV = "DEADPOOL_STORE_INGEST_BYTES_PER_S"
"""Tests and benchmarks only: a store that ingests no faster than this many bytes per second."""


@dataclass(frozen=True)
class StoreConfig:
    nats_url: str
    store_id: str
    host: str = "127.0.0.1"
    port: int = 0
    advertise_host: str = ""
    capacity_bytes: int = 8 * 1024**3
    status_period_s: float = 0.5
    node: str = ""
    """This host's name as members give theirs (default: `DEADPOOL_HOST`, else the hostname)."""
    unsealed_max_s: float = 60.0
    """An upload not sealed this long after it began is freed (its sender died or gave up)."""
    replicate_timeout_s: float = 60.0
    """One copy to another store, at most (the swapper asks again if it did not arrive)."""
    nkey_file: str = ""
    """The store role's NATS nkey seed ('' where the server has no auth)."""
    dataplane_key: bytes = b""
    """Uploads and fetches must carry their job's token under this key (`dataplane.job_token`); empty:
    the data plane is open (logged as a warning at start)."""
    ingest_threads: int | None = None
    """Threads that receive and checksum uploads' chunks (`ingest_thread`): None, one per core this
    process may run on; 0, none (every byte on the event loop, one core)."""
    nice: int = 0
    """Added CPU niceness. 0 by default: on a 2-core machine fully busy with CPU training, nice 10 starved
    ingest (10 of 120 captures skipped in bench/overhead.py) with no measurable gain in step time."""


class StoreService:
    def __init__(self, config: StoreConfig, nc: Client, log: Any) -> None:
        self.config = config
        self.tls = tls.client_context(tls.from_env())
        """What the store verifies the stores it replicates to with (None: TLS off)."""
        self.nc = nc
        self.log = log
        self._refusals = RefusalLog(log)
        self.memory = SnapshotMemory(config.capacity_bytes)
        if not self.memory.host_room_for(config.capacity_bytes):
            log.warning(
                "capacity past the host's available memory: uploads past that are refused",
                capacity_bytes=config.capacity_bytes,
                available_bytes=self.memory.host_available(),
                reserve_bytes=self.memory.host_reserve_bytes,
            )
        self.metrics = Metrics("deadpool-store")
        store = {"store": config.store_id}
        self.metrics.gauge(
            "deadpool.store.memory.used", "By", "snapshot bytes held", lambda: [(self.memory.used_bytes, store)]
        )
        self.metrics.gauge(
            "deadpool.store.memory.capacity",
            "By",
            "snapshot bytes allowed",
            lambda: [(self.memory.capacity_bytes, store)],
        )
        self.metrics.gauge(
            "deadpool.store.memory.pooled",
            "By",
            "faulted-in buffers kept for the next uploads",
            lambda: [(self.memory.pooled_bytes, store)],
        )
        self.directory = StoreDirectory(config.store_id)
        """The other stores, as they announce themselves: where a chained upload goes next."""
        self.server = DataPlaneServer(
            self.memory,
            self._on_sealed,
            log,
            key=config.dataplane_key,
            tracing=Tracing("deadpool-store"),
            ingest_bytes_per_s=float(os.environ.get(INGEST_LIMIT_ENV, "0") or 0),
            tls=tls.server_context(tls.from_env()),
            directory=self.directory,
            client_tls=self.tls,
            ingest_threads=config.ingest_threads,
        )
        self.events = EventPublisher(nc, log)
        self.sealed = SealedReports(config.store_id, self.events.publish_soon)
        self.port = 0
        self.node = config.node or os.environ.get("DEADPOOL_HOST", "") or host_name()
        self.incarnation = secrets.token_hex(6)
        self._replicating: dict[tuple[str, int, int, str], asyncio.Task[None]] = {}
        """Copies under way, by (job, rank, step, target): a repeated request joins the one running."""

    def status(self) -> StoreStatus:
        return StoreStatus(
            store=self.config.store_id,
            host=self.config.advertise_host or self.config.host,
            port=self.port,
            used_bytes=self.memory.used_bytes,
            capacity_bytes=self.memory.capacity_bytes,
            snapshots=len(self.memory),
            t=time.time(),
            node=self.node,
            unsealed=self.memory.unsealed,
            incarnation=self.incarnation,
        )

    async def _on_sealed(self, snap: StoredSnapshot) -> None:
        self.sealed.sealed(snap.job, snap.generation, snap.step, snap.rank, snap.total_bytes)

    async def _on_store_status(self, status: StoreStatus, _msg: Msg) -> None:
        self.directory.heard(status, time.monotonic())

    async def _on_commit(self, commit: Commit, _msg: Msg) -> None:
        freed = self.memory.commit(commit.job, commit.step, commit.generation)
        if freed:
            self.log.debug("snapshots freed", job=commit.job, step=commit.step, freed=len(freed))

    async def _on_finished(self, finished: JobFinished, _msg: Msg) -> None:
        freed = self.memory.finished(finished.job, finished.generation)
        if freed:
            self.log.info("snapshots of a finished job freed", job=finished.job, freed=len(freed))

    async def _on_replicate(self, request: Replicate, _msg: Msg) -> None:
        key = (request.job, request.rank, request.step, request.target.store)
        if key in self._replicating:
            return  # the swapper asked again while the copy runs
        if len(self._replicating) >= REPLICATIONS_MAX:
            self.log.warning("replication refused: too many under way", job=request.job, limit=REPLICATIONS_MAX)
            return
        try:
            snap = self.memory.get(request.job, request.rank, request.step)
        except StoreError as exc:
            self.log.warning("cannot replicate", job=request.job, rank=request.rank, step=request.step, reason=str(exc))
            return
        task = asyncio.create_task(self._replicate(snap, request))
        self._replicating[key] = task
        task.add_done_callback(lambda _: self._replicating.pop(key, None))

    async def _on_reserve(self, reservation: Reserve, _msg: Msg) -> None:
        if reservation.store != self.config.store_id:
            self.log.warning("reservation for another store ignored", job=reservation.job, store=reservation.store)
            return
        wanted = [
            rank
            for rank, nbytes in zip(reservation.ranks, reservation.nbytes, strict=True)
            if self.memory.reserve(reservation.job, rank, nbytes)
        ]
        if wanted:
            self.log.info("buffers reserved for ranks placed here", job=reservation.job, ranks=len(wanted))
            self.server.prefault()

    async def _replicate(self, snap: StoredSnapshot, request: Replicate) -> None:
        started = time.monotonic()
        where = {"job": request.job, "rank": request.rank, "step": request.step, "target": request.target.store}
        try:
            pushed = push_snapshot(snap, request.target, self.server.token_for(snap.job), self.tls)
            await asyncio.wait_for(pushed, self.config.replicate_timeout_s)
        except (OSError, TimeoutError, ProtocolError, ReplicaRefusedError, asyncio.IncompleteReadError) as exc:
            self.log.warning("replication failed", **where, reason=repr(exc))
            return
        self.log.info("replicated", **where, nbytes=snap.total_bytes, took_s=round(time.monotonic() - started, 4))

    async def _corrupt_endpoint(self, req: Request) -> None:
        result = fault_injection.corrupt_request(self.memory, req.data)
        self.log.warning("snapshots corrupted on request", **result)
        await req.respond(json.dumps(result).encode())

    async def _status_endpoint(self, req: Request) -> None:
        await req.respond(json.dumps(to_fields(self.status())).encode())

    async def run(self, stop: asyncio.Event) -> None:
        self.port = await self.server.start(self.config.host, self.config.port)
        await subscribe_validated(self.nc, Subjects.any_job().commit, Commit, self._on_commit, self.log)
        await subscribe_validated(self.nc, STORE_STATUS, StoreStatus, self._on_store_status, self.log)
        await subscribe_validated(self.nc, Subjects.any_job().finished, JobFinished, self._on_finished, self.log)
        replicate = store_replicate(self.config.store_id)
        await subscribe_validated(self.nc, replicate, Replicate, self._on_replicate, self.log)
        reserve = store_reserve(self.config.store_id)
        await subscribe_validated(self.nc, reserve, Reserve, self._on_reserve, self.log)
        service = await add_service(
            self.nc,
            name="deadpool-store",
            version=VERSION,
            description="DeadPool RAM snapshot store",
            metadata={"store": self.config.store_id, "host": socket.gethostname()},
        )
        await service.add_endpoint(
            name="status",
            subject=f"deadpool.store.{self.config.store_id}.status",
            handler=self._status_endpoint,
        )
        if fault_injection.armed():
            self.log.warning("fault injection armed: deadpool.store.<id>.corrupt flips bytes in stored snapshots")
            await service.add_endpoint(
                name="corrupt",
                subject=f"deadpool.store.{self.config.store_id}.corrupt",
                handler=self._corrupt_endpoint,
            )
        self.log.info("store ready", host=self.config.host, port=self.port, capacity_bytes=self.config.capacity_bytes)
        if self.server.ingest_bytes_per_s > 0:
            self.log.warning("ingest limited (tests and benchmarks)", bytes_per_s=self.server.ingest_bytes_per_s)
        if not self.config.dataplane_key:
            self.log.warning("the data plane is open: no data-plane key, so uploads and fetches carry no token")
        while True:
            for job, rank, step in self.memory.expire_unsealed(time.monotonic(), self.config.unsealed_max_s):
                self.log.warning(
                    "unsealed upload freed", job=job, rank=rank, step=step, after_s=self.config.unsealed_max_s
                )
            try:
                await publish(self.nc, store_announce(self.config.store_id), self.status())
            except nats.errors.Error as exc:  # NATS away for long: its client's outbound buffer is full
                self._refusals.warning("store status not sent", error=repr(exc))
            if await stopped_within(stop, self.config.status_period_s):
                break
        await service.stop()
        for task in list(self._replicating.values()):
            task.cancel()
        await self.server.stop()
        self.sealed.flush()
        await self.events.drain(2.0)
        self.server.tracing.shutdown()
        self.metrics.shutdown()


def main(config: StoreConfig) -> None:
    if config.nice:
        os.nice(config.nice)
    run_nats_service(
        "store",
        config.nats_url,
        f"deadpool-store-{config.store_id}",
        lambda nc, log, stop: StoreService(config, nc, log).run(stop),
        config.nkey_file,
        service_inbox("store", config.store_id),  # its own replies only: never a job's
        store=config.store_id,
    )
