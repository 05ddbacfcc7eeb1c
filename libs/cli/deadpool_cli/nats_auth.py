"""Who may say what on the bus: one NATS user per role, authenticated by an nkey, with the server's
permissions limiting what each may publish and subscribe to.

The permissions are the protocol's trust boundaries:
- only the swapper publishes commands (rebuild, void, placement, commit, finished), fences and
  replication requests;
- only detectors publish verdicts (failure, straggler, group broken);
- only stores publish store status and snapshot completions;
- launchers publish their host's heartbeat batches and child exits, and answer fences;
- members publish heartbeats, reports and acks, and receive commands;
- `admin` (operators, `deadpool status`, tests) may do anything.
Everything that answers a request (a hello, a fence, a micro-service ping) does so with
`allow_responses`, which lets it publish to the requester's reply subject only.

Subjects have `*` in the job's place: a role is trusted for every job of the deployment. Isolating one
job's members from another's on the bus needs a NATS account per tenant (see docs/operations.md); on
the data plane, job tokens already do it.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

from deadpool_protocol.events import event_subjects
from deadpool_protocol.subjects import PREFIX, STORE_STATUS, Subjects
from deadpool_runtime.credentials import ROLES

__all__ = ["PERMISSIONS", "authorization_config", "create_credentials", "public_key", "write_server_authorization"]

_ANY = Subjects.any_job()
_REPLIES = "_INBOX.>"
_JETSTREAM = ["$JS.API.>", "$JS.ACK.>", "$JS.FC.>"]
_SERVICE = "$SRV.>"
_PING = "$SRV.PING.>"
"""A service's own health check (`deadpool ping`) pings it with the service's credentials."""
_FENCE = f"{PREFIX}.*.launcher.*.fence"
_TO_LAUNCHER = f"{PREFIX}.*.launcher.*.heartbeat"
_REPLICATE = f"{PREFIX}.store.*.replicate"
_STORE_OWN = f"{PREFIX}.store.*.>"
"""A store's own subjects: replicate requests and its micro-service endpoints."""

PERMISSIONS: dict[str, dict[str, list[str]]] = {
    "admin": {"publish": [">"], "subscribe": [">"]},
    "swapper": {
        "publish": [
            _ANY.rebuild,
            _ANY.void,
            _ANY.placement,
            _ANY.commit,
            _ANY.finished,
            _ANY.incident,
            _FENCE,
            _REPLICATE,
            *_JETSTREAM,
            "$KV.>",
            _PING,
        ],
        "subscribe": [">"],
    },
    "detector": {
        "publish": [_ANY.failure, _ANY.straggler, _ANY.group_broken, *_JETSTREAM, _PING],
        "subscribe": [">"],
    },
    "store": {
        "publish": [STORE_STATUS, _ANY.snapshot_complete, _PING],
        "subscribe": [_ANY.commit, _STORE_OWN, _SERVICE, _REPLIES],
    },
    "launcher": {
        "publish": [_ANY.heartbeat_batch, *event_subjects("*", ("child_exit",))],
        "subscribe": [
            _TO_LAUNCHER,
            _FENCE,
            _ANY.rebuild,
            _ANY.finished,
            _REPLIES,
        ],
    },
    "member": {
        "publish": [f"{PREFIX}.*.member.>", _TO_LAUNCHER],
        "subscribe": [_ANY.rebuild, _ANY.void, _ANY.placement, _ANY.finished, _REPLIES],
    },
}
_ANSWERS_REQUESTS = {"swapper", "detector", "store", "launcher"}
"""Roles that answer requests (hellos, status, fences, micro-service pings): `allow_responses`."""


def create_credentials(directory: Path) -> None:
    """Write one nkey seed per role and a data-plane key into `directory` (mode 0600), keeping those
    already there: restarting `deadpool up` on the same work directory keeps every credential."""
    import nkeys  # nats-py's own nkeys library

    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    for role in ROLES:
        path = directory / f"{role}.nk"
        if not path.exists():
            seed = nkeys.encode_seed(secrets.token_bytes(32), nkeys.PREFIX_BYTE_USER)
            _write_private(path, seed.decode() + "\n")
    key = directory / "dataplane.key"
    if not key.exists():
        _write_private(key, secrets.token_hex(32) + "\n")


def public_key(seed_file: Path) -> str:
    import nkeys

    seed = bytearray(seed_file.read_text().strip().encode())
    pub: bytes = nkeys.from_seed(seed).public_key
    return pub.decode()


def authorization_config(directory: Path) -> str:
    """The nats-server `authorization` block for the nkeys in `directory`: every role's public key with
    its permissions. Clients without one of these keys are refused."""
    users = []
    for role in ROLES:
        permissions = PERMISSIONS[role]
        publish, subscribe = json.dumps(permissions["publish"]), json.dumps(permissions["subscribe"])
        responses = ", allow_responses: true" if role in _ANSWERS_REQUESTS else ""
        users.append(
            f"    {{ nkey: {public_key(directory / f'{role}.nk')}, permissions: {{ publish: {{ allow: {publish} }}, "
            f"subscribe: {{ allow: {subscribe} }}{responses} }} }}  # {role}"
        )
    return "authorization {\n  users: [\n" + "\n".join(users) + "\n  ]\n}\n"


def write_server_authorization(directory: Path) -> Path:
    """Create the credentials in `directory` (keeping those there) and write `nats-auth.conf`, the block
    each NATS server's configuration includes (`include nats-auth.conf`). Returns its path."""
    create_credentials(directory)
    path = directory / "nats-auth.conf"
    path.write_text(authorization_config(directory))
    return path


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
