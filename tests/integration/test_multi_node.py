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
import os
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
ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "deploy" / "slurm" / "deadpool.sbatch"
STAND_IN = Path(__file__).resolve().parent / "slurm_stand_in"


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


def launch_torchrun_way(net: TestNetwork, url: str, key: Path, job: str, out: Path) -> list[subprocess.Popen[bytes]]:
    """Launchers on hosts a, b (two ranks each) and c (spares only), with torchrun's flags; the
    surviving ones (b's and c's), whose exit is the job's outcome."""
    common = ["launch", "--nats", url, "--nkey", str(key), "--job", job, "--collective-timeout-s", "20"]
    for index, host in enumerate(["hosta", "hostb"]):
        command = [*common, "--nnodes", "2", "--node-rank", str(index), "--nproc-per-node", "2", "--spares", "0"]
        net.spawn(host, deadpool(*command, *training(out)), name=f"launch-{host}")
    command = deadpool(*common, "--nproc-per-node", "0", "--spares", "2", *training(out))
    net.spawn("hostc", command, name="launch-hostc")
    return [net.processes["hostb"][0], net.processes["hostc"][0]]


def launch_slurm_way(net: TestNetwork, url: str, key: Path, out: Path) -> subprocess.Popen[bytes]:
    """`deploy/slurm/deadpool.sbatch` as sbatch runs it on an allocation of hosts a, b and c (the last
    one of spares only), its srun played over the hosts' namespaces (`slurm_stand_in/srun`)."""
    env = {
        "PATH": f"{STAND_IN}:{Path(sys.executable).parent}:{os.environ['PATH']}",
        "STAND_IN_NAMESPACES": ",".join(net.namespaces[h] for h in ("hosta", "hostb", "hostc")),
        "STAND_IN_HOSTS": "hosta,hostb,hostc",
        "SLURM_JOB_ID": SLURM_JOB_ID,
        "SLURM_JOB_NUM_NODES": "3",
        "NPROC_PER_NODE": "2",
        "SPARE_NODES": "1",
        "SPARES_ON_SPARE_NODES": "2",
        "DEADPOOL": str(Path(sys.executable).parent / "deadpool"),
        "DEADPOOL_NATS": url,
        "DEADPOOL_JOB_KEY": str(key),
        "DEADPOOL_PG_TIMEOUT_S": "20",
    }
    log = open(net.logdir / "sbatch.log", "ab")  # noqa: SIM115 (the child owns it)
    with log:
        return subprocess.Popen(
            ["bash", str(SBATCH), *training(out)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env},
            start_new_session=True,
        )


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
            if way == "torchrun":
                survivors = launch_torchrun_way(net, url, key, job, out)
                names = ["launch-hosta", "launch-hostb", "launch-hostc"]
            else:
                sbatch = launch_slurm_way(net, url, key, out)
                names = ["sbatch"]

            def logs() -> str:
                return "\n".join(
                    f"--- {name}:\n" + (tmp_path / f"{name}.log").read_text(errors="replace")[-4000:] for name in names
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
            if way == "torchrun":
                for launcher in survivors:
                    assert await asyncio.wait_for(asyncio.to_thread(launcher.wait), RUN_TIMEOUT_S) == 0, logs()
            else:  # the ranks' srun step reports the lost node's task; the survivors' outcome is in the log
                await asyncio.wait_for(asyncio.to_thread(sbatch.wait), RUN_TIMEOUT_S)
                finished = watch.finished_message
                assert finished is not None and not finished.failed, logs()
            assert sorted(i.rank for i in watch.incidents) == [0, 1], watch.incidents
            assert all(i.replacement.startswith("hostc-") for i in watch.incidents), watch.incidents
            assert len({i.generation for i in watch.incidents}) == 1, "both ranks should move in one generation"
            for i in watch.incidents:  # the figures a closing note quotes (pytest -s)
                print(
                    f"{way}: rank {i.rank} {i.member} -> {i.replacement}: detected after {i.detect_s:.2f} s, "
                    f"first step after the fault {i.downtime_s:.2f} s, {i.lost_steps} steps lost; phases (s) "
                    + " ".join(f"{k} {v:.2f}" for k, v in i.phases.items())
                )
            # The lost host's link is down: the server still holds its launcher's connection, and a fence
            # sent there is never answered. The spares did not wait for it (they waited its whole 5 s).
            assert all(i.phases["fence"] < 1.0 for i in watch.incidents), [i.phases for i in watch.incidents]

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


async def test_a_rendezvous_address_the_other_hosts_cannot_reach_moves_to_another_host_and_the_job_trains(
    tmp_path: Path,
) -> None:
    """Host a offers a rendezvous address that host b has no route to (a second interface's, as a
    container bridge's or a management network's would be: `--rendezvous-host` given wrong). What the
    user sees: b's members say the address is unreachable, a's that the group did not form within the
    collective timeout; the next generation's rendezvous is on b, and the job trains to its end. The
    rotation once named a's three members one after another: the job trained from generation 4."""
    job = "unreachable"
    hidden = "10.214.0.1"  # on host a only: no host has a route to it
    with TestNetwork(["ctl", "hosta", "hostb"], tmp_path) as net:
        url = await control_plane(net, tmp_path / "ctl")
        credentials = tmp_path / "ctl" / "credentials"
        key = job_key(credentials, job)
        ns = net.namespaces["hosta"]
        subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True)
        subprocess.run(["ip", "-n", ns, "addr", "add", f"{hidden}/32", "dev", "lo"], check=True)
        with net.entered("ctl"):
            nc = await connect(url, credentials / "admin.nk")
            watch = JobWatch(nc, job, get_logger(test=job))
            await watch.start()
            common = ["launch", "--nats", url, "--nkey", str(key), "--job", job, "--collective-timeout-s", "10"]
            launchers = []
            for index, host in enumerate(["hosta", "hostb"]):
                command = [*common, "--nnodes", "2", "--node-rank", str(index), "--nproc-per-node", "3"]
                command += ["--spares", "0", *(["--rendezvous-host", hidden] if host == "hosta" else [])]
                launchers.append(net.spawn(host, deadpool(*command, *training(tmp_path / "out")), name=host))
            started = time.monotonic()
            try:
                await asyncio.wait_for(watch.wait_for(lambda: every_rank_at(watch, 1)), WAIT_S)
            except TimeoutError:
                tails = [(tmp_path / f"{h}.log").read_text(errors="replace")[-3000:] for h in ("hosta", "hostb")]
                pytest.fail("the job never trained:\n" + "\n".join(tails))
            first_step_s = time.monotonic() - started
            codes = [await asyncio.wait_for(asyncio.to_thread(p.wait), RUN_TIMEOUT_S) for p in launchers]
            await nc.close()
    logs = {h: (tmp_path / f"{h}.log").read_text(errors="replace") for h in ("hosta", "hostb")}
    assert codes == [0, 0], logs["hostb"][-3000:]
    assert f"rendezvous store {hidden}:" in logs["hostb"] and "Network is unreachable" in logs["hostb"]
    assert "of generation 1 not formed" in logs["hosta"], logs["hosta"][-3000:]
    formed = [r for _, r in watch.rebuilds if r.generation == 2]
    assert formed and formed[0].rendezvous_member.startswith("hostb-"), [r.rendezvous_member for _, r in watch.rebuilds]
    assert watch.finished_message is not None and not watch.finished_message.failed
    assert watch.rebuild is not None
    print(f"unreachable rendezvous: first step after {first_step_s:.1f} s, generation {watch.rebuild.generation}")
