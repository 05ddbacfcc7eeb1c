"""A job's phase, named, and the transitions between phases that the swapper may make.

The swapper's job state is loose fields; which phase a job is in (forming, training, rebuilding...)
was read from `generation`, `pending`, `formed`, `void_generation`, `held_since` and the like wherever
it was needed. `phase_of` says it in one place, from those fields, and `LEGAL` says which changes of
phase one decision may make: the core asserts every decision against it (`SwapperCore`'s entry points),
so a decision that would take a job somewhere no rule allows (back to unformed while it trains, out of
finished without a new run) stops at the assertion instead of going on in a state nobody designed.
"""

from __future__ import annotations

import enum
import typing

from deadpool_protocol.errors import DeadPoolError

if typing.TYPE_CHECKING:
    from deadpool_swapper.core import JobState

__all__ = ["LEGAL", "IllegalTransitionError", "JobPhase", "check_transition", "phase_of"]


class JobPhase(enum.StrEnum):
    ABSENT = "absent"
    """No state for the job (never heard of, or forgotten after it ended)."""
    UNFORMED = "unformed"
    """Members gather; no generation of this run was published."""
    FORMING = "forming"
    """A generation was published and not every rank has acked one yet (the run never trained)."""
    TRAINING = "training"
    """The current generation formed and trains."""
    VOIDED = "voided"
    """The current generation was announced void (a failure): waiting for the last call or a spare."""
    REBUILDING = "rebuilding"
    """A rebuild is published and waits for its acks, after the job formed once."""
    HOLDING = "holding"
    """Training is held for want of a snapshot store (the run's policy when every store is lost)."""
    FINISHED = "finished"
    FAILED = "failed"
    """The swapper ended the job, saying why."""


P = JobPhase
_RUNNING = frozenset({P.TRAINING, P.VOIDED, P.REBUILDING, P.HOLDING})
_ENDED = frozenset({P.FINISHED, P.FAILED})

LEGAL: frozenset[tuple[JobPhase, JobPhase]] = frozenset(
    {(p, p) for p in P}  # most decisions change no phase
    | {(P.ABSENT, P.UNFORMED), (P.UNFORMED, P.ABSENT)}  # a job is heard of; one that never formed is forgotten
    | {(P.ABSENT, P.FORMING)}  # a job of one rank, whose first hello forms it
    | {(P.UNFORMED, P.FORMING), (P.FORMING, P.TRAINING), (P.FORMING, P.VOIDED)}
    | {(P.VOIDED, P.FORMING)}  # a formation voided before it formed publishes the next
    | {(a, b) for a in _RUNNING for b in _RUNNING}  # a failure, a rebuild, its acks, a store lost or back
    | {(a, b) for a in {P.UNFORMED, P.FORMING, *_RUNNING} for b in _ENDED}  # the job ends, from anywhere
    | {(a, b) for a in _ENDED for b in {P.ABSENT, P.UNFORMED}}  # forgotten, or a new run of the name
)
"""(before, after) pairs one decision may make."""


class IllegalTransitionError(DeadPoolError, AssertionError):
    """A decision took a job from one phase to one no rule allows: a bug in the swapper's rules."""


def phase_of(state: JobState | None) -> JobPhase:
    if state is None:
        return P.ABSENT
    if state.finished:
        return P.FAILED if state.failed_reason else P.FINISHED
    if not state.started():
        return P.UNFORMED
    if state.recovery.pending is not None:
        return P.REBUILDING if state.recovery.formed else P.FORMING
    if 0 < state.recovery.void_generation == state.generation:
        return P.VOIDED
    if not state.recovery.formed:
        return P.FORMING
    if state.protection.held_since is not None:
        return P.HOLDING
    return P.TRAINING


def check_transition(job: str, before: JobPhase, after: JobPhase, why: str) -> None:
    if (before, after) not in LEGAL:
        raise IllegalTransitionError(f"job {job}: {before} -> {after} is not a legal transition ({why})")
