"""Messages in keyed parts: a command naming every rank of a job of 16,384 travels in frames of at most
256 KiB, is put together whatever the order and the repeats of its parts, and nothing malformed,
oversized or forged is held past its bounds or believed."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deadpool_protocol import NO_STEP, ProtocolError, Rebuild, StoreAddress
from deadpool_protocol.codec import decode, encode
from deadpool_protocol.message_parts import (
    ASSEMBLED_MESSAGE_BYTES_MAX,
    ASSEMBLY_S,
    MESSAGE_PART_BYTES_MAX,
    PART_PAYLOAD_BYTES_MAX,
    PARTS_MAX,
    PartAssembler,
    split_message,
)
from deadpool_protocol.names import content_digest

pytestmark = pytest.mark.unit


def rebuild_of(ranks: int, generation: int = 1) -> Rebuild:
    """A formation of `ranks` ranks on 32 stores, two per rank, with names as long as a real cluster's."""
    members = [f"node{r // 8:05d}-cluster-example-com-gpu{r % 8}-pid{100000 + r}" for r in range(ranks)]
    stores = [StoreAddress(f"store-{s:03d}", f"10.0.{s}.1", 7000) for s in range(32)]
    placement = [[stores[r % 32].store, stores[(r + 1) % 32].store] for r in range(ranks)]
    return Rebuild(
        "job", generation, ranks, members, [], members[0], "node00000", 29500, NO_STEP, stores, placement, "", 1.0
    )


def test_a_16384_rank_rebuild_goes_in_frames_of_at_most_256_kib_and_comes_back_whole() -> None:
    rebuild = rebuild_of(16384)
    data = encode(rebuild)
    assert len(data) > 3 * MESSAGE_PART_BYTES_MAX  # the case this exists for: about 1 MB in one frame
    frames = split_message(data)
    assert all(len(payload) <= PART_PAYLOAD_BYTES_MAX and len(header) < 64 for header, payload in frames)
    assembler = PartAssembler()
    wholes = [assembler.add(header, payload, 0.0) for header, payload in frames]
    assert wholes[:-1] == [None] * (len(frames) - 1)
    assert decode(wholes[-1] or b"", Rebuild, ASSEMBLED_MESSAGE_BYTES_MAX) == rebuild
    assert assembler.held_bytes == 0


def test_a_message_that_fits_one_frame_goes_as_it_is() -> None:
    data = encode(rebuild_of(64))
    assert split_message(data) == [("", data)]


@settings(max_examples=60, deadline=None)
@given(
    size=st.integers(min_value=1, max_value=5000),
    parts=st.integers(min_value=1, max_value=PARTS_MAX),
    seed=st.integers(),
)
def test_parts_in_any_order_and_any_repeats_make_the_message(size: int, parts: int, seed: int) -> None:
    rng = random.Random(seed)
    data = rng.randbytes(size)
    frames = split_message(data, -(-size // parts))
    if len(frames) == 1:
        assert frames == [("", data)]
        return
    sent = frames + [rng.choice(frames) for _ in range(rng.randrange(len(frames)))]
    rng.shuffle(sent)
    assembler = PartAssembler()
    wholes = [w for h, p in sent if (w := assembler.add(h, p, 0.0)) is not None]
    assert wholes and all(w == data for w in wholes)


def test_a_forged_part_is_refused_and_the_message_is_not_believed() -> None:
    data = encode(rebuild_of(16384))
    frames = split_message(data)
    header, payload = frames[1]
    forged = [frames[0], (header, payload[:-1] + bytes([payload[-1] ^ 1])), *frames[2:]]
    assembler = PartAssembler()
    with pytest.raises(ProtocolError, match="do not make the message"):
        for h, p in forged:
            assembler.add(h, p, 0.0)
    assert assembler.held_bytes == 0


@pytest.mark.parametrize(
    ("header", "why"),
    [
        ("", "malformed"),
        ("0/1/" + "a" * 32, "1 parts"),
        (f"0/{PARTS_MAX + 1}/" + "a" * 32, f"{PARTS_MAX + 1} parts"),
        ("3/3/" + "a" * 32, "part 3 of a message of 3"),
        ("0/2/" + "A" * 32, "malformed"),
        ("0/2/" + "a" * 31, "malformed"),
        ("-1/2/" + "a" * 32, "malformed"),
        ("0/2/" + "a" * 32 + "\n", "malformed"),
        ("1" * 10_000, "malformed"),
    ],
)
def test_a_malformed_part_header_is_refused_before_anything_is_held(header: str, why: str) -> None:
    assembler = PartAssembler()
    with pytest.raises(ProtocolError, match=why):
        assembler.add(header, b"x", 0.0)
    assert assembler.held_bytes == 0


def test_a_part_too_large_or_empty_is_refused() -> None:
    assembler = PartAssembler()
    with pytest.raises(ProtocolError, match="exceeds"):
        assembler.add("0/2/" + "a" * 32, b"x" * (PART_PAYLOAD_BYTES_MAX + 1), 0.0)
    with pytest.raises(ProtocolError, match="empty"):
        assembler.add("0/2/" + "a" * 32, b"", 0.0)
    assert assembler.held_bytes == 0


def test_a_part_that_disagrees_on_the_count_is_refused() -> None:
    assembler = PartAssembler()
    assembler.add("0/3/" + "a" * 32, b"x", 0.0)
    with pytest.raises(ProtocolError, match="says 4 parts"):
        assembler.add("1/4/" + "a" * 32, b"y", 0.0)


def test_a_message_past_its_bound_is_not_sent() -> None:
    with pytest.raises(ProtocolError, match="even in parts"):
        split_message(b"x" * (ASSEMBLED_MESSAGE_BYTES_MAX + 1))


def test_what_a_receiver_holds_is_bounded_in_messages_and_in_time() -> None:
    """A flood of first parts of different messages keeps the newest few, and parts left waiting go
    after `ASSEMBLY_S`: the memory held never grows with what was sent."""
    assembler = PartAssembler(assemblies_max=2)
    for i in range(100):
        assembler.add(f"0/2/{content_digest(bytes([i])):s}", b"z" * 1000, float(i) * 0.001)
    assert assembler.held_bytes == 2 * 1000
    data = b"a" * 10 + b"b" * 10
    frames = split_message(data, 10)
    assert assembler.add(*frames[0], 1.0) is None
    assert assembler.add(*frames[1], 1.0 + ASSEMBLY_S + 0.1) is None  # its first part was dropped meanwhile
    assert assembler.held_bytes == 10  # the late part waits alone: the flood's and the first part went
    assert assembler.add(*frames[0], 1.0 + ASSEMBLY_S + 0.2) == data  # the next sending completes it
