"""The stuck-collective watch: a training thread left inside a broken group's collective is judged
stuck at once when it is blocked (no CPU), and only after `leave_wait_s` when it may be computing.

The training thread is a real thread whose innermost frame is a function compiled under a file name
inside torch's distributed package (what `thread_probe` looks for); it either waits on a held lock
(blocked, as gloo's pending send is) or spins (computing, as a long backward is) until the test ends."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast

import pytest

from deadpool.stuck_watch import LEAVE_WAIT_MIN_S, StuckCollectiveWatch

GENERATION, STEP = 4, 17
NOTICE_TIMEOUT_S = 10.0

_IN_TORCH = compile(
    """
def block(hold):
    hold.acquire()  # C code straight from this frame, as torch's C++ wait is
    hold.release()

def compute(hold):
    while hold.locked():
        sum(i * i for i in range(1000))
""",
    "/venv/site-packages/torch/distributed/distributed_c10d.py",
    "exec",
)
IN_TORCH: dict[str, Any] = {}
exec(_IN_TORCH, IN_TORCH)


@dataclass
class Progress:
    generation: int = GENERATION
    step: int = STEP
    in_step: bool = True


class Link:
    """What the watch reads of the control link: the training thread's progress and identity."""

    def __init__(self, thread: threading.Thread) -> None:
        self.progress = Progress()
        self.training_thread = thread.ident


class Stuck:
    def __init__(self) -> None:
        self.judged = threading.Event()
        self.at = 0.0

    def __call__(self, generation: int) -> None:
        assert generation == GENERATION
        self.at = time.monotonic()
        self.judged.set()


class Log:
    def error(self, event: str, **fields: Any) -> None:
        self.last = (event, fields)


@pytest.fixture
def training() -> Iterator[tuple[threading.Lock, list[threading.Thread]]]:
    hold, threads = threading.Lock(), list[threading.Thread]()
    hold.acquire()
    yield hold, threads
    hold.release()
    for thread in threads:
        thread.join(5)


def start(body: str, hold: threading.Lock, threads: list[threading.Thread]) -> threading.Thread:
    thread = threading.Thread(target=IN_TORCH[body], args=(hold,), daemon=True)
    thread.start()
    threads.append(thread)
    return thread


def watching(link: Link, step_time_s: float, blocked_means_stuck: bool) -> tuple[StuckCollectiveWatch, Stuck]:
    stuck = Stuck()
    watch = StuckCollectiveWatch(
        cast(Any, link), stuck, Log(), step_time_s=lambda: step_time_s, blocked_means_stuck=blocked_means_stuck
    )
    return watch, stuck


def test_a_blocked_training_thread_is_judged_stuck_long_before_leave_wait(training: Any) -> None:
    thread = start("block", *training)
    watch, stuck = watching(Link(thread), 20.0, True)
    assert watch.leave_wait_s() == 60.0
    watch.watch(GENERATION)
    try:
        assert stuck.judged.wait(NOTICE_TIMEOUT_S), "a thread blocked in a broken collective was not judged"
    finally:
        watch.close()


@pytest.mark.parametrize(
    ("body", "blocked_means_stuck"),
    [("compute", True), ("block", False)],
    ids=["a computing thread", "a blocked thread where blocking is legitimate (a GPU driver)"],
)
def test_a_thread_that_may_be_working_is_judged_only_after_leave_wait(
    training: Any, body: str, blocked_means_stuck: bool
) -> None:
    thread = start(body, *training)
    watch, stuck = watching(Link(thread), 0.0, blocked_means_stuck)
    broken = time.monotonic()
    watch.watch(GENERATION)
    try:
        assert stuck.judged.wait(NOTICE_TIMEOUT_S), "a thread still in a broken collective was never judged"
        assert stuck.at - broken >= LEAVE_WAIT_MIN_S, "judged before leave_wait_s"
    finally:
        watch.close()


def test_a_thread_that_left_the_step_is_never_judged(training: Any) -> None:
    thread = start("block", *training)
    link = Link(thread)
    watch, stuck = watching(link, 0.0, True)
    watch.watch(GENERATION)
    link.progress = Progress(in_step=False)  # the collective failed and it went to await a rebuild
    try:
        assert not stuck.judged.wait(LEAVE_WAIT_MIN_S + 1.0)
    finally:
        watch.close()
