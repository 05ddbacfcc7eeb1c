"""What a save of a job record packs again, and what it takes as the last save left it.

A record's large fields are sections named by their content's digest (`deadpool_protocol.job_record`):
a section already stored is not written again. Building, packing and digesting a large field costs
its size all the same, so the memo keeps, beside each section, a copy of what it was built from, and
a field whose source is unchanged is not built again.

The fields that change a little at a time are kept in *chunks*, each built, packed and compared on
its own, so a save costs what changed, not the job's size:
- the members (their rows, and the summary's map of their hosts), in the order they registered, cut
  after a member whose name hashes to a multiple of `MEMBER_CHUNK_MEAN`: where the cuts fall depends
  on the names alone, so a member that registers changes the last chunk, one that fails its own;
- the rank maps (the ranks, the placement) and the holders of the committed step and the one before,
  cut every `RANK_CHUNK_ITEMS` ranks: a swap changes one chunk of each;
- the rebuild in flight's acks, in the order they came, cut every `ACK_CHUNK_ITEMS`: a save while
  they come in builds the newest chunk again.
Whole, a save while 16,384 members registered built, packed and compressed the membership again,
21 ms with 16 members more (`control_plane_costs.py`, `save_in_formation_ms`: 22 s of the swapper's
time over a formation at that pace), and a save after a swap packed 2 MB again (42 ms).

Where the cuts fall is this process's (`hash` of a name is salted per process): a new leader's first
save may write every chunk once; a reader joins what it finds, wherever the cuts are.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import msgpack

from deadpool_protocol import Rebuild, RebuildAck, RebuildDelta
from deadpool_protocol.codec import to_fields
from deadpool_protocol.job_record import SECTION_INLINE_BYTES, Section
from deadpool_protocol.names import content_digest
from deadpool_swapper.core import JobState
from deadpool_swapper.job_parts import command_less, command_shares, copy_command, holder_rows, member_row
from deadpool_swapper.placement import MemberInfo

__all__ = [
    "ACK_CHUNK_ITEMS",
    "CHUNK_ITEMS_MAX",
    "FIELDS_KEPT",
    "MEMBER_CHUNK_MEAN",
    "RANK_CHUNK_ITEMS",
    "SectionMemo",
    "ack_chunks",
    "holder_chunks",
    "member_chunks",
    "rank_chunks",
]

MEMBER_CHUNK_MEAN = 1024
"""Members per chunk on average (a power of two): about 100 kB of rows, 30 kB compressed."""
CHUNK_ITEMS_MAX = 4 * MEMBER_CHUNK_MEAN
"""A chunk is cut here whatever the names say (a run of names that never hash to a cut)."""
RANK_CHUNK_ITEMS = 2048
"""Ranks per chunk of a rank map: at 16,384 ranks, 8 chunks."""
ACK_CHUNK_ITEMS = 256
"""Acks per chunk of the rebuild in flight's acks, in the order they came: a save while they come in
builds the last chunk or two again (about 5 ms at 20 µs an ack), not every ack so far (8,192 of
them, 64-120 ms a save at 8,192 ranks)."""

Chunk = tuple[Hashable, list[Any]]
"""A chunk's key (what finds the chunk that last save built at its place) and its items."""


def member_chunks(members: dict[str, MemberInfo]) -> list[Chunk]:
    """The members in registration order, in chunks keyed by their first member's name."""
    infos = list(members.values())
    mask = MEMBER_CHUNK_MEAN - 1
    ends = [end for end, name in enumerate(members, 1) if not hash(name) & mask]
    chunks: list[Chunk] = []
    start = 0
    for end in [*ends, len(infos)]:
        for cut in range(start, end, CHUNK_ITEMS_MAX):
            chunks.append((infos[cut].member, infos[cut : min(end, cut + CHUNK_ITEMS_MAX)]))
        start = end
    return chunks


def _slices(items: list[Any], size: int) -> list[Chunk]:
    """`items` in slices of `size`, each with where it starts."""
    return [(start, items[start : start + size]) for start in range(0, len(items), size)]


def ack_chunks(acks: dict[str, RebuildAck]) -> list[Chunk]:
    """The rebuild in flight's acks in the order they came, in chunks of `ACK_CHUNK_ITEMS`, keyed by
    where each starts (an ack repeated by its member replaces its own in place)."""
    return _slices(list(acks.values()), ACK_CHUNK_ITEMS)


def holder_chunks(holders: dict[int, set[str]]) -> list[Chunk]:
    """A step's holders in rank order, `RANK_CHUNK_ITEMS` ranks a chunk, keyed by their first rank."""
    return [(items[0][0], items) for _, items in _slices(sorted(holders.items()), RANK_CHUNK_ITEMS)]


def rank_chunks(by_rank: list[Any]) -> list[Chunk]:
    """A rank map in chunks of `RANK_CHUNK_ITEMS` ranks, keyed by their first rank."""
    return _slices(by_rank, RANK_CHUNK_ITEMS)


@dataclass(frozen=True)
class _Chunked:
    """A field kept in chunks: its source and how to copy it (compared whole first: unchanged, the
    last chunks stand; None: compared chunk by chunk, where cutting costs less than a copy of the
    whole), how the source is cut, what a chunk's value depends on beside its items (every chunk is
    built again when it changes), how a chunk's items become its value, and how they are copied.
    Copies keep the state's changes in place from reaching the memo."""

    group: str
    field: str
    source: Callable[[JobState], Any]
    copy_source: Callable[[Any], Any] | None
    chunks: Callable[[Any], list[Chunk]]
    context: Callable[[JobState], Any]
    value: Callable[[list[Any], Any], Any]
    copy: Callable[[list[Any]], list[Any]]


def _oldest(state: JobState) -> float:
    return state.membership.oldest_registration(0.0)


def _members(state: JobState) -> dict[str, MemberInfo]:
    return state.membership.members


def _nothing(_state: JobState) -> None:
    return None


def _hosts(infos: list[MemberInfo], _: None) -> dict[str, str]:
    return {info.member: info.host for info in infos}


def _rows(infos: list[MemberInfo], oldest: float) -> list[list[Any]]:
    return [member_row(info, oldest) for info in infos]


def _lists(items: list[list[str]], _: None = None) -> list[list[str]]:
    return [list(item) for item in items]


def _same(items: list[Any], _: None) -> list[Any]:
    return items


def _holders(items: list[tuple[int, set[str]]], _: None) -> list[list[Any]]:
    return holder_rows(items)


def _frozen_holders(holders: dict[int, set[str]]) -> dict[int, frozenset[str]]:
    return {rank: frozenset(stores) for rank, stores in holders.items()}


def _frozen_items(items: list[tuple[int, set[str]]]) -> list[tuple[int, frozenset[str]]]:
    return [(rank, frozenset(stores)) for rank, stores in items]


def _acks(state: JobState) -> dict[str, RebuildAck]:
    pending = state.recovery.pending
    return {} if pending is None else pending.acks


def _ack_fields(acks: list[RebuildAck], _: None) -> list[dict[str, Any]]:
    return [to_fields(ack) for ack in acks]


_CHUNKED = (
    _Chunked("summary", "hosts", _members, dict, member_chunks, _nothing, _hosts, list),
    _Chunked("swapper", "member_rows", _members, dict, member_chunks, _oldest, _rows, list),
    _Chunked("summary", "ranks", lambda s: s.membership.ranks, None, rank_chunks, _nothing, _same, list),
    _Chunked("swapper", "placement", lambda s: s.stores.placement, None, rank_chunks, _nothing, _lists, _lists),
    _Chunked("swapper", "pending_acks", _acks, None, ack_chunks, _nothing, _ack_fields, list),
    _Chunked(
        "swapper",
        "committed_holders",
        lambda s: s.ledger.committed_holders,
        _frozen_holders,
        holder_chunks,
        _nothing,
        _holders,
        _frozen_items,
    ),
    _Chunked(
        "swapper",
        "previous_committed_holders",
        lambda s: s.ledger.previous_committed.holders,
        _frozen_holders,
        holder_chunks,
        _nothing,
        _holders,
        _frozen_items,
    ),
)
"""The fields kept in chunks (a member's info is kept as it is: `MemberInfo` is frozen, and so is an
ack). The members are compared whole first (cutting them hashes every name); a rank map is sliced, and
only the chunks that changed are copied: a copy of the whole placement was a third of a save after a
swap at 16,384 ranks. The acks are sliced too: they only grow while a rebuild is in flight. The
holders of the committed step and of the one before are compared whole first (the commits between
swaps change neither, and cutting sorts them), then cut by rank: a swap changes a chunk of each, where
the commit after it built both whole (8,192 ranks' sorted stores, each)."""


def pending_shares(state: JobState) -> tuple[str, ...]:
    """The lists the rebuild in flight's command shares with the job (`job_parts.command_entries`)."""
    pending = state.recovery.pending
    return () if pending is None else command_shares(pending.command, state.membership.ranks, state.stores.placement)


def _pending_command(state: JobState) -> tuple[Rebuild, tuple[str, ...]] | None:
    """The rebuild in flight's command less the lists it shares with the job (kept in chunks, and
    left out of its entry): copied and compared whole, they were another third of a save after a swap
    at 16,384 ranks."""
    pending = state.recovery.pending
    if pending is None:
        return None
    shares = pending_shares(state)
    return command_less(pending.command, shares), shares


def _copy_pending(kept: tuple[Rebuild, tuple[str, ...]] | None) -> tuple[Rebuild | None, tuple[str, ...]] | None:
    return None if kept is None else (copy_command(kept[0]), kept[1])


def _pending_delta(state: JobState) -> RebuildDelta | None:
    pending = state.recovery.pending
    return None if pending is None else pending.delta


def _as_is(value: Any) -> Any:
    return value


_WHOLE: tuple[tuple[str, str, Callable[[JobState], Any], Callable[[Any], Any]], ...] = (
    ("swapper", "rank_bytes", lambda s: s.ledger.rank_bytes, dict),
    ("swapper", "pending_command", _pending_command, _copy_pending),
    ("swapper", "pending_delta", _pending_delta, _as_is),
    ("swapper", "placement_delta", lambda s: s.stores.unconfirmed_delta(), _as_is),
)
"""The large fields kept whole: each with its source in the state and how to copy it. The rebuild in
flight's command is one (with the lists it shares with the job: what its entry leaves out): every
save while its acks came in packed it again, 10 ms at 16,384 ranks. Deltas are messages, never
changed once made: kept as they are."""

FIELDS_KEPT = frozenset({spec.field for spec in _CHUNKED} | {name for _, name, *_ in _WHOLE})
"""Every field a memo keeps, in chunks or whole."""


@dataclass
class _KeptChunk:
    items: list[Any]
    section: Section


@dataclass
class _KeptField:
    source: Any
    """A copy of the source the chunks below were built from."""
    context: Any
    chunks: dict[Hashable, _KeptChunk]
    sections: list[Section] | None
    """The field's sections in order; None when it was small enough for the head."""


class SectionMemo:
    """One job's large fields as its last save packed them, beside copies of what they were built
    from: a field (or a chunk of one) whose source equals (`==`) its copy is not built, packed or
    digested again. Comparing is cheap: the same member infos and strings, compared by identity
    first."""

    def __init__(self) -> None:
        self._whole: dict[tuple[str, str], tuple[Any, Section]] = {}
        self._chunked: dict[tuple[str, str], _KeptField] = {}

    def packed(self, state: JobState) -> dict[tuple[str, str], list[Section]]:
        """The sections of `state`'s fields that this memo packs or kept, by (group, field): every
        chunked field (unless small enough for the head: left to the caller, whole) and the whole
        fields unchanged since `keep`."""
        found: dict[tuple[str, str], list[Section]] = {}
        for group, field_name, source, _ in _WHOLE:
            kept = self._whole.get((group, field_name))
            if kept is not None and kept[0] == source(state):
                found[(group, field_name)] = [kept[1]]
        cut: dict[tuple[object, int], list[Chunk]] = {}
        """The chunks of a source, by cutting and source: the members are cut once for both fields."""
        for spec in _CHUNKED:
            sections = self._chunk(spec, state, cut)
            if sections is not None:
                found[(spec.group, spec.field)] = sections
        return found

    def _chunk(
        self, spec: _Chunked, state: JobState, cut: dict[tuple[object, int], list[Chunk]]
    ) -> list[Section] | None:
        source, context = spec.source(state), spec.context(state)
        kept = self._chunked.get((spec.group, spec.field))
        whole = spec.copy_source is not None
        if kept is not None and whole and kept.context == context and kept.source == source:
            return kept.sections
        last = {} if kept is None or kept.context != context else kept.chunks
        chunks: dict[Hashable, _KeptChunk] = {}
        cut_key = (spec.chunks, id(source))
        if cut_key not in cut:
            cut[cut_key] = spec.chunks(source)
        for key, items in cut[cut_key]:
            chunk = last.get(key)
            if chunk is None or chunk.items != items:
                packed: bytes = msgpack.packb(spec.value(items, context), use_bin_type=True)
                chunk = _KeptChunk(spec.copy(items), Section(spec.group, spec.field, packed, content_digest(packed)))
            chunks[key] = chunk
        sections = [chunk.section for chunk in chunks.values()]
        small = sum(len(section.packed) for section in sections) <= SECTION_INLINE_BYTES
        self._chunked[(spec.group, spec.field)] = _KeptField(
            spec.copy_source(source) if spec.copy_source is not None else None,
            context,
            chunks,
            None if small else sections,
        )
        return None if small else sections

    def keep(self, state: JobState, sections: list[Section]) -> None:
        """Remember the whole fields' sections just packed from `state` (a field small enough for the
        head is not a section: nothing is kept for it)."""
        packed = {(s.group, s.field): s for s in sections}
        for group, field_name, source, copy in _WHOLE:
            section = packed.get((group, field_name))
            kept = self._whole.get((group, field_name))
            if section is None:
                self._whole.pop((group, field_name), None)
            elif kept is None or kept[1] is not section:
                self._whole[(group, field_name)] = (copy(source(state)), section)
