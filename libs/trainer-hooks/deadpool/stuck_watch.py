"""Watching that the training thread leaves a broken group's collective, and saying so when it cannot.

Breaking a gloo group's sockets fails every collective blocked on them, with one exception: a send
still waiting for its peer's "ready to receive" when that peer left is woken by no socket error
(gloo's `abortWaitSend` is only reachable for point-to-point work). Such a member would sit in the
old generation until the collective timeout, holding up the new generation's rendezvous. So after
the control thread broke the group of generation g, it checks back `leave_wait_s` later: if the
training thread is still in the same step of g, inside torch's distributed or autograd code, it is
stuck; the member reports it (`MemberError`) and exits, and the swapper replaces it with a spare.

`leave_wait_s` is three of the job's recent step times, and never under `LEAVE_WAIT_MIN_S` (1.5 s): compute
that was running when the group broke (a long backward) finishes well within that, and a thread in
user code is re-checked (up to `RECHECKS_MAX` times) rather than judged.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from deadpool.control_link import ControlLink
from deadpool.thread_probe import probe_thread

__all__ = ["LEAVE_WAIT_MIN_S", "StuckCollectiveWatch"]

LEAVE_WAIT_MIN_S = 1.5
STEP_TIMES_FACTOR = 3.0
RECHECKS_MAX = 10


class StuckCollectiveWatch:
    def __init__(
        self,
        link: ControlLink,
        on_stuck: Callable[[int], None],
        log: Any,
        step_time_s: Callable[[], float] = lambda: 0.0,
    ) -> None:
        self.link = link
        self.on_stuck = on_stuck
        self.log = log
        self.step_time_s = step_time_s
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self._closed = False

    def leave_wait_s(self) -> float:
        return max(LEAVE_WAIT_MIN_S, STEP_TIMES_FACTOR * self.step_time_s())

    def watch(self, generation: int) -> None:
        """The group of `generation` was just broken: check back later that the thread left it."""
        progress = self.link.progress
        if progress.generation != generation or not progress.in_step:
            return  # between steps (or already rebuilding): it will see the newer command itself
        self._arm(generation, progress.step, RECHECKS_MAX)

    def clear(self) -> None:
        """The training thread started a rebuild: it left whatever it was in."""
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self.clear()

    def _arm(self, generation: int, step: int, rechecks: int) -> None:
        with self._lock:
            if self._closed:
                return
            if self._timer is not None:
                self._timer.cancel()
            self._timer = threading.Timer(self.leave_wait_s(), self._check, (generation, step, rechecks))
            self._timer.daemon = True
            self._timer.start()

    def _check(self, generation: int, step: int, rechecks: int) -> None:
        progress = self.link.progress
        if progress.generation != generation or progress.step != step or not progress.in_step:
            return  # it left
        waiting, where = probe_thread(self.link.training_thread)
        if waiting:
            self.log.error("training thread still in a broken collective", generation=generation, where=where)
            self.on_stuck(generation)
        elif rechecks > 0:
            self._arm(generation, step, rechecks - 1)
