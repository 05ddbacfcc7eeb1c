"""Who may say what on the bus: one NATS user per role, authenticated by an nkey, with the server's
permissions limiting what each may publish and subscribe to.

The permissions are the protocol's trust boundaries:
- only the swapper publishes commands (rebuild, void, placement, commit, finished), fences and
  replication requests;
- only detectors publish verdicts (failure, straggler, group broken);
- only stores publish store status and snapshot completions, each store with a key of its own that
  may announce its own name and report its own copies only (`create_store_credentials`): one shared
  store key could announce any store, and forged completions committed a step 5,000 while the job was
  at step 48;
- a training job's processes hold the job's own key (`create_job_credentials`): its launchers start
  its runs, publish its hosts' heartbeat batches and child exits and answer its fences; its members
  publish heartbeats, reports and acks, and receive its commands. That key may publish and read the
  job's subjects only, and only replies to its own requests (the job's inbox, `Subjects.inbox`): one
  job's processes can neither act for, nor listen to, nor start another job. There is no key shared
  by every job's members or launchers (one such key, on every training host, could end, truncate or
  join any job). On the data plane, job tokens do the same;
- `admin` (operators, `deadpool status`, tests) may do anything.
Everything that answers a request (a hello, a fence, a micro-service ping) does so with
`allow_responses`, which lets it publish to the requester's reply subject only.

The services' subjects have `*` in the job's place: a service role is trusted for every job of the
deployment.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

from deadpool_protocol.events import EVENTS_STREAM, event_subjects
from deadpool_protocol.subjects import PING_INBOX, PREFIX, STORE_STATUS, Subjects, service_inbox, store_announce
from deadpool_runtime.credentials import ROLES, job_nkey_path, store_nkey_path

__all__ = [
    "PERMISSIONS",
    "authorization_config",
    "create_credentials",
    "create_job_credentials",
    "create_store_credentials",
    "job_permissions",
    "public_key",
    "store_permissions",
    "write_server_authorization",
]

_ANY = Subjects.any_job()
_JS_READ = [
    "$JS.API.INFO",
    "$JS.API.STREAM.INFO.*",
    "$JS.API.CONSUMER.CREATE.*",
    "$JS.API.CONSUMER.CREATE.*.>",
    "$JS.API.CONSUMER.INFO.*.*",
    "$JS.API.CONSUMER.DELETE.*.*",
    "$JS.API.DIRECT.GET.*",
    "$JS.API.DIRECT.GET.*.>",
    "$JS.API.STREAM.MSG.GET.*",
    "$JS.FC.>",
]
"""The JetStream API a service that reads streams and buckets uses: stream info, its own ephemeral
(ordered) consumers, direct and message gets, flow control. Never purge, delete or a stream's
removal: with `$JS.API.>` a detector key once purged a running job's record, and the swapper forgot
the job."""
_JS_EVENTS = [f"$JS.API.STREAM.CREATE.{EVENTS_STREAM}", f"$JS.API.STREAM.UPDATE.{EVENTS_STREAM}"]
"""Creating the events stream, or updating its subjects (`ensure_events_stream`): any service may."""
_JS_OWNER = ["$JS.API.STREAM.CREATE.*", "$JS.API.STREAM.UPDATE.*", "$JS.ACK.>", "$KV.>"]
"""The swapper's own: it creates the job records' and the lease's buckets and writes them."""
_SERVICE = "$SRV.>"
_PING = "$SRV.PING.>"
"""A service's own health check (`deadpool ping`) pings it with the service's credentials."""
_FENCE = f"{PREFIX}.*.launcher.*.fence"
_REPLICATE = f"{PREFIX}.store.*.replicate"
_RESERVE = f"{PREFIX}.store.*.reserve"

PERMISSIONS: dict[str, dict[str, list[str]]] = {
    "admin": {"publish": [">"], "subscribe": [">"]},
    "swapper": {
        "publish": [
            _ANY.rebuild,
            _ANY.rebuild_delta,
            _ANY.void,
            _ANY.placement,
            _ANY.placement_delta,
            _ANY.commit,
            _ANY.finished,
            _ANY.incident,
            _FENCE,
            _REPLICATE,
            _RESERVE,
            *_JS_READ,
            *_JS_OWNER,
            _PING,
        ],
        "subscribe": [">"],
    },
    "detector": {
        "publish": [_ANY.failure, _ANY.straggler, _ANY.group_broken, *_JS_READ, *_JS_EVENTS, _PING],
        # DeadPool's subjects and its own replies: never a job's replies (their tokens and seal keys).
        "subscribe": [f"{PREFIX}.>", _SERVICE, f"{service_inbox('detector')}.>", f"{PING_INBOX}.>"],
    },
}
_ANSWERS_REQUESTS = {"swapper", "detector"}
"""Roles that answer requests (hellos, status, micro-service pings): `allow_responses`. A job's key
does too: its launchers answer fences."""


def store_permissions(store: str) -> dict[str, list[str]]:
    """What store `store`'s own key may do: announce itself, report the copies it sealed, answer its own
    requests (replication, status, pings), hear commits, ends and the other stores' announcements (a
    chained upload's next store), and read its own replies only."""
    return {
        "publish": [store_announce(store), f"{PREFIX}.*.snapshot.complete.{store}", _PING],
        "subscribe": [
            STORE_STATUS,
            _ANY.commit,
            _ANY.finished,
            f"{PREFIX}.store.{store}.>",
            _SERVICE,
            f"{service_inbox('store', store)}.>",
            f"{PING_INBOX}.>",
        ],
    }


def job_permissions(job: str) -> dict[str, list[str]]:
    """What job `job`'s own key may do: what its members and its launchers say and hear, for that job
    only. (Fence requests, which a launcher answers, are the swapper's to send: the job may read them,
    not send them.)"""
    s = Subjects.for_job(job)
    return {
        "publish": [
            f"{PREFIX}.{job}.member.>",
            f"{PREFIX}.{job}.launcher.*.heartbeat",
            f"{PREFIX}.{job}.launcher.*.ack",
            f"{PREFIX}.{job}.launcher.*.resumed",
            s.heartbeat_batch,
            s.run_start,
            *event_subjects(job, ("child_exit", "rebuild_ack_batch", "step_resumed_batch")),
        ],
        "subscribe": [
            s.rebuild,
            s.rebuild_delta,
            s.void,
            s.placement,
            s.placement_delta,
            s.finished,
            s.snapshot_interval,
            s.commit,
            f"{PREFIX}.{job}.launcher.*.heartbeat",
            f"{PREFIX}.{job}.launcher.*.ack",
            f"{PREFIX}.{job}.launcher.*.resumed",
            f"{PREFIX}.{job}.launcher.*.fence",
            f"{s.inbox}.>",
        ],
    }


def create_job_credentials(directory: Path, job: str) -> Path:
    """Write job `job`'s nkey into `directory` (kept if there) and return its path. The servers admit it
    once their `authorization` block lists it (`write_server_authorization`, then a reload). Two
    launchers of a job may create it at once: one file wins, whole, and both use it."""
    return _seed_file(job_nkey_path(directory, job))


def create_store_credentials(directory: Path, store: str) -> Path:
    """Write store `store`'s nkey into `directory` (kept if there) and return its path; the servers admit
    it at their next reload, as a job's."""
    return _seed_file(store_nkey_path(directory, store))


def _seed_file(path: Path) -> Path:
    """An nkey seed at `path` (kept if there), in a directory only its owner reads."""
    path.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    if not path.exists():
        _write_private(path, _new_seed() + "\n")
    return path


def create_credentials(directory: Path) -> None:
    """Write one nkey seed per role, the data-plane key and the seal-signing key into `directory` (mode
    0600), keeping those already there: restarting `deadpool up` on the same work directory keeps every credential."""
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    for role in ROLES:
        path = directory / f"{role}.nk"
        if not path.exists():
            _write_private(path, _new_seed() + "\n")
    for name in ("dataplane.key", "seal.key"):
        if not (directory / name).exists():
            _write_private(directory / name, secrets.token_hex(32) + "\n")


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
    for path in sorted((directory / "stores").glob("*.nk")):
        users.append(_user(path, store_permissions(path.stem), True, f"store {path.stem}"))
    for path in sorted((directory / "jobs").glob("*.nk")):
        users.append(_user(path, job_permissions(path.stem), True, f"job {path.stem}"))
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
    """Write `path` whole (mode 0600) unless it exists: a reader never sees half of it, and of two
    writers at once the first wins and the other keeps its file."""
    partial = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.link(partial, path)
    except FileExistsError:
        pass
    finally:
        partial.unlink()
