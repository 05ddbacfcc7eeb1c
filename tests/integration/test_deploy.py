"""The deploy files as shipped: the NATS configuration with its generated authorization runs and refuses
strangers, and every systemd unit verifies against an install root laid out by install.sh."""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import nats
import pytest

from deadpool_cli.nats_auth import write_server_authorization
from deadpool_cli.nats_server import free_port, nats_server_binary
from deadpool_runtime.credentials import nkey_file

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
UNITS = sorted(p.name for p in (DEPLOY / "systemd").glob("*.service"))
START_S = 20.0


async def test_the_shipped_nats_config_refuses_strangers_and_admits_roles(tmp_path: Path) -> None:
    credentials = tmp_path / "credentials"
    auth = write_server_authorization(credentials)
    port = free_port()
    config = (DEPLOY / "nats" / "nats.conf").read_text()
    config = config.replace("port: 4222", f"port: {port}").replace('"/var/lib/nats/jetstream"', f'"{tmp_path}/js"')
    config = re.sub(r"http_port: \d+", f"http_port: {free_port()}", config)
    (tmp_path / "nats.conf").write_text(config)
    shutil.copy(auth, tmp_path / "nats-auth.conf")
    server = subprocess.Popen([nats_server_binary(), "-c", str(tmp_path / "nats.conf")], stderr=subprocess.PIPE)
    ready = threading.Event()
    said: list[bytes] = []

    def read_log() -> None:
        assert server.stderr is not None
        for line in server.stderr:
            said.append(line)
            if b"Server is ready" in line:
                ready.set()

    threading.Thread(target=read_log, daemon=True).start()
    url = f"nats://127.0.0.1:{port}"
    try:
        assert await asyncio.to_thread(ready.wait, START_S), b"".join(said).decode()
        admin = await nats.connect(url, nkeys_seed=nkey_file(credentials, "admin"), allow_reconnect=False)
        await admin.close()
        with pytest.raises(nats.errors.Error, match="Authorization Violation"):
            await nats.connect(url, allow_reconnect=False, max_reconnect_attempts=0)
    finally:
        server.terminate()
        server.wait(10)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_every_systemd_unit_verifies_in_an_install_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    subprocess.run(["bash", str(DEPLOY / "systemd" / "install.sh"), "--root", str(root), "--no-venv"], check=True)
    venv_bin = root / "opt/deadpool/.venv/bin"  # --no-venv: the venv is ours to put where the units expect it
    venv_bin.mkdir(parents=True)
    for tool in ("deadpool", "nats-server"):
        shutil.copy(Path(sys.executable).parent / tool, venv_bin / tool)
    write_server_authorization(root / "etc/deadpool/credentials")
    (root / "etc/deadpool/jobs/example.env").write_text("DEADPOOL_LAUNCH_ARGS=--nproc 1 train.py\n")
    shutil.copytree("/lib/systemd/system", root / "usr/lib/systemd/system", symlinks=True)  # the base system's
    (root / "bin").mkdir()
    shutil.copy("/bin/kill", root / "bin/kill")
    installed = sorted(p.name for p in (root / "etc/systemd/system").glob("*.service"))
    assert installed == UNITS
    assert {"nats-server.service", "deadpool-launch@.service"} <= set(installed)
    for unit in installed:
        name = unit.replace("@.", "@7001.") if unit.startswith("deadpool-store@") else unit.replace("@.", "@example.")
        result = subprocess.run(
            ["systemd-analyze", "verify", f"--root={root}", name], capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, f"{name}: {result.stdout}{result.stderr}"
        text = (root / "etc/systemd/system" / unit).read_text()
        assert "LimitNOFILE=" in text and ("MemoryMax=" in text or unit.startswith("deadpool-launch@")), unit


def compose_command() -> list[str]:
    """`docker compose` (the plugin) or `docker-compose` (Debian's package), whichever is installed."""
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    return ["docker-compose"] if shutil.which("docker-compose") else []


@pytest.mark.skipif(not compose_command(), reason="neither docker compose nor docker-compose is installed")
def test_the_compose_file_is_valid_and_needs_an_advertised_address(tmp_path: Path) -> None:
    deploy = tmp_path / "deploy"
    shutil.copytree(DEPLOY, deploy)
    write_server_authorization(deploy / "credentials")

    def config(advertise_host: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*compose_command(), "-f", str(deploy / "compose.yaml"), "config", "--quiet"],
            capture_output=True,
            text=True,
            env={"DEADPOOL_ADVERTISE_HOST": advertise_host, "PATH": "/usr/bin:/usr/local/bin:/bin"},
            timeout=60,
        )

    valid = config("10.0.0.10")
    assert valid.returncode == 0, valid.stderr
    missing = config("")  # stores would advertise an address no other host can reach
    assert missing.returncode != 0 and "set DEADPOOL_ADVERTISE_HOST" in missing.stderr, missing
