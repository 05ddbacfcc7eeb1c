"""A placement's delta, applied to the placement it goes from, is the placement; applied to any other,
it is refused; a store lost at 16,384 ranks is a delta a tenth of the whole; and it is a notice where
there is no base."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deadpool_protocol import Placement, PlacementDelta, ProtocolError, Rebuild, StoreAddress, decode, encode
from deadpool_protocol.placement_delta import placement_applied, placement_delta_of, placement_notice
from tests.unit.test_rebuild_delta import NAMES, STORES, command

pytestmark = pytest.mark.unit


def placement_of(held: Rebuild, version: int, placement: list[list[str]]) -> Placement:
    new = Placement(held.job, held.generation, version, list(STORES), placement, "stores lost: ['s3']")
    new.check()
    return new


@st.composite
def a_new_placement(draw: st.DrawFn) -> tuple[Rebuild, int, list[list[str]], Placement]:
    """A command, a placement version of it (its maps: what a member holds), and the next placement."""
    size = draw(st.integers(1, 40))
    stores = st.lists(st.sampled_from(NAMES), min_size=0, max_size=2, unique=True)
    held = command(3, [f"m{i}" for i in range(size)], draw(st.lists(stores, min_size=size, max_size=size)), [])
    version = draw(st.integers(0, 3))
    base = [list(p) for p in held.placement]
    for rank in draw(st.sets(st.integers(0, size - 1), max_size=3)) if version else ():
        base[rank] = draw(stores)
    new = list(base)  # kept ranks keep their lists
    for rank in draw(st.sets(st.integers(0, size - 1), max_size=size)):
        new[rank] = draw(stores)
    return held, version, base, placement_of(held, version + draw(st.integers(1, 2)), new)


@settings(max_examples=300, deadline=None)
@given(a_new_placement())
def test_a_delta_applied_to_the_placement_it_goes_from_is_the_placement_and_to_any_other_is_refused(
    case: tuple[Rebuild, int, list[list[str]], Placement],
) -> None:
    held, version, base, new = case
    delta = placement_delta_of(new, version, base)
    received = decode(encode(delta), PlacementDelta)  # checked on the way, as a member takes it
    assert received == delta
    assert received.replaced == [r for r in range(held.world_size) if new.placement[r] != base[r]]
    assert placement_applied(received, held, version, base) == new
    assert placement_applied(received, held, version + 1, base) is None, "a placement it did not hear"
    assert placement_applied(received, dataclasses.replace(held, generation=4), version, base) is None
    assert placement_applied(received, None, version, base) is None
    assert placement_applied(placement_notice(new), held, version, base) is None
    kept = [r for r in range(held.world_size) if r not in received.replaced and base[r]]
    if kept:
        other = [list(p) for p in base]
        other[kept[0]] = []
        assert placement_applied(received, held, version, other) is None, "the digest tells a base that differs"


def test_a_store_lost_at_16384_ranks_is_a_delta_of_a_tenth_of_the_whole_placement() -> None:
    """32 stores, two copies a rank: a store lost moves a sixteenth of the ranks' copies."""
    size, names = 16_384, [f"store-{i:02d}" for i in range(32)]
    stores = [StoreAddress(n, "10.0.0.1", 7000 + i) for i, n in enumerate(names)]
    placement = [[names[i % 32], names[(i + 1) % 32]] for i in range(size)]
    ranks = [f"m{i}" for i in range(size)]
    held = Rebuild("j", 5, size, ranks, [], "m0", "10.0.0.2", 4000, 7, stores, placement, "", 0.0)
    moved = [[n if n != "store-07" else names[(i + 9) % 32] for n in p] for i, p in enumerate(placement)]
    new = Placement("j", 5, 1, stores, moved, "stores lost: ['store-07']")
    delta = placement_delta_of(new, 0, placement)
    assert len(delta.replaced) == 2 * size // 32
    whole, small = len(encode(new)), len(encode(delta))
    assert small * 8 < whole and whole > 300_000, (small, whole)
    assert placement_applied(decode(encode(delta), PlacementDelta), held, 0, placement) == new


def test_a_placement_with_no_base_is_a_notice_and_every_store_lost_a_delta() -> None:
    held = command(2, ["m0", "m1"], [["s0"], ["s1"]], [])
    new = placement_of(held, 1, [["s2"], ["s1"]])
    assert placement_delta_of(new, 0, None) == placement_notice(new), "a leader that loaded it holds no base"
    assert placement_delta_of(new, 0, [["s0"]]) == placement_notice(new), "another world"
    assert placement_delta_of(new, 1, held.placement) == placement_notice(new), "a base that is not earlier"
    notice = placement_notice(new)
    assert (notice.digest, notice.replaced, notice.base_version) == ("", [], 0)
    size = 8_192
    every = command(3, [f"a{i}" for i in range(size)], [["s0", "s1"]] * size, [])
    none = placement_of(every, 1, [[] for _ in range(size)])
    lost = placement_delta_of(none, 0, every.placement)
    assert len(lost.replaced) == size and len(encode(lost)) < len(encode(none)) + 3 * size
    assert placement_applied(decode(encode(lost), PlacementDelta), every, 0, every.placement) == none


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"replaced": [1, 0], "replacements": [["s0"], ["s1"]]}, "in order"),
        ({"replaced": [2], "replacements": [["s0"]]}, "out of range"),
        ({"replaced": [0], "replacements": []}, "one placement per replaced rank"),
        ({"replaced": [0], "replacements": [["s9"]]}, "unknown store"),
        ({"replaced": [0], "replacements": [["s0", "s0"]]}, "a store twice"),
        ({"digest": ""}, "notice without a base"),
        ({"digest": "not-a-digest"}, "not a content digest"),
        ({"base_version": 1}, "earlier placement"),
        ({"world_size": 0}, "world_size"),
    ],
)
def test_a_malformed_delta_is_refused_saying_why(change: dict[str, object], why: str) -> None:
    held = command(1, ["m0", "m1"], [["s0"], ["s1"]], [])
    good = placement_delta_of(placement_of(held, 1, [["s0"], ["s2"]]), 0, held.placement)
    assert good.replaced == [1]
    with pytest.raises(ProtocolError, match=why):
        decode(encode(dataclasses.replace(good, **change)), PlacementDelta)  # type: ignore[arg-type]
