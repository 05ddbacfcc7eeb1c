"""Time lost to a failure, as the demo measures it: from exact step-completion times, against the run
without it, start-up left out."""

from __future__ import annotations

import pytest

from deadpool_cli.demo import time_lost
from deadpool_cli.job_watch import StepDone


def run(steps: range, start_t: float, step_s: float, generation: int = 1, ranks: int = 2) -> list[StepDone]:
    return [
        StepDone(start_t + i * step_s + 0.01 * rank, f"m{rank}", rank, generation, step)
        for i, step in enumerate(steps)
        for rank in range(ranks)
    ]


def test_time_lost_is_the_extra_time_between_the_same_steps_whatever_the_start_up() -> None:
    reference = run(range(1, 21), start_t=100.0, step_s=0.2)  # steps 1..20, one every 0.2 s
    # The run with the failure started 7 s later (slower imports), lost steps 9 and 10 at a kill during
    # step 11, and was back 0.9 s after the last step it completed before the kill.
    before = run(range(1, 11), start_t=107.0, step_s=0.2)
    after = run(range(9, 21), start_t=107.0 + 9 * 0.2 + 0.9, step_s=0.2, generation=2)
    lost = time_lost(before + after, reference)
    assert lost is not None
    assert lost[1:] == (1, 20)
    assert lost[0] == pytest.approx(0.9 + 2 * 0.2 - 0.2)  # the gap, and steps 9 and 10 done again


def test_a_step_counts_when_the_last_member_that_reported_it_completed_it() -> None:
    reference = run(range(1, 5), 0.0, 0.1)  # ranks 0 and 1, rank 1 10 ms behind
    survivor = run(range(1, 5), 50.0, 0.1, ranks=1)  # the killed rank wrote no step times
    lost = time_lost(survivor, reference)
    assert lost is not None and lost[0] == pytest.approx(0.0)  # 0.3 s from step 1 to 4, in both runs


def test_without_steps_completed_in_both_runs_there_is_no_figure() -> None:
    assert time_lost([], run(range(1, 5), 0.0, 0.1)) is None
    assert time_lost(run(range(1, 3), 0.0, 0.1), run(range(5, 9), 0.0, 0.1)) is None
