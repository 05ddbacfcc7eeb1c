"""What the hooks cost each step, measured on the training thread, for benchmarks and operators.

Per step: the wall time from this step's start to the next one's (`step_s`), when it completed
(`t_completed`, wall clock), and the time the training thread spent inside DeadPool (`stall_s`: the
step-start bookkeeping, the capture call, and any wait in the optimizer pre-hook for a copy still
running). Kept in memory (bounded) and written as
JSON when the member closes, if `DEADPOOL_STATS_DIR` is set.
"""

from __future__ import annotations

import json
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["StepStats"]

STEPS_KEPT_MAX = 100_000
RECENT_STEPS = 16
"""Steps the recent step time is the median of."""


@dataclass
class StepStats:
    steps: list[dict[str, Any]] = field(default_factory=list)
    snapshot_bytes: int = 0
    snapshot_bytes_whole: int = 0
    listener: Callable[[dict[str, Any]], None] | None = None
    """Told of every step's record as it is made (the member's metrics)."""
    _current: dict[str, Any] | None = None
    _recent: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_STEPS))

    def started(self, step: int, generation: int) -> None:
        now = time.perf_counter()
        if self._current is not None and self._current.get("done"):
            current = self._current
            record = {
                "step": current["step"],
                "generation": current["generation"],
                "step_s": now - current["t"],
                "t_completed": current["t_completed"],
                "stall_s": current["stall_s"],
                "captured": current["captured"],
            }
            if len(self.steps) < STEPS_KEPT_MAX:
                self.steps.append(record)
            self._recent.append(record["step_s"])
            if self.listener is not None:
                self.listener(record)
        self._current = {"step": step, "generation": generation, "t": now, "stall_s": 0.0, "captured": False}

    def recent_step_s(self) -> float:
        """The median of the last `RECENT_STEPS` step times (0 before the first)."""
        return statistics.median(self._recent) if self._recent else 0.0

    def stalled(self, seconds: float) -> None:
        if self._current is not None:
            self._current["stall_s"] += seconds

    def completed(self, captured: bool) -> None:
        if self._current is not None:
            self._current["done"] = True
            self._current["t_completed"] = time.time()
            self._current["captured"] = captured

    def abandoned(self) -> None:
        """The step broke (a failure): it is not a step time."""
        self._current = None

    def write(self, directory: str, member: str, extra: dict[str, Any]) -> None:
        path = Path(directory) / f"{member}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        record = {
            "member": member,
            "snapshot_bytes": self.snapshot_bytes,
            "snapshot_bytes_whole": self.snapshot_bytes_whole,
            "steps": self.steps,
            **extra,
        }
        path.write_text(json.dumps(record))
