"""A message too large for one frame travels in keyed parts, and is put together before it is read.

The swapper's `Rebuild` and `Placement` name every rank: about 600 kB at 16,384 ranks with short
names, several MB at the largest job (`MEMBERS_PER_JOB_MAX` members with long names), past NATS'
`max_payload`. No frame on the bus may be larger than `MESSAGE_PART_BYTES_MAX` (256 KiB, header
included), so an encoded message larger than a part's payload is sent as parts: each carries a slice
of the encoded message and one header, `Deadpool-Part: <index>/<count>/<digest>`, where the digest is
the first 128 bits of the whole encoding's SHA-256, in hex. The parts of one message share its
digest, which is its key: a receiver gathers them (`PartAssembler`), checks the whole against its
digest, and only then decodes and validates it as it would one frame.

What a receiver holds is bounded before anything is kept: a header is parsed strictly, a part's
payload is at most `PART_PAYLOAD_BYTES_MAX`, a message at most `ASSEMBLED_MESSAGE_BYTES_MAX` (its
count of parts is checked against it), at most `ASSEMBLIES_MAX` messages are gathered at once (the
oldest is dropped for a newer one), and one not complete within `ASSEMBLY_S` is dropped. Parts arrive
in any order and any number of times (a part already held is a no-op). A part lost is not asked for
again: the sender's commands are re-sent until answered, and the next sending brings it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from deadpool_protocol.messages import ProtocolError
from deadpool_protocol.names import DIGEST_CHARS, content_digest

__all__ = [
    "ASSEMBLED_MESSAGE_BYTES_MAX",
    "ASSEMBLIES_MAX",
    "ASSEMBLY_S",
    "MESSAGE_PART_BYTES_MAX",
    "PART_HEADER",
    "PART_PAYLOAD_BYTES_MAX",
    "PartAssembler",
    "split_message",
]

MESSAGE_PART_BYTES_MAX = 256 * 1024
"""The largest frame DeadPool puts on the bus, its headers included (issue 26's bound)."""
PART_PAYLOAD_BYTES_MAX = MESSAGE_PART_BYTES_MAX - 1024
"""A part's slice of the message: a frame's bound less room for its header and NATS' framing."""
ASSEMBLED_MESSAGE_BYTES_MAX = 32 * 1024 * 1024
"""The largest message sent in parts: a `Rebuild` of `MEMBERS_PER_JOB_MAX` ranks with names of the
longest length (`NAME_MAX_CHARS`, 128), each rank placed on three stores, is about 17 MB."""
PARTS_MAX = -(-ASSEMBLED_MESSAGE_BYTES_MAX // PART_PAYLOAD_BYTES_MAX)
"""The most parts one message has (129)."""
ASSEMBLIES_MAX = 2
"""Messages gathered at once per subscription: the command in flight and the one that replaces it.
A receiver holds at most this many times `ASSEMBLED_MESSAGE_BYTES_MAX` of parts."""
ASSEMBLY_S = 10.0
"""How long the parts of a message are kept waiting for the rest; the sender re-sends before then."""
PART_HEADER = "Deadpool-Part"

_HEADER = re.compile(f"([0-9]{{1,3}})/([0-9]{{1,3}})/([0-9a-f]{{{DIGEST_CHARS}}})")


def split_message(data: bytes, payload_bytes: int = PART_PAYLOAD_BYTES_MAX) -> list[tuple[str, bytes]]:
    """An encoded message as the frames to send: `[("", data)]` (no header) when it fits one, else
    each part's `PART_HEADER` value and slice. A message past `ASSEMBLED_MESSAGE_BYTES_MAX` is a bug
    of the sender's (ProtocolError)."""
    if len(data) <= payload_bytes:
        return [("", data)]
    if len(data) > ASSEMBLED_MESSAGE_BYTES_MAX:
        raise ProtocolError(f"a message of {len(data)} bytes exceeds {ASSEMBLED_MESSAGE_BYTES_MAX} even in parts")
    digest = content_digest(data)
    slices = [data[i : i + payload_bytes] for i in range(0, len(data), payload_bytes)]
    return [(f"{i}/{len(slices)}/{digest}", piece) for i, piece in enumerate(slices)]


@dataclass(slots=True)
class _Assembly:
    count: int
    started: float
    parts: dict[int, bytes] = field(default_factory=dict)


class PartAssembler:
    """Gathers the parts of the messages of one subscription (see the module's doc for its bounds).
    Not thread-safe: one per subscription, fed from its callback."""

    def __init__(self, assemblies_max: int = ASSEMBLIES_MAX, assembly_s: float = ASSEMBLY_S) -> None:
        self._assemblies_max = assemblies_max
        self._assembly_s = assembly_s
        self._assemblies: dict[str, _Assembly] = {}

    @property
    def held_bytes(self) -> int:
        return sum(len(p) for a in self._assemblies.values() for p in a.parts.values())

    def add(self, header: str, payload: bytes, now: float) -> bytes | None:
        """Take one part; the whole message when this part completes it (its digest checked), None while
        parts are missing. A message sent again is put together again, as a frame sent again is read
        again. Raises ProtocolError for a malformed
        part or a whole that does not match its digest (its parts are dropped)."""
        index, count, digest = _parsed(header)
        if len(payload) > PART_PAYLOAD_BYTES_MAX:
            raise ProtocolError(f"a part of {len(payload)} bytes exceeds {PART_PAYLOAD_BYTES_MAX}")
        if not payload:
            raise ProtocolError("an empty part")
        self._expire(now)
        assembly = self._assemblies.get(digest)
        if assembly is None:
            while len(self._assemblies) >= self._assemblies_max:
                del self._assemblies[min(self._assemblies, key=lambda d: self._assemblies[d].started)]
            assembly = self._assemblies[digest] = _Assembly(count, now)
        if assembly.count != count:
            raise ProtocolError(f"part {index} of {digest} says {count} parts, its first said {assembly.count}")
        assembly.parts.setdefault(index, payload)
        if len(assembly.parts) < count:
            return None
        del self._assemblies[digest]
        whole = b"".join(assembly.parts[i] for i in range(count))
        if content_digest(whole) != digest:
            raise ProtocolError(f"the parts of {digest} do not make the message it names")
        return whole

    def _expire(self, now: float) -> None:
        for digest in [d for d, a in self._assemblies.items() if now - a.started > self._assembly_s]:
            del self._assemblies[digest]


def _parsed(header: str) -> tuple[int, int, str]:
    """A part header's index, count and digest, each checked against its bound."""
    match = _HEADER.fullmatch(header)
    if match is None:
        raise ProtocolError(f"a malformed part header {header[:80]!r}")
    index, count = int(match.group(1)), int(match.group(2))
    if not 2 <= count <= PARTS_MAX:
        raise ProtocolError(f"a message of {count} parts (allowed: 2 to {PARTS_MAX})")
    if index >= count:
        raise ProtocolError(f"part {index} of a message of {count}")
    return index, count, match.group(3)
