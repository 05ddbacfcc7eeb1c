"""Hosts for tests: Linux network namespaces joined by a bridge, each with its own private address.

`TestNetwork(["ctl", "hosta", ...])` makes one namespace per host and one more for the switch (a
bridge, no address), links every host to the switch with a veth pair, and gives each host an address
of 10.213.<n>.0/24 inside its own namespace only: no address is added to the machine's own namespace,
so no test traffic can leave the test's hosts. Processes run inside a host with `spawn`; the test's own
NATS client runs inside one with `entered` (network namespaces are per thread, and a socket keeps the
namespace it was made in). `lose(host)` kills the host's processes and takes its link down, as a host
that died would. Everything is removed on exit, whatever the outcome.

Needs root (CI runs as root; `ip` from iproute2).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType

__all__ = ["TestNetwork", "namespaces_available"]

CLONE_NEWNET = 0x40000000
STOP_WAIT_S = 10.0


def namespaces_available() -> bool:
    return os.geteuid() == 0 and subprocess.run(["ip", "netns", "list"], capture_output=True).returncode == 0


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")


class TestNetwork:
    __test__ = False  # not a test class, despite its name

    def __init__(self, hosts: list[str], logdir: Path) -> None:
        tag = os.getpid() % 10000
        self.prefix = f"dp{tag}"
        self.subnet = f"10.213.{tag % 250}"
        self.hosts = hosts
        self.logdir = logdir
        self.switch = f"{self.prefix}-sw"
        self.namespaces = {h: f"{self.prefix}-{h}" for h in hosts}
        self.addresses = {h: f"{self.subnet}.{i + 1}" for i, h in enumerate(hosts)}
        self._links = {h: f"{self.prefix}s{i}" for i, h in enumerate(hosts)}
        """The switch-side end of each host's link (taking it down cuts the host off)."""
        self.processes: dict[str, list[subprocess.Popen[bytes]]] = {h: [] for h in hosts}

    def __enter__(self) -> TestNetwork:
        try:
            _ip("netns", "add", self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for i, host in enumerate(self.hosts):
                ns, outside = self.namespaces[host], self._links[host]
                _ip("netns", "add", ns)
                _ip("link", "add", f"{self.prefix}h{i}", "type", "veth", "peer", "name", outside)
                _ip("link", "set", f"{self.prefix}h{i}", "netns", ns, "name", "eth0")
                _ip("link", "set", outside, "netns", self.switch)
                _ip("-n", self.switch, "link", "set", outside, "master", "br0", "up")
                _ip("-n", ns, "addr", "add", f"{self.addresses[host]}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        for host in self.hosts:
            self.kill(host)
        for ns in [*self.namespaces.values(), self.switch]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    def spawn(
        self, host: str, argv: list[str], env: dict[str, str] | None = None, name: str = ""
    ) -> subprocess.Popen[bytes]:
        """Start `argv` inside `host`; its output goes to `<logdir>/<name>.log`."""
        log = open(self.logdir / f"{name or host}.log", "ab")  # noqa: SIM115 (the child owns it)
        with log:
            process = subprocess.Popen(
                ["ip", "netns", "exec", self.namespaces[host], *argv],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1", "DEADPOOL_HOST": host, **(env or {})},
                start_new_session=True,
            )
        self.processes[host].append(process)
        return process

    def kill(self, host: str) -> None:
        for process in self.processes[host]:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)  # the process and everything it started
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(STOP_WAIT_S)
        # And whatever else runs inside the host (started by a stand-in of srun, say), as a host's death kills.
        listed = subprocess.run(["ip", "netns", "pids", self.namespaces[host]], capture_output=True, text=True)
        for pid in listed.stdout.split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)

    def lose(self, host: str) -> None:
        """The host dies: every process on it is SIGKILLed and its link goes down."""
        _ip("-n", self.switch, "link", "set", self._links[host], "down")
        self.kill(host)

    @contextlib.contextmanager
    def entered(self, host: str) -> Iterator[None]:
        """Run the calling thread (and the threads and sockets it creates meanwhile) inside `host`."""
        libc = ctypes.CDLL(None, use_errno=True)
        with open("/proc/thread-self/ns/net") as own, open(f"/run/netns/{self.namespaces[host]}") as target:
            if libc.setns(target.fileno(), CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns into the test host failed")
            try:
                yield
            finally:
                libc.setns(own.fileno(), CLONE_NEWNET)
