"""The job's snapshot interval K: up when two snapshots in a row take longer to store than it (one,
if it held a due stream back), down after slack over enough steps, the longest any live peer of the
generation asks for, and a forced interval left alone."""

from __future__ import annotations

import pytest

from deadpool.snapshot_cadence import FILL, PEER_TTL_S, SLACK_STEPS, SLACK_STREAMS, SnapshotCadence
from deadpool_protocol import SNAPSHOT_EVERY_MAX, ProtocolError, SnapshotInterval

pytestmark = pytest.mark.unit

STEP_S = 1.0


def interval(rank: int, every: int, generation: int = 1) -> SnapshotInterval:
    return SnapshotInterval("j", generation, f"m{rank}", rank, every, 0.0)


class Cadence(SnapshotCadence):
    """A cadence that counts the steps its snapshots were of."""

    step = 0


def streams(cadence: Cadence, stream_s: float, count: int) -> None:
    """`count` snapshots, one per interval, each taking `stream_s` to store."""
    for _ in range(count):
        cadence.step += cadence.own
        cadence.streamed(stream_s, STEP_S, cadence.step)


def test_two_snapshots_slower_than_their_interval_raise_k_to_the_power_of_two_the_quicker_fits() -> None:
    cadence = Cadence(0.01)
    streams(cadence, 0.5, 3)
    assert cadence.own == 1
    streams(cadence, 12.0, 1)
    assert cadence.own == 1, "one slow snapshot (a first touch of memory) is a one-off"
    streams(cadence, 0.5, 1)
    streams(cadence, 2.5, 1)  # fits in FILL of 4 steps (3.2 s), not of 2 (1.6 s)
    assert cadence.own == 1
    streams(cadence, 6.0, 1)
    assert cadence.own == 4, "the quicker of the two in a row"
    streams(cadence, 1000.0, 2)
    assert cadence.own == SNAPSHOT_EVERY_MAX


def test_a_slow_snapshot_that_held_a_due_stream_back_raises_k_at_once_a_skip_alone_does_not() -> None:
    """Skips are each rank's own: while K is too short the ranks stream different steps and nothing
    commits, so a stored snapshot that took the whole interval (a due stream was skipped meanwhile)
    raises K without waiting for a second one."""
    cadence = Cadence(0.01)
    streams(cadence, 0.5, 3)
    cadence.skipped()
    assert cadence.own == 1, "a skip alone (its stream may be held by a lost store) moves nothing"
    streams(cadence, 6.0, 1)
    assert cadence.own == 8, "the snapshot the skip waited on needed 8 steps: at once"
    cadence.skipped()
    streams(cadence, 0.5, 1)
    assert cadence.own == 8, "a skip then a quick snapshot: nothing to raise"
    streams(cadence, 20.0, 1)
    assert cadence.own == 8, "no skip: one slow snapshot is still a one-off"


def test_k_comes_down_after_slack_over_enough_steps_and_holds_inside_the_band() -> None:
    cadence = Cadence(0.01)
    streams(cadence, 6.0, 2)
    assert cadence.own == 8
    in_band = FILL * 8 * STEP_S * 0.75  # above FILL of half the interval, below FILL of it
    streams(cadence, in_band, 10)
    assert cadence.own == 8, "a stream filling 60 % of its interval moves nothing (hysteresis)"
    streams(cadence, 0.01, SLACK_STREAMS - 1)
    assert cadence.own == 8
    streams(cadence, FILL * 2 * STEP_S * 0.9, 1)  # needs 2
    assert cadence.own == 2, "down to the longest interval the slack snapshots needed, at once"
    streams(cadence, 0.01, 4)
    assert cadence.own == 2, f"at K = 2, slack must span {SLACK_STEPS} steps"
    cadence.skipped()  # a skip breaks the run of slack
    streams(cadence, 0.01, 4)
    assert cadence.own == 2 and cadence.skips == 1
    streams(cadence, 0.01, 1)
    assert cadence.own == 1


def test_the_job_streams_at_the_longest_interval_a_live_peer_of_the_generation_asks_for() -> None:
    cadence = SnapshotCadence(0.01)
    cadence.place(rank=0, world_size=4, generation=1)
    assert cadence.every(now=0.0) == 1
    assert cadence.heard(interval(1, 4), now=0.0)
    assert cadence.heard(interval(2, 2), now=0.0)
    assert cadence.every(now=1.0) == 4
    assert 8 % cadence.every(now=1.0) == 0 and 6 % cadence.every(now=1.0) != 0
    assert not cadence.heard(interval(0, 16), now=1.0), "our own interval is ours, not a peer's"
    assert not cadence.heard(interval(1, 16, generation=0), now=1.0), "an older generation's"
    assert not cadence.heard(interval(4, 16), now=1.0), "a rank the generation does not have (a hostile key)"
    assert cadence.every(now=1.0) == 4
    assert cadence.every(now=PEER_TTL_S + 0.5) == 1, "a peer gone silent no longer holds the job"
    cadence.heard(interval(1, 4), now=20.0)
    cadence.place(rank=0, world_size=4, generation=2)
    assert cadence.every(now=20.0) == 1, "a new generation's peers say theirs again"


def test_ranks_that_disagree_on_k_still_stream_common_steps() -> None:
    slow, fast = SnapshotCadence(0.01), SnapshotCadence(0.01)
    slow.own, fast.own = 8, 2
    both = [s for s in range(1, 65) if s % slow.every(0.0) == 0 and s % fast.every(0.0) == 0]
    assert both == [s for s in range(1, 65) if s % 8 == 0]


def test_a_forced_interval_does_not_adapt_and_the_budget_bounds_the_wait() -> None:
    cadence = SnapshotCadence(0.02, forced_every=3)
    cadence.streamed(100.0, STEP_S, 1)
    cadence.heard(interval(1, 64), now=0.0)
    assert cadence.every(now=0.0) == 3 and not cadence.adaptive
    assert SnapshotCadence(0.02).wait_s(1.5) == pytest.approx(0.03)
    with pytest.raises(ValueError):
        SnapshotCadence(1.0)
    with pytest.raises(ValueError):
        SnapshotCadence(0.01, forced_every=0)


@pytest.mark.parametrize("every", [0, 3, 128, -2])
def test_an_interval_off_the_grid_is_refused_on_the_wire(every: int) -> None:
    with pytest.raises(ProtocolError):
        interval(1, every).check()
