"""What a real member's heartbeat says within a step, for the benchmarks that simulate members.

A real member's beat names its training thread's innermost frame (`where`) and whether it is inside
torch's collective or autograd code (`waiting`), sampled at every beat: both change within a step. A
simulated member whose beat said the same thing until its step moved was kinder to the detector than
a real one (its launcher could name it instead of sending it whole).
"""

from __future__ import annotations

from deadpool_protocol import Heartbeat

__all__ = ["real_beat"]

FORWARD_SHARE = 0.3
"""Of a step: the forward pass, in the user's model code (not waiting)."""
BACKWARD_SHARE = 0.55
"""Then the backward pass and its gradient all-reduces, in autograd and torch.distributed (waiting);
the rest is the optimizer step, in the user's code again."""


def real_beat(
    job: str,
    generation: int,
    member: str,
    rank: int,
    pid: int,
    host: str,
    step: int,
    into: float,
    step_s: float,
    t0: float,
    now: float,
) -> Heartbeat:
    """The beat of `member` sent at `now` (wall clock), `into` (0 to 1) of the way through `step`, its
    steps `step_s` long from `t0` (wall clock)."""
    if into < FORWARD_SHARE:
        where, waiting = f"model.py:{40 + int(into * 100)} forward", False
    elif into < FORWARD_SHARE + BACKWARD_SHARE:
        where, waiting = "train.py:88 train_step", True
    else:
        where, waiting = f"optim.py:{120 + int(into * 100)} step", False
    return Heartbeat(
        job, generation, member, rank, pid, step, True, t0 + step * step_s, now, waiting=waiting, where=where, host=host
    )
