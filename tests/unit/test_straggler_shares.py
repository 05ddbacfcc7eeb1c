"""The straggler review's shortcuts give what its rule says: each rank's busy share over the window
against the median of the other ranks' shares (`statistics.median`, exactly)."""

from __future__ import annotations

import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deadpool_detector.core import DetectorConfig, DetectorCore, Watched, _median_without, _sample_busy
from deadpool_protocol.timeouts import HEARTBEAT_PERIOD_S_DEFAULT
from tests.unit.test_detector_core import formed

pytestmark = pytest.mark.unit

PERIOD_S = HEARTBEAT_PERIOD_S_DEFAULT


@given(st.lists(st.integers(0, 12).map(lambda k: k / 12), min_size=2, max_size=40), st.data())
def test_the_median_without_one_rank_is_the_median_of_the_others(shares: list[float], data: st.DataObject) -> None:
    i = data.draw(st.integers(0, len(shares) - 1))
    others = shares[:i] + shares[i + 1 :]
    assert _median_without(sorted(shares), shares[i]) == statistics.median(others)


@given(st.lists(st.tuples(st.booleans(), st.integers(1, 4)), max_size=60), st.integers(1, 30))
def test_a_busy_share_is_the_share_of_the_last_window_of_samples(beats: list[tuple[bool, int]], window: int) -> None:
    watched = Watched("m0", 0, 0.0)
    samples: list[bool] = []
    t = 1.0
    for busy, periods in beats:
        t += periods * PERIOD_S
        before = len(watched.busy)
        _sample_busy(watched, busy, t)
        samples += [busy] * (len(watched.busy) - before)  # the periods since the last beat
    assert watched.busy_total == sum(samples)
    if len(samples) >= window:
        assert watched.busy_share(window) == sum(samples[-window:]) / window


def reference_stragglers(core: DetectorCore) -> set[str]:
    """The rule as it reads, one rank at a time against a sort of the others."""
    c = core.config
    found = set()
    for view in core.jobs.values():
        ranked = [w for w in view.members.values() if w.rank >= 0 and len(w.busy) >= c.straggler_window]
        if len(ranked) < 2:
            continue
        shares = {w.member: w.busy_share(c.straggler_window) for w in ranked}
        for w in ranked:
            typical = statistics.median(share for m, share in shares.items() if m != w.member)
            share = shares[w.member]
            if share >= c.straggler_factor * typical and share - typical >= c.straggler_margin:
                found.add(w.member)
    return found


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.booleans(), min_size=10, max_size=14), min_size=2, max_size=24))
def test_the_review_names_the_stragglers_the_rule_names(histories: list[list[bool]]) -> None:
    core = DetectorCore(DetectorConfig(straggler_window=10))
    members = tuple(f"m{k}" for k in range(len(histories)))
    formed(core, 0.0, ranks=members, spares=())
    view = core.jobs["j"]
    for member, history in zip(members, histories, strict=True):
        for k, busy in enumerate(history):
            _sample_busy(view.members[member], busy, k * PERIOD_S)
    expected = reference_stragglers(core)
    assert {event.member for event in core.stragglers(10.0)} == expected
