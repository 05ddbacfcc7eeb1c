"""Watching that the training thread leaves a broken group's collective, and saying so when it cannot.

Breaking a gloo group's sockets fails every collective blocked on them, with one exception: a send
still waiting for its peer's "ready to receive" when that peer left is woken by no socket error
(gloo's `abortWaitSend` is only reachable for point-to-point work). Such a member would sit in the
old generation until the collective timeout, holding up the new generation's rendezvous. So after
the control thread broke the group of generation g, it looks every `CHECK_EVERY_S`: while the
training thread is still in the same step of g, inside torch's distributed or autograd code, it is
stuck if

- it used (almost) no CPU since the last look (`BLOCKED_CPU_S`): blocked on a condition, not
  computing. Only where the training thread does the compute itself (a CPU model on gloo); a thread
  that drives a GPU waits without CPU legitimately. Or
- `leave_wait_s` passed: three of the job's recent step times, never under `LEAVE_WAIT_MIN_S`
  (1.5 s), within which compute that was running when the group broke (a long backward) finishes.

Then the member reports it (`MemberError`) and exits, and the swapper replaces it with a spare. A
thread in user code is looked at again, up to `RECHECKS_MAX` times `leave_wait_s`, rather than judged.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from deadpool.control_link import ControlLink
from deadpool.thread_probe import probe_thread

__all__ = ["LEAVE_WAIT_MIN_S", "StuckCollectiveWatch"]

LEAVE_WAIT_MIN_S = 1.5
STEP_TIMES_FACTOR = 3.0
RECHECKS_MAX = 10
CHECK_EVERY_S = 0.25
BLOCKED_CPU_S = 0.002
"""CPU time under which a training thread, over one `CHECK_EVERY_S`, counts as blocked (a computing
thread uses tens of milliseconds in that time even on a crowded host)."""


class StuckCollectiveWatch:
    def __init__(
        self,
        link: ControlLink,
        on_stuck: Callable[[int], None],
        log: Any,
        step_time_s: Callable[[], float] = lambda: 0.0,
        blocked_means_stuck: bool = False,
    ) -> None:
        self.link = link
        self.on_stuck = on_stuck
        self.log = log
        self.step_time_s = step_time_s
        self.blocked_means_stuck = blocked_means_stuck
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self._closed = False

    def leave_wait_s(self) -> float:
        return max(LEAVE_WAIT_MIN_S, STEP_TIMES_FACTOR * self.step_time_s())

    def watch(self, generation: int) -> None:
        """The group of `generation` was just broken: check back that the thread leaves it."""
        progress = self.link.progress
        if progress.generation != generation or not progress.in_step:
            return  # between steps (or already rebuilding): it will see the newer command itself
        now = time.monotonic()
        self._arm(_Watched(generation, progress.step, now, now + self.leave_wait_s(), self._thread_cpu_s()))

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

    def _arm(self, watched: _Watched) -> None:
        with self._lock:
            if self._closed:
                return
            if self._timer is not None:
                self._timer.cancel()
            self._timer = threading.Timer(CHECK_EVERY_S, self._check, (watched,))
            self._timer.daemon = True
            self._timer.start()

    def _check(self, watched: _Watched) -> None:
        progress = self.link.progress
        if progress.generation != watched.generation or progress.step != watched.step or not progress.in_step:
            return  # it left
        now, cpu = time.monotonic(), self._thread_cpu_s()
        waiting, where = probe_thread(self.link.training_thread)
        blocked = (
            self.blocked_means_stuck
            and cpu is not None
            and watched.cpu_s is not None
            and cpu - watched.cpu_s < BLOCKED_CPU_S
        )
        if waiting and (blocked or now >= watched.judge_at):
            self.log.error(
                "training thread still in a broken collective",
                generation=watched.generation,
                where=where,
                blocked=blocked,
                since_break_s=round(now - watched.broken_at, 3),
            )
            self.on_stuck(watched.generation)
        elif now < watched.broken_at + (RECHECKS_MAX + 1) * (watched.judge_at - watched.broken_at):
            self._arm(replace(watched, cpu_s=cpu))

    def _thread_cpu_s(self) -> float | None:
        """The training thread's CPU time so far, or None where it cannot be read."""
        ident = self.link.training_thread
        if ident is None:
            return None
        try:
            return time.clock_gettime(time.pthread_getcpuclockid(ident))
        except (OSError, AttributeError):  # the thread is gone, or a platform without thread clocks
            return None


@dataclass(frozen=True)
class _Watched:
    generation: int
    step: int
    broken_at: float
    judge_at: float
    """When `leave_wait_s` has passed (monotonic): a thread still waiting then is stuck, blocked or not."""
    cpu_s: float | None
    """The training thread's CPU time at the previous look."""
