"""A launcher's batch names a member whose beat says nothing new, instead of repeating the beat.

Members beat at 10 Hz and a step takes a second or more, so nine beats in ten say what the one before
said, its send time aside. At 16,384 members the detector decoded 164,000 beats a second, each a
dozen checked fields: more than a core. A batch now carries a member's whole beat when anything in it
changed and at least every `HEARTBEAT_REFRESH_S` (so a detector that just started learns every
member's state within that), and only the member's name otherwise (`HeartbeatBatch.alive`): alive
now, as it last said.

Two fields change within a step, many times a second, and do not make a beat whole: `where` (the
training thread's innermost frame) is evidence read when a hang is judged, seconds after the frame
stopped changing, so the refresh carries it soon enough; `waiting` (inside torch's collectives or not)
is sampled by the straggler rule every period, so it rides beside the name as one bit
(`HeartbeatBatch.alive_waiting`). Before, a real member's beat was whole in nearly every batch.

The refresh is 2 s. At 1 s, with a step every 2 s, a member's whole beat went once a second; at 2 s
the steps alone make nearly all of them (0.51 a second), and the detector's decoding of 16,384
members' batches fell from 12.5 to 9.5 µs per member and second (`detector_at_size_us`, one process).
What waits for the refresh is read seconds later: the hang rule reads `where` at its threshold
(`hang_floor_s`, 10 s by default, 3 s in the tests), and a detector that starts late watches its
members from the job record meanwhile.
"""

from __future__ import annotations

import dataclasses
import operator

from deadpool_protocol import Heartbeat, HeartbeatBatch
from deadpool_protocol.bounds import BEAT_AGE_MS_MAX

__all__ = ["HEARTBEAT_REFRESH_S", "BeatCompaction"]

HEARTBEAT_REFRESH_S = 2.0
"""A member's whole beat goes out at least this often, changed or not."""


class BeatCompaction:
    def __init__(self, refresh_s: float = HEARTBEAT_REFRESH_S) -> None:
        self.refresh_s = refresh_s
        self._sent: dict[str, tuple[Heartbeat, float]] = {}
        """member -> its last whole beat sent, and when (monotonic)."""

    def split(self, beats: list[Heartbeat], now: float) -> tuple[list[Heartbeat], list[Heartbeat]]:
        """The beats to send whole, and those to send as a name (with their `waiting`). Members that
        sent no beat this period are forgotten (a member that comes back sends its whole beat again)."""
        whole: list[Heartbeat] = []
        named: list[Heartbeat] = []
        sent: dict[str, tuple[Heartbeat, float]] = {}
        for beat in beats:
            last = self._sent.get(beat.member)
            if last is not None and now - last[1] < self.refresh_s and _same_but_moment(beat, last[0]):
                named.append(beat)
                sent[beat.member] = last
            else:
                whole.append(beat)
                sent[beat.member] = (beat, now)
        self._sent = sent
        return whole, named

    def batch(
        self, job: str, generation: int, launcher: str, received: dict[str, tuple[Heartbeat, float]], now: float
    ) -> HeartbeatBatch:
        """The batch of the beats `received` since the last one (member -> its newest beat and when it
        came, monotonic): whole or named (`split`), each with its age at `now` (`HeartbeatBatch.ages_ms`)."""
        whole, named = self.split([hb for hb, _ in received.values()], now)
        ages = [_age_ms(now, received[hb.member][1]) for hb in [*whole, *named]]
        alive, waiting = [hb.member for hb in named], [hb.waiting for hb in named]
        return HeartbeatBatch(job, generation, launcher, whole, alive, ages, waiting)


WITHIN_A_STEP = frozenset({"t", "where", "waiting"})
"""A beat's fields that change without making it whole: its send time, and what changes within a step."""
_SAID = operator.attrgetter(
    *(f.name for f in dataclasses.fields(Heartbeat) if f.compare and f.name not in WITHIN_A_STEP)
)
"""Every other field of a beat, as one tuple (built and compared in C: a launcher of the scale bench
asks this of 4,096 members four times a second, and a copy of the beat to compare took a quarter of it)."""


def _same_but_moment(beat: Heartbeat, last: Heartbeat) -> bool:
    """`beat` says what `last` said, but for its send time and what changes within a step."""
    return bool(_SAID(beat) == _SAID(last))


def _age_ms(now: float, received: float) -> int:
    return min(BEAT_AGE_MS_MAX, max(0, round((now - received) * 1000)))
