"""The member's state machine: every phase is reachable, none is a trap, and a change the table does
not hold is refused (the member's own transitions run in every integration test)."""

from __future__ import annotations

import pytest

from deadpool.errors import PhaseError
from deadpool.member_lifecycle import NEXT, check_transition
from deadpool_protocol import MemberPhase as P


def reachable(start: P) -> set[P]:
    seen, todo = {start}, [start]
    while todo:
        for phase in NEXT[todo.pop()] | {P.CLOSED}:
            if phase not in seen:
                seen.add(phase)
                todo.append(phase)
    return seen


def test_every_phase_is_in_the_table_and_reachable_from_the_start() -> None:
    assert set(NEXT) == set(P)
    assert reachable(P.SPARE) == set(P)


def test_every_phase_but_the_last_two_can_still_end_the_job() -> None:
    for phase in set(P) - {P.DONE, P.CLOSED}:
        assert P.DONE in reachable(phase) - {phase}, phase
    assert NEXT[P.DONE] == NEXT[P.CLOSED] == frozenset()


@pytest.mark.parametrize(
    ("current", "phase"),
    [
        (P.SPARE, P.TRAINING),  # a rank is only ever given by a rebuild
        (P.WARMING, P.REBUILDING),  # a spare warms up before it waits for a rank
        (P.TRAINING, P.SPARE),  # a rank is taken away by fencing, which ends the member
        (P.TRAINING, P.DONE),  # the last step is followed by FINISHING
        (P.DONE, P.TRAINING),
        (P.CLOSED, P.SPARE),
        (P.LEFT_EARLY, P.TRAINING),
    ],
)
def test_a_change_the_table_does_not_hold_is_refused(current: P, phase: P) -> None:
    with pytest.raises(PhaseError, match=f"from {current} to {phase}"):
        check_transition(current, phase)


def test_the_changes_the_table_holds_pass_and_any_phase_may_close() -> None:
    for current, following in NEXT.items():
        for phase in following | {P.CLOSED, current}:
            check_transition(current, phase)
