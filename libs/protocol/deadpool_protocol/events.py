"""Which control-plane messages are *events*: they change state, so they travel through a JetStream
stream and are delivered at least once.

Everything else stays on core NATS: heartbeats and status (losing one harms nobody), and the
swapper's commands (`rebuild`, `void`, `finished`), which it retransmits until every member has
confirmed them. An event is published with a `Nats-Msg-Id`, so a publisher that retries after a lost
acknowledgement does not store it twice, and every receiver handles a repeated event as a no-op.
"""

from __future__ import annotations

from deadpool_protocol.messages import (
    ChildExit,
    Failure,
    GroupBroken,
    MemberDone,
    MemberError,
    Message,
    RebuildAck,
    RebuildAckBatch,
    SnapshotComplete,
    StepResumed,
    StepResumedBatch,
)
from deadpool_protocol.subjects import Subjects

__all__ = [
    "DETECTOR_EVENTS",
    "EVENTS_STREAM",
    "EVENT_KINDS",
    "SWAPPER_EVENTS",
    "SWAPPER_IN_TURN",
    "SWAPPER_REPORTS",
    "event_subjects",
]

EVENTS_STREAM = "DEADPOOL_EVENTS"

EVENT_KINDS: dict[str, type[Message]] = {
    "failure": Failure,
    "rebuild_ack": RebuildAck,
    "rebuild_ack_batch": RebuildAckBatch,
    "group_broken": GroupBroken,
    "snapshot_complete": SnapshotComplete,
    "member_done": MemberDone,
    "step_resumed": StepResumed,
    "step_resumed_batch": StepResumedBatch,
    "member_error": MemberError,
    "child_exit": ChildExit,
}
"""`Subjects` property name -> the message published there."""

SWAPPER_EVENTS = (
    "failure",
    "rebuild_ack",
    "rebuild_ack_batch",
    "group_broken",
    "snapshot_complete",
    "member_done",
    "step_resumed",
    "step_resumed_batch",
)
"""What the swapper consumes: verdicts, acks, commits' raw material, completion, first steps."""
SWAPPER_REPORTS = ("snapshot_complete",)
"""The stores' reports of the ranks they sealed, which commit steps. The swapper reads them in a lane of
their own, ahead of its other events (`SWAPPER_IN_TURN`): a commit behind a rebuild's acks and first
steps (a batch per host of each: 2,048 at 16,384 ranks) waited 200-430 ms at 8,192 ranks. A report
overtaking them changes nothing it decides: a step's copies were sealed before it was reported, a
step every rank sealed is a valid restore whatever failed since, and a report of a generation that
has been replaced counts only for steps that generation's restore kept (`on_snapshot_complete`). The
other events keep their order among themselves: a failure read before the acks stored ahead of it
would find their rebuild still pending (a formation: not formed, so a fresh start)."""
SWAPPER_IN_TURN = tuple(kind for kind in SWAPPER_EVENTS if kind not in SWAPPER_REPORTS)
"""The swapper's events read in the stream's order: verdicts, acks, first steps, broken groups, completion."""
DETECTOR_EVENTS = ("child_exit", "member_error", "member_done")
"""What the detector consumes besides heartbeats: exits, members' own reports, completion."""


def event_subjects(job: str = "*", topics: tuple[str, ...] = tuple(EVENT_KINDS)) -> list[str]:
    """The subjects of `topics` for one job, or for every job with `*`."""
    subjects = Subjects(job) if job == "*" else Subjects.for_job(job)
    return [getattr(subjects, topic) for topic in topics]
