"""Where a deployment's credentials live, and reading them.

A credentials directory holds one NATS nkey seed file per role, `<role>.nk` (the file `nats --nkey`
and every NATS client library read), `dataplane.key`, the key that job tokens for the data plane
are derived from (`deadpool_protocol.dataplane.job_token`), which only stores and swappers read; and
`seal.key`, which the seal keys that members sign their snapshots with are derived from
(`deadpool_protocol.dataplane.seal_key`), which only swappers read: a store, which holds every job's
token, cannot sign. The NATS server holds the public half of each nkey, with the role's permissions
(`deadpool_cli.nats_auth`). A host is given only the files of the roles it runs.

Each store has a key of its own, `stores/<store>.nk` (`deadpool credentials DIR --store STORE`): the
server lets it announce that store's name and report that store's copies only. A store's host is given
its own key alone, as `store.nk`.

A training job's processes, its launchers and its members, hold the job's own key, `jobs/<job>.nk`
(`deadpool credentials DIR --job JOB`), which the server lets publish and read that job's subjects
only. There is no key shared by every job's members or launchers: a training script is user code, and
on a shared cluster another team's script runs beside it. A training host is given the files of the
jobs it runs, nothing else.
"""

from __future__ import annotations

from pathlib import Path

from deadpool_protocol.dataplane import DATAPLANE_KEY_BYTES_MIN
from deadpool_protocol.names import require_name

__all__ = [
    "CREDENTIALS_ENV",
    "NKEY_ENV",
    "ROLES",
    "dataplane_key_file",
    "job_nkey_file",
    "job_nkey_path",
    "nkey_file",
    "read_dataplane_key",
    "signing_key_file",
    "store_nkey_file",
    "store_nkey_path",
]

CREDENTIALS_ENV = "DEADPOOL_CREDENTIALS"
"""The default of every command's `--credentials DIR`."""
NKEY_ENV = "DEADPOOL_NATS_NKEY"
"""A member's own nkey seed file (its launcher sets it)."""
ROLES = ("admin", "swapper", "detector")
"""The roles with one key, `<role>.nk`. Each store has its own (`store_nkey_file`), and a job's
launchers and members hold the job's (`job_nkey_path`)."""


def nkey_file(directory: str | Path, role: str) -> str:
    """The nkey seed file of `role` in a credentials directory ('' without a directory: no auth); role
    "store" is a store host's own key, `store.nk`."""
    if role not in (*ROLES, "store"):
        raise ValueError(f"no role {role!r} (roles: {', '.join(ROLES)}, store)")
    if not directory:
        return ""
    path = Path(directory) / f"{role}.nk"
    if not path.is_file():
        raise FileNotFoundError(f"no {role} credentials: {path} does not exist")
    return str(path)


def store_nkey_path(directory: str | Path, store: str) -> Path:
    """Where store `store`'s own nkey lives in the control plane's credentials directory."""
    return Path(directory) / "stores" / f"{require_name(store, 'store')}.nk"


def store_nkey_file(directory: str | Path, store: str) -> str:
    """Store `store`'s nkey seed file: `stores/<store>.nk` in the control plane's directory, or `store.nk`
    in a store host's, which holds its own key alone ('' without a directory: no auth)."""
    if not directory:
        return ""
    path = store_nkey_path(directory, store)
    if path.is_file():
        return str(path)
    own = Path(directory) / "store.nk"
    if own.is_file():
        return str(own)
    raise FileNotFoundError(
        f"store {store} has no credentials: neither {path} nor {own} exists (create them with "
        f"`deadpool credentials DIR --store {store}` and reload the NATS servers)"
    )


def job_nkey_path(directory: str | Path, job: str) -> Path:
    """Where job `job`'s own nkey (its launchers' and members') lives in a credentials directory."""
    return Path(directory) / "jobs" / f"{require_name(job, 'job')}.nk"


def job_nkey_file(directory: str | Path, job: str) -> str:
    """Job `job`'s nkey seed file in a credentials directory ('' without a directory: no auth)."""
    if not directory:
        return ""
    path = job_nkey_path(directory, job)
    if not path.is_file():
        raise FileNotFoundError(
            f"job {job} has no credentials: {path} does not exist (create them where the control plane's "
            f"credentials are, `deadpool credentials DIR --job {job}`, reload the NATS servers, and give "
            "this host the file)"
        )
    return str(path)


def signing_key_file(directory: str | Path) -> str:
    """`seal.key`, which seal keys are derived from (`dataplane.seal_key`): the swapper's alone, never a
    store's ('' without a directory: snapshots unsigned)."""
    if not directory:
        return ""
    path = Path(directory) / "seal.key"
    if not path.is_file():
        raise FileNotFoundError(f"no snapshot signing key: {path} does not exist (`deadpool credentials` makes it)")
    return str(path)


def dataplane_key_file(directory: str | Path) -> str:
    if not directory:
        return ""
    path = Path(directory) / "dataplane.key"
    if not path.is_file():
        raise FileNotFoundError(f"no data-plane key: {path} does not exist")
    return str(path)


def read_dataplane_key(path: str) -> bytes:
    """The key in a `dataplane.key` or `seal.key` file (hex), checked for length; b'' for no file (off)."""
    if not path:
        return b""
    try:
        key = bytes.fromhex(Path(path).read_text().strip())
    except ValueError:
        raise ValueError(f"{path}: the data-plane key is not hex") from None
    if len(key) < DATAPLANE_KEY_BYTES_MIN:
        raise ValueError(f"{path}: a data-plane key of {len(key)} bytes (at least {DATAPLANE_KEY_BYTES_MIN})")
    return key
