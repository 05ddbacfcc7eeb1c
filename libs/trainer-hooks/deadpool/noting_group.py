"""A process group that notes a failed collective instead of raising it: the way torchft lets a step
fail without a context manager around it.

DDP built over a `NotingGroup` (`wrap=deadpool.ddp`) runs its collectives (the gradient all-reduce,
the unused-parameter map, the buffer broadcast in forward, the checks at construction) through the
generation's real group. When one fails (a peer died, the group was aborted on a rebuild), the error
is noted and the collective completes with its tensors as they are. Backward then returns, the
optimizer's step is skipped (`skip_step_after_failure`: the gradients were not reduced), and the
job, at the end of the step (`job.steps()` asked for the next one, or `with job.step()` ending),
sees the note and recovers: the swapper's rebuild, then the restored step. The loop body needs no
re-indenting under a context manager.

Collectives that do not go through this group (ZeRO's broadcasts, a loss all-reduce of the user's
own, FSDP2's, which needs a registered group) raise as before: keep those steps inside
`with job.step()`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
from torch.distributed import ProcessGroup, Work

__all__ = ["FailureNote", "NotingGroup", "skip_step_after_failure"]


class FailureNote:
    """The first collective failure of the current step, from any thread (None: none)."""

    def __init__(self) -> None:
        self.error: Exception | None = None

    def note(self, exc: Exception) -> None:
        if self.error is None:
            self.error = exc

    def clear(self) -> None:
        self.error = None


class _NotingWork(Work):
    def __init__(self, work: Work, result: Any, note: FailureNote) -> None:
        super().__init__()
        self._work, self._result, self._note = work, result, note

    def wait(self, timeout: timedelta | None = None) -> bool:
        try:
            self._work.wait()
        except Exception as exc:
            self._note.note(exc)
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        def settled(done: torch.futures.Future[Any]) -> Any:
            try:
                return done.value()
            except Exception as exc:
                self._note.note(exc)
                return self._result

        future: torch.futures.Future[Any] = self._work.get_future().then(settled)
        return future


class _DoneWork(Work):
    """A collective that could not even start (the group is broken): complete at once."""

    def __init__(self, result: Any) -> None:
        super().__init__()
        self._future: torch.futures.Future[Any] = torch.futures.Future()
        self._future.set_result(result)

    def wait(self, timeout: timedelta | None = None) -> bool:
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        return self._future


class NotingGroup(ProcessGroup):
    """`group`'s collectives, their failures noted in `note` instead of raised (see the module docstring)."""

    def __init__(self, group: ProcessGroup, note: FailureNote) -> None:
        super().__init__(group.rank(), group.size())  # type: ignore[call-arg]
        self._group, self._note = group, note

    def _run(self, start: Callable[[], Work], result: Any) -> Work:
        try:
            work = start()
        except Exception as exc:
            self._note.note(exc)
            return _DoneWork(result)
        return _NotingWork(work, result, self._note)

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> Work:  # type: ignore[override]
        return self._run(lambda: self._group.allreduce(tensors, opts), tensors)

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any) -> Work:  # type: ignore[override]
        return self._run(lambda: self._group.allgather(outputs, inputs, opts), outputs)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> Work:  # type: ignore[override]
        return self._run(lambda: self._group.broadcast(tensors, opts), tensors)

    def barrier(self, opts: Any) -> Work:  # type: ignore[override]
        return self._run(lambda: self._group.barrier(opts), None)

    def size(self) -> int:
        return int(self._group.size())

    def getBackendName(self) -> str:
        return f"noting-{self._group.name()}"


def skip_step_after_failure(optimizer: torch.optim.Optimizer, note: FailureNote) -> None:
    """Make `optimizer.step()` do nothing in a step whose collectives failed (once per optimizer)."""
    original = optimizer.step
    if getattr(original, "_deadpool_skips_after_failure", False):
        return

    @functools.wraps(original)
    def step(*args: Any, **kwargs: Any) -> Any:
        if note.error is not None:
            return None
        return original(*args, **kwargs)

    step._deadpool_skips_after_failure = True  # type: ignore[attr-defined]
    optimizer.step = step  # type: ignore[method-assign]
