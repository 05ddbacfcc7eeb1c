"""Every way a member's training can end other than finishing, under `DeadPoolError`.

Seen by the user (raised out of `steps()` or `step()`):
- `JobFailedError`: the swapper ended the job; the text says why.
- `MemberFencedError`: this member was declared failed and replaced.
- `MemberCannotContinueError`: a rebuild this member cannot carry out, for a reason a spare would meet
  too (`cause`, a `MemberErrorCause`); reported to the detector first.

Inside a rebuild (never reaching the user; each decides what the member waits for next):
- `SupersededError`: a newer generation, a void notice or the job's end broke a wait of this one.
- `RendezvousFailedError`: the generation's process group could not be formed.
- `RestoreUnavailableError`: no copy of the restore step could be had; the swapper tries the next link.

A bug: `PhaseError`, a change of the member's phase its state machine does not hold (`member_lifecycle`).
"""

from __future__ import annotations

from deadpool_protocol import MemberErrorCause
from deadpool_protocol.errors import DeadPoolError

__all__ = [
    "DeadPoolError",
    "JobFailedError",
    "MemberCannotContinueError",
    "MemberFencedError",
    "PhaseError",
    "RendezvousFailedError",
    "RestoreUnavailableError",
    "SupersededError",
]


class JobFailedError(DeadPoolError, RuntimeError):
    """The swapper ended the job (the text says why); this member stops with it."""


class MemberFencedError(DeadPoolError, RuntimeError):
    """This member was declared failed and replaced; it must not touch the job's collectives again."""


class MemberCannotContinueError(DeadPoolError, RuntimeError):
    """This member cannot carry out the rebuild for a reason a spare would meet too (`cause`)."""

    def __init__(self, cause: MemberErrorCause, message: str) -> None:
        super().__init__(message)
        self.cause = cause


class SupersededError(DeadPoolError):
    """The generation being formed was superseded (a newer rebuild, a void notice, the job's end)."""


class RendezvousFailedError(DeadPoolError):
    """The generation's process group could not be formed (the cause is chained)."""


class RestoreUnavailableError(DeadPoolError):
    """No copy of the rebuild's restore step (or of any durable step) could be had; the text says why."""


class PhaseError(DeadPoolError, AssertionError):
    """A change of phase the member's state machine does not hold: a bug in DeadPool, never the user's."""
