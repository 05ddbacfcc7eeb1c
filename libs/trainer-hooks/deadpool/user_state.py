"""The user's own training state, registered with the job by name: anything with `state_dict()` and
`load_state_dict()` (the `Stateful` protocol of `torch.distributed.checkpoint`): an LR scheduler, a
`torch.amp.GradScaler`, torchdata's `StatefulDataLoader`, an EMA module, a dict-like of counters.

Two kinds of registration:
- an **object**, kept for the whole run: its state is captured with every snapshot and loaded back
  into it at every rebuild;
- a **factory** `optimizer -> object`, for objects bound to an optimizer the job builds (a
  scheduler over a `ZeroRedundancyOptimizer` built by the job's factory): it is called again for
  each generation's optimizer, before the optimizer's state is loaded (a scheduler's constructor
  sets the learning rate, which the snapshot's then overrides), and the new object gets the
  snapshot's state. `job.state[name]` is always the current one.

An object given an optimizer of its own (the user's optimizer passed to `attach`) needs no factory:
that optimizer is the same object for the whole run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

__all__ = ["UserState"]

BoundFactory = Callable[[torch.optim.Optimizer], Any]


def _is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


class UserState(Mapping[str, Any]):
    """Name -> the registered object of the current generation (see the module docstring)."""

    def __init__(self) -> None:
        self._kept: dict[str, Any] = {}
        self._factories: dict[str, BoundFactory] = {}
        self._built: dict[str, Any] = {}

    def register(self, name: str, obj: Any) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError("registered state needs a non-empty name")
        if name in self._kept or name in self._factories:
            raise ValueError(f"state {name!r} is registered already")
        if _is_stateful(obj):
            self._kept[name] = obj
        elif callable(obj):
            self._factories[name] = obj
        else:
            raise TypeError(
                f"state {name!r}: a {type(obj).__qualname__} has no state_dict()/load_state_dict(); register "
                "an object that has them, or a factory taking the optimizer and returning one"
            )

    def read_once(self, name: str | None = None) -> None:
        """Read the state of the object registered as `name` (None: of every registered object) once,
        now, outside any rebuild.

        A `StatefulDataLoader` with worker processes has no iterator until it is iterated or its state
        is read; reading its state makes one, which forks the workers and waits, with no bound, until
        each has started. Left to the first snapshot, that happened inside the formation's rebuild
        (SEAL), with DeadPool's threads running and nothing able to end the wait: the one wait without
        a bound between a rank's "rendezvous" and its "rebuild done", where a rank once stayed for
        minutes while its peer's first collective timed out (issue 21). A ranked member's `attach`
        reads them before DeadPool starts a thread, so its workers are forked before any exists, and
        torchdata keeps that iterator for the loop's first `iter(loader)`. A spare's and a resumed
        job's are left alone: their first rebuild loads a snapshot's state into them (which would stop
        those workers again), and a resumed formation's SEAL captures that state as loaded
        (`Job._capture`). Only a spare taken into a formation from scratch still forks them in SEAL.
        A factory's object is not built yet: only the snapshots read it."""
        for key, obj in self._kept.items():
            if name is None or key == name:
                obj.state_dict()

    def bind(self, optimizer: torch.optim.Optimizer) -> None:
        """Build every factory's object for `optimizer` (a new generation's). Raises what a factory
        raises, or TypeError if it returned something without a state."""
        built = {}
        for name, factory in self._factories.items():
            obj = factory(optimizer)
            if not _is_stateful(obj):
                raise TypeError(f"the factory of state {name!r} returned a {type(obj).__qualname__}, without a state")
            built[name] = obj
        self._built = built

    def __getitem__(self, name: str) -> Any:
        if name in self._kept:
            return self._kept[name]
        if name in self._built:
            return self._built[name]
        if name in self._factories:
            raise KeyError(f"state {name!r} is built with the optimizer, once this member holds a rank")
        raise KeyError(name)

    def __iter__(self) -> Iterator[str]:
        yield from self._kept
        yield from (name for name in self._factories if name in self._built)

    def __len__(self) -> int:
        return len(self._kept) + sum(name in self._built for name in self._factories)
