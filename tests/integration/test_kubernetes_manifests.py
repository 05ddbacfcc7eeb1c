"""The Kubernetes manifests (deploy/kubernetes/), checked without a cluster: every object, shipped or made
by its scripts, is valid under a pinned Kubernetes version's schema with unknown fields refused; each
workload mounts its own role's files and no other's; every command parses with the `deadpool` CLI as it
is; the stores advertise their node and are pinned to it; the trainer's Indexed Jobs cover every rank
once; and the NATS configuration of the ConfigMap is accepted by a real nats-server with a pod's
environment, and forms a JetStream cluster over TLS."""

from __future__ import annotations

import asyncio
import base64
import os
import re
import shutil
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import nats
import pytest
import yaml
from nats.errors import Error as NatsError
from nats.js.errors import Error as JetStreamError

from deadpool_cli.main import _parser, node_plan_of
from deadpool_cli.nats_auth import write_server_authorization
from deadpool_cli.nats_server import NatsServer, free_port, nats_server_binary
from deadpool_runtime.credentials import nkey_file

from .test_deploy import make_tls
from .test_tls import CROSS_WAIT_S, crosses

KUBERNETES = "1.31.0"
"""The schema the manifests are validated against (kubernetes-validate's bundled copy, offline): the
oldest release they are meant for (the trainer's backoffLimitPerIndex is on by default from 1.29)."""
MANIFESTS = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
SHIPPED = sorted(MANIFESTS.glob("*.yaml"))
NATS_URLS = ",".join(f"nats://nats-{n}.nats-cluster.deadpool.svc:4222" for n in range(3))
STORES = {"store-a": "ip-10-0-0-1.ec2.internal", "store-b": "gpu-node-2"}
"""Stores made by make-stores.sh for the tests: one on a node whose name has dots, one without."""
CAPACITY_GIB = 8
JOB = "example"
UID = 10001
HEALTHZ_OPTIONS = frozenset({"js-enabled-only", "js-server-only"})
"""The options of nats-server's /healthz the probes may use (liveness and readiness)."""
WORKLOADS = frozenset({"Deployment", "StatefulSet", "DaemonSet", "Job"})

ROLE_FILES: dict[str, dict[str, set[str]]] = {
    "nats": {
        "deadpool-nats": {
            "nats-auth.conf",
            "ca.pem",
            "cert.pem",
            "key.pem",
            "routes-ca.pem",
            "routes-cert.pem",
            "routes-key.pem",
        }
    },
    "deadpool-detector": {"deadpool-detector": {"detector.nk", "ca.pem"}},
    "deadpool-swapper": {"deadpool-swapper": {"swapper.nk", "dataplane.key", "seal.key", "ca.pem"}},
    **{
        f"deadpool-store-{store}": {
            f"deadpool-store-{store}": {"store.nk", "dataplane.key", "ca.pem", "cert.pem", "key.pem"}
        }
        for store in STORES
    },
    f"{JOB}-ranks": {f"deadpool-job-{JOB}": {"job.nk", "ca.pem"}},
    f"{JOB}-spares": {f"deadpool-job-{JOB}": {"job.nk", "ca.pem"}},
}
"""Each workload's Secrets and the keys it mounts of them (docs/operations.md §2: who holds what)."""

Manifest = dict[str, Any]


def load(text: str) -> list[Manifest]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


def deadpool_command() -> str:
    return str(Path(sys.executable).parent / "deadpool")


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """make-secrets.sh's files (credentials, TLS, secrets.yaml) and make-stores.sh's stores.yaml."""
    out = tmp_path_factory.mktemp("kubernetes")
    stores = [arg for store in STORES for arg in ("--store", store)]
    subprocess.run(
        ["bash", str(MANIFESTS / "make-secrets.sh"), *stores, "--job", JOB, "--tls-name", "10.0.0.1", str(out)],
        check=True,
        capture_output=True,
        env={**os.environ, "DEADPOOL": deadpool_command()},
    )
    pairs = [f"{store}={node}" for store, node in STORES.items()]
    made = subprocess.run(
        ["bash", str(MANIFESTS / "make-stores.sh"), "--capacity-gib", str(CAPACITY_GIB), *pairs],
        check=True,
        capture_output=True,
        text=True,
    )
    (out / "stores.yaml").write_text(made.stdout)
    return out


@pytest.fixture(scope="module")
def objects(generated: Path) -> list[Manifest]:
    """Every object to apply: the shipped files', the stores' and the Secrets'."""
    files = [*SHIPPED, generated / "stores.yaml", generated / "secrets.yaml"]
    return [doc for path in files for doc in load(path.read_text())]


@pytest.fixture(scope="module")
def workloads(objects: list[Manifest]) -> dict[str, Manifest]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] in WORKLOADS}


def pod_spec(workload: Manifest) -> dict[str, Any]:
    spec: dict[str, Any] = workload["spec"]["template"]["spec"]
    return spec


def container(workload: Manifest) -> dict[str, Any]:
    containers: list[dict[str, Any]] = pod_spec(workload)["containers"]
    assert len(containers) == 1, workload["metadata"]["name"]
    return containers[0]


def env_of(workload: Manifest) -> dict[str, Any]:
    """A container's environment: each name with its value or its `valueFrom`."""
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container(workload).get("env", [])}


def mounted_secrets(spec: dict[str, Any]) -> dict[str, set[str]]:
    """Each Secret a pod mounts, with the keys it mounts (a Secret volume must list them: without
    `items` it would mount every key the Secret has, whatever it holds)."""
    sources: list[dict[str, Any]] = []
    for volume in spec.get("volumes", []):
        if "secret" in volume:
            sources.append({**volume["secret"], "name": volume["secret"]["secretName"]})
        for source in volume.get("projected", {}).get("sources", []):
            if "secret" in source:
                sources.append(source["secret"])
    mounted: dict[str, set[str]] = {}
    for source in sources:
        assert source.get("items"), f"Secret {source['name']} mounted whole"
        mounted.setdefault(source["name"], set()).update(item["key"] for item in source["items"])
    return mounted


def quantity_bytes(quantity: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    match = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti)?", quantity)
    assert match, quantity
    return int(match[1]) * units.get(match[2] or "", 1)


# ------------------------------------------------------------------ schema


@pytest.mark.parametrize("name", [p.name for p in SHIPPED] + ["stores.yaml", "secrets.yaml"])
def test_every_manifest_is_valid_under_the_pinned_kubernetes_schema(name: str, generated: Path) -> None:
    path = MANIFESTS / name if (MANIFESTS / name).exists() else generated / name
    documents = load(path.read_text())
    assert documents, f"{name} holds no object"
    for document in documents:
        assert {"apiVersion", "kind", "metadata"} <= document.keys(), name
        validated = kubernetes_validate.validate(document, KUBERNETES, strict=True)
        assert validated == KUBERNETES.rsplit(".", 1)[0], (name, validated)
        if document["kind"] != "Namespace":
            assert document["metadata"]["namespace"] == "deadpool", (name, document["metadata"]["name"])


def test_the_schema_refuses_an_unknown_field_and_a_wrong_type(workloads: dict[str, Manifest]) -> None:
    """The validation above means something: a misspelt field or a quoted number is refused."""
    detector = workloads["deadpool-detector"]
    misspelt = yaml.safe_load(yaml.safe_dump(detector))
    container(misspelt)["securityContext"]["readOnlyRootFS"] = True
    with pytest.raises(kubernetes_validate.ValidationError, match="readOnlyRootFS"):
        kubernetes_validate.validate(misspelt, KUBERNETES, strict=True)
    quoted = yaml.safe_load(yaml.safe_dump(detector))
    pod_spec(quoted)["securityContext"]["runAsUser"] = str(UID)
    with pytest.raises(kubernetes_validate.ValidationError, match="integer"):
        kubernetes_validate.validate(quoted, KUBERNETES, strict=True)


# ------------------------------------------------------------------ keys


def test_each_workload_mounts_its_own_roles_files_and_no_other(workloads: dict[str, Manifest]) -> None:
    assert set(workloads) == set(ROLE_FILES)
    for name, workload in workloads.items():
        spec = pod_spec(workload)
        assert mounted_secrets(spec) == ROLE_FILES[name], name
        assert spec["automountServiceAccountToken"] is False, name  # no pod needs the Kubernetes API
    seal_holders = {
        n for n, w in workloads.items() if any("seal.key" in k for k in mounted_secrets(pod_spec(w)).values())
    }
    assert seal_holders == {"deadpool-swapper"}
    trainer = mounted_secrets(pod_spec(workloads[f"{JOB}-ranks"]))
    assert trainer == {f"deadpool-job-{JOB}": {"job.nk", "ca.pem"}}  # the job's key and the authority only


def test_each_secret_holds_its_roles_files_and_the_stores_their_own_keys(
    objects: list[Manifest], generated: Path
) -> None:
    secrets = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Secret"}
    expected: dict[str, set[str]] = {}
    for files in ROLE_FILES.values():
        expected.update(files)
    assert {name: set(s["data"]) for name, s in secrets.items()} == expected
    for secret in secrets.values():  # the operators' key and the authorities' keys stay off the cluster
        assert not {"admin.nk", "ca-key.pem", "routes-ca-key.pem"} & set(secret["data"])
    credentials = generated / "credentials"
    for store in STORES:
        own = base64.b64decode(secrets[f"deadpool-store-{store}"]["data"]["store.nk"])
        assert own == (credentials / "stores" / f"{store}.nk").read_bytes(), store
    job_key = base64.b64decode(secrets[f"deadpool-job-{JOB}"]["data"]["job.nk"])
    assert job_key == (credentials / "jobs" / f"{JOB}.nk").read_bytes()
    assert (
        base64.b64decode(secrets["deadpool-detector"]["data"]["detector.nk"])
        == Path(nkey_file(credentials, "detector")).read_bytes()
    )
    tls = generated / "tls"
    names = subprocess.run(
        ["openssl", "x509", "-noout", "-ext", "subjectAltName", "-in", str(tls / "cert.pem")],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    for name in [*(f"nats-{n}.nats-cluster.deadpool.svc" for n in range(3)), "nats.deadpool.svc"]:
        assert f"DNS:{name}" in names  # the URLs clients and routes use
    assert "IP Address:10.0.0.1" in names  # a store's node, which it advertises


def test_make_secrets_refuses_stores_whose_addresses_no_certificate_names(tmp_path: Path) -> None:
    refused = subprocess.run(
        ["bash", str(MANIFESTS / "make-secrets.sh"), "--store", "store-a", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        env={**os.environ, "DEADPOOL": deadpool_command()},
    )
    assert refused.returncode == 2 and "--tls-name" in refused.stderr, refused.stderr
    assert not (tmp_path / "out" / "tls").exists()


# ------------------------------------------------------------------ pods


def test_every_container_runs_as_the_images_user_with_a_read_only_root(workloads: dict[str, Manifest]) -> None:
    for name, workload in workloads.items():
        spec = pod_spec(workload)
        pod = spec["securityContext"]
        assert pod["runAsNonRoot"] is True and pod["runAsUser"] == UID and pod["fsGroup"] == UID, name
        assert pod["seccompProfile"]["type"] == "RuntimeDefault", name
        assert not spec.get("hostNetwork") and not spec.get("hostPID") and not spec.get("hostIPC"), name
        for each in spec["containers"] + spec.get("initContainers", []):
            security = each["securityContext"]
            assert security.get("runAsUser", UID) == UID and security.get("runAsNonRoot", True) is True, name
            assert security["allowPrivilegeEscalation"] is False and security["readOnlyRootFilesystem"] is True, name
            assert security["capabilities"]["drop"] == ["ALL"] and "add" not in security["capabilities"], name
            assert "memory" in each["resources"]["limits"] and "memory" in each["resources"]["requests"], name
            assert "cpu" in each["resources"]["requests"], name


def test_every_probe_runs_inside_the_pod(workloads: dict[str, Manifest]) -> None:
    """Monitoring listens on loopback and the services answer pings on NATS: an httpGet or tcpSocket
    probe, made from the kubelet's side, would find nothing (or need monitoring opened to the network)."""
    probed = set()
    for name, workload in workloads.items():
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            probe = container(workload).get(kind)
            if probe is not None:
                assert set(probe) & {"exec", "httpGet", "tcpSocket", "grpc"} == {"exec"}, (name, kind)
                probed.add(name)
    assert probed == set(ROLE_FILES) - {f"{JOB}-ranks", f"{JOB}-spares"}  # every service is probed


def test_every_deadpool_command_parses_with_the_cli_as_it_is(workloads: dict[str, Manifest]) -> None:
    parser = _parser()
    checked = 0
    for name, workload in workloads.items():
        each = container(workload)
        if each.get("command") == ["nats-server"]:
            continue
        if each.get("command"):  # the trainer: sh -c '... exec deadpool launch "$@"' NAME ARGS...
            assert "exec deadpool launch" in each["command"][2], name
            args = ["launch", *each["args"]]
        else:  # the image's entrypoint is deadpool
            args = each["args"]
        parsed = parser.parse_args(args)
        assert parsed.nats == NATS_URLS, name
        probe = each.get("livenessProbe", {}).get("exec", {}).get("command", [])
        if probe:
            assert probe[:2] == ["deadpool", "ping"], name
            ping = parser.parse_args(probe[1:])
            assert (ping.nats, ping.credentials, ping.service) == (NATS_URLS, "/run/secrets", f"deadpool-{args[0]}")
            assert ping.role == args[0] and parsed.credentials == "/run/secrets", name
            assert env_of(workload)["DEADPOOL_TLS"] == "/run/secrets", name
        checked += 1
    assert checked == len(workloads) - 1
    detector = parser.parse_args(container(workloads["deadpool-detector"])["args"])
    assert (detector.js_replicas, detector.heartbeat_timeout_s) == (3, 5.0)
    swapper = parser.parse_args(container(workloads["deadpool-swapper"])["args"])
    assert (swapper.js_replicas, swapper.replication) == (3, 2)
    assert workloads["deadpool-detector"]["spec"]["replicas"] == workloads["deadpool-swapper"]["spec"]["replicas"] == 2


# ------------------------------------------------------------------ NATS


def nats_config(objects: list[Manifest]) -> str:
    (config_map,) = [o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "deadpool-nats-config"]
    text: str = config_map["data"]["nats.conf"]
    return text


def test_the_nats_statefulset_runs_three_jetstream_nodes_that_find_each_other(
    objects: list[Manifest], workloads: dict[str, Manifest]
) -> None:
    nats_set = workloads["nats"]
    assert nats_set["kind"] == "StatefulSet" and nats_set["spec"]["replicas"] == 3
    assert nats_set["spec"]["podManagementPolicy"] == "Parallel"  # no node is healthy before a quorum
    (headless,) = [
        o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == nats_set["spec"]["serviceName"]
    ]
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    config = nats_config(objects)
    assert re.search(r"^jetstream \{", config, re.MULTILINE) and "/var/lib/nats/jetstream" in config
    routes = re.findall(r"nats://(\S+):6222", config)
    assert routes == [f"nats-{n}.{headless['metadata']['name']}.deadpool.svc" for n in range(3)]
    assert re.search(r"^server_name: \$POD_NAME", config, re.MULTILINE)
    assert re.search(r"^host: \$DEADPOOL_NATS_LISTEN", config, re.MULTILINE)
    assert re.search(r"^http: 127\.0\.0\.1:8222", config, re.MULTILINE) and "handshake_first: true" in config
    assert "include ./nats-auth.conf" in config
    env = env_of(nats_set)
    assert env["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}} and env["DEADPOOL_NATS_LISTEN"] == "0.0.0.0"
    mounts = {m["mountPath"]: m["name"] for m in container(nats_set)["volumeMounts"]}
    assert mounts["/var/lib/nats"] in {t["metadata"]["name"] for t in nats_set["spec"]["volumeClaimTemplates"]}
    for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
        (url,) = re.findall(r"'(http://[^']+)'", container(nats_set)[kind]["exec"]["command"][-1])
        assert url.startswith("http://127.0.0.1:8222/healthz"), kind
        # nats-server answers a misspelt option as the plain /healthz: only its own options are taken
        assert {option.split("=")[0] for option in re.findall(r"[?&]([^&]+)", url)} <= HEALTHZ_OPTIONS, url


def pod_environment(name: str, listen: str, advertise: str) -> dict[str, str]:
    return {
        **os.environ,
        "POD_NAME": name,
        "DEADPOOL_NATS_LISTEN": listen,
        "DEADPOOL_NATS_ROUTE_ADVERTISE": advertise,
    }


def replace_once(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, f"{old!r} is not in the configuration once"
    return text.replace(old, new)


class ConfigMapNatsServer(NatsServer):
    """A nats-server run from the ConfigMap's configuration, its pod's names, ports, store and TLS files
    moved under the test's directory and onto loopback; routes to nats-N go to the test's node N."""

    def __init__(self, workdir: Path, config: str, tls: Path, node: int, cluster_ports: list[int]) -> None:
        super().__init__(workdir)
        self.pod = f"nats-{node}"
        self.cluster_port = cluster_ports[node]
        self.monitor_port = free_port()
        config = replace_once(config, "port: 4222", f"port: {self.port}")
        config = replace_once(config, "port: 6222", f"port: {self.cluster_port}")
        config = replace_once(config, "http: 127.0.0.1:8222", f"http: 127.0.0.1:{self.monitor_port}")
        config = replace_once(config, '"/var/lib/nats/jetstream"', f'"{workdir}/jetstream"')
        config = config.replace("/etc/deadpool/tls", str(tls))
        for n, port in enumerate(cluster_ports):
            config = replace_once(config, f"nats://nats-{n}.nats-cluster.deadpool.svc:6222", f"nats://127.0.0.1:{port}")
        workdir.mkdir(parents=True, exist_ok=True)
        self._file = workdir / "nats.conf"
        self._file.write_text(config)

    def _config(self) -> Path:
        return self._file


def config_beside_auth(objects: list[Manifest], tmp_path: Path) -> tuple[Path, Path]:
    """The ConfigMap's nats.conf with its files' paths under tmp_path, nats-auth.conf beside it (as the
    pod's projected volume puts it), and the TLS files; returns (config, credentials)."""
    tls = make_tls(tmp_path / "tls")
    credentials = tmp_path / "credentials"
    auth = write_server_authorization(credentials)
    conf = tmp_path / "nats" / "nats.conf"
    conf.parent.mkdir()
    text = nats_config(objects).replace("/etc/deadpool/tls", str(tls))
    conf.write_text(text.replace("/var/lib/nats", str(tmp_path / "nats")))
    shutil.copy(auth, conf.parent / "nats-auth.conf")
    return conf, credentials


def test_nats_server_accepts_the_config_map_with_its_pods_environment(objects: list[Manifest], tmp_path: Path) -> None:
    conf, _ = config_beside_auth(objects, tmp_path)
    advertise = "nats-0.nats-cluster.deadpool.svc:6222"
    checked = subprocess.run(
        [nats_server_binary(), "-t", "-c", str(conf)],
        capture_output=True,
        text=True,
        env=pod_environment("nats-0", "0.0.0.0", advertise),
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    without_listen = {k: v for k, v in pod_environment("nats-0", "", advertise).items() if k != "DEADPOOL_NATS_LISTEN"}
    refused = subprocess.run(
        [nats_server_binary(), "-t", "-c", str(conf)], capture_output=True, text=True, env=without_listen
    )
    assert refused.returncode != 0 and "DEADPOOL_NATS_LISTEN" in refused.stdout + refused.stderr  # no silent 0.0.0.0


def probe_exit(command: list[str], monitor_port: int) -> int:
    """A probe's command run here: the interpreter the image calls python3 is this one."""
    assert command[0] == "python3"
    code = command[-1].replace("127.0.0.1:8222", f"127.0.0.1:{monitor_port}")
    return subprocess.run([sys.executable, *command[1:-1], code], capture_output=True, timeout=10).returncode


@pytest.fixture
def config_map_cluster(
    objects: list[Manifest], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[list[ConfigMapNatsServer], Path, Path]]:
    conf, credentials = config_beside_auth(objects, tmp_path)
    tls = tmp_path / "tls"
    ports = [free_port() for _ in range(3)]
    servers = [ConfigMapNatsServer(tmp_path / f"nats-{n}", nats_config(objects), tls, n, ports) for n in range(3)]
    try:
        for server in servers:  # each started with its pod's environment, as the StatefulSet gives it
            shutil.copy(conf.parent / "nats-auth.conf", server.workdir / "nats-auth.conf")
            for key, value in pod_environment(server.pod, "127.0.0.1", f"127.0.0.1:{server.cluster_port}").items():
                monkeypatch.setenv(key, value)
            server.start()
        yield servers, credentials, tls
    finally:
        for server in servers:
            server.stop()


async def test_the_config_map_forms_a_jetstream_cluster_over_tls_that_the_probes_see(
    config_map_cluster: tuple[list[ConfigMapNatsServer], Path, Path], workloads: dict[str, Manifest]
) -> None:
    servers, credentials, tls = config_map_cluster
    context = ssl.create_default_context(cafile=str(tls / "ca.pem"))
    seed = nkey_file(credentials, "admin")
    first, third = [
        await nats.connect(s.url, nkeys_seed=seed, tls=context, tls_handshake_first=True, allow_reconnect=False)
        for s in (servers[0], servers[2])
    ]
    try:
        assert await crosses(first, third, CROSS_WAIT_S), "the routes did not form"
        js = first.jetstream()
        deadline = time.monotonic() + 30
        while True:  # until the three elect a JetStream meta leader
            try:
                info = await js.add_stream(name="KUBERNETES", subjects=["kubernetes.>"], num_replicas=3)
                break
            except (JetStreamError, NatsError):
                assert time.monotonic() < deadline, "no JetStream cluster formed"
                await asyncio.sleep(0.5)
        assert info.cluster is not None and len(info.cluster.replicas or []) == 2
        peers = {info.cluster.leader, *(peer.name for peer in info.cluster.replicas or [])}
        assert peers == {"nats-0", "nats-1", "nats-2"}  # each server is named by its pod ($POD_NAME)
    finally:
        await first.close()
        await third.close()
    nats_set = container(workloads["nats"])
    for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
        command = nats_set[kind]["exec"]["command"]
        for server in servers:
            deadline = time.monotonic() + 30
            while await asyncio.to_thread(probe_exit, command, server.monitor_port) != 0:
                assert time.monotonic() < deadline, f"{kind} fails on {server.pod}"
                await asyncio.sleep(0.5)
        assert await asyncio.to_thread(probe_exit, command, free_port()) != 0, f"{kind} passes with no server"


# ------------------------------------------------------------------ stores


def test_each_store_is_pinned_to_its_node_and_advertises_the_nodes_address(workloads: dict[str, Manifest]) -> None:
    parser = _parser()
    for store, node in STORES.items():
        workload = workloads[f"deadpool-store-{store}"]
        assert workload["kind"] == "DaemonSet"
        (term,) = pod_spec(workload)["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
            "nodeSelectorTerms"
        ]
        assert term["matchFields"] == [{"key": "metadata.name", "operator": "In", "values": [node]}]
        each = container(workload)
        args = parser.parse_args(each["args"])
        assert args.id == store and args.host == "0.0.0.0"
        assert args.advertise_host == "$(HOST_IP)"
        assert env_of(workload)["HOST_IP"] == {"fieldRef": {"fieldPath": "status.hostIP"}}
        (port,) = each["ports"]
        assert port["containerPort"] == port["hostPort"] == args.port == 7001
        assert args.node == node.split(".")[0]  # as the trainer's pods name their host
        assert args.capacity_bytes == CAPACITY_GIB * 2**30
        limits, requests = each["resources"]["limits"], each["resources"]["requests"]
        assert quantity_bytes(limits["memory"]) == quantity_bytes(requests["memory"]) == args.capacity_bytes + 2**30


@pytest.mark.parametrize(
    "pairs",
    [["store-a=node-1", "store-b=node-1"], ["store-a=node-1", "store-a=node-2"], ["Store_A=node-1"], ["a=Node_1"]],
    ids=["two-on-one-node", "one-name-twice", "not-a-kubernetes-name", "not-a-node-name"],
)
def test_make_stores_refuses_what_would_not_run(pairs: list[str]) -> None:
    made = subprocess.run(["bash", str(MANIFESTS / "make-stores.sh"), *pairs], capture_output=True, text=True)
    assert made.returncode == 2 and made.stdout == "", made


# ------------------------------------------------------------------ trainer


def launch_args(workload: Manifest) -> list[str]:
    args: list[str] = ["launch", *container(workload)["args"]]
    return args


def test_the_trainers_indexed_jobs_give_every_rank_to_one_node(workloads: dict[str, Manifest]) -> None:
    """Each pod's launcher, given its index as Kubernetes gives it, asks for its own ranks: together, every
    rank of the job once; the spares' pods take the world size from the run."""
    parser = _parser()
    ranks, spares = workloads[f"{JOB}-ranks"], workloads[f"{JOB}-spares"]
    asked: list[int] = []
    for workload in (ranks, spares):
        spec = workload["spec"]
        assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"]
        assert pod_spec(workload)["restartPolicy"] == "Never"
        assert spec["maxFailedIndexes"] == spec["completions"]  # one pod's failure never ends the others
        assert spec.get("backoffLimit") is None and spec["backoffLimitPerIndex"] >= 0
        args = parser.parse_args(launch_args(workload))
        assert (args.job, args.nkey, args.nats) == (JOB, "/run/secrets/job.nk", NATS_URLS)
        for index in range(spec["completions"]):
            plan = node_plan_of(args, {"JOB_COMPLETION_INDEX": str(index)})  # as `launch` plans its node
            assert (plan.job, plan.run, plan.source) == (JOB, JOB, "kubernetes")
            if workload is ranks:
                assert args.nnodes == spec["completions"] and plan.world_size == args.nnodes * args.nproc
                asked += range(plan.rank_offset, plan.rank_offset + args.nproc)
            else:
                assert args.nproc == 0 and args.spares > 0 and plan.world_size == 0
    world = ranks["spec"]["completions"] * parser.parse_args(launch_args(ranks)).nproc
    assert sorted(asked) == list(range(world))


def test_the_trainers_pods_name_their_host_as_the_stores_name_theirs(
    workloads: dict[str, Manifest], tmp_path: Path
) -> None:
    """The trainer's command, run with a stand-in `deadpool`: DEADPOOL_HOST is the node name's first label
    (a DeadPool name has no dots), the --node make-stores.sh gives the store on that node, and the
    arguments reach `deadpool launch` intact."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stand_in = bin_dir / "deadpool"
    stand_in.write_text('#!/bin/sh\nprintf "%s\\n" "host=$DEADPOOL_HOST" "$@"\n')
    stand_in.chmod(0o755)
    parser = _parser()
    for name in (f"{JOB}-ranks", f"{JOB}-spares"):
        workload = workloads[name]
        assert env_of(workload)["NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
        for store, node in STORES.items():
            each = container(workload)
            ran = subprocess.run(
                [*each["command"], *each["args"]],
                capture_output=True,
                text=True,
                check=True,
                env={"PATH": f"{bin_dir}:/usr/bin:/bin", "NODE_NAME": node},
            )
            host, *args = ran.stdout.splitlines()
            store_node = parser.parse_args(container(workloads[f"deadpool-store-{store}"])["args"]).node
            assert host == f"host={store_node}", (name, node)
            assert args == ["launch", *each["args"]], name
