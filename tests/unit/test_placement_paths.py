"""A rebuild's placement takes shortcuts at scale: a rank that keeps every store keeps its list, and a
placement where every rank does is the previous one, checked in C (16,384 ranks: 105 ms of a rebuild
decision became 20). Whatever the stores lost, added or filled, the shortcuts must give what the rules
give, rank by rank; tuples as the previous placement take the rules' own path, with no shortcut."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deadpool_protocol.names import first_invalid_name, is_valid_name
from deadpool_swapper.placement import MemberInfo, StoreInfo, pick_rendezvous, place_snapshots

CI = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])

STORE_NAMES = [f"s{i}" for i in range(6)]


@st.composite
def layouts(draw: st.DrawFn) -> tuple[list[str], dict[str, MemberInfo], list[StoreInfo], list[StoreInfo], int]:
    """Ranks on hosts, the stores of a first placement, the stores live at the next one, replication."""
    hosts = draw(st.lists(st.sampled_from("abcd"), min_size=1, max_size=24))
    members = {f"m{i}": MemberInfo(f"m{i}", h, 1, f"l-{h}", i, h, 1, float(i)) for i, h in enumerate(hosts)}

    def store(name: str) -> StoreInfo:
        node = draw(st.sampled_from("abcde"))
        capacity = draw(st.sampled_from([0, 100, 10_000]))
        return StoreInfo(name, "10.0.0.1", 5000, 0.0, draw(st.integers(0, 50)), capacity, node)

    first = [store(n) for n in draw(st.lists(st.sampled_from(STORE_NAMES), min_size=1, unique=True))]
    then = [store(n) for n in draw(st.lists(st.sampled_from(STORE_NAMES), min_size=1, unique=True))]
    return list(members), members, first, then, draw(st.integers(1, 3))


@CI
@given(layouts(), st.dictionaries(st.integers(0, 23), st.integers(1, 40)))
def test_the_shortcuts_place_every_rank_where_the_rules_do(
    layout: tuple[list[str], dict[str, MemberInfo], list[StoreInfo], list[StoreInfo], int], sizes: dict[int, int]
) -> None:
    ranks, members, first, then, replication = layout
    previous = place_snapshots(ranks, members, first, replication, sizes)
    swapped = [*ranks[1:], ranks[0]]  # a rebuild moves members; the kept stores stay with the rank
    fast = place_snapshots(swapped, members, then, replication, sizes, previous)
    by_rules = place_snapshots(swapped, members, then, replication, sizes, [tuple(p) for p in previous])
    assert fast == [list(p) for p in by_rules]
    for old, new in zip(previous, fast, strict=True):
        assert (new is old) == (new == old and len(new) == min(replication, len(then)))


def test_a_placement_that_keeps_every_store_is_the_previous_lists() -> None:
    members = {f"m{i}": MemberInfo(f"m{i}", "a", 1, "l", i, "a", 1, 0.0) for i in range(3)}
    stores = [StoreInfo(n, "10.0.0.1", 5000, 0.0, 0, 100, "z") for n in ("s0", "s1")]
    previous = place_snapshots(list(members), members, stores, 2)
    again = place_snapshots(["m1", "m0", "m2"], members, stores, 2, previous=previous)
    assert again == previous and again is not previous and all(a is b for a, b in zip(again, previous, strict=True))


def test_the_first_attempt_meets_at_the_lowest_survivor() -> None:
    assert pick_rendezvous(["new0", "m1", "m2"], {"new0"}) == "m1"
    assert pick_rendezvous(["new0", "new1"], {"new0", "new1"}) == "new0"  # nobody survived: the lowest rank


def test_a_name_ending_in_a_newline_is_not_a_name() -> None:
    """`$` matched before a trailing newline: such a launcher's name went into its fence subject."""
    assert not is_valid_name("launcher\n") and not is_valid_name("launcher\r\n") and is_valid_name("launcher")
    assert first_invalid_name(["m0", "m1\n", "m 2"]) == "m1\n" and first_invalid_name(["m0", "m1"]) is None
