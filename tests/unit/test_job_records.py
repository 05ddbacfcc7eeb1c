"""A job record carries the whole job state, the rebuild in flight included, so a new leader finishes it."""

from __future__ import annotations

import msgpack
import pytest

from deadpool_protocol import Failure, ProtocolError, Rebuild
from deadpool_protocol.job_record import unpack_record
from deadpool_swapper.job_records import state_from_record, state_to_record
from tests.unit.test_swapper_core import ack, fail, formed_core, published


def test_a_record_holds_the_rebuild_in_flight_with_its_acks_and_the_open_incidents() -> None:
    core, _ = formed_core(spares=("s1", "s2"))
    (rebuild,) = published(fail(core, Failure("j", 1, "r1", 1, "exit", {}, 5.0, 5.0), 5.0), Rebuild)
    core.on_ack(ack(rebuild, "r0", 5.5), 5.5)
    state = core.jobs["j"]
    state.applied_seq, state.stream_id = 42, "2026-12-01T00:00:00+00:00"
    loaded = state_from_record(state_to_record(state))
    assert loaded.pending is not None and loaded.pending.command == rebuild
    assert set(loaded.pending.acks) == {"r0"} and loaded.pending.rank_members == frozenset(rebuild.ranks)
    assert [i.member for i in loaded.open_incidents] == ["r1"]
    assert (loaded.generation, loaded.void_generation, loaded.attempts, loaded.formed) == (2, 1, 1, True)
    assert (loaded.applied_seq, loaded.stream_id) == (42, state.stream_id)
    assert loaded.members.keys() == state.members.keys() and loaded.failed == ["r1"]
    summary, _ = unpack_record(state_to_record(state))
    assert summary.ranks == rebuild.ranks and summary.failed == ["r1"] and summary.hosts["r0"] == "h0"


def test_a_new_leader_completes_the_loaded_rebuild_when_the_last_ack_arrives() -> None:
    core, _ = formed_core(spares=("s1",))
    (rebuild,) = published(fail(core, Failure("j", 1, "r1", 1, "exit", {}, 5.0, 5.0), 5.0), Rebuild)
    core.on_ack(ack(rebuild, "r0", 5.5), 5.5)
    record = state_to_record(core.jobs["j"])
    successor, _ = formed_core()
    successor.jobs["j"] = state_from_record(record)
    (again,) = published(successor.tick(6.6), Rebuild)  # retransmitted at once: it is pending
    assert again == rebuild
    decision = successor.on_ack(ack(rebuild, "s1", 6.7, source="store"), 6.7)
    assert "recovered" in decision.reason and successor.jobs["j"].pending is None


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
    raw = msgpack.unpackb(state_to_record(core.jobs["j"]), raw=False)
    for key in ("formed", "attempts", "void_generation", "applied_seq", "stream_id", "silent_hosts"):
        del raw["swapper"][key]
    loaded = state_from_record(msgpack.packb(raw, use_bin_type=True))
    assert loaded.formed and loaded.attempts == 0 and loaded.applied_seq == 0 and loaded.generation == 1
