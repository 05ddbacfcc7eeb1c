"""Identifiers that travel on the bus: jobs, members, launchers and stores.

They end up inside NATS subjects and KV keys, so they are restricted to one subject token:
letters, digits, '-' and '_' (no dots, spaces or wildcards).
"""

from __future__ import annotations

import re

__all__ = ["NAME_MAX_CHARS", "is_valid_name", "name_of_host", "require_name"]

NAME_MAX_CHARS = 128
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,128}$")


def is_valid_name(value: str) -> bool:
    """True when `value` can be used as a job, member, launcher or store name."""
    return bool(_NAME.match(value))


def require_name(value: str, what: str) -> str:
    """Return `value`, or raise ValueError saying why it cannot be a name."""
    if not is_valid_name(value):
        raise ValueError(f"{what} {value!r} is not a valid name: use 1 to {NAME_MAX_CHARS} letters, digits, '-' or '_'")
    return value


def name_of_host(raw: str) -> str:
    """A host's name (`socket.gethostname()`), reduced to the characters a DeadPool name may hold
    (members and stores name their host alike, so placement can keep a rank's snapshots off its own
    host)."""
    first = raw.split(".")[0] or "host"
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in first)[:64]
