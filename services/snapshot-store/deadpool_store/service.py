"""`deadpool store`: a snapshot store process (RAM copies of snapshots, served over the data plane).

NATS side: announces itself and its memory use on `deadpool.store.status`, reports each sealed
snapshot on `deadpool.<job>.snapshot.complete` (an event: stored in the events stream, retried until
the server has it, without holding up the data plane), frees old snapshots on
`deadpool.<job>.commit`, and
is a `nats.micro` service (`deadpool-store`) whose `status` endpoint answers with its contents.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.micro import add_service
from nats.micro.request import Request

from deadpool_protocol import Commit, SnapshotComplete, StoreStatus, Subjects
from deadpool_protocol.codec import to_fields
from deadpool_protocol.subjects import STORE_STATUS
from deadpool_runtime import EventPublisher, publish, run_nats_service, stopped_within, subscribe_validated
from deadpool_store.dataplane_server import DataPlaneServer
from deadpool_store.memory import SnapshotMemory, StoredSnapshot

__all__ = ["StoreConfig", "main"]

VERSION = "0.1.0"


@dataclass(frozen=True)
class StoreConfig:
    nats_url: str
    store_id: str
    host: str = "127.0.0.1"
    port: int = 0
    advertise_host: str = ""
    capacity_bytes: int = 8 * 1024**3
    status_period_s: float = 1.0
    nice: int = 0
    """Added CPU niceness. 0 by default: on a 2-core machine fully busy with CPU training, nice 10 starved
    ingest (10 of 120 captures skipped in bench/overhead.py) with no measurable gain in step time."""


class StoreService:
    def __init__(self, config: StoreConfig, nc: Client, log: Any) -> None:
        self.config = config
        self.nc = nc
        self.log = log
        self.memory = SnapshotMemory(config.capacity_bytes)
        self.server = DataPlaneServer(self.memory, self._on_sealed, log)
        self.events = EventPublisher(nc, log)
        self.port = 0

    def status(self) -> StoreStatus:
        return StoreStatus(
            store=self.config.store_id,
            host=self.config.advertise_host or self.config.host,
            port=self.port,
            used_bytes=self.memory.used_bytes,
            capacity_bytes=self.memory.capacity_bytes,
            snapshots=len(self.memory),
            t=time.time(),
        )

    async def _on_sealed(self, snap: StoredSnapshot) -> None:
        self.events.publish_soon(
            Subjects.for_job(snap.job).snapshot_complete,
            SnapshotComplete(
                job=snap.job,
                generation=snap.generation,
                store=self.config.store_id,
                rank=snap.rank,
                member=snap.member,
                step=snap.step,
                nbytes=snap.total_bytes,
            ),
        )

    async def _on_commit(self, commit: Commit, _msg: Msg) -> None:
        freed = self.memory.commit(commit.job, commit.step)
        if freed:
            self.log.debug("snapshots freed", job=commit.job, step=commit.step, freed=len(freed))

    async def _status_endpoint(self, req: Request) -> None:
        await req.respond(json.dumps(to_fields(self.status())).encode())

    async def run(self, stop: asyncio.Event) -> None:
        self.port = await self.server.start(self.config.host, self.config.port)
        await subscribe_validated(self.nc, Subjects.any_job().commit, Commit, self._on_commit, self.log)
        service = await add_service(
            self.nc,
            name="deadpool-store",
            version=VERSION,
            description="DeadPool RAM snapshot store",
            metadata={"store": self.config.store_id},
        )
        await service.add_endpoint(
            name="status",
            subject=f"deadpool.store.{self.config.store_id}.status",
            handler=self._status_endpoint,
        )
        self.log.info("store ready", host=self.config.host, port=self.port, capacity_bytes=self.config.capacity_bytes)
        while True:
            await publish(self.nc, STORE_STATUS, self.status())
            if await stopped_within(stop, self.config.status_period_s):
                break
        await service.stop()
        await self.server.stop()
        await self.events.drain(2.0)


def main(config: StoreConfig) -> None:
    if config.nice:
        os.nice(config.nice)
    run_nats_service(
        "store",
        config.nats_url,
        f"deadpool-store-{config.store_id}",
        lambda nc, log, stop: StoreService(config, nc, log).run(stop),
        store=config.store_id,
    )
