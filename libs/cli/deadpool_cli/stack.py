"""The local control plane: NATS (embedded unless a URL is given), detector, swapper and N snapshot
stores, each a separate process started from this Python, with their logs in the work directory.

Used by `deadpool up`, by `deadpool launch` without `--nats`, by the demo, and by the tests.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import nats
from nats.aio.client import Client
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from deadpool_cli.nats_server import NatsServer
from deadpool_protocol import StoreStatus, decode
from deadpool_protocol.subjects import STORE_STATUS

__all__ = ["Stack", "StackConfig", "answers_ping"]

READY_TIMEOUT_S = 60.0
STOP_GRACE_S = 5.0


@dataclass(frozen=True)
class StackConfig:
    workdir: Path
    nats_url: str = ""
    """An existing server; empty starts an embedded one."""
    stores: int = 2
    replication: int = 2
    heartbeat_timeout_s: float = 5.0
    hang_factor: float = 10.0
    hang_floor_s: float = 10.0
    first_step_s: float = 120.0
    store_capacity_bytes: int = 8 * 1024**3
    trace_file: str = ""


async def answers_ping(nc: Client, service: str, timeout_s: float = 0.2) -> bool:
    """Whether the `nats.micro` service `service` answers a PING (i.e. is up and subscribed)."""
    try:
        await nc.request(f"$SRV.PING.{service}", b"", timeout=timeout_s)
    except (NoRespondersError, NatsTimeoutError):
        return False
    return True


class Stack:
    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self.nats: NatsServer | None = None
        self.url = config.nats_url
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.logdir = config.workdir / "logs"

    async def __aenter__(self) -> Stack:
        self.logdir.mkdir(parents=True, exist_ok=True)
        try:
            if not self.url:
                self.nats = NatsServer(self.config.workdir / "nats")
                self.url = self.nats.start()
            c = self.config
            self._spawn(
                "detector",
                *("--heartbeat-timeout-s", str(c.heartbeat_timeout_s), "--hang-factor", str(c.hang_factor)),
                *("--hang-floor-s", str(c.hang_floor_s), "--first-step-s", str(c.first_step_s)),
            )
            swapper_args = ["--replication", str(self.config.replication)]
            if self.config.trace_file:
                swapper_args += ["--trace-file", self.config.trace_file]
            self._spawn("swapper", *swapper_args)
            for i in range(self.config.stores):
                self._spawn(
                    "store",
                    "--id",
                    f"store-{i}",
                    "--capacity-bytes",
                    str(self.config.store_capacity_bytes),
                    name=f"store-{i}",
                )
            await self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def _spawn(self, command: str, *args: str, name: str = "") -> None:
        name = name or command
        log = open(self.logdir / f"{name}.log", "wb")  # noqa: SIM115 (the child owns it)
        with log:
            self.processes[name] = subprocess.Popen(
                [sys.executable, "-m", "deadpool_cli", command, "--nats", self.url, *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )

    def _check_alive(self) -> None:
        for name, process in self.processes.items():
            if process.poll() is not None:
                tail = (self.logdir / f"{name}.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{name} exited with code {process.returncode} while starting:\n{tail}")

    async def _wait_ready(self) -> None:
        nc: Client = await nats.connect(self.url)
        try:
            stores_seen: set[str] = set()

            async def on_store(msg: object) -> None:
                stores_seen.add(decode(msg.data, StoreStatus).store)  # type: ignore[attr-defined]

            await nc.subscribe(STORE_STATUS, cb=on_store)
            deadline = time.monotonic() + READY_TIMEOUT_S
            pending = {"deadpool-detector", "deadpool-swapper"}
            while pending or len(stores_seen) < self.config.stores:
                self._check_alive()
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"services not ready after {READY_TIMEOUT_S} s: {sorted(pending)}, stores {sorted(stores_seen)}"
                    )
                pending = {service for service in pending if not await answers_ping(nc, service)}
                await asyncio.sleep(0.05)
        finally:
            await nc.close()

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for process in self.processes.values():
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self.nats is not None:
            self.nats.stop()
