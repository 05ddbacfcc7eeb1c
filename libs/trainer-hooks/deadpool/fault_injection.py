"""Faults on demand, for tests and benchmarks: `DEADPOOL_FAULT_INJECTION=1` arms two signals.

- SIGUSR1: the training thread hangs where it is, in Python, its heartbeats going on (as a rank
  stuck in a data loader or on a lock would): the detector must find it from step progress.
- SIGUSR2: the training thread raises `InjectedFaultError` where it is (as a bug or a CUDA error
  would): the member reports the error and exits.
- SIGWINCH: from now on every step of this rank starts `SLOW_STEP_S` late (as a rank on a throttled
  GPU or a slow data shard would): a straggler, which the detector reports and nobody swaps.

SIGKILL (a crash) and SIGSTOP (the whole process frozen, heartbeats too) need no arming. Never armed
unless the variable is set.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from types import FrameType

__all__ = ["ENV_FAULT_INJECTION", "SLOW_STEP_S", "InjectedFaultError", "arm_from_env", "step_delay_s"]

ENV_FAULT_INJECTION = "DEADPOOL_FAULT_INJECTION"
HANG_POLL_S = 0.05
SLOW_STEP_S = 0.2
_delay_s = 0.0


def step_delay_s() -> float:
    """How late each step starts on this rank (0 unless SIGWINCH was injected)."""
    return _delay_s


class InjectedFaultError(RuntimeError):
    """A fault injected with SIGUSR2."""


def _hang(signum: int, frame: FrameType | None) -> None:
    while True:  # stuck for good: only a fence (SIGKILL) ends it
        time.sleep(HANG_POLL_S)


def _raise(signum: int, frame: FrameType | None) -> None:
    raise InjectedFaultError("fault injected with SIGUSR2")


def _slow_down(signum: int, frame: FrameType | None) -> None:
    global _delay_s
    _delay_s = SLOW_STEP_S


def arm_from_env() -> bool:
    """Install the handlers if `DEADPOOL_FAULT_INJECTION=1` (main thread only). Returns whether armed."""
    if os.environ.get(ENV_FAULT_INJECTION) != "1" or threading.current_thread() is not threading.main_thread():
        return False
    signal.signal(signal.SIGUSR1, _hang)
    signal.signal(signal.SIGUSR2, _raise)
    signal.signal(signal.SIGWINCH, _slow_down)
    return True
