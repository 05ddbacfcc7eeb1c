"""The ranks that completed their first step travel in the job record as runs: every rank of a job is one
entry at any size, and a run out of a job's bounds is refused before anything is allocated."""

from __future__ import annotations

import itertools
import typing

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deadpool_protocol.bounds import MEMBERS_PER_JOB_MAX
from deadpool_swapper.job_parts import IncidentLog, rank_runs, ranks_of_runs

pytestmark = pytest.mark.unit


@settings(deadline=None)  # a timing bound flakes on a busy machine; this tests what, not how fast
@given(st.sets(st.integers(0, 300)))
def test_ranks_travel_as_sorted_disjoint_runs_and_come_back_the_same(ranks: set[int]) -> None:
    runs = rank_runs(ranks)
    assert ranks_of_runs(runs) == ranks
    assert all(first < end for first, end in runs)
    assert all(a[1] < b[0] for a, b in itertools.pairwise(runs)), "runs that touch are one"


def test_every_rank_of_a_job_of_16384_is_one_run() -> None:
    assert rank_runs(set(range(16384))) == [[0, 16384]]
    assert rank_runs(set(range(16384)) - {77}) == [[0, 77], [78, 16384]]


@pytest.mark.parametrize(
    "runs",
    [[[-1, 3]], [[5, 5]], [[7, 3]], [[0, MEMBERS_PER_JOB_MAX + 1]], [[0, MEMBERS_PER_JOB_MAX], [0, 1]]],
    ids=["negative", "empty", "backwards", "past the bound", "past the bound in all"],
)
def test_a_run_out_of_a_jobs_bounds_is_refused(runs: list[list[int]]) -> None:
    with pytest.raises(ValueError, match="out of a job's bounds"):
        ranks_of_runs(runs)


def test_a_record_of_before_with_a_time_per_rank_loads_as_its_ranks_and_latest_time() -> None:
    log = IncidentLog.from_record(typing.cast(typing.Any, None), {"first_steps": [[0, 1.5], [2, 3.5]]}, 10.0)
    assert log.first_step_ranks == {0, 2} and log.first_step_t == 3.5
