"""Why a launcher exits 1 although its job finished: it says which members did not exit cleanly
after every rank was done (their code after the training loop is not replayed on a spare)."""

from __future__ import annotations

import pytest

from deadpool.launcher import unclean_after_finish

pytestmark = pytest.mark.unit


def test_members_that_died_after_the_job_finished_are_named_with_their_exit() -> None:
    said = unclean_after_finish({"m0", "m1", "m2"}, {"m0": 0, "m1": -9, "m2": 1})
    assert "m1 (exit -9), m2 (exit 1)" in said and "m0" not in said
    assert "final save" in said


def test_a_member_that_never_exited_counts_as_unclean_and_clean_exits_say_nothing() -> None:
    assert "m1 (exit unknown)" in unclean_after_finish({"m0", "m1"}, {"m0": 0})
    assert unclean_after_finish({"m0", "m1"}, {"m0": 0, "m1": 0}) == ""
    assert unclean_after_finish(set(), {"m0": -9}) == "", "a member that died before the end was replaced"
