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
DETECTOR_EVENTS = ("child_exit", "member_error", "member_done")
"""What the detector consumes besides heartbeats: exits, members' own reports, completion."""


def event_subjects(job: str = "*", topics: tuple[str, ...] = tuple(EVENT_KINDS)) -> list[str]:
    """The subjects of `topics` for one job, or for every job with `*`."""
    subjects = Subjects(job) if job == "*" else Subjects.for_job(job)
    return [getattr(subjects, topic) for topic in topics]
