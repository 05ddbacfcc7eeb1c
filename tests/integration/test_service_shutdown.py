"""Every DeadPool process stops within 5 s of SIGTERM, whether or not NATS is reachable.

Real processes against a real nats-server: a detector, two swappers (a leader and a standby), a
snapshot store and a launcher with one member. Once NATS was gone, the detectors and the standby
swapper were still running 5 s after SIGTERM (issue 21): an unbounded drain of a connection that
cannot reach its server.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deadpool_cli.nats_server import NatsServer
from deadpool_runtime.lifecycle import HARD_STOP_EXIT_CODE

from .conftest import SpawnService

STOPPED_WITHIN_S = 5.0
READY_WAIT_S = 60.0
"""Five Python processes importing on two cores."""
DISCONNECTED_WAIT_S = 15.0
LOG_POLL_S = 0.1
"""Another process's log lines have no event to wait on: the files are read again this often."""

MEMBER_SCRIPT = "import time\ntime.sleep(600)\n"
"""A member that does nothing until it is stopped (the launcher's own stop is what is tested)."""


def log_events(path: Path) -> list[str]:
    events = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                events.append(str(json.loads(line).get("event", "")))
            except json.JSONDecodeError:
                continue  # a line being written
    return events


def wait_for_lines(logs: dict[str, Path], wanted: dict[str, str], timeout_s: float) -> None:
    """Until every process's log holds the line it is asked for (`wanted`: process -> event)."""
    deadline = time.monotonic() + timeout_s
    missing = dict(wanted)
    while missing:
        missing = {p: e for p, e in missing.items() if e not in log_events(logs[p])}
        if not missing:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {missing} within {timeout_s} s")
        time.sleep(LOG_POLL_S)


def start_every_service(
    spawn_service: SpawnService, tmp_path: Path
) -> tuple[dict[str, subprocess.Popen[bytes]], dict[str, Path]]:
    script = tmp_path / "member.py"
    script.write_text(MEMBER_SCRIPT)
    commands = {
        "detector": ("detector",),
        "swapper-a": ("swapper",),
        "swapper-b": ("swapper",),
        "store": ("store", "--id", "s0", "--capacity-bytes", str(16 * 1024 * 1024)),
        "launcher": ("launch", "--nproc", "1", "--spares", "0", "--gpus", "none", "--job", "shutdown", str(script)),
    }
    processes = {name: spawn_service(*args) for name, args in commands.items()}
    logs = {name: tmp_path / f"{args[0]}-{i}.log" for i, (name, args) in enumerate(commands.items())}
    wait_for_lines(
        logs,
        {
            "detector": "detector ready",
            "swapper-a": "swapper ready",
            "swapper-b": "swapper ready",
            "store": "store ready",
            "launcher": "member started",
        },
        READY_WAIT_S,
    )
    leaders = [name for name in ("swapper-a", "swapper-b") if "leading" in log_events(logs[name])]
    deadline = time.monotonic() + READY_WAIT_S
    while not leaders:  # one leads, the other stands by: both are stopped
        assert time.monotonic() < deadline, "no swapper took the lead"
        time.sleep(LOG_POLL_S)
        leaders = [name for name in ("swapper-a", "swapper-b") if "leading" in log_events(logs[name])]
    return processes, logs


def stop_all(processes: dict[str, subprocess.Popen[bytes]]) -> dict[str, tuple[int | None, float]]:
    """SIGTERM to every process at once; each one's exit code (None: still running) and when it ended."""
    started = time.monotonic()
    for process in processes.values():
        process.send_signal(signal.SIGTERM)
    ended: dict[str, tuple[int | None, float]] = {}
    deadline = started + STOPPED_WITHIN_S
    while len(ended) < len(processes) and time.monotonic() < deadline:
        for name, process in processes.items():
            if name not in ended and process.poll() is not None:
                ended[name] = (process.returncode, round(time.monotonic() - started, 2))
        time.sleep(0.02)
    outcome = {name: ended.get(name, (None, STOPPED_WITHIN_S)) for name in processes}
    print("exit codes and seconds after SIGTERM:", outcome)  # shown with -s
    return outcome


# The launcher's code says whether its job finished: one stopped by a signal did not (1); the
# services stop cleanly (0).
EXPECTED_CODES = {"detector": 0, "swapper-a": 0, "swapper-b": 0, "store": 0, "launcher": 1}

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="signals and PR_SET_PDEATHSIG are Linux's")


def codes(outcome: dict[str, tuple[int | None, float]]) -> dict[str, int | None]:
    return {name: code for name, (code, _) in outcome.items()}


def test_every_service_stops_within_5_s_of_sigterm(spawn_service: SpawnService, tmp_path: Path) -> None:
    processes, _ = start_every_service(spawn_service, tmp_path)
    outcome = stop_all(processes)
    assert codes(outcome) == EXPECTED_CODES, f"exit codes and seconds after SIGTERM (None: still running): {outcome}"


@pytest.mark.parametrize("how", ["killed", "frozen"])
def test_every_service_stops_within_5_s_of_sigterm_once_nats_is_gone(
    how: str, spawn_service: SpawnService, nats_server: NatsServer, tmp_path: Path
) -> None:
    """Killed: the clients see their connection end and try to reconnect. Frozen (SIGSTOP, as a
    partition looks): the connection stays open and nothing answers on it."""
    processes, logs = start_every_service(spawn_service, tmp_path)
    assert nats_server.process is not None
    try:
        if how == "killed":
            nats_server.kill()
            wait_for_lines(logs, dict.fromkeys(processes, "nats disconnected"), DISCONNECTED_WAIT_S)
        else:
            nats_server.process.send_signal(signal.SIGSTOP)
        outcome = stop_all(processes)
    finally:
        nats_server.kill()  # a stopped process takes SIGKILL too
    assert codes(outcome) == EXPECTED_CODES, f"exit codes and seconds after SIGTERM (None: still running): {outcome}"


STUCK_SERVICE = """
import time
from deadpool_runtime.lifecycle import run_service

async def main(stop):
    print("ready", flush=True)
    time.sleep(60)  # its event loop blocked: no asyncio handler runs, no await returns

run_service(main, hard_stop_s=1.0)
"""


def test_a_service_stuck_outside_its_event_loop_is_ended_by_the_hard_stop() -> None:
    process = subprocess.Popen([sys.executable, "-c", STUCK_SERVICE], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert process.stdout is not None and process.stdout.readline() == b"ready\n"
        process.send_signal(signal.SIGTERM)
        assert process.wait(STOPPED_WITHIN_S) == HARD_STOP_EXIT_CODE
        assert process.stderr is not None and b"still running after the stop signal" in process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
