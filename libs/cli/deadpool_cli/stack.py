"""The local control plane: NATS (embedded unless a URL is given: one server, or a cluster of
`nats_nodes`), `detectors` detectors, `swappers` swappers and N snapshot stores, each a separate
process started from this Python, with their logs in the work directory.

Used by `deadpool up`, by `deadpool launch` without `--nats`, by the demo, the tests and the benches.
With `restart_after_s`, a service that dies is started again after that long, as systemd's
`Restart=always` would (the chaos benchmark kills them on purpose).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import nats
from nats.aio.client import Client
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from deadpool_cli.nats_auth import (
    authorization_config,
    create_credentials,
    create_job_credentials,
    create_store_credentials,
)
from deadpool_cli.nats_server import NatsCluster, NatsServer
from deadpool_detector.core import DetectorConfig
from deadpool_protocol import StoreStatus, decode
from deadpool_protocol.subjects import STORE_STATUS
from deadpool_runtime import server_urls, tls
from deadpool_runtime.bus import tls_options
from deadpool_runtime.credentials import nkey_file
from deadpool_runtime.event_loop import IO_WAIT_MIN_S
from deadpool_runtime.host import LOOPBACK
from deadpool_runtime.tracing import TRACE_FILE_ENV
from deadpool_store import StoreConfig
from deadpool_swapper import SwapperConfig

__all__ = ["Stack", "StackConfig", "answers_ping"]

READY_TIMEOUT_S = 60.0
STOP_GRACE_S = 5.0
SUPERVISE_PERIOD_S = 0.1
ADMIT_POLL_S = 0.2
"""How often a stack with embedded NATS looks for new job keys to admit."""


@dataclass(frozen=True)
class StackConfig:
    """The parts' knobs a stack sets take their defaults from the parts' own configs (`DetectorConfig`,
    `SwapperConfig`, `StoreConfig`), and reach each process as command-line options built from this
    config's values (`detector_args`, `swapper_args`, `store_args`), never from a literal of their own."""

    workdir: Path
    nats_url: str = ""
    """An existing server (or a comma-separated cluster); empty starts embedded ones."""
    nats_nodes: int = 1
    """Embedded NATS servers: 1, or a cluster (3 for JetStream replicas 3)."""
    stores: int = 2
    replication: int = SwapperConfig.replication
    swappers: int = 1
    """Swapper instances; one leads, the others stand by."""
    detectors: int = 1
    heartbeat_timeout_s: float = DetectorConfig.heartbeat_timeout_s
    hang_factor: float = DetectorConfig.hang_factor
    hang_floor_s: float = DetectorConfig.hang_floor_s
    first_step_s: float = DetectorConfig.first_step_s
    straggler_window: int = DetectorConfig.straggler_window
    detector_io_wait_min_s: float = IO_WAIT_MIN_S
    """The detectors' event loops wait for I/O at most once per this (0: asyncio's own loop)."""
    store_capacity_bytes: int = StoreConfig.capacity_bytes
    trace_file: str = ""
    restart_after_s: float = 0.0
    """Start a service that died again after this long (0: never)."""
    auth: bool = True
    """Embedded NATS: generate credentials (`nats_auth`) into `workdir/credentials` and give every
    component only its role's; stores then take job tokens only. False: an open bus and data plane."""
    credentials: str = ""
    """With `nats_url`: the credentials directory of that deployment ('' if its server has no auth)."""
    listen: str = LOOPBACK
    """Embedded NATS and the stores listen here: loopback serves this host only; a private address
    (or 0.0.0.0 with `advertise`) serves other hosts (`deadpool up --listen`)."""
    advertise: str = ""
    """The address other hosts reach NATS and the stores at ('' is `listen`, which must then not be a
    wildcard)."""
    jobs: tuple[str, ...] = ()
    """Embedded NATS with auth: jobs given member credentials of their own before the server starts
    (`nats_auth.create_job_credentials`; a running server admits a later one on `NatsServer.reload`)."""

    def __post_init__(self) -> None:
        if not self.advertise and self.listen in ("0.0.0.0", "::", ""):
            raise ValueError(f"listening on {self.listen}, say which address other hosts reach: --advertise ADDRESS")

    @property
    def advertised(self) -> str:
        return self.advertise or self.listen

    @property
    def js_replicas(self) -> int:
        return min(3, self.nats_nodes) if not self.nats_url else min(3, len(server_urls(self.nats_url)))

    def detector_args(self) -> list[str]:
        """The `deadpool detector` options that give a detector this stack's knobs (NATS's aside)."""
        return [
            *("--heartbeat-timeout-s", str(self.heartbeat_timeout_s), "--hang-factor", str(self.hang_factor)),
            *("--hang-floor-s", str(self.hang_floor_s), "--first-step-s", str(self.first_step_s)),
            *("--straggler-window", str(self.straggler_window), "--js-replicas", str(self.js_replicas)),
            *("--io-wait-min-s", str(self.detector_io_wait_min_s)),
        ]

    def swapper_args(self) -> list[str]:
        """The `deadpool swapper` options that give a swapper this stack's knobs (NATS's aside)."""
        args = ["--replication", str(self.replication), "--js-replicas", str(self.js_replicas)]
        return args + (["--trace-file", self.trace_file] if self.trace_file else [])

    @staticmethod
    def store_id(index: int) -> str:
        return f"store-{index}"

    def store_args(self, index: int) -> list[str]:
        """The `deadpool store` options of this stack's store `index` (NATS's aside)."""
        args = ["--id", self.store_id(index), "--capacity-bytes", str(self.store_capacity_bytes)]
        if self.listen != LOOPBACK or self.advertise:
            args += ["--host", self.listen, "--advertise-host", self.advertised]
        return args


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
        self.cluster: NatsCluster | None = None
        self.url = config.nats_url
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self._commands: dict[str, list[str]] = {}
        self._stopping = False
        self._supervisor: asyncio.Task[None] | None = None
        self.restarts: dict[str, int] = {}
        self.held: set[str] = set()
        """Services (and `nats-<name>` servers) the supervisor leaves dead until `release` (faults that
        keep a part of DeadPool away for a while)."""
        self.logdir = config.workdir / "logs"
        self.credentials: Path | None = Path(config.credentials) if config.credentials else None
        """The credentials directory every component of this stack reads (None: no auth)."""
        self._admitter: asyncio.Task[None] | None = None

    @property
    def nats(self) -> NatsServer | None:
        """The embedded server (the first of a cluster), if this stack started any."""
        return self.cluster.servers[0] if self.cluster is not None else None

    async def __aenter__(self) -> Stack:
        self.logdir.mkdir(parents=True, exist_ok=True)
        try:
            if not self.url:
                authorization = ""
                if self.config.auth:
                    self.credentials = self.config.workdir / "credentials"
                    create_credentials(self.credentials)
                    for i in range(self.config.stores):
                        create_store_credentials(self.credentials, self.config.store_id(i))
                    for job in self.config.jobs:
                        create_job_credentials(self.credentials, job)
                    authorization = authorization_config(self.credentials)
                self.cluster = NatsCluster(
                    self.config.workdir / "nats",
                    self.config.nats_nodes,
                    host=self.config.listen,
                    authorization=authorization,
                    tls=tls.from_env(),  # every process of the stack inherits the same setting
                    advertise=self.config.advertised,
                )
                self.url = self.cluster.start()
            c = self.config
            for i in range(c.detectors):
                self._spawn("detector", *c.detector_args(), name="detector" if c.detectors == 1 else f"detector-{i}")
            for i in range(c.swappers):
                self._spawn("swapper", *c.swapper_args(), name="swapper" if c.swappers == 1 else f"swapper-{i}")
            for i in range(c.stores):
                self._spawn("store", *c.store_args(i), name=f"store-{i}")
            await self._wait_ready()
        except BaseException:
            self.stop()
            raise
        if self.config.restart_after_s > 0:
            self._supervisor = asyncio.create_task(self._supervise())
        if self.cluster is not None and self.credentials is not None:
            self._admitter = asyncio.create_task(self._admit_job_keys(self.credentials, self.cluster))
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for task in (self._supervisor, self._admitter):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self.stop()

    @property
    def trace_env(self) -> dict[str, str]:
        """The environment that sends a process's spans to this stack's trace file (if it has one)."""
        return {TRACE_FILE_ENV: self.config.trace_file} if self.config.trace_file else {}

    @property
    def nats_args(self) -> list[str]:
        """`--nats URL` and, with auth, `--credentials DIR`: what a `deadpool` command needs to join."""
        return ["--nats", self.url, *(["--credentials", str(self.credentials)] if self.credentials else [])]

    async def connect(self, **options: Any) -> Client:
        """A NATS client with the admin role (operators, tests, benches)."""
        seed = nkey_file(self.credentials, "admin") if self.credentials else None
        return await nats.connect(servers=server_urls(self.url), nkeys_seed=seed, **tls_options(), **options)

    def _spawn(self, command: str, *args: str, name: str = "") -> None:
        name = name or command
        self._commands[name] = [sys.executable, "-m", "deadpool_cli", command, *self.nats_args, *args]
        self._start(name)

    def _start(self, name: str) -> None:
        log = open(self.logdir / f"{name}.log", "ab")  # noqa: SIM115 (the child owns it)
        with log:
            self.processes[name] = subprocess.Popen(
                self._commands[name],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **self.trace_env},
            )

    def names(self, kind: str) -> list[str]:
        """The names of this stack's services of one kind ('swapper', 'detector', 'store')."""
        return [n for n in self.processes if n == kind or n.startswith(f"{kind}-")]

    def kill(self, name: str) -> int:
        """SIGKILL one service process (it is started again after `restart_after_s`, if set)."""
        process = self.processes[name]
        process.send_signal(signal.SIGKILL)
        process.wait()
        return process.pid

    def hold(self, *names: str) -> None:
        """Keep these services (or `nats-<name>` servers) dead once they die, until `release`."""
        self.held.update(names)

    def release(self, *names: str) -> None:
        """Let the supervisor start these again (after `restart_after_s`, counted from now)."""
        self.held.difference_update(names)

    async def _supervise(self) -> None:
        died: dict[str, float] = {}
        while not self._stopping:
            now = time.monotonic()
            for name in self.held:
                died.pop(name, None)
            for name, process in list(self.processes.items()):
                if process.poll() is None or name in self.held:
                    continue
                died.setdefault(name, now)
                if now - died[name] >= self.config.restart_after_s:
                    del died[name]
                    self.restarts[name] = self.restarts.get(name, 0) + 1
                    self._start(name)
            if self.cluster is not None:
                for server in self.cluster.servers:
                    key = f"nats-{server.name}"
                    if server.process is not None and not server.running() and key not in self.held:
                        died.setdefault(key, now)
                        if now - died[key] >= self.config.restart_after_s:
                            try:
                                await asyncio.to_thread(server.start)
                            except RuntimeError as exc:  # tried again next round: the supervisor goes on
                                print(f"deadpool stack: NATS server {server.name} did not restart: {exc}", flush=True)
                                continue
                            del died[key]
                            self.restarts[key] = self.restarts.get(key, 0) + 1
            await asyncio.sleep(SUPERVISE_PERIOD_S)

    @staticmethod
    async def _admit_job_keys(credentials: Path, cluster: NatsCluster) -> None:
        """Admit every job or store key that appears in `credentials/jobs` or `credentials/stores`
        (`deadpool launch` creates one there for a job that has none): the servers reload their
        authorization within `ADMIT_POLL_S`."""

        def listed() -> list[Path]:
            return sorted([*(credentials / "jobs").glob("*.nk"), *(credentials / "stores").glob("*.nk")])

        known = listed()
        while True:
            await asyncio.sleep(ADMIT_POLL_S)
            keys = listed()
            if keys != known:
                try:
                    await asyncio.to_thread(cluster.reload, authorization_config(credentials))
                except (OSError, ValueError, RuntimeError) as exc:  # tried again at the next poll
                    print(f"deadpool stack: job keys not admitted yet: {exc}", flush=True)
                    continue
                known = keys

    def _check_alive(self) -> None:
        for name, process in self.processes.items():
            if process.poll() is not None:
                tail = (self.logdir / f"{name}.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{name} exited with code {process.returncode} while starting:\n{tail}")

    async def _wait_ready(self) -> None:
        nc = await self.connect()
        try:
            stores_seen: set[str] = set()

            async def on_store(msg: object) -> None:
                stores_seen.add(decode(msg.data, StoreStatus).store)  # type: ignore[attr-defined]

            await nc.subscribe(STORE_STATUS, cb=on_store)
            deadline = time.monotonic() + READY_TIMEOUT_S
            wanted = (("deadpool-detector", self.config.detectors), ("deadpool-swapper", self.config.swappers))
            pending = {service for service, count in wanted if count}  # a stack may leave one out
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
        self._stopping = True
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
        if self.cluster is not None:
            self.cluster.stop()
