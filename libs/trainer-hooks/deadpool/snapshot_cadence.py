"""Which steps a rank streams to its stores: every K-th, with K the same on every rank of the job.

Every step is still captured into the member's own buffers when it has a crash copy (`host_copy`: a
crashed process loses at most one step whatever K is), but only every K-th step is streamed to the
stores, which is what a lost host can fall back to. K is a power of two and a rank streams step s
when `s % K == 0`: ranks that disagree on K for a moment (one has heard a peer's longer interval,
another not yet) still stream a common subset of steps, and those commit.

Each rank asks for the interval its own stream keeps up with (`own`), and tells its peers
(`SnapshotInterval`); the job streams at the longest interval any rank of the generation asks for
(`every`). A rank's own interval is measured on each snapshot that reached every one of its stores
(from its capture to its last seal, against the recent median step time):
- it goes up when two snapshots in a row took more than `FILL` of it, to the smallest power of two
  whose interval the quicker of the two fits in at `FILL`: a one-off (a first touch of memory, a
  pause) does not raise it, a slow data plane does within two snapshots;
- it goes up at once, to what the snapshot needed, when the snapshot held a due stream back (a skip
  while it streamed: it took longer than the whole interval). Skips are each rank's own, so while K is
  too short the ranks stream different steps and nothing commits: waiting for a second slow snapshot
  once left a job's committed step 17 steps behind at K = 8 (`bench/scale.py`, 1 GiB at 1 s steps),
  past the 2K-1 a lost host is told it may lose;
- it comes down once the snapshots of at least `SLACK_STEPS` steps, `SLACK_STREAMS` of them or more,
  would each have fit in half of it, to the longest interval one of them needed. The band between
  (a stream filling 40-80 % of its interval) is the hysteresis: K does not flap.
A snapshot that did not reach every store (one was lost, its upload abandoned when the swapper placed
the rank elsewhere) says nothing of the data plane's pace and changes nothing: a first version doubled
K at each due step the stream was still busy, and a lost store (a stream held for 2 s) took K to 32 in
30 steps, from which it took hundreds of steps to come down.

The budget (`--snapshot-budget`, a share of the step time, default 1 %) is the longest a step waits
for the previous stream: past it, the due step is captured without being streamed (a skip, counted),
and training never pays for a data plane slower than its steps beyond that. `--snapshot-every N` forces
N instead (the member then waits for the stream, as every snapshot was once streamed, so that a forced
interval is kept).
"""

from __future__ import annotations

import threading

from deadpool_protocol import SNAPSHOT_EVERY_MAX, SnapshotInterval

__all__ = ["ANNOUNCE_EVERY_S", "FILL", "PEER_TTL_S", "SLACK_STEPS", "SLACK_STREAMS", "SnapshotCadence"]

FILL = 0.8
"""The share of its interval a snapshot may take to store before the interval goes up."""
SLACK_STREAMS = 2
SLACK_STEPS = 8
"""Before the interval comes down: at least this many snapshots in a row that would have fit in half of
it, the last at least this many steps after the first (five at K = 2, three at K = 4, two from 8 on)."""
PEER_TTL_S = 10.0
"""A peer's interval counts this long after it was last heard (peers say it every `ANNOUNCE_EVERY_S`):
a peer gone silent (dead, or its messages lost) no longer holds the job at its interval."""
ANNOUNCE_EVERY_S = 2.0
"""How often a rank says its interval even when it has not changed (delivery at least once)."""


class SnapshotCadence:
    """One rank's view of the job's snapshot interval (the training thread asks, the control thread
    tells it what peers said)."""

    def __init__(self, budget: float, forced_every: int | None = None) -> None:
        if not 0 <= budget < 1:
            raise ValueError("the snapshot budget is a share of the step time, from 0 to below 1")
        if forced_every is not None and forced_every < 1:
            raise ValueError("a forced snapshot interval is a positive number of steps")
        self.budget = budget
        self.forced_every = forced_every
        self.own = 1
        """The interval this rank's own stream keeps up with (a power of two)."""
        self.skips = 0
        """Due streams skipped because the previous one was still running after the budget's wait."""
        self.generation = 0
        self.rank = -1
        self.world_size = 0
        self._slack = 0
        """Snapshots in a row that would have fit in half the interval, since step `_slack_since`; the
        longest interval one of them needed."""
        self._slack_since = 0
        self._slack_needed = 1
        self._last_needed: int | None = None
        """The interval the previous snapshot needed (the interval goes up on two in a row)."""
        self._skipped = False
        """A due stream was skipped since the last snapshot stored: that one took the whole interval."""
        self._peers: dict[int, tuple[int, float]] = {}
        """rank -> (interval, when heard, monotonic) for this generation."""
        self._lock = threading.Lock()

    @property
    def adaptive(self) -> bool:
        return self.forced_every is None

    def every(self, now: float) -> int:
        """The job's interval as this rank knows it: the longest any live rank of the generation asks for."""
        if self.forced_every is not None:
            return self.forced_every
        with self._lock:
            heard = [every for every, t in self._peers.values() if now - t <= PEER_TTL_S]
        return max([self.own, *heard])

    def wait_s(self, step_s: float) -> float:
        """How long a due capture may wait for the previous stream before it is skipped."""
        return self.budget * step_s

    def place(self, rank: int, world_size: int, generation: int) -> None:
        """A new generation: the peers' intervals of the old one no longer count (each says its own again)."""
        with self._lock:
            if generation != self.generation:
                self._peers.clear()
            self.rank, self.world_size, self.generation = rank, world_size, generation

    def heard(self, interval: SnapshotInterval, now: float) -> bool:
        """A peer said its interval (control thread); False if it is of another generation, our own, or
        of a rank the generation does not have (one key holder naming a million ranks must not make
        this map a million entries long)."""
        with self._lock:
            ours = interval.generation == self.generation and interval.rank < self.world_size
            if not ours or interval.rank == self.rank:
                return False
            self._peers[interval.rank] = (interval.every, now)
            return True

    def skipped(self) -> None:
        """A due stream was skipped: the previous one was still running after the budget's wait. The
        interval follows what that snapshot takes once it is stored (`streamed`: up at once, as it took
        the whole interval); a stream held up by a lost store is never stored, and no measure of the pace."""
        self.skips += 1
        self._slack = 0
        self._skipped = True

    def streamed(self, stream_s: float, step_s: float, step: int) -> None:
        """The snapshot of `step` reached every store `stream_s` after its capture while steps take
        `step_s`: adjust this rank's own interval."""
        if step_s <= 0:
            return
        needed = 1
        while needed < SNAPSHOT_EVERY_MAX and stream_s > FILL * needed * step_s:
            needed *= 2
        last, self._last_needed = self._last_needed, needed
        skipped, self._skipped = self._skipped, False
        if needed >= self.own:
            self._slack = 0
            if skipped and needed > self.own:  # it held the next due stream back
                self.own = needed
            elif last is not None and min(needed, last) > self.own:  # two in a row: not a one-off
                self.own = min(needed, last)
            return
        if self._slack == 0:
            self._slack_since, self._slack_needed = step, needed
        self._slack += 1
        self._slack_needed = max(self._slack_needed, needed)
        if self._slack >= SLACK_STREAMS and step - self._slack_since >= SLACK_STEPS:
            self.own, self._slack = self._slack_needed, 0
