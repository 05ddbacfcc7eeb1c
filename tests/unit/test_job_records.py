"""A job record carries the whole job state, the rebuild in flight included, so a new leader finishes it."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import random
import typing

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from deadpool_protocol import (
    Failure,
    FailureReason,
    Incident,
    Placement,
    ProtocolError,
    Rebuild,
    RebuildAck,
    RebuildDelta,
    Reserve,
    RestoreSource,
    StoreAddress,
    decode,
    encode,
)
from deadpool_protocol.bounds import EVIDENCE_ENTRIES_MAX
from deadpool_protocol.codec import to_fields
from deadpool_protocol.job_record import (
    PART_SEPARATOR,
    RECORD_BYTES_MAX,
    decode_stored,
    encode_stored,
    join_parts,
    join_sections,
    pack_head,
    part_key,
    section_parts,
    section_value,
    sections_of,
    split_record,
    unpack_record,
)
from deadpool_protocol.placement_delta import placement_delta_of
from deadpool_protocol.rebuild_delta import delta_of, notice_of
from deadpool_swapper import job_parts, section_memo
from deadpool_swapper.core import JobState
from deadpool_swapper.job_parts import Membership, PendingRebuild, Recovery, StorePlacement
from deadpool_swapper.job_records import (
    KV_WRITES_IN_FLIGHT_MAX,
    JobRecords,
    _bounded,
    state_fields,
    state_from_record,
    state_to_record,
)
from deadpool_swapper.placement import MemberInfo
from deadpool_swapper.restore_chain import CommittedCopies
from deadpool_swapper.section_memo import FIELDS_KEPT, SectionMemo
from tests.unit.test_swapper_core import ack, fail, first_steps, formed_core, published


def test_a_record_holds_the_rebuild_in_flight_with_its_acks_and_the_open_incidents() -> None:
    core, _ = formed_core(spares=("s1", "s2"))
    (rebuild,) = published(fail(core, Failure("j", 1, "r1", 1, FailureReason.EXIT, {}, 5.0, 5.0), 5.0), Rebuild)
    core.on_ack(ack(rebuild, "r0", 5.5), 5.5)
    state = core.jobs["j"]
    state.position.applied_seq, state.position.stream_id = 42, "2026-12-01T00:00:00+00:00"
    loaded = state_from_record(state_to_record(state, 5.5), 5.5)
    assert loaded.recovery.pending is not None and loaded.recovery.pending.command == rebuild
    assert set(loaded.recovery.pending.acks) == {"r0"} and loaded.recovery.pending.rank_members == frozenset(
        rebuild.ranks
    )
    assert [i.member for i in loaded.incident_log.open_incidents] == ["r1"]
    assert (loaded.generation, loaded.recovery.void_generation, loaded.recovery.attempts, loaded.recovery.formed) == (
        2,
        1,
        1,
        True,
    )
    assert (loaded.position.applied_seq, loaded.position.stream_id) == (42, state.position.stream_id)
    assert loaded.membership.members.keys() == state.membership.members.keys() and loaded.membership.failed == ["r1"]
    summary, _ = unpack_record(state_to_record(state, 5.5))
    assert summary.ranks == rebuild.ranks and summary.failed == ["r1"] and summary.hosts["r0"] == "h0"


def test_a_new_leader_completes_the_loaded_rebuild_when_the_last_ack_arrives() -> None:
    core, _ = formed_core(spares=("s1",))
    (rebuild,) = published(fail(core, Failure("j", 1, "r1", 1, FailureReason.EXIT, {}, 5.0, 5.0), 5.0), Rebuild)
    core.on_ack(ack(rebuild, "r0", 5.5), 5.5)
    record = state_to_record(core.jobs["j"], 5.5)
    successor, _ = formed_core()
    successor.jobs["j"] = state_from_record(record, 5.5)
    (again,) = published(successor.tick(6.6), Rebuild)  # retransmitted at once: it is pending
    assert again == rebuild
    decision = successor.on_ack(ack(rebuild, "s1", 6.7, source=RestoreSource.STORE), 6.7)
    assert "recovered" in decision.reason and successor.jobs["j"].recovery.pending is None


def test_a_new_leader_sends_the_loaded_rebuilds_delta_and_a_record_from_before_a_notice() -> None:
    """A member that missed the rebuild holds the generation before: the new leader's retransmission
    carries the delta it needs, not a notice (which sends every member to the whole subject, 937 kB
    each at 16,384 ranks, a retransmission later). A record that holds no delta (one from before) gives
    a notice; one whose delta is not the command's is unreadable, as any malformed entry is."""
    core, _ = formed_core(spares=("s1",))
    decision = fail(core, Failure("j", 1, "r1", 1, FailureReason.EXIT, {}, 5.0, 5.0), 5.0)
    ((rebuild,), (delta,)) = published(decision, Rebuild), published(decision, RebuildDelta)
    assert delta.base_generation == 1 and delta.movers == ["s1"]
    raw = msgpack.unpackb(state_to_record(core.jobs["j"], 5.5), raw=False)

    def retransmitted(record: dict[str, typing.Any]) -> list[RebuildDelta]:
        successor, _ = formed_core()
        successor.jobs["j"] = state_from_record(msgpack.packb(record, use_bin_type=True), 5.5)
        sent = successor.tick(6.6)
        assert published(sent, Rebuild) == [rebuild]
        return published(sent, RebuildDelta)

    assert retransmitted(raw) == [delta]
    assert retransmitted(raw | {"swapper": raw["swapper"] | {"pending_delta": None}}) == [notice_of(rebuild)]
    for wrong in ({"generation": 3}, {"job": "k"}, {"moved": [5], "movers": ["s1"]}):
        bad = raw | {"swapper": raw["swapper"] | {"pending_delta": raw["swapper"]["pending_delta"] | wrong}}
        with pytest.raises((ProtocolError, ValueError)):
            state_from_record(msgpack.packb(bad, use_bin_type=True), 5.5)


def test_a_record_that_is_not_ours_is_refused_with_a_reason() -> None:
    with pytest.raises(ProtocolError, match="version"):
        unpack_record(msgpack.packb({"v": 99}))
    with pytest.raises(ProtocolError, match="not msgpack"):
        unpack_record(b"\xc1garbage")
    bad = msgpack.packb(
        {
            "v": 1,
            "summary": {
                "job": "j",
                "world_size": 2,
                "generation": 1,
                "ranks": ["a b", "c"],
                "spares": [],
                "hosts": {},
                "failed": [],
                "committed_step": 0,
                "finished": False,
            },
        }
    )
    with pytest.raises(ProtocolError, match="not a valid name"):
        unpack_record(bad)


def test_a_record_written_before_a_field_existed_is_read_with_its_default() -> None:
    """A swapper upgraded while a job runs must read the record its predecessor wrote (an unreadable
    record once made the job look new to a restarted swapper, which would have started it over)."""
    core, _ = formed_core()
    raw = msgpack.unpackb(state_to_record(core.jobs["j"], 2.0), raw=False)
    for key in ("formed", "attempts", "void_generation", "applied_seq", "stream_id", "silent_hosts", "hold_left_s"):
        del raw["swapper"][key]
    loaded = state_from_record(msgpack.packb(raw, use_bin_type=True), 2.0)
    assert (
        loaded.recovery.formed
        and loaded.recovery.attempts == 0
        and loaded.position.applied_seq == 0
        and loaded.generation == 1
    )


def test_a_record_saved_before_the_reports_lane_reads_them_from_where_it_read_everything() -> None:
    """A record from before the reports' lane has one position: both lanes start after it (a default
    of 0 would replay every store report of the stream into the job)."""
    core, _ = formed_core()
    state = core.jobs["j"]
    state.position.applied_seq, state.position.reported_seq = 42, 44
    raw = msgpack.unpackb(state_to_record(state, 2.0), raw=False)
    assert state_from_record(msgpack.packb(raw, use_bin_type=True), 2.0).position.reported_seq == 44
    del raw["swapper"]["reported_seq"]
    loaded = state_from_record(msgpack.packb(raw, use_bin_type=True), 2.0)
    assert (loaded.position.applied_seq, loaded.position.reported_seq) == (42, 42)


def test_a_record_carries_its_timers_as_ages_so_a_loader_on_another_clock_keeps_them() -> None:
    """A new leader ran 10 min behind the old one and rebuilt 601 s after the failure: the record held
    the old leader's wall-clock instants. Now it holds ages, read on the loader's own clock."""
    core, _ = formed_core(spares=("s1",))
    core.on_failure(Failure("j", 1, "r1", 1, FailureReason.EXIT, {}, 5.0, 5.0), 5.0)  # the last call holds the rebuild
    state = core.jobs["j"]
    hold_left_s = state.recovery.hold_until - 5.0
    assert hold_left_s > 0
    for loader_now in (5.0 - 600.0, 5.0 + 600.0, 1e6):  # another host's monotonic clock, behind or ahead
        loaded = state_from_record(state_to_record(state, 5.0), loader_now)
        assert loaded.recovery.hold_until == pytest.approx(loader_now + hold_left_s)
        assert loaded.membership.members["r0"].registered_at <= loader_now
    successor, _ = formed_core()
    successor.jobs["j"] = state_from_record(state_to_record(state, 5.0), 1e6)
    assert published(successor.tick(1e6 + hold_left_s), Rebuild)  # rebuilt when the last call ends, not later


def test_a_large_record_is_stored_compressed_in_parts_and_read_back_whole() -> None:
    record = random.Random(1).randbytes(100_000)  # does not compress
    stored = encode_stored(record, 16 * 1024, "abc123")
    assert stored.parts and all(len(p) <= 16 * 1024 for p in stored.parts)
    inline, tag, count = decode_stored(stored.head)
    assert inline is None and (tag, count) == ("abc123", len(stored.parts))
    assert join_parts(stored.head, stored.parts) == record
    small = encode_stored(b"x" * 100, 16 * 1024, "abc124")
    assert small.parts == [] and decode_stored(small.head)[0] == b"x" * 100


def test_parts_of_another_record_or_a_record_too_large_are_refused_with_a_reason() -> None:
    first = encode_stored(bytes(range(256)) * 512, 1024, "aaa")
    second = encode_stored(bytes(reversed(range(256))) * 512, 1024, "bbb")
    with pytest.raises(ProtocolError, match="do not match"):
        join_parts(first.head, second.parts)
    with pytest.raises(ProtocolError, match="exceeds"):
        encode_stored(b"\0" * (RECORD_BYTES_MAX + 1), 1024 * 1024, "ccc")


def test_a_sectioned_record_reads_back_whole_and_a_hostile_head_or_a_swapped_section_is_refused() -> None:
    core, _ = formed_core(spares=("s1", "s2"))
    state = core.jobs["j"]
    state.stores.placement = [[f"store-{r % 7}-" + "x" * 40, f"store-{(r + 1) % 7}"] for r in range(200)]
    inline, sections = split_record(*state_fields(state, 5.0))
    assert [s.field for s in sections] == ["placement"] and "committed_step" in inline["summary"]
    parts = {s.digest: section_parts(s, 1024) for s in sections}
    head = pack_head(inline, [(s.group, s.field, s.digest, len(parts[s.digest])) for s in sections])
    fields, refs = sections_of(head) or ({}, [])
    values = [(group, field, section_value(digest, parts[digest])) for group, field, digest, _ in refs]
    assert state_from_record(join_sections(fields, values), 5.0).stores.placement == state.stores.placement
    other = split_record(
        *state_fields(dataclasses.replace(state, stores=StorePlacement(placement=state.stores.placement[::-1])), 5.0)
    )[1][0]
    with pytest.raises(ProtocolError, match="does not match its digest"):
        section_value(sections[0].digest, section_parts(other, 1024))
    for body in (
        {"v": 3, "inline": {"summary": {}}, "sections": []},  # a group missing
        {"v": 3, "inline": {"summary": {}, "swapper": {}}, "sections": [["summary", "ranks", "../etc", 1]]},
        {"v": 3, "inline": {"summary": {}, "swapper": {}}, "sections": [["summary", "ranks", "a" * 32, 10_000]]},
        {"v": 3, "inline": {"summary": {}, "swapper": {}}, "sections": [["other", "ranks", "a" * 32, 1]]},
    ):
        with pytest.raises(ProtocolError):
            sections_of(msgpack.packb(body))
    assert sections_of(encode_stored(b"x" * 100, 1024, "abc").head) is None  # an earlier form: read as before


def test_a_verdict_with_evidence_at_its_bound_leaves_a_record_that_loads_and_incidents_that_decode() -> None:
    """A detector may send evidence at its bound; the swapper adds its own entries (the typed facts,
    the restore link and reason) to the incident: neither the record nor the incident may outgrow it."""
    core, _ = formed_core()
    evidence = {f"k{i:02d}": "x" for i in range(EVIDENCE_ENTRIES_MAX)}
    failure = Failure("j", 1, "r1", 1, FailureReason.ERROR, evidence, 5.0, 5.0, lost_host="h1", lost_host_members=1)
    (rebuild,) = published(fail(core, failure, 5.0), Rebuild)
    for member in rebuild.ranks:
        core.on_ack(ack(rebuild, member, 5.5), 5.5)
    decision = first_steps(core, rebuild, 6.0)
    (incident,) = published(decision, Incident)
    assert decode(encode(incident), Incident) == incident  # within every bound
    assert len(incident.evidence) <= EVIDENCE_ENTRIES_MAX and incident.evidence["host"] == "h1"
    assert incident.evidence["restore_link"] == "committed" and "k00" in incident.evidence  # the first kept
    loaded = state_from_record(state_to_record(core.jobs["j"], 6.0), 6.0)
    assert [i.incident_id for i in loaded.incident_log.incidents] == [incident.incident_id]


RETRANSMIT_TIMERS = frozenset({"void_sent_t", "placement_sent_t", "replicate_sent_t"})
"""Not in the record: a new leader retransmits what is outstanding at once (each is idempotent)."""
HINTS = frozenset({"reserving"})
"""Not in the record: what a new leader does not send again (a store faults a rank's buffers in at its
first upload there anyway)."""
INSTANTS = frozenset({"finished_t", "last_hello_t", "hold_until", "awaiting_since", "unprotected_since", "held_since"})
"""The swapper's own monotonic instants: they travel as ages (or time left) and come back on the
loader's clock."""
DERIVED = frozenset({"commit_progress"})
"""Not in the record: made again from the fields that are (`completes`, the placement, the stores)."""


def every_field_set(saved_at: float) -> JobState:
    """A job state whose every field differs from its default: a rebuild in flight with an ack and an
    open incident (from the core itself), and every other field given a value by hand."""
    core, _ = formed_core(spares=("s1", "s2"))
    (rebuild,) = published(fail(core, Failure("j", 1, "r1", 1, FailureReason.EXIT, {}, 5.0, 5.0), 5.0), Rebuild)
    core.on_ack(ack(rebuild, "r0", 5.5), 5.5)
    state = core.jobs["j"]
    state.run, state.base_generation = "run-2", 3
    state.finished, state.finished_t, state.failed_reason = True, saved_at - 10.0, "a reason"
    who = state.membership
    who.world_size, who.done, who.last_hello_t = 2, {"r0": 40}, saved_at - 2.0
    recovery = state.recovery
    recovery.hold_until, recovery.silent_hosts, recovery.void_sent_t = saved_at + 30.0, {"h3": (2, 5)}, saved_at - 1.0
    ledger = state.ledger
    ledger.committed_step, ledger.restore_step, ledger.committed_generation = 40, 39, 2
    ledger.completes = {41: {0: {"store0", "store1"}, 1: {"store0", "store1"}}, 42: {0: {"store0"}}}
    ledger.committed_holders, ledger.rank_bytes = {0: {"store0"}, 1: {"store1"}}, {0: 1000, 1: 2000}
    ledger.previous_committed, ledger.replicate_sent_t = CommittedCopies(35, 1, {0: {"store1"}}), saved_at - 1.0
    restores = state.restores
    restores.unavailable, restores.durable_failed, restores.local_failed = {(1, 41)}, True, True
    restores.durable_completes = {0: {"store0"}}
    stores = state.stores
    stores.placement_version, stores.placement_confirmed, stores.placement_sent_t = 3, False, saved_at - 1.0
    stores.announced_stores = {"store0": ("10.0.0.5", 7001)}
    stores.reserving = [Reserve("j", 2, "store1", [0], [1000])]
    newest = Placement("j", 2, 3, [StoreAddress("store0", "10.0.0.5", 7001)], [["store0"]], "store lost: store2")
    stores.delta = placement_delta_of(newest, 2, [["store2"]])
    log = state.incident_log
    log.incidents = [
        Incident(
            job="j",
            generation=2,
            incident_id="i-1",
            rank=0,
            member="r9",
            replacement="s0",
            reason="exit",
            t_fault=1.0,
            t_detected=2.0,
            t_decided=3.0,
            t_resumed=4.0,
            restore_step=39,
            lost_steps=1,
            phases={"detect": 1.0},
            evidence={"a": "b"},
            t_first_step=5.0,
        )
    ]
    log.incident_seq, log.awaiting_first_step, log.awaiting_since = 7, ["s1"], saved_at - 4.0
    log.first_step_ranks, log.first_step_t = {0, 2, 3}, 1234.5
    protection = state.protection
    protection.unprotected_since, protection.unprotected_step = saved_at - 6.0, 38
    protection.hold_without_stores_s, protection.held_since = 9.0, saved_at - 8.0
    state.position.applied_seq, state.position.stream_id = 42, "2026-12-01T00:00:00+00:00"
    state.position.reported_seq = 44  # the reports' lane, ahead
    return state


def leaves(state: object, prefix: str = "") -> dict[str, typing.Any]:
    """Every field of `state`, a part's (a field that writes its own record entries) by its path:
    'ledger.completes'."""
    found: dict[str, typing.Any] = {}
    for f in dataclasses.fields(state):  # type: ignore[arg-type]
        value = getattr(state, f.name)
        if hasattr(value, "to_record"):
            found |= leaves(value, f"{prefix}{f.name}.")
        else:
            found[prefix + f.name] = value
    return found


def test_every_field_of_a_job_state_survives_its_record_field_by_field() -> None:
    """What a new leader loads is what its predecessor held, for every field of `JobState` there is,
    so a field added without its place in the record fails here (the fixture must give it a value
    first). Instants come back shifted to the loader's clock; retransmission timers start afresh."""
    saved_at, loaded_at = 100.0, 5000.0
    shift = loaded_at - saved_at
    state, default = every_field_set(saved_at), JobState("j")
    want, defaults = leaves(state), leaves(default)
    parts = [
        getattr(state, f.name) for f in dataclasses.fields(JobState) if hasattr(getattr(state, f.name), "to_record")
    ]
    assert [id(p) for p in parts] == [id(p) for p in state.parts()]  # every part writes its entries
    unset = [n for n in want if n.split(".")[-1] not in {"job", *DERIVED} and want[n] == defaults[n]]
    assert not unset, f"give these fields a value in every_field_set: {unset}"
    loaded = state_from_record(state_to_record(state, saved_at), loaded_at)
    got_all = leaves(loaded)
    assert got_all.keys() == want.keys()
    for path, got in got_all.items():
        name, was = path.split(".")[-1], want[path]
        if name in RETRANSMIT_TIMERS | HINTS:
            assert got == defaults[path], path
        elif name in INSTANTS:
            assert got == was + shift, path
        elif name == "members":
            moved = {
                m: dataclasses.replace(i, registered_at=pytest.approx(i.registered_at + shift)) for m, i in was.items()
            }
            assert got == moved, path
        elif name in DERIVED:
            live = frozenset({"store0", "store1"})
            steps = [
                x.ledger.commit_progress.complete_steps(x.ledger.completes, live, x.stores.placement, 2)
                for x in (state, loaded)
            ]
            assert steps[0] == steps[1] == [41], path
        elif name == "pending":
            assert got is not None and was is not None
            assert (got.command, got.acks, got.t_sent) == (was.command, was.acks, was.t_sent + shift)
            assert got.delta == was.delta and was.delta is not None and was.delta.base_generation == 1
        else:
            assert got == was, path


def large_state(ranks: int = 400) -> JobState:
    """A job whose membership, placement, holders and sizes are each large enough to be a section."""
    state = JobState("big", generation=3, membership=Membership(world_size=ranks), recovery=Recovery(formed=True))
    state.membership.members = {
        f"m{i}": MemberInfo(f"m{i}", f"host-{i // 8}", 100 + i, f"l-{i // 8}", i, f"host-{i // 8}", 29500, float(i))
        for i in range(ranks + 4)
    }
    state.membership.ranks = [f"m{i}" for i in range(ranks)]
    state.membership.spares = [f"m{i}" for i in range(ranks, ranks + 4)]
    state.stores.placement = [[f"store-{r % 5}", f"store-{(r + 1) % 5}"] for r in range(ranks)]
    state.ledger.committed_holders = {r: set(p) for r, p in enumerate(state.stores.placement)}
    state.ledger.previous_committed = CommittedCopies(1, 3, {r: set(p) for r, p in enumerate(state.stores.placement)})
    state.ledger.rank_bytes = dict.fromkeys(range(ranks), 1 << 30)
    moved = [list(stores) for stores in state.stores.placement]  # the rebuild moves every rank's copies:
    for stores in moved:  # its placement is its own (a section), its ranks the job's (named, not held),
        stores.reverse()  # and its delta from generation 2 names every rank (a section too)
    command = dataclasses.replace(rebuild_of(state, generation=3), placement=moved)
    delta = delta_of(command, 2, 0, state.membership.ranks, state.stores.placement)
    state.recovery.pending = PendingRebuild(command, 4.0, delta=delta)
    for member in command.ranks[:300]:  # and 300 of its acks in
        state.recovery.pending.acks[member] = big_ack(command, member, 4.5)
    unsent = Placement("big", 3, 1, command.stores, moved, "stores lost")  # and a placement not confirmed
    state.stores.placement_confirmed = False
    state.stores.delta = placement_delta_of(unsent, 0, state.stores.placement)
    return state


def big_ack(command: Rebuild, member: str, t: float) -> RebuildAck:
    return dataclasses.replace(ack(command, member, t), job="big")


def rebuild_of(state: JobState, generation: int) -> Rebuild:
    stores = [StoreAddress(f"store-{i}", "127.0.0.1", 7000 + i) for i in range(10)]
    return Rebuild(
        "big",
        generation,
        len(state.membership.ranks),
        state.membership.ranks,
        state.membership.spares,
        "m0",
        "h",
        1,
        1,
        stores,
        state.stores.placement,
        "",
        4.0,
    )


def hand_over(state: JobState, rank: int, spare: str) -> None:
    state.membership.spares.remove(spare)
    state.membership.ranks[rank] = spare


def acked(state: JobState, member: str, t: float) -> None:
    pending = state.recovery.pending
    assert pending is not None
    pending.acks[member] = big_ack(pending.command, member, t)


CHANGES_IN_PLACE: dict[str, typing.Callable[[JobState], object]] = {
    "a member joins": lambda s: s.membership.members.__setitem__(
        "new", MemberInfo("new", "h", 1, "l", -1, "h", 1, 0.5)
    ),
    "a member's info is replaced": lambda s: s.membership.members.__setitem__(
        "m3", dataclasses.replace(s.membership.members["m3"], pid=7)
    ),
    "a member leaves": lambda s: s.membership.members.pop("m5"),
    "the oldest member leaves (every row's instant moves)": lambda s: s.membership.members.pop("m0"),
    "a rank changes hands": lambda s: hand_over(s, 2, "m401"),
    "a rank's stores change": lambda s: s.stores.placement[7].__setitem__(1, "store-9"),
    "a holder is added": lambda s: s.ledger.committed_holders[3].add("store-8"),
    "a previous holder goes": lambda s: s.ledger.previous_committed.holders[4].discard("store-4"),
    "a size changes": lambda s: s.ledger.rank_bytes.__setitem__(9, 5),
    "another rebuild goes out": lambda s: setattr(s.recovery, "pending", PendingRebuild(rebuild_of(s, 4), 5.0)),
    "an ack comes in": lambda s: acked(s, "m350", 5.0),
    "an ack comes again, later": lambda s: acked(s, "m120", 5.0),
    "nothing changes": lambda s: None,
}


def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of a few members and ranks, so that a job of 400 has dozens of each (none cut at its
    longest: where a name cuts is this process's, and a cut by length moves when a member leaves)."""
    monkeypatch.setattr(section_memo, "MEMBER_CHUNK_MEAN", 8)
    monkeypatch.setattr(section_memo, "CHUNK_ITEMS_MAX", 10_000)
    monkeypatch.setattr(section_memo, "RANK_CHUNK_ITEMS", 16)
    monkeypatch.setattr(section_memo, "ACK_CHUNK_ITEMS", 16)


@pytest.mark.parametrize("chunks", ["as shipped", "small"])
@pytest.mark.parametrize("change", CHANGES_IN_PLACE)
def test_a_save_that_remembers_its_large_fields_writes_what_a_fresh_one_does_after_any_change_in_place(
    change: str, chunks: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if chunks == "small":
        small_chunks(monkeypatch)
    records = JobRecords(typing.cast(typing.Any, None), None)
    state, memo = large_state(), SectionMemo()
    first = records._encode("big", state, 5.0, {}, memo)
    remembered = FIELDS_KEPT - {"ranks"}  # 400 ranks' names fit in the head
    assert remembered <= {s.field for s in split_record(*state_fields(state, 5.0))[1]}, "the case: all sections"
    CHANGES_IN_PLACE[change](state)
    again = records._encode("big", state, 5.0, first.sections, memo)
    fresh = records._encode("big", state, 5.0, first.sections, SectionMemo())
    assert again.head == fresh.head and again.parts == fresh.parts
    assert (again.head == first.head) is (change == "nothing changes")
    assert_loads_as(again, first.parts | again.parts, state)


def assert_loads_as(encoded: typing.Any, parts: dict[str, bytes], state: JobState) -> None:
    """The record `encoded` names, read from `parts` as a reader would, holds `state`'s membership,
    ranks and placement (each field joined from its chunks)."""
    fields, refs = sections_of(encoded.head) or ({}, [])
    values = [
        (group, field, section_value(digest, [parts[part_key("big", digest, i)] for i in range(count)]))
        for group, field, digest, count in refs
    ]
    loaded = state_from_record(join_sections(fields, values), 5.0)
    assert list(loaded.membership.members.items()) == list(state.membership.members.items())
    assert loaded.membership.ranks == state.membership.ranks and loaded.stores.placement == state.stores.placement
    pending, loaded_pending = state.recovery.pending, loaded.recovery.pending
    assert (pending and list(pending.acks.items())) == (loaded_pending and list(loaded_pending.acks.items()))


@given(
    names=st.lists(st.text("abcdefgh0123456789-", min_size=1, max_size=12), unique=True, max_size=200),
    longest=st.integers(1, 40),
)
def test_members_are_cut_in_order_after_a_cut_name_or_at_the_longest_chunk(names: list[str], longest: int) -> None:
    members = {n: MemberInfo(n, "h", 1, "l", -1, "h", 1, 0.0) for n in names}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(section_memo, "MEMBER_CHUNK_MEAN", 4)
        patch.setattr(section_memo, "CHUNK_ITEMS_MAX", longest)
        chunks = section_memo.member_chunks(members)
    assert [info.member for _, items in chunks for info in items] == names
    assert all(key == items[0].member and 0 < len(items) <= longest for key, items in chunks)
    for _, items in chunks[:-1]:
        assert len(items) == longest or hash(items[-1].member) & 3 == 0
    assert all(hash(info.member) & 3 for _, items in chunks for info in items[:-1])


def test_a_save_while_a_job_forms_or_after_a_swap_writes_one_chunk_of_each_field_that_changed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A member that registers changes the members' last chunk; a swap changes the chunk of the
    member that failed, and the placement's chunk where its rank is: each save writes those and the
    head, never the membership of the whole job."""
    small_chunks(monkeypatch)
    records = JobRecords(typing.cast(typing.Any, None), None)
    state, memo = large_state(), SectionMemo()
    first = records._encode("big", state, 5.0, {}, memo)
    stored, parts = dict(first.sections), dict(first.parts)
    refs = sections_of(first.head)[1]  # type: ignore[index]
    chunked = ("hosts", "member_rows", "placement")  # 400 ranks' names fit in the head
    assert all(sum(1 for _, f, _, _ in refs if f == field) > 10 for field in chunked), "the case: chunks of each"

    def written(encoded: typing.Any) -> list[str]:
        stored.update(encoded.sections)
        parts.update(encoded.parts)
        refs = sections_of(encoded.head)[1]  # type: ignore[index]
        new = {key.split(PART_SEPARATOR)[1].split(".")[0] for key in encoded.parts}
        return sorted(field for _, field, digest, _ in refs if digest in new)

    for i in range(20):  # members register, one save each
        info = MemberInfo(f"late-{i}", "host-late", 1, "l", -1, "host-late", 1, 500.0 + i)
        state.membership.members[info.member] = info
        again = records._encode("big", state, 5.0, stored, memo)
        assert written(again) == ["hosts", "member_rows"]
        assert_loads_as(again, parts, state)
    who = state.membership
    for rank in (3, 150, 399):  # swaps: a spare takes the rank, its stores change
        gone = who.ranks[rank]
        # a member alone in its chunk takes the chunk with it: nothing of the members is new (where the
        # cuts fall is this process's hash of the names: one run in some 30 draws such a member)
        alone = [gone] in ([info.member for info in items] for _, items in section_memo.member_chunks(who.members))
        del who.members[gone]
        who.ranks[rank] = who.spares.pop(0)
        state.stores.placement[rank] = state.stores.placement[rank][::-1]
        again = records._encode("big", state, 5.0, stored, memo)
        # the rebuild in flight's command is whole (here it shares the placement: a swap sends a new one)
        members = [] if alone else ["hosts", "member_rows"]
        assert written(again) == sorted([*members, "pending_command", "placement"])
        assert_loads_as(again, parts, state)
    pending = state.recovery.pending
    assert pending is not None
    converted: list[RebuildAck] = []

    def counted(message: typing.Any) -> typing.Any:
        converted.extend([message] if isinstance(message, RebuildAck) else [])
        return to_fields(message)

    for module in (section_memo, job_parts):
        monkeypatch.setattr(module, "to_fields", counted)
    for rank in range(300, 310):  # acks come in: the newest chunk of them is built, nothing else
        acked(state, pending.command.ranks[rank], 6.0)
        converted.clear()
        again = records._encode("big", state, 5.0, stored, memo)
        assert written(again) == ["pending_acks"]
        assert 0 < len(converted) <= 2 * section_memo.ACK_CHUNK_ITEMS < len(pending.acks) / 8  # not every ack
        assert_loads_as(again, parts, state)


async def test_a_save_writes_its_parts_a_group_at_a_time_and_stops_at_the_first_group_that_fails() -> None:
    """A save's parts go out together, at most `KV_WRITES_IN_FLIGHT_MAX` at once; after a group with a
    failed write none of the later groups starts (and none is left unawaited)."""
    running, most, done = [0], [0], []

    async def write(i: int) -> None:
        running[0] += 1
        most[0] = max(most[0], running[0])
        await asyncio.sleep(0)
        running[0] -= 1
        if i == KV_WRITES_IN_FLIGHT_MAX + 1:
            raise TimeoutError(f"write {i}")
        done.append(i)

    writes = [write(i) for i in range(3 * KV_WRITES_IN_FLIGHT_MAX)]
    with pytest.raises(TimeoutError, match=f"write {KV_WRITES_IN_FLIGHT_MAX + 1}"):
        await _bounded(writes)
    assert all(inspect.getcoroutinestate(w) == inspect.CORO_CLOSED for w in writes)  # run, or closed unstarted
    assert most[0] == KV_WRITES_IN_FLIGHT_MAX
    assert sorted(done) == [i for i in range(2 * KV_WRITES_IN_FLIGHT_MAX) if i != KV_WRITES_IN_FLIGHT_MAX + 1]


def test_a_rebuild_command_names_the_jobs_ranks_while_it_shares_them_and_holds_its_own_once_they_differ() -> None:
    """The command in flight is saved less the lists it shares with the job (the record holds those
    already); once the job's ranks move on and the command's do not, the next save holds the
    command's own, and a reader gets each back as it was."""
    records = JobRecords(typing.cast(typing.Any, None), None)
    state, memo = large_state(), SectionMemo()
    pending = state.recovery.pending
    assert pending is not None
    command = dataclasses.replace(  # lists of its own: its ranks equal the job's, not the same list
        pending.command, ranks=list(state.membership.ranks), spares=list(state.membership.spares)
    )
    state.recovery.pending = PendingRebuild(command, 4.0)
    first = records._encode("big", state, 5.0, {}, memo)
    assert (sections_of(first.head) or ({}, []))[0]["swapper"]["pending_command_shares"] == ["ranks"]
    hand_over(state, 5, "m401")  # the job moves on; the command in flight does not
    again = records._encode("big", state, 5.0, first.sections, memo)
    assert (sections_of(again.head) or ({}, []))[0]["swapper"]["pending_command_shares"] == []
    for encoded in (first, again):
        fields, refs = sections_of(encoded.head) or ({}, [])
        parts = first.parts | again.parts
        values = [
            (group, field, section_value(digest, [parts[part_key("big", digest, i)] for i in range(count)]))
            for group, field, digest, count in refs
        ]
        loaded = state_from_record(join_sections(fields, values), 5.0)
        assert loaded.recovery.pending is not None and loaded.recovery.pending.command == command
    assert loaded.membership.ranks == state.membership.ranks != command.ranks
