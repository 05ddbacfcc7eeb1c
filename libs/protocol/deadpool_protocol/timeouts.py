"""The one hierarchy every DeadPool timeout must respect, checked at start with a clear error.

    heartbeat period  <  heartbeat timeout  <  hang threshold floor  <  collective (process group) timeout

Each level must see a failure before the next one could: a heartbeat timeout shorter than a few
periods declares live members dead; a hang floor below the heartbeat timeout calls a frozen process
(silent) "hung" instead of silent; a collective timeout below the hang floor makes the survivors
raise (and leave the group) before the detector has named the hung rank. Defaults: 0.1 s < 5 s < 10 s
< 60 s; the demo's 0.1 s < 2 s < 3 s < 20 s.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "COLLECTIVE_TIMEOUT_S_DEFAULT",
    "HEARTBEATS_PER_TIMEOUT_MIN",
    "HEARTBEAT_PERIOD_S_DEFAULT",
    "TimeoutHierarchy",
]

HEARTBEAT_PERIOD_S_DEFAULT = 0.1
"""How often a member beats (`DEADPOOL_HEARTBEAT_PERIOD_S`), and how often a launcher sends its batch."""
COLLECTIVE_TIMEOUT_S_DEFAULT = 60.0
"""How long a collective may block (`DEADPOOL_PG_TIMEOUT_S`, `deadpool launch --collective-timeout-s`)."""

HEARTBEATS_PER_TIMEOUT_MIN = 3
"""A heartbeat timeout must span at least this many periods (one lost or late beat is not a death)."""


@dataclass(frozen=True)
class TimeoutHierarchy:
    heartbeat_period_s: float
    heartbeat_timeout_s: float
    hang_floor_s: float
    collective_timeout_s: float

    def check(self) -> None:
        """Raise ValueError naming every level that is out of order."""
        problems = []
        if self.heartbeat_period_s <= 0:
            problems.append("the heartbeat period must be positive")
        if self.heartbeat_timeout_s < HEARTBEATS_PER_TIMEOUT_MIN * self.heartbeat_period_s:
            problems.append(
                f"heartbeat timeout {self.heartbeat_timeout_s} s must be at least {HEARTBEATS_PER_TIMEOUT_MIN} "
                f"heartbeat periods ({HEARTBEATS_PER_TIMEOUT_MIN * self.heartbeat_period_s:g} s)"
            )
        if self.hang_floor_s <= self.heartbeat_timeout_s:
            problems.append(
                f"hang floor {self.hang_floor_s} s must exceed the heartbeat timeout {self.heartbeat_timeout_s} s"
            )
        if self.collective_timeout_s <= self.hang_floor_s:
            problems.append(
                f"collective timeout {self.collective_timeout_s} s must exceed the hang floor {self.hang_floor_s} s"
            )
        if problems:
            raise ValueError(
                "inconsistent timeouts (heartbeat period < heartbeat timeout < hang floor < collective timeout): "
                + "; ".join(problems)
            )
