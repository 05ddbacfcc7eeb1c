"""How much each field of a message, a data-plane frame or a job record may hold.

Every `str`, `bytes`, `list` and `dict` field has a bound, which the codec checks while it decodes,
before anything is built (`codec.from_fields`): a field over its bound costs one `len()` and is
refused with a `ProtocolError` that names the field and the bound. A field declares its bound next
to it, by its type (`host: Host`, `ranks: Members`, `reason: Text`); a field that declares none has
its type's default (`DEFAULT_BOUNDS`), which is small for lists and maps, so a bound forgotten
refuses loudly rather than opening a door. Why: one hello with a 600 kB host name was accepted, went
into its job's record, and the record could no longer be saved: the job stopped.

Honest senders stay within the bounds: the free text they build (a reason, an exception's text)
goes through `clip_text` first.
"""

from __future__ import annotations

import typing
from collections.abc import Sized
from dataclasses import dataclass
from typing import Annotated, Any

from deadpool_protocol.names import NAME_MAX_CHARS

__all__ = [
    "BEATS",
    "BEAT_AGES",
    "BEAT_AGES_MAX",
    "BEAT_AGE_MS_MAX",
    "CLIPPED_MARK",
    "DEFAULT_BOUNDS",
    "EVIDENCE_ENTRIES_MAX",
    "HEARTBEATS_PER_BATCH_MAX",
    "HOST",
    "HOST_NAME_BYTES_MAX",
    "INCIDENT_IDS_CHARS_MAX",
    "MEMBERS_PER_JOB_MAX",
    "MEMBER_ENTRIES",
    "SEALED",
    "SEALED_PER_REPORT_MAX",
    "SECTION_CHARS_MAX",
    "STORES",
    "STORES_PER_MESSAGE_MAX",
    "TAG_CHARS_MAX",
    "TEXT_CHARS_MAX",
    "TIME_MARKS_MAX",
    "TOKEN_BYTES",
    "TRACEPARENT_CHARS_MAX",
    "WHERE_CHARS_MAX",
    "Bound",
    "Evidence",
    "Host",
    "IncidentId",
    "IncidentIds",
    "Marks",
    "Members",
    "Name",
    "Placements",
    "Sealed",
    "Section",
    "Tag",
    "Text",
    "Token",
    "Traceparent",
    "Where",
    "bound_of",
    "clip_text",
]


@dataclass(frozen=True, slots=True)
class Bound:
    """At most `most` `unit` in one value: characters of a str (its UTF-8 bytes where `unit` is
    "bytes"), bytes of a bytes, items of a list, entries of a map. `name` is the constant that
    says it, so a refusal names it."""

    most: int
    name: str
    unit: str

    def excess(self, value: Sized) -> str:
        """Why `value` is over this bound ('' when it is not)."""
        size = len(value)
        if self.unit == "bytes" and isinstance(value, str) and not value.isascii():
            size = len(value.encode())
        if size <= self.most:
            return ""
        return f"{size} {self.unit} exceeds {self.name} ({self.most})"


HOST_NAME_BYTES_MAX = 253
"""A host name or address (RFC 1035: a full domain name has at most 253 characters)."""
TAG_CHARS_MAX = 64
"""A short word from a known set: a cause, a restore source, a failure reason, a key of evidence."""
SECTION_CHARS_MAX = 128
"""The name of a section of work between steps (`job.section`)."""
WHERE_CHARS_MAX = 256
"""Where a training thread is ('file:line function'; members send at most 200 characters)."""
TEXT_CHARS_MAX = 4096
"""Free text: a reason, an error, a detail, a value of evidence (`clip_text` keeps one within)."""
TRACEPARENT_CHARS_MAX = 128
"""A W3C trace context (55 characters; its content is the tracer's to parse)."""
TOKEN_BYTES = 32
"""A job's data-plane token: HMAC-SHA256 (`dataplane.job_token`)."""
INCIDENT_IDS_CHARS_MAX = 64 * 1024
"""The incidents one rebuild answers, comma-separated (over 400 at once)."""
MEMBERS_PER_JOB_MAX = 32 * 1024
"""Ranks and spares of one job together: a job of 16,384 ranks with as many spares. The swapper
refuses a hello past it; every list or map of a job's members is bounded by it."""
STORES_PER_MESSAGE_MAX = 1024
"""Stores one message names (every live store, in a rebuild)."""
EVIDENCE_ENTRIES_MAX = 32
"""Entries of a verdict's evidence (a detector writes fewer than ten)."""
TIME_MARKS_MAX = 32
"""Named times or durations of one rebuild (a member's marks, an incident's phases)."""
HEARTBEATS_PER_BATCH_MAX = 1024
"""Heartbeats in one launcher's batch (its members on one host)."""
BEAT_AGES_MAX = 2 * HEARTBEATS_PER_BATCH_MAX
"""Ages in one batch: one per beat and per name."""
BEAT_AGE_MS_MAX = 60_000
"""A beat's age in its launcher's batch (`HeartbeatBatch.ages_ms`): a batch goes every fraction of a
second; a launcher that says older only makes its own members look silent, which it can do anyway."""
SEALED_PER_REPORT_MAX = 8192
"""Ranks one store's report of sealed snapshots names (a store sealing more in one batch sends several):
at most about 100 kB of message."""
INCIDENT_ID_CHARS_MAX = NAME_MAX_CHARS + 32
"""An incident's id: its job's name and a counter."""
ENTRIES_DEFAULT_MAX = 64
"""A list or a map that declares no bound of its own."""
BYTES_DEFAULT_MAX = 4096
"""A bytes field that declares no bound of its own."""

NAME = Bound(NAME_MAX_CHARS, "NAME_MAX_CHARS", "characters")
HOST = Bound(HOST_NAME_BYTES_MAX, "HOST_NAME_BYTES_MAX", "bytes")
TAG = Bound(TAG_CHARS_MAX, "TAG_CHARS_MAX", "characters")
SECTION = Bound(SECTION_CHARS_MAX, "SECTION_CHARS_MAX", "characters")
WHERE = Bound(WHERE_CHARS_MAX, "WHERE_CHARS_MAX", "characters")
TEXT = Bound(TEXT_CHARS_MAX, "TEXT_CHARS_MAX", "characters")
TRACEPARENT = Bound(TRACEPARENT_CHARS_MAX, "TRACEPARENT_CHARS_MAX", "characters")
TOKEN = Bound(TOKEN_BYTES, "TOKEN_BYTES", "bytes")
INCIDENT_ID = Bound(INCIDENT_ID_CHARS_MAX, "INCIDENT_ID_CHARS_MAX", "characters")
INCIDENT_IDS = Bound(INCIDENT_IDS_CHARS_MAX, "INCIDENT_IDS_CHARS_MAX", "characters")
MEMBERS = Bound(MEMBERS_PER_JOB_MAX, "MEMBERS_PER_JOB_MAX", "items")
MEMBER_ENTRIES = Bound(MEMBERS_PER_JOB_MAX, "MEMBERS_PER_JOB_MAX", "entries")
STORES = Bound(STORES_PER_MESSAGE_MAX, "STORES_PER_MESSAGE_MAX", "items")
EVIDENCE = Bound(EVIDENCE_ENTRIES_MAX, "EVIDENCE_ENTRIES_MAX", "entries")
MARKS = Bound(TIME_MARKS_MAX, "TIME_MARKS_MAX", "entries")
BEATS = Bound(HEARTBEATS_PER_BATCH_MAX, "HEARTBEATS_PER_BATCH_MAX", "items")
SEALED = Bound(SEALED_PER_REPORT_MAX, "SEALED_PER_REPORT_MAX", "items")
BEAT_AGES = Bound(BEAT_AGES_MAX, "BEAT_AGES_MAX", "items")

DEFAULT_BOUNDS: dict[Any, Bound] = {
    str: TEXT,
    bytes: Bound(BYTES_DEFAULT_MAX, "BYTES_DEFAULT_MAX", "bytes"),
    list: Bound(ENTRIES_DEFAULT_MAX, "ENTRIES_DEFAULT_MAX", "items"),
    dict: Bound(ENTRIES_DEFAULT_MAX, "ENTRIES_DEFAULT_MAX", "entries"),
}
"""The bound of a field of each kind that declares none (keyed by the type, or a generic's origin)."""

Name = Annotated[str, NAME]
"""A job, member, launcher or store name (`names.is_valid_name` says which characters)."""
Host = Annotated[str, HOST]
Tag = Annotated[str, TAG]
Section = Annotated[str, SECTION]
Where = Annotated[str, WHERE]
Text = Annotated[str, TEXT]
Traceparent = Annotated[str, TRACEPARENT]
Token = Annotated[bytes, TOKEN]
IncidentId = Annotated[str, INCIDENT_ID]
IncidentIds = Annotated[str, INCIDENT_IDS]
Members = Annotated[list[Name], MEMBERS]
Evidence = Annotated[dict[Tag, Text], EVIDENCE]
Marks = Annotated[dict[Tag, float], MARKS]
Sealed = Annotated[list[int], SEALED]
"""Per rank a store sealed, one number (its rank, its snapshot's size)."""
Ranks = Annotated[list[int], MEMBERS]
"""Ranks of a job, each once (a rebuild's changes: `RebuildDelta`)."""
Placements = Annotated[list[Annotated[list[Name], STORES]], MEMBERS]
"""Per rank, the stores its snapshots go to."""


def bound_of(hint: Any) -> tuple[Any, Bound | None]:
    """The type under `hint`'s annotations, and the bound of a value of it: its own (`Annotated[str,
    HOST]`), else its type's default, else None (a number, a bool, a nested message)."""
    if typing.get_origin(hint) is Annotated:
        base, *extras = typing.get_args(hint)
        own = [e for e in extras if isinstance(e, Bound)]
        return base, own[0] if own else bound_of(base)[1]
    return hint, DEFAULT_BOUNDS.get(typing.get_origin(hint) or hint)


CLIPPED_MARK = " [cut]"


def clip_text(text: str, most: int = TEXT_CHARS_MAX) -> str:
    """`text` within `most` characters, ending in `CLIPPED_MARK` where it was cut: the free text a
    sender builds (an exception's text, a reason quoting another) keeps to its bound, and a reader
    sees that it was cut."""
    if len(text) <= most:
        return text
    if most < len(CLIPPED_MARK):
        return text[:most]
    return text[: most - len(CLIPPED_MARK)] + CLIPPED_MARK
