"""The deploy files as shipped: the NATS configuration with its generated authorization runs and refuses
strangers, and every systemd unit verifies against an install root laid out by install.sh."""

from __future__ import annotations

import asyncio
import re
import shutil
import ssl
import subprocess
import sys
from pathlib import Path

import nats
import pytest

from deadpool_cli.nats_auth import create_job_credentials, create_store_credentials, write_server_authorization
from deadpool_cli.nats_server import NatsCluster, NatsServer, free_port, nats_server_binary
from deadpool_runtime.credentials import nkey_file

from .test_tls import CROSS_WAIT_S, ROUTE_REFUSED, crosses, log_count, until_logged

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
UNITS = sorted(p.name for p in (DEPLOY / "systemd").glob("*.service"))


class ShippedNatsServer(NatsServer):
    """A nats-server run from a configuration file as shipped, with its ports, store, TLS files and routes
    moved under the test's directory and onto loopback; it binds `$DEADPOOL_NATS_LISTEN` as shipped."""

    def __init__(self, workdir: Path, shipped: Path, tls: Path, cluster_ports: dict[str, int] | None = None) -> None:
        super().__init__(workdir)
        config = shipped.read_text().replace("port: 4222", f"port: {self.port}")
        config = config.replace('"/var/lib/nats/jetstream"', f'"{workdir}/js"').replace("/etc/deadpool/tls", str(tls))
        if cluster_ports is not None:  # nats-N:6222 -> 127.0.0.1:<node N's port>
            self.cluster_port = cluster_ports[re.findall(r"^server_name: (\S+)", config, re.MULTILINE)[0]]
            config = config.replace("port: 6222", f"port: {self.cluster_port}")
            for name, port in cluster_ports.items():
                config = config.replace(f"nats://{name}:6222", f"nats://127.0.0.1:{port}")
        self._shipped = workdir / shipped.name
        workdir.mkdir(parents=True, exist_ok=True)
        self._shipped.write_text(re.sub(r"http: 127.0.0.1:\d+", f"http: 127.0.0.1:{free_port()}", config))

    def _config(self) -> Path:
        return self._shipped


def make_tls(directory: Path) -> Path:
    """TLS files from the shipped script, naming loopback."""
    script = DEPLOY / "tls" / "make-tls.sh"
    subprocess.run(["bash", str(script), str(directory), "127.0.0.1", "localhost"], check=True, capture_output=True)
    return directory


def test_the_shipped_nats_configs_keep_monitoring_off_the_network() -> None:
    """Monitoring (/varz, /connz: every client's name and address) has no authentication: it listens on
    loopback only (it listened on every interface). Clients and routes listen on the address a host is
    given, and speak TLS only."""
    for conf in sorted((DEPLOY / "nats").glob("*.conf")):
        text = conf.read_text()
        assert re.search(r"^http: 127\.0\.0\.1:\d+", text, re.MULTILINE) and "http_port" not in text, conf.name
        assert re.search(r"^host: \$DEADPOOL_NATS_LISTEN", text, re.MULTILINE), conf.name
        assert "handshake_first: true" in text, conf.name


async def test_the_shipped_nats_config_refuses_strangers_and_plain_text_and_admits_roles(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    credentials = tmp_path / "credentials"
    auth = write_server_authorization(credentials)
    tls = make_tls(tmp_path / "tls")
    conf = DEPLOY / "nats" / "nats.conf"
    monkeypatch.delenv("DEADPOOL_NATS_LISTEN", raising=False)
    checked = subprocess.run([nats_server_binary(), "-t", "-c", str(conf)], capture_output=True, text=True)
    assert checked.returncode != 0 and "DEADPOOL_NATS_LISTEN" in checked.stdout + checked.stderr  # no silent 0.0.0.0
    monkeypatch.setenv("DEADPOOL_NATS_LISTEN", "127.0.0.1")
    server = ShippedNatsServer(tmp_path / "nats", conf, tls)
    shutil.copy(auth, tmp_path / "nats" / "nats-auth.conf")  # beside the configuration that includes it
    await asyncio.to_thread(server.start)
    context = ssl.create_default_context(cafile=str(tls / "ca.pem"))
    try:
        log = (server.workdir / "nats-server.log").read_text()
        assert f"Listening for client connections on 127.0.0.1:{server.port}" in log
        seed = nkey_file(credentials, "admin")
        admin = await nats.connect(
            server.url, nkeys_seed=seed, allow_reconnect=False, tls=context, tls_handshake_first=True
        )
        await admin.close()
        with pytest.raises(Exception):  # noqa: B017 (plain text: the server waits for a TLS handshake)
            await nats.connect(server.url, nkeys_seed=seed, allow_reconnect=False, connect_timeout=2)
        with pytest.raises(nats.errors.Error, match="Authorization Violation"):
            await nats.connect(
                server.url, allow_reconnect=False, max_reconnect_attempts=0, tls=context, tls_handshake_first=True
            )
    finally:
        server.stop()


async def test_the_shipped_cluster_forms_over_tls_and_a_rogue_server_gets_no_route(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The finding: a server with no users joined a node's cluster port, and its anonymous client read
    a swapper command and injected a forged one. The shipped routes take only the routes' authority."""
    credentials = tmp_path / "credentials"
    auth = write_server_authorization(credentials)
    tls = make_tls(tmp_path / "tls")
    monkeypatch.setenv("DEADPOOL_NATS_LISTEN", "127.0.0.1")
    ports = {f"nats-{n}": free_port() for n in (1, 2, 3)}
    cluster = NatsCluster(tmp_path / "unused", 1)
    cluster.servers = [
        ShippedNatsServer(tmp_path / name, DEPLOY / "nats" / f"{name}.conf", tls, ports) for name in ports
    ]
    for server in cluster.servers:
        shutil.copy(auth, server.workdir / "nats-auth.conf")
    await asyncio.to_thread(cluster.start)
    context = ssl.create_default_context(cafile=str(tls / "ca.pem"))
    node = cluster.servers[0]
    rogue = NatsServer(tmp_path / "rogue", cluster_port=free_port(), routes=[node.cluster_port])
    try:
        seed = nkey_file(credentials, "admin")
        first = await nats.connect(node.url, nkeys_seed=seed, tls=context, tls_handshake_first=True)
        third = await nats.connect(cluster.servers[2].url, nkeys_seed=seed, tls=context, tls_handshake_first=True)
        assert await crosses(first, third, CROSS_WAIT_S), "the shipped routes did not form"
        refused = log_count(node, ROUTE_REFUSED)
        await asyncio.to_thread(rogue.start)
        await until_logged(node, ROUTE_REFUSED, refused)
        stranger = await nats.connect(rogue.url)
        assert not await crosses(first, stranger, 1.0), "the rogue read a command"
        assert not await crosses(stranger, third, 1.0), "the rogue injected a command"
        for client in (stranger, first, third):
            await client.close()
    finally:
        rogue.stop()
        cluster.stop()


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_every_systemd_unit_verifies_in_an_install_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    subprocess.run(["bash", str(DEPLOY / "systemd" / "install.sh"), "--root", str(root), "--no-venv"], check=True)
    venv_bin = root / "opt/deadpool/.venv/bin"  # --no-venv: the venv is ours to put where the units expect it
    venv_bin.mkdir(parents=True)
    for tool in ("deadpool", "nats-server"):
        shutil.copy(Path(sys.executable).parent / tool, venv_bin / tool)
    create_job_credentials(root / "etc/deadpool/credentials", "example")  # the job's key, for its launcher
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
    for store in ("store-a", "store-b"):  # as the header says: --store store-a --store store-b --job example
        create_store_credentials(deploy / "credentials", store)
    create_job_credentials(deploy / "credentials", "example")
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
