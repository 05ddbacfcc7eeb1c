"""A store's reports of the snapshots it sealed: one message per step per batch, not one per rank.

At 16,384 ranks and R = 2, one report per rank copy was 32,768 events per step through the events
stream, and as many inputs for the swapper. A store now gathers what it seals of a (job, generation,
step) for `SEALED_REPORT_S` after the first seal not yet reported, then publishes one
`SnapshotComplete` naming every rank of it (at most `SEALED_PER_REPORT_MAX`; a batch that reaches it
goes out at once). A commit waits at most `SEALED_REPORT_S` longer for its last copy; the messages
per step are bounded by the stores and the time the step's uploads are spread over, not by the ranks.

The report is an event (published until the stream has it); a repeated report (a snapshot sealed again
after a replica copy) is counted once by the swapper.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from deadpool_protocol import SnapshotComplete, Subjects
from deadpool_protocol.bounds import SEALED_PER_REPORT_MAX

__all__ = ["SEALED_REPORT_S", "SealedReports"]

SEALED_REPORT_S = 0.01
"""How long a store gathers seals of one step before it reports them (the commit's added wait)."""

Publish = Callable[[str, SnapshotComplete], object]


class SealedReports:
    def __init__(self, store: str, publish: Publish, window_s: float = SEALED_REPORT_S) -> None:
        self.store = store
        self._publish = publish
        self.window_s = window_s
        self._batches: dict[tuple[str, int, int], dict[int, int]] = {}
        """(job, generation, step) -> rank -> bytes, sealed and not reported yet."""
        self._timer: asyncio.TimerHandle | None = None
        self.reports = 0
        """Reports published (a figure for tests and benchmarks)."""

    def sealed(self, job: str, generation: int, step: int, rank: int, nbytes: int) -> None:
        key = (job, generation, step)
        batch = self._batches.setdefault(key, {})
        batch[rank] = nbytes
        if len(batch) >= SEALED_PER_REPORT_MAX:
            self._send(key)
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.window_s, self.flush)

    def flush(self) -> None:
        """Report every batch now (the window ended, or the store stops)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for key in list(self._batches):
            self._send(key)

    def _send(self, key: tuple[str, int, int]) -> None:
        batch = self._batches.pop(key)
        job, generation, step = key
        ranks = sorted(batch)
        report = SnapshotComplete(job, generation, self.store, step, ranks, [batch[r] for r in ranks])
        self._publish(Subjects.for_job(job).snapshot_complete_by(self.store), report)
        self.reports += 1
