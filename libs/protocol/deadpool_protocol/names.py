"""Identifiers that travel on the bus: jobs, members, launchers and stores.

They end up inside NATS subjects and KV keys, so they are restricted to one subject token:
letters, digits, '-' and '_' (no dots, spaces or wildcards).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable

__all__ = [
    "DIGEST_CHARS",
    "NAME_MAX_CHARS",
    "content_digest",
    "first_invalid_name",
    "is_content_digest",
    "is_valid_name",
    "name_of_host",
    "require_name",
]

NAME_MAX_CHARS = 128
_NAME = re.compile(r"[A-Za-z0-9_-]{1,128}")
"""Matched whole (`fullmatch`): `$` would also match before a trailing newline, and a name ending in
one went into a NATS subject (a member's launcher, in its fence request), where it ends the protocol
line early."""


DIGEST_CHARS = 32
"""A content digest's length: the first 128 bits of a SHA-256, in hex."""
_DIGEST = re.compile(f"[0-9a-f]{{{DIGEST_CHARS}}}")


def content_digest(data: bytes) -> str:
    """What names a content: a job record's section (its KV key), a message's parts (their header), a
    set of members (a broken group's)."""
    return hashlib.sha256(data).hexdigest()[:DIGEST_CHARS]


def is_content_digest(value: str) -> bool:
    """True when `value` has the form `content_digest` gives."""
    return _DIGEST.fullmatch(value) is not None


def is_valid_name(value: str) -> bool:
    """True when `value` can be used as a job, member, launcher or store name."""
    return _NAME.fullmatch(value) is not None


def first_invalid_name(values: Iterable[str]) -> str | None:
    """The first of `values` that is not a valid name, else None: a rebuild's 16,384 members checked
    in one pass of the regex engine's own loop, without a Python call per name."""
    values = values if isinstance(values, list) else list(values)
    if all(map(_NAME.fullmatch, values)):
        return None
    return next(v for v in values if not is_valid_name(v))


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
