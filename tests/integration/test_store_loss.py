"""A store's host is lost while a job trains; every host is a network namespace with its own address.

Hosts: `ctl` (NATS, detector, swapper), `hosta` (a launcher with 2 ranks and a spare) and three store
hosts. Losing a store host (its processes SIGKILLed, its link down) must heal without a rebuild: the
generation stays, the swapper places the snapshots anew within it, the committed step is copied store
to store until every rank has its replicas again, and commits go on. A rank killed afterwards then
restores from the copies, and the final weights equal an uninterrupted run's, bit for bit.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client

from deadpool_cli.job_watch import JobWatch
from deadpool_cli.nats_server import nats_server_binary
from deadpool_cli.weights_check import compare_final_states
from deadpool_protocol import SWAPPER_STATUS, Commit, Placement, StoreStatus, Subjects, decode
from deadpool_protocol.subjects import STORE_STATUS
from deadpool_runtime.logs import get_logger

from .jobs import every_rank_at
from .netns import TestNetwork, namespaces_available

pytestmark = pytest.mark.skipif(not namespaces_available(), reason="network namespaces need root and iproute2")

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py"
STEPS = 400
"""Training does not wait for a stream held up by the lost store (the due steps are not streamed
meanwhile), so the job must outlast the store's detection (1.5 s) and heal: 40 steps once ended first."""
RUN_TIMEOUT_S = 240.0
WAIT_S = 60.0
HEAL_WAIT_S = 15.0
"""Generous on 2 busy cores; how fast it heals is `bench/durability.py`'s business."""
STORE_HOSTS = ["store0", "store1", "store2"]


def deadpool(*args: str) -> list[str]:
    return [sys.executable, "-m", "deadpool_cli", *args]


def launch(net: TestNetwork, url: str, job: str, out: Path, spares: int = 1) -> object:
    command = deadpool("launch", "--nats", url, "--job", job, "--nproc", "2", "--spares", str(spares))
    command += ["--rendezvous-host", net.addresses["hosta"], "--collective-timeout-s", "20"]
    command += [str(SCRIPT), "--steps", str(STEPS), "--model-size", "tiny", "--out", str(out)]
    return net.spawn("hosta", command, name=f"launch-{job}")


async def connect(url: str) -> Client:
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            return await nats.connect(url, connect_timeout=1, max_reconnect_attempts=-1)
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)  # nats-server is starting inside its namespace


async def swapper_status(nc: Client, job: str) -> dict[str, object]:
    reply = await nc.request(SWAPPER_STATUS, job.encode(), timeout=5)
    status: dict[str, object] = json.loads(reply.data)
    return status


async def test_a_lost_store_host_heals_without_a_rebuild_and_a_later_swap_is_bit_identical(tmp_path: Path) -> None:
    with TestNetwork(["ctl", "hosta", *STORE_HOSTS], tmp_path) as net:
        ctl = net.addresses["ctl"]
        url = f"nats://{ctl}:4222"
        net.spawn(
            "ctl", [nats_server_binary(), "-a", ctl, "-p", "4222", "-js", "-sd", str(tmp_path / "js")], name="nats"
        )
        with net.entered("ctl"):
            nc = await connect(url)
            stores_seen: set[str] = set()

            async def on_store(msg: object) -> None:
                stores_seen.add(decode(msg.data, StoreStatus).store)  # type: ignore[attr-defined]

            await nc.subscribe(STORE_STATUS, cb=on_store)
            net.spawn("ctl", deadpool("detector", "--nats", url, "--heartbeat-timeout-s", "2", "--hang-floor-s", "3"))
            net.spawn("ctl", deadpool("swapper", "--nats", url, "--replication", "2"), name="swapper")
            for host in STORE_HOSTS:
                address = net.addresses[host]
                net.spawn(host, deadpool("store", "--nats", url, "--id", host, "--host", address))
            deadline = time.monotonic() + WAIT_S
            while len(stores_seen) < len(STORE_HOSTS):
                assert time.monotonic() < deadline, f"stores seen: {sorted(stores_seen)}"
                await asyncio.sleep(0.1)

            job = "store-loss"
            subjects = Subjects.for_job(job)
            watch = JobWatch(nc, job, get_logger(test=job))
            await watch.start()
            commits: list[tuple[float, Commit]] = []
            placements: list[tuple[float, Placement]] = []

            async def on_commit(msg: object) -> None:
                commits.append((time.time(), decode(msg.data, Commit)))  # type: ignore[attr-defined]

            async def on_placement(msg: object) -> None:
                placements.append((time.time(), decode(msg.data, Placement)))  # type: ignore[attr-defined]

            await nc.subscribe(subjects.commit, cb=on_commit)
            await nc.subscribe(subjects.placement, cb=on_placement)
            out = tmp_path / "swap"
            launcher = launch(net, url, job, out)

            await asyncio.wait_for(watch.wait_for(lambda: every_rank_at(watch, 8) and commits), WAIT_S)
            assert watch.rebuild is not None
            generation, first_placement = watch.rebuild.generation, watch.rebuild.placement
            lost = first_placement[0][0]
            committed_at_loss = commits[-1][1].step
            t_lost = time.time()
            net.lose(lost)

            async def healed() -> None:
                while True:
                    status = await swapper_status(nc, job)
                    newer = [c for t, c in commits if t > t_lost and c.step > committed_at_loss]
                    if placements and newer and status["replicas_short"] == 0:
                        return
                    await asyncio.sleep(0.2)

            await asyncio.wait_for(healed(), HEAL_WAIT_S)
            t_placed, placement = placements[0]
            assert placement.generation == generation and watch.rebuild.generation == generation, "no rebuild"
            assert all(lost not in names and len(set(names)) == 2 for names in placement.placement)
            assert t_placed - t_lost < HEAL_WAIT_S

            victim = watch.holder_of(1)
            assert victim is not None
            commits_before_kill = len(commits)
            await asyncio.wait_for(watch.wait_for(lambda: len(commits) > commits_before_kill), WAIT_S)
            os.kill(watch.members[victim].pid, signal.SIGKILL)
            returncode = await asyncio.wait_for(asyncio.to_thread(launcher.wait), RUN_TIMEOUT_S)  # type: ignore[attr-defined]
            assert returncode == 0, (tmp_path / f"launch-{job}.log").read_text(errors="replace")[-3000:]
            assert [i.rank for i in watch.incidents] == [1]
            (incident,) = watch.incidents
            assert incident.lost_steps <= 1 and incident.restore_step > committed_at_loss

            reference = tmp_path / "reference"
            solo = launch(net, url, "store-loss-ref", reference, spares=0)
            assert await asyncio.wait_for(asyncio.to_thread(solo.wait), RUN_TIMEOUT_S) == 0  # type: ignore[attr-defined]
            await nc.close()
    identical, tensors, differences = compare_final_states(out, reference)
    assert identical and tensors > 0, differences[:5]
