"""Where a deployment's credentials live, and reading them.

A credentials directory holds one NATS nkey seed file per role, `<role>.nk` (the file `nats --nkey`
and every NATS client library read), and `dataplane.key`, the key that job tokens for the data plane
are derived from (`deadpool_protocol.dataplane.job_token`); only stores and swappers read it. The
NATS server holds the public half of each nkey, with the role's permissions (`deadpool_cli.nats_auth`).
A host is given only the files of the roles it runs: a training host `launcher.nk` and `member.nk`.

`member.nk` is trusted for every job of the deployment. A job can have member credentials of its own,
`jobs/<job>.nk` (`deadpool credentials DIR --job JOB`), which the server lets publish and read that
job's subjects only; a launcher hands its members their job's file where there is one.
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
    "job_nkey_path",
    "member_nkey_file",
    "nkey_file",
    "read_dataplane_key",
]

CREDENTIALS_ENV = "DEADPOOL_CREDENTIALS"
"""The default of every command's `--credentials DIR`."""
NKEY_ENV = "DEADPOOL_NATS_NKEY"
"""A member's own nkey seed file (its launcher sets it)."""
ROLES = ("admin", "swapper", "detector", "store", "launcher", "member")


def nkey_file(directory: str | Path, role: str) -> str:
    """The nkey seed file of `role` in a credentials directory ('' without a directory: no auth)."""
    if role not in ROLES:
        raise ValueError(f"no role {role!r} (roles: {', '.join(ROLES)})")
    if not directory:
        return ""
    path = Path(directory) / f"{role}.nk"
    if not path.is_file():
        raise FileNotFoundError(f"no {role} credentials: {path} does not exist")
    return str(path)


def job_nkey_path(directory: str | Path, job: str) -> Path:
    """Where job `job`'s own member nkey lives in a credentials directory."""
    return Path(directory) / "jobs" / f"{require_name(job, 'job')}.nk"


def member_nkey_file(directory: str | Path, job: str) -> str:
    """The nkey a launcher hands to job `job`'s members: the job's own where it has one, else the member
    role's ('' without a directory: no auth)."""
    if directory and job_nkey_path(directory, job).is_file():
        return str(job_nkey_path(directory, job))
    return nkey_file(directory, "member")


def dataplane_key_file(directory: str | Path) -> str:
    if not directory:
        return ""
    path = Path(directory) / "dataplane.key"
    if not path.is_file():
        raise FileNotFoundError(f"no data-plane key: {path} does not exist")
    return str(path)


def read_dataplane_key(path: str) -> bytes:
    """The key in a `dataplane.key` file (hex), checked for length; b'' for no file (tokens off)."""
    if not path:
        return b""
    try:
        key = bytes.fromhex(Path(path).read_text().strip())
    except ValueError:
        raise ValueError(f"{path}: the data-plane key is not hex") from None
    if len(key) < DATAPLANE_KEY_BYTES_MIN:
        raise ValueError(f"{path}: a data-plane key of {len(key)} bytes (at least {DATAPLANE_KEY_BYTES_MIN})")
    return key
