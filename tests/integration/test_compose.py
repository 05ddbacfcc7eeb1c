"""deploy/compose.yaml run for real: its images built with no registry (`deploy/image/build-images.sh`:
a Debian base from Debian's packages, wheels built on this host), the 3-node NATS cluster over TLS, two
detectors, two swappers, two stores and the example trainer with a spare. A trainer rank is SIGKILLed
inside its container; the spare takes its rank, trains on, and the job finishes with weights
bit-identical to the same job run uninterrupted on this host.

It needs a running Docker engine, docker-compose (or the compose plugin), root (the credentials are
given to the containers' uid) and, for the base image, debootstrap and a Debian mirror; where any is
missing it is skipped, saying which. The images are built once per engine (a few minutes the first time)
and reused after.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest

from deadpool_cli.job_watch import JobWatch
from deadpool_cli.weights_check import compare_final_states
from deadpool_runtime.logs import get_logger

from .jobs import every_rank_at
from .test_deploy import compose_command

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
JOB = "example"  # the compose file's trainer runs job "example" with one spare
TRAINER_STEPS = 600  # DEADPOOL_EXAMPLE_STEPS (2,000 by default)
OUT_IN_CONTAINER = "/var/lib/deadpool/example-out"  # its --out, a named volume
CONTAINER_UID = 10001
KILL_AT = 40
WAIT_S = 180.0
BUILD_TIMEOUT_S = 900.0
ADVERTISE = "host.docker.internal"  # the trainer's name for the host, whose published ports lead to the stores
NATS_URLS = ["tls://localhost:4222", "tls://localhost:4223", "tls://localhost:4224"]


def why_compose_cannot_run() -> str | None:
    """The reason this machine cannot run the compose file, or None."""
    if not compose_command():
        return "neither docker compose nor docker-compose is installed"
    if shutil.which("docker") is None or subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        return "no Docker engine answers (docker info failed): start dockerd to run the compose file for real"
    if os.geteuid() != 0:
        return "the credentials are handed to the containers' uid 10001, which needs root"
    base = subprocess.run(["docker", "image", "inspect", "deadpool-base:bookworm"], capture_output=True)
    if base.returncode != 0 and shutil.which("debootstrap") is None:
        return "no deadpool-base:bookworm image and no debootstrap to make one"
    return None


REASON = why_compose_cannot_run()
pytestmark = [
    pytest.mark.skipif(REASON is not None, reason=REASON or ""),
    pytest.mark.timeout(1200),  # the first build of the images takes minutes; the run itself about one
]


def build_images() -> None:
    built = subprocess.run(
        ["bash", str(DEPLOY / "image" / "build-images.sh")],
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]


def secrets_for_compose(directory: Path) -> dict[str, str]:
    """Credentials and TLS files as the compose file's header makes them, owned by the containers' uid;
    the environment that points the compose file at them."""
    credentials, tls = directory / "credentials", directory / "tls"
    command = ["credentials", str(credentials), "--store", "store-a", "--store", "store-b", "--job", JOB]
    made = subprocess.run([sys.executable, "-m", "deadpool_cli", *command], capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    names = ["nats-1", "nats-2", "nats-3", "localhost", ADVERTISE]
    subprocess.run(["bash", str(DEPLOY / "tls" / "make-tls.sh"), str(tls), *names], check=True, capture_output=True)
    for path in [directory, credentials, tls, *credentials.rglob("*"), *tls.rglob("*")]:
        os.chown(path, CONTAINER_UID, -1)
    return {
        "DEADPOOL_CREDENTIALS_DIR": str(credentials),
        "DEADPOOL_TLS_DIR": str(tls),
        "DEADPOOL_ADVERTISE_HOST": ADVERTISE,
        "DEADPOOL_EXAMPLE_STEPS": str(TRAINER_STEPS),
    }


class ComposeProject:
    """One `compose up` of the shipped file under a project name of its own, taken down with its volumes."""

    def __init__(self, env: dict[str, str], logdir: Path) -> None:
        self.name = f"deadpool-test-{secrets.token_hex(3)}"
        self.env = {**os.environ, **env}
        self.logdir = logdir

    def run(self, *args: str, timeout_s: float = 300.0) -> subprocess.CompletedProcess[str]:
        command = [*compose_command(), "-p", self.name, "-f", str(DEPLOY / "compose.yaml"), "--profile", "example"]
        return subprocess.run([*command, *args], capture_output=True, text=True, env=self.env, timeout=timeout_s)

    def logs(self, service: str = "") -> str:
        return self.run("logs", "--no-color", *([service] if service else [])).stdout

    def container(self, service: str) -> str:
        found = self.run("ps", "-q", service)
        assert found.returncode == 0 and found.stdout.strip(), found.stderr
        return found.stdout.strip().splitlines()[0]

    @classmethod
    def up(cls, env: dict[str, str], logdir: Path) -> Iterator[ComposeProject]:
        project = cls(env, logdir)
        try:
            started = project.run("up", "-d")
            assert started.returncode == 0, started.stdout[-3000:] + started.stderr[-3000:]
            yield project
        finally:
            (logdir / f"{project.name}.log").write_text(project.logs())
            project.run("down", "-v", "--timeout", "5")


def tls_context(tls: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(tls / "ca.pem"))


@pytest.fixture
def compose(tmp_path: Path) -> Iterator[ComposeProject]:
    build_images()
    env = secrets_for_compose(tmp_path / "secrets")
    yield from ComposeProject.up(env, tmp_path)


async def test_the_compose_file_runs_a_job_whose_killed_rank_the_spare_takes(
    compose: ComposeProject, tmp_path: Path
) -> None:
    credentials, tls = Path(compose.env["DEADPOOL_CREDENTIALS_DIR"]), Path(compose.env["DEADPOOL_TLS_DIR"])
    deadline = time.monotonic() + WAIT_S
    while True:  # the NATS nodes are healthy before `up` returns; an admin session from the host
        try:
            nc = await nats.connect(
                servers=NATS_URLS,
                nkeys_seed=str(credentials / "admin.nk"),
                tls=tls_context(tls),
                tls_handshake_first=True,
                connect_timeout=2,
                max_reconnect_attempts=-1,
            )
            break
        except Exception:
            assert time.monotonic() < deadline, compose.logs()[-4000:]
            await asyncio.sleep(0.5)
    try:
        watch = JobWatch(nc, JOB, get_logger(test="compose"))
        await watch.start()
        try:
            await asyncio.wait_for(watch.wait_for(lambda: every_rank_at(watch, KILL_AT)), WAIT_S)
        except TimeoutError:
            pytest.fail(f"the compose job did not reach step {KILL_AT}:\n{compose.logs()[-6000:]}")
        assert watch.rebuild is not None and len(watch.rebuild.ranks) == 2
        victim = watch.rebuild.ranks[0]
        pid = watch.members[victim].pid
        assert pid > 0, watch.members[victim]
        killed_t = time.time()  # the heartbeats' clock: the same kernel's, inside the containers
        killed = subprocess.run(["docker", "exec", compose.container("trainer"), "kill", "-9", str(pid)])
        assert killed.returncode == 0

        try:
            await asyncio.wait_for(watch.wait_for(lambda: bool(watch.incidents)), WAIT_S)
        except TimeoutError:
            pytest.fail(f"no incident after the kill:\n{compose.logs('trainer')[-6000:]}")
        incident = watch.incidents[0]
        assert incident.rank == 0 and incident.member == victim, incident
        assert incident.replacement not in (victim, watch.rebuild.ranks[1]), incident
        try:
            await asyncio.wait_for(watch.finished.wait(), WAIT_S)
        except TimeoutError:
            pytest.fail(f"the job did not finish:\n{compose.logs('trainer')[-6000:]}")
        assert watch.finished_message is not None and not watch.finished_message.failed, watch.finished_message
        after = [d for d in watch.steps_done if d.member == incident.replacement and d.t >= killed_t and d.rank == 0]
        assert after, "the spare never completed a step as rank 0"
        print(  # the figures a closing note quotes (pytest -s)
            f"compose: rank {incident.rank} {incident.member} -> {incident.replacement}: detected after "
            f"{incident.detect_s:.2f} s, first step after the fault {incident.downtime_s:.2f} s, "
            f"{incident.lost_steps} steps lost; phases (s) "
            + " ".join(f"{k} {v:.2f}" for k, v in incident.phases.items())
        )
    finally:
        await nc.close()
    trainer = compose.container("trainer")
    exited = subprocess.run(["docker", "wait", trainer], capture_output=True, text=True)
    assert exited.stdout.strip() == "0", compose.logs("trainer")[-4000:]
    swapped = tmp_path / "swap"  # the ranks' final weights, from the trainer's volume
    copied = subprocess.run(["docker", "cp", f"{trainer}:{OUT_IN_CONTAINER}", str(swapped)], capture_output=True)
    assert copied.returncode == 0, copied.stderr

    reference = tmp_path / "reference"  # the same job uninterrupted, on this host: the same torch, seed, ranks
    log = tmp_path / "reference.log"
    command = ["launch", "--nproc", "2", "--spares", "0", str(ROOT / "examples" / "train_gpt.py")]
    command += ["--steps", str(TRAINER_STEPS), "--model-size", "tiny", "--out", str(reference)]
    with open(log, "wb") as sink:
        ran = subprocess.run([sys.executable, "-m", "deadpool_cli", *command], stdout=sink, stderr=sink, timeout=600)
    assert ran.returncode == 0, log.read_text(errors="replace")[-3000:]
    identical, tensors, differences = compare_final_states(swapped, reference)
    assert identical and tensors > 0, differences[:5]
    print(f"compose: final weights bit-identical to an uninterrupted run ({tensors} tensors)")
