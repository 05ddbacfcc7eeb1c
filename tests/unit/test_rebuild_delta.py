"""A rebuild's delta, applied to the command it goes from, is the command; applied to any other, it is
refused; it is small where the whole is large; and it is a notice where it could not be smaller."""

from __future__ import annotations

import dataclasses
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deadpool_protocol import ProtocolError, Rebuild, RebuildDelta, StoreAddress, decode, encode
from deadpool_protocol.rebuild_delta import applied, delta_of, maps_digest, notice_of

pytestmark = pytest.mark.unit

STORES = [StoreAddress(f"s{i}", "10.0.0.1", 7000 + i) for i in range(4)]
NAMES = [s.store for s in STORES]


def command(generation: int, ranks: list[str], placement: list[list[str]], spares: list[str]) -> Rebuild:
    rebuild = Rebuild(
        "j", generation, len(ranks), ranks, spares, ranks[0], "10.0.0.2", 4000, 7, STORES, placement, "j-1", time.time()
    )
    rebuild.check()
    return rebuild


@st.composite
def a_swap(draw: st.DrawFn) -> tuple[Rebuild, int, list[list[str]], Rebuild]:
    """A command, a placement version of it, and the next command: some ranks to spares, some ranks'
    stores changed (each a new list, as the swapper's placement makes them)."""
    size = draw(st.integers(1, 40))
    members = [f"m{i}" for i in range(size + 8)]
    ranks, spares = members[:size], members[size:]
    stores = st.lists(st.sampled_from(NAMES), min_size=0, max_size=2, unique=True)
    placement = draw(st.lists(stores, min_size=size, max_size=size))
    base = command(3, ranks, placement, spares)
    version = draw(st.integers(0, 3))
    heard = [list(p) for p in placement]  # what a member holds: the rebuild's, or a placement's after it
    for rank in draw(st.sets(st.integers(0, size - 1), max_size=3)) if version else ():
        heard[rank] = draw(stores)
    new_ranks, new_spares = list(ranks), list(spares)
    for rank in sorted(draw(st.sets(st.integers(0, size - 1), max_size=min(size, len(spares))))):
        new_ranks[rank] = new_spares.pop(0)
    new_placement = list(heard)  # kept ranks keep their lists
    for rank in draw(st.sets(st.integers(0, size - 1), max_size=size)):
        new_placement[rank] = draw(stores)
    return (
        base,
        version,
        heard,
        command(base.generation + draw(st.integers(1, 2)), new_ranks, new_placement, new_spares),
    )


@settings(max_examples=300, deadline=None)
@given(a_swap())
def test_a_delta_applied_to_the_command_it_goes_from_is_the_command_and_to_any_other_is_refused(
    swap: tuple[Rebuild, int, list[list[str]], Rebuild],
) -> None:
    base, version, heard, new = swap
    delta = delta_of(new, base.generation, version, list(base.ranks), heard)
    received = decode(encode(delta), RebuildDelta)  # checked on the way, as a member takes it
    assert received == delta
    moved = [r for r in range(new.world_size) if new.ranks[r] != base.ranks[r]]
    assert received.moved == moved and received.movers == [new.ranks[r] for r in moved]
    assert received.replaced == [r for r in range(new.world_size) if new.placement[r] != heard[r]]
    assert applied(received, base, version, heard) == new
    assert applied(received, base, version + 1, heard) is None  # a placement it did not hear
    assert applied(received, dataclasses.replace(base, generation=base.generation - 1), version, heard) is None
    assert applied(notice_of(new), base, version, heard) is None
    kept = [r for r in range(new.world_size) if r not in received.replaced and heard[r]]
    if kept:
        other = [list(p) for p in heard]
        other[kept[0]] = []
        assert applied(received, base, version, other) is None, "the digest tells a base that differs"


def test_a_swap_of_one_rank_of_16384_is_a_delta_of_a_few_hundred_bytes() -> None:
    size = 16_384
    ranks = [f"vm-{i // 8:05d}-member-{i % 8}" for i in range(size)]
    placement = [[NAMES[i % 4], NAMES[(i + 1) % 4]] for i in range(size)]
    base = command(5, ranks, placement, ["spare-0", "spare-1"])
    new_ranks = list(ranks)
    new_ranks[100] = "spare-0"
    new = command(6, new_ranks, [*placement[:100], ["s2", "s3"], *placement[101:]], ["spare-1"])
    delta = delta_of(new, 5, 0, ranks, placement)
    assert (delta.moved, delta.replaced) == ([100], [100])
    assert len(encode(delta)) < 1_000 < 400_000 < len(encode(new))
    assert applied(decode(encode(delta), RebuildDelta), base, 0, placement) == new


def test_a_command_with_no_base_to_go_from_is_a_notice() -> None:
    base = command(2, ["m0", "m1"], [["s0"], ["s1"]], ["m2", "m3"])
    formation = delta_of(command(1, ["m0", "m1"], [["s0"], ["s1"]], []), 0, 0, [], [])
    assert (formation.base_generation, formation.digest, formation.moved) == (0, "", [])
    grown = command(3, ["m0", "m1", "m2"], [["s0"], ["s1"], ["s2"]], ["m3"])
    assert delta_of(grown, 2, 0, list(base.ranks), base.placement).base_generation == 0


def test_a_delta_goes_however_much_changed_at_about_the_size_of_the_whole() -> None:
    """Every rank to another member and store: still a delta (members no longer hear the whole
    subject, so a notice would send each of them to it, a retransmission later)."""
    size = 8_192
    many = command(4, [f"a{i}" for i in range(size)], [["s0"]] * size, [])
    every = command(5, [f"b{i}" for i in range(size)], [["s1"]] * size, [])
    delta = delta_of(every, 4, 0, list(many.ranks), many.placement)
    assert len(delta.moved) == len(delta.replaced) == size
    assert len(encode(delta)) < len(encode(every)) + 3 * 2 * size
    assert applied(decode(encode(delta), RebuildDelta), many, 0, many.placement) == every


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"moved": [1, 0], "movers": ["m0", "m1"]}, "in order"),
        ({"moved": [0, 0], "movers": ["m0", "m1"]}, "in order"),
        ({"moved": [2], "movers": ["m2"]}, "out of range"),
        ({"moved": [-1], "movers": ["m2"]}, "out of range"),
        ({"moved": [0], "movers": []}, "one member per moved rank"),
        ({"replaced": [0], "replacements": [["s9"]]}, "unknown store"),
        ({"moved": [0], "movers": ["m2"], "spares": ["m2"]}, "both rank and spare"),
        ({"base_generation": 0}, "notice without a base"),
        ({"base_generation": 2}, "earlier generation"),
        ({"digest": "not-a-digest"}, "not a content digest"),
    ],
)
def test_a_malformed_delta_is_refused_saying_why(change: dict[str, object], why: str) -> None:
    base = command(1, ["m0", "m1"], [["s0"], ["s1"]], ["m2"])
    good = delta_of(command(2, ["m0", "m1"], [["s0"], ["s2"]], ["m2"]), 1, 0, list(base.ranks), base.placement)
    with pytest.raises(ProtocolError, match=why):
        decode(encode(dataclasses.replace(good, **change)), RebuildDelta)  # type: ignore[arg-type]


def test_the_digest_tells_where_a_name_ends() -> None:
    assert maps_digest(["ab", "c"], [[]]) != maps_digest(["a", "bc"], [[]])
    assert maps_digest(["a"], [["s0", "s1"]]) != maps_digest(["a"], [["s0"], ["s1"]])
