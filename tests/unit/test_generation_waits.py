"""Waits of a generation end when it is superseded: a newer rebuild, a void notice, the job's end."""

from __future__ import annotations

import threading

import pytest

from deadpool.errors import SupersededError
from deadpool.generation_waits import GenerationWaits


def test_a_newer_rebuild_or_a_void_notice_supersedes_a_generation_and_only_older_ones() -> None:
    waits = GenerationWaits()
    waits.supersede(newest=3)
    assert waits.superseded(2) and not waits.superseded(3)
    waits.supersede(void=3)
    assert waits.superseded(3) and not waits.superseded(4)
    waits.supersede(newest=2)  # an older rebuild arriving late changes nothing
    assert not waits.superseded(4)
    waits.supersede(ended=True)
    assert waits.superseded(99)


def test_a_wait_is_broken_from_another_thread_when_its_generation_is_superseded() -> None:
    waits = GenerationWaits()
    blocked, broken = threading.Event(), threading.Event()

    def control() -> None:
        assert blocked.wait(60), "the training thread never reached its wait"
        assert waits.supersede(newest=5) == 1

    threading.Thread(target=control, daemon=True).start()
    with pytest.raises(SupersededError), waits.breakable(4, broken.set):
        blocked.set()
        if not broken.wait(60):  # a blocked socket call, failing once its socket is shut down
            raise AssertionError("never broken")
        raise ConnectionResetError("the socket was shut down")


def test_a_wait_registered_after_its_generation_was_superseded_is_broken_at_once() -> None:
    waits = GenerationWaits()
    waits.supersede(void=4)
    broken = threading.Event()
    with pytest.raises(SupersededError), waits.breakable(4, broken.set):
        assert broken.is_set()
    with waits.breakable(5, broken.clear):  # a wait of the next generation is left alone
        pass
    assert broken.is_set()
