"""A job over three hosts, each a network namespace with its own address, launched as users launch
jobs over several hosts: torchrun's flags, or Slurm's environment inside srun.

A control plane host runs `deadpool up --listen ADDRESS` (NATS, two detectors, two swappers, two
stores, credentials on). Hosts a and b run two ranks each (`--nnodes 2 --node-rank I
--nproc-per-node 2`); host c holds two spares and no ranks (`--nproc-per-node 0 --spares 2`), and takes
the job's world size from the job. No launcher is told a rendezvous address: each finds its own on its
route to NATS. Host a is lost (every process SIGKILLed, its link down); host c's spares take ranks 0
and 1, and the final weights equal an uninterrupted run's, bit for bit.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client

from deadpool_cli.job_watch import JobWatch
from deadpool_cli.weights_check import compare_final_states
from deadpool_runtime.logs import get_logger

from .jobs import every_rank_at
from .netns import TestNetwork, namespaces_available

pytestmark = pytest.mark.skipif(not namespaces_available(), reason="network namespaces need root and iproute2")

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py"
STEPS = 30
KILL_AT = 8
WAIT_S = 120.0
RUN_TIMEOUT_S = 240.0
SLURM_JOB_ID = "4242"


def deadpool(*args: str) -> list[str]:
    return [sys.executable, "-m", "deadpool_cli", *args]


def training(out: Path) -> list[str]:
    return [str(SCRIPT), "--steps", str(STEPS), "--model-size", "tiny", "--out", str(out)]


async def control_plane(net: TestNetwork, workdir: Path) -> str:
    """`deadpool up` on the control plane host, serving the others; the URL it prints."""
    net.spawn("ctl", deadpool("up", "--listen", net.addresses["ctl"], "--workdir", str(workdir)), name="up")
    log = net.logdir / "up.log"
    deadline = time.monotonic() + WAIT_S
    while not (found := re.search(r"NATS at (\S+);", log.read_text(errors="replace") if log.exists() else "")):
        assert time.monotonic() < deadline, log.read_text(errors="replace")[-3000:] if log.exists() else "no log"
        await asyncio.sleep(0.2)  # `up` prints once every part answers
    url = found.group(1)
    assert net.addresses["ctl"] in url, f"up printed {url}, which other hosts cannot reach"
    return url


def job_key(credentials: Path, job: str) -> Path:
    """The job's own key, made where the control plane keeps its credentials (`up` admits it)."""
    subprocess.run(deadpool("credentials", str(credentials), "--job", job), check=True, capture_output=True)
    return credentials / "jobs" / f"{job}.nk"


def launch_all(net: TestNetwork, way: str, url: str, key: Path, job: str, out: Path) -> dict[str, object]:
    """Launchers on hosts a, b (two ranks each) and c (spares only), the torchrun way or the Slurm way."""
    common = ["launch", "--nats", url, "--nkey", str(key), "--collective-timeout-s", "20"]
    launchers: dict[str, object] = {}
    for index, host in enumerate(["hosta", "hostb"]):
        if way == "torchrun":
            args = [*common, "--job", job, "--nnodes", "2", "--node-rank", str(index)]
            env: dict[str, str] = {}
        else:  # srun --nodes 2 --ntasks-per-node 1 deadpool launch ...
            args, env = common, slurm_env(step=0, nodes=2, node=index)
        command = deadpool(*args, "--nproc-per-node", "2", "--spares", "0", *training(out))
        launchers[host] = net.spawn(host, command, env=env, name=f"launch-{host}")
    spares = [*common, "--job", job] if way == "torchrun" else common
    env = {} if way == "torchrun" else slurm_env(step=1, nodes=1, node=0)  # a second srun, on the spare node
    command = deadpool(*spares, "--nproc-per-node", "0", "--spares", "2", *training(out))
    launchers["hostc"] = net.spawn("hostc", command, env=env, name="launch-hostc")
    return launchers


def slurm_env(step: int, nodes: int, node: int) -> dict[str, str]:
    return {
        "SLURM_JOB_ID": SLURM_JOB_ID,
        "SLURM_STEP_ID": str(step),
        "SLURM_NNODES": str(nodes),
        "SLURM_NODEID": str(node),
    }


async def connect(url: str, seed: Path) -> Client:
    return await nats.connect(url, nkeys_seed=str(seed), connect_timeout=2, max_reconnect_attempts=-1)


@pytest.mark.parametrize("way", ["torchrun", "slurm"])
async def test_three_hosts_one_of_spares_lose_a_host_and_its_ranks_move_to_the_spares_bit_identical(
    tmp_path: Path, way: str
) -> None:
    job = "multi" if way == "torchrun" else f"slurm-{SLURM_JOB_ID}"
    with TestNetwork(["ctl", "hosta", "hostb", "hostc"], tmp_path) as net:
        url = await control_plane(net, tmp_path / "ctl")
        credentials = tmp_path / "ctl" / "credentials"
        key = job_key(credentials, job)
        with net.entered("ctl"):
            nc = await connect(url, credentials / "admin.nk")
            watch = JobWatch(nc, job, get_logger(test=job))
            await watch.start()
            out = tmp_path / "swap"
            launchers = launch_all(net, way, url, key, job, out)

            def logs() -> str:
                return "\n".join(
                    f"--- {h}:\n" + (tmp_path / f"launch-{h}.log").read_text(errors="replace")[-2000:]
                    for h in ("hosta", "hostb", "hostc")
                )

            try:
                await asyncio.wait_for(watch.wait_for(lambda: every_rank_at(watch, KILL_AT)), WAIT_S)
            except TimeoutError:
                pytest.fail(f"the job did not train to step {KILL_AT}:\n{logs()}")
            assert watch.rebuild is not None and len(watch.rebuild.ranks) == 4
            assert all(m.startswith("hosta-") for m in watch.rebuild.ranks[:2]), watch.rebuild.ranks
            assert all(m.startswith("hostb-") for m in watch.rebuild.ranks[2:]), watch.rebuild.ranks
            assert watch.failures == [], [(f.member, f.reason, f.evidence) for f in watch.failures]
            net.lose("hosta")
            for host in ("hostb", "hostc"):
                code = await asyncio.wait_for(asyncio.to_thread(launchers[host].wait), RUN_TIMEOUT_S)  # type: ignore[attr-defined]
                assert code == 0, logs()
            assert sorted(i.rank for i in watch.incidents) == [0, 1], watch.incidents
            assert all(i.replacement.startswith("hostc-") for i in watch.incidents), watch.incidents
            assert len({i.generation for i in watch.incidents}) == 1, "both ranks should move in one generation"
            for i in watch.incidents:  # the figures a closing note quotes (pytest -s)
                print(
                    f"{way}: rank {i.rank} {i.member} -> {i.replacement}: detected after {i.detect_s:.2f} s, "
                    f"first step after the fault {i.downtime_s:.2f} s, {i.lost_steps} steps lost"
                )

            reference = tmp_path / "reference"  # the same job uninterrupted, its four ranks on one host
            ref_key = str(job_key(credentials, "multi-ref"))
            solo_command = deadpool("launch", "--nats", url, "--nkey", ref_key, "--job", "multi-ref", "--nproc", "4")
            solo = net.spawn("hostb", [*solo_command, "--spares", "0", *training(reference)], name="reference")
            assert await asyncio.wait_for(asyncio.to_thread(solo.wait), RUN_TIMEOUT_S) == 0, (
                tmp_path / "reference.log"
            ).read_text(errors="replace")[-3000:]
            await nc.close()
    identical, tensors, differences = compare_final_states(out, reference)
    assert identical and tensors > 0, differences[:5]
