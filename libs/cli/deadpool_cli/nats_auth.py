"""Who may say what on the bus: one NATS user per role, authenticated by an nkey, with the server's
permissions limiting what each may publish and subscribe to.

The permissions are the protocol's trust boundaries:
- only the swapper publishes commands (rebuild, void, placement, commit, finished), fences and
  replication requests;
- only detectors publish verdicts (failure, straggler, group broken);
- only stores publish store status and snapshot completions;
- launchers start runs (only they may: a member cannot squat a job name), publish their host's heartbeat
  batches and child exits, and answer fences;
- members publish heartbeats, reports and acks, and receive commands;
- `admin` (operators, `deadpool status`, tests) may do anything.
Everything that answers a request (a hello, a fence, a micro-service ping) does so with
`allow_responses`, which lets it publish to the requester's reply subject only.

Subjects have `*` in the job's place: a role is trusted for every job of the deployment. A job can
also have member credentials of its own (`create_job_credentials`): that user may publish only the
job's member subjects and heartbeats to its launchers, and read only the job's commands and the replies
to its own requests (the job's inbox, `Subjects.inbox`); so one job's processes can neither act for nor
listen to another's. On the data plane, job tokens do the same.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

from deadpool_protocol.events import event_subjects
from deadpool_protocol.subjects import PREFIX, STORE_STATUS, Subjects
from deadpool_runtime.credentials import ROLES, job_nkey_path

__all__ = [
    "PERMISSIONS",
    "authorization_config",
    "create_credentials",
    "create_job_credentials",
    "job_member_permissions",
    "public_key",
    "write_server_authorization",
]

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
        "subscribe": [_ANY.commit, _ANY.finished, _STORE_OWN, _SERVICE, _REPLIES],
    },
    "launcher": {
        "publish": [_ANY.heartbeat_batch, _ANY.run_start, *event_subjects("*", ("child_exit",))],
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
        "subscribe": [
            _ANY.rebuild,
            _ANY.void,
            _ANY.placement,
            _ANY.finished,
            _ANY.snapshot_interval,
            f"{_ANY.inbox}.>",
        ],
    },
}
_ANSWERS_REQUESTS = {"swapper", "detector", "store", "launcher"}
"""Roles that answer requests (hellos, status, fences, micro-service pings): `allow_responses`."""


def job_member_permissions(job: str) -> dict[str, list[str]]:
    """What job `job`'s own member credentials may do: the member role's, for that job only."""
    s = Subjects.for_job(job)
    return {
        "publish": [f"{PREFIX}.{job}.member.>", f"{PREFIX}.{job}.launcher.*.heartbeat"],
        "subscribe": [s.rebuild, s.void, s.placement, s.finished, s.snapshot_interval, f"{s.inbox}.>"],
    }


def create_job_credentials(directory: Path, job: str) -> Path:
    """Write job `job`'s member nkey into `directory` (kept if there) and return its path. The servers
    admit it once their `authorization` block lists it (`write_server_authorization`, then a reload)."""
    path = job_nkey_path(directory, job)
    path.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    if not path.exists():
        _write_private(path, _new_seed() + "\n")
    return path


def create_credentials(directory: Path) -> None:
    """Write one nkey seed per role and a data-plane key into `directory` (mode 0600), keeping those
    already there: restarting `deadpool up` on the same work directory keeps every credential."""
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    for role in ROLES:
        path = directory / f"{role}.nk"
        if not path.exists():
            _write_private(path, _new_seed() + "\n")
    key = directory / "dataplane.key"
    if not key.exists():
        _write_private(key, secrets.token_hex(32) + "\n")


def _new_seed() -> str:
    import nkeys  # nats-py's own nkeys library

    seed: bytes = nkeys.encode_seed(secrets.token_bytes(32), nkeys.PREFIX_BYTE_USER)
    return seed.decode()


def public_key(seed_file: Path) -> str:
    import nkeys

    seed = bytearray(seed_file.read_text().strip().encode())
    pub: bytes = nkeys.from_seed(seed).public_key
    return pub.decode()


def authorization_config(directory: Path) -> str:
    """The nats-server `authorization` block for the nkeys in `directory`: every role's public key with
    its permissions, and every job's own member key (`jobs/<job>.nk`) with that job's. Clients without
    one of these keys are refused."""
    users = [_user(directory / f"{role}.nk", PERMISSIONS[role], role in _ANSWERS_REQUESTS, role) for role in ROLES]
    for path in sorted((directory / "jobs").glob("*.nk")):
        users.append(_user(path, job_member_permissions(path.stem), False, f"job {path.stem}'s members"))
    return "authorization {\n  users: [\n" + "\n".join(users) + "\n  ]\n}\n"


def _user(seed_file: Path, permissions: dict[str, list[str]], answers_requests: bool, comment: str) -> str:
    publish, subscribe = json.dumps(permissions["publish"]), json.dumps(permissions["subscribe"])
    responses = ", allow_responses: true" if answers_requests else ""
    return (
        f"    {{ nkey: {public_key(seed_file)}, permissions: {{ publish: {{ allow: {publish} }}, "
        f"subscribe: {{ allow: {subscribe} }}{responses} }} }}  # {comment}"
    )


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
