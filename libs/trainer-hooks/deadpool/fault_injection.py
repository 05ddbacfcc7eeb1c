"""Faults on demand, for tests and benchmarks: `DEADPOOL_FAULT_INJECTION=1` arms four signals.

- SIGUSR1: the training thread hangs, in Python, its heartbeats going on (as a rank stuck in a data
  loader or on a lock would): the detector must find it from step progress.
- SIGUSR2: the training thread raises `InjectedFaultError` (as a bug or a CUDA error would): the
  member reports the error and exits.
- SIGURG: the process group's connections of this rank are reset (as a network fault would reset
  them): every rank's collective fails while every process stays alive; nobody is to blame, and the
  job must regroup.
- SIGWINCH: from now on every step of this rank starts `SLOW_STEP_S` late (as a rank on a throttled
  GPU or a slow data shard would): a straggler, which the detector reports and nobody swaps.

The hang, the exception and the reset do not happen inside the signal handler, which Python runs
wherever the main thread happens to be: an exception raised there can land in a `__del__` or a
library's `except Exception` and vanish (the step goes on as if nothing happened), or leave a
library's bookkeeping half done (DDP's, ours) and turn one failure into another. The handler only
records the fault; the job carries it out at a fixed point inside the next step,
`act_on_pending_fault()` in its optimizer step pre-hook, where a failing optimizer step (or a CUDA
error it surfaces) would.

SIGKILL (a crash) and SIGSTOP (the whole process frozen, heartbeats too) need no arming. Never armed
unless the variable is set.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType

from deadpool_protocol.errors import DeadPoolError

__all__ = [
    "ENV_FAULT_INJECTION",
    "SLOW_STEP_S",
    "InjectedFaultError",
    "act_on_pending_fault",
    "arm_from_env",
    "step_delay_s",
]

ENV_FAULT_INJECTION = "DEADPOOL_FAULT_INJECTION"
HANG_POLL_S = 0.05
SLOW_STEP_S = 0.2
_delay_s = 0.0
_pending = ""
"""The fault recorded by a signal and not yet carried out: '', 'hang', 'raise' or 'reset'."""


def step_delay_s() -> float:
    """How late each step starts on this rank (0 unless SIGWINCH was injected)."""
    return _delay_s


class InjectedFaultError(DeadPoolError, RuntimeError):
    """A fault injected with SIGUSR2."""


def act_on_pending_fault(reset_group: Callable[[], object]) -> None:
    """Carry out the fault a signal recorded: hang for good, raise, or call `reset_group` (which
    breaks this rank's process-group connections). Does nothing if none is pending.

    Called by the training thread inside each step; costs one global read when nothing is pending.
    """
    global _pending
    if not _pending:
        return
    fault, _pending = _pending, ""
    if fault == "raise":
        raise InjectedFaultError("fault injected with SIGUSR2")
    if fault == "reset":
        reset_group()
        return
    while True:  # 'hang': stuck for good, only a fence (SIGKILL) ends it
        time.sleep(HANG_POLL_S)


def _recorder(fault: str) -> Callable[[int, FrameType | None], None]:
    """A signal handler that only records `fault`, for `act_on_pending_fault` to carry out."""

    def record(signum: int, frame: FrameType | None) -> None:
        global _pending
        _pending = fault

    return record


def _slow_down(signum: int, frame: FrameType | None) -> None:
    global _delay_s
    _delay_s = SLOW_STEP_S


def arm_from_env() -> bool:
    """Install the handlers if `DEADPOOL_FAULT_INJECTION=1` (main thread only). Returns whether armed."""
    if os.environ.get(ENV_FAULT_INJECTION) != "1" or threading.current_thread() is not threading.main_thread():
        return False
    signal.signal(signal.SIGUSR1, _recorder("hang"))
    signal.signal(signal.SIGUSR2, _recorder("raise"))
    signal.signal(signal.SIGURG, _recorder("reset"))
    signal.signal(signal.SIGWINCH, _slow_down)
    return True
