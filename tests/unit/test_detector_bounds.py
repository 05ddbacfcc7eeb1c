"""The detector's passes skip their walk over every member when a lower bound answers for them
(`JobView.heard_since`, `JobView.progressed_since`, `JobView.rebuilding`): whatever beats, batches of
old beats, finished members and rebuilds come, they find what a walk over every member finds."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from deadpool_detector.core import DetectorConfig, DetectorCore
from deadpool_protocol import Heartbeat, HeartbeatBatch, MemberDone
from tests.unit.test_detector_core import formed

MEMBERS = ("m0", "m1", "m2", "m3")
TIMEOUT_S = 1.0
KINDS = ("beat", "step", "old_step", "section", "rebuilding", "done", "rebuild", "nothing")

events = st.lists(
    st.tuples(st.sampled_from(KINDS), st.integers(0, len(MEMBERS) - 1), st.floats(0.0, 0.7)),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(events)
def test_the_bounds_never_hide_a_silence_a_stall_or_a_rank_stuck_in_its_rebuild(
    script: list[tuple[str, int, float]],
) -> None:
    config = DetectorConfig(heartbeat_timeout_s=TIMEOUT_S, hang_factor=2, hang_floor_s=1.2, first_step_s=1.5)
    core = DetectorCore(config, wall_offset=lambda: 0.0)
    formed(core, 0.0, ranks=MEMBERS, spares=())
    view = core.jobs["j"]
    now, generation, steps = 0.0, 1, dict.fromkeys(MEMBERS, 0)
    for kind, k, dt in script:
        now = round(now + dt, 6)
        member = MEMBERS[k]
        if kind in ("step", "old_step"):
            steps[member] += 1
        beat = Heartbeat(
            "j",
            generation,
            member,
            k,
            100,
            steps[member],
            True,
            now,
            now,
            section="evaluation" if kind == "section" else "",
            rebuilding=kind == "rebuilding",
        )
        if kind == "old_step":  # a beat its launcher held for up to 0.6 s: dated before its arrival
            age_ms = round(dt * 1000 * 0.9)
            core.on_batch(HeartbeatBatch("j", generation, f"l{k}", [beat], [], [age_ms]), now)
        elif kind == "done":
            core.on_done(MemberDone("j", generation, member, k, steps[member]))
        elif kind == "rebuild":
            generation += 1
            formed(core, now, generation, ranks=MEMBERS, spares=())
        elif kind != "nothing":
            core.on_heartbeat(beat, now)

        silent_before = now - TIMEOUT_S
        walked = any(w.last_seen < silent_before and not w.done for w in view.members.values())
        assert core.overdue(now) == walked, (now, kind)
        threshold = core.hang_threshold_s(view)
        stalled = [
            w.member
            for w in view.members.values()
            if w.rank >= 0 and not w.done and now - w.progress_t > core._threshold_of(w, threshold)
        ]
        assert [w.member for w in core._stalled(view, now, threshold)] == stalled, (now, kind)
        rebuilding = {w.member for w in view.members.values() if w.rank >= 0 and w.rebuilding_since}
        assert rebuilding <= view.rebuilding, (now, kind)  # the rule looks at every one of them


def test_a_step_clock_set_to_a_beat_older_than_the_bound_lowers_it() -> None:
    """A rebuild starts every step clock at its arrival; a beat sent before that, held by its launcher,
    sets one clock earlier than the bound the last walk found. The stall is still found on time."""
    config = DetectorConfig(heartbeat_timeout_s=TIMEOUT_S, hang_factor=2, hang_floor_s=1.2, first_step_s=1.5)
    core = DetectorCore(config, wall_offset=lambda: 0.0)
    formed(core, 0.0, ranks=MEMBERS, spares=())
    formed(core, 5.0, 2, ranks=MEMBERS, spares=())  # every clock starts again at 5.0
    view = core.jobs["j"]
    assert core._stalled(view, 5.0, core.hang_threshold_s(view)) == []  # the walk: nothing before 5.0
    for k, member in enumerate(MEMBERS):
        beat = Heartbeat("j", 2, member, k, 100, 1, True, 5.5, 5.5)
        age_ms = 600 if member == "m0" else 0  # m0's beat was sent at 4.9, before the rebuild came
        core.on_batch(HeartbeatBatch("j", 2, f"l{k}", [beat], [], [age_ms]), 5.5)
    stalled = core._stalled(view, 6.45, core.hang_threshold_s(view))  # 1.55 s after 4.9, 1.45 s after 5.0
    assert [w.member for w in stalled] == ["m0"]  # the threshold: the first step's 1.5 s, no step timed yet
