"""Real parts for integration tests: a nats-server on a free loopback port, and service processes.

Every process a test starts is stopped at teardown, whatever the outcome.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.aio.client import Client

from deadpool_cli.nats_server import NatsServer
from deadpool_cli.stack import answers_ping


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    server = NatsServer(tmp_path / "nats")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def nats_url(nats_server: NatsServer) -> str:
    return nats_server.url


@pytest.fixture
async def nc(nats_url: str) -> AsyncIterator[Client]:
    client = await nats.connect(nats_url)
    yield client
    await client.close()


SpawnService = Callable[..., subprocess.Popen[bytes]]


@pytest.fixture
def spawn_service(nats_url: str, tmp_path: Path) -> Iterator[SpawnService]:
    """Start `deadpool <command> --nats URL <args>` as a process; its log goes to tmp_path."""
    started: list[subprocess.Popen[bytes]] = []

    def spawn(command: str, *args: str) -> subprocess.Popen[bytes]:
        log = open(tmp_path / f"{command}-{len(started)}.log", "wb")  # noqa: SIM115
        with log:
            process = subprocess.Popen(
                [sys.executable, "-m", "deadpool_cli", command, "--nats", nats_url, *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        started.append(process)
        return process

    yield spawn
    for process in started:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


async def wait_for_micro_service(nc: Client, name: str, timeout_s: float = 30.0) -> None:
    """Block until the `nats.micro` service `name` answers a PING."""
    deadline = time.monotonic() + timeout_s
    while not await answers_ping(nc, name, timeout_s=0.5):
        if time.monotonic() > deadline:
            raise TimeoutError(f"service {name} did not come up")
        await asyncio.sleep(0.1)  # no responders yet: the process is still importing


@pytest.fixture
def ctx() -> Any:
    """A multiprocessing context that starts fresh interpreters (torch and gloo do not survive fork)."""
    return multiprocessing.get_context("spawn")


def stop_processes(processes: list[Any]) -> None:
    """Kill and reap the test's processes, whatever state the test left them in."""
    for p in processes:
        if p.is_alive():
            p.kill()
        p.join(10)
