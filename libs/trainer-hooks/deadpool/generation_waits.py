"""The training thread's waits that belong to a generation, and ending them when it is superseded.

A member carrying out generation g's rebuild can be blocked on the network for a long time: fetching
a snapshot, connecting to the rendezvous store, inside `init_process_group` waiting for a peer that
will never come, in the replica exchange. None of those calls can be interrupted from Python, but
each blocks on sockets this process owns. So every such wait is registered here with a way to break
it (shutting its sockets down), and the control thread calls `supersede` the moment it learns that
g will not form: a newer rebuild, a void notice for g, or the job's end. The blocked call then fails
at once, and the training thread moves on to the newest command.

A wait registered for a generation that is already superseded is broken at once, so the race between
"register" and "supersede" always ends the wait.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable, Iterator

from deadpool.errors import SupersededError

__all__ = ["GenerationWaits"]


class GenerationWaits:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._newest = 0
        """The newest generation announced by a rebuild."""
        self._void = 0
        """The newest generation announced void."""
        self._ended = False
        self._waits: dict[int, tuple[int, Callable[[], None]]] = {}
        self._ids = itertools.count()

    def superseded(self, generation: int) -> bool:
        """Whether `generation` can no longer form (or train)."""
        with self._lock:
            return self._superseded(generation)

    def _superseded(self, generation: int) -> bool:
        return self._ended or generation < self._newest or generation <= self._void

    def check(self, generation: int) -> None:
        """Raise SupersededError if `generation` was superseded (called between the steps of a rebuild)."""
        if self.superseded(generation):
            raise SupersededError(f"generation {generation} was superseded")

    @contextlib.contextmanager
    def breakable(self, generation: int, breaker: Callable[[], None]) -> Iterator[None]:
        """Run the block as a wait of `generation`; `breaker` ends it (from another thread) if the
        generation is superseded meanwhile. Raises SupersededError afterwards if it was."""
        key = next(self._ids)
        with self._lock:
            self._waits[key] = (generation, breaker)
            already = self._superseded(generation)
        if already:
            breaker()
        try:
            yield
        except Exception as exc:
            if self.superseded(generation):  # the wait failed because we broke it
                raise SupersededError(f"generation {generation} was superseded") from exc
            raise
        finally:
            with self._lock:
                self._waits.pop(key, None)
        self.check(generation)

    def supersede(self, newest: int = 0, void: int = 0, ended: bool = False) -> int:
        """Control thread: record a newer rebuild, a void notice or the job's end, and break every wait
        of a generation that can no longer form. Returns how many waits were broken."""
        with self._lock:
            self._newest = max(self._newest, newest)
            self._void = max(self._void, void)
            self._ended = self._ended or ended
            breakers = [b for g, b in self._waits.values() if self._superseded(g)]
        for breaker in breakers:
            breaker()
        return len(breakers)
