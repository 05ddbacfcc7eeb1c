"""Was an exception out of a training step a broken collective (a peer or the network failed: regroup
and go on) or the step's own failure (a bug, a data loader timing out: the member fails with it)?

Decided by type and origin, never by words in the message. A timeout of the user's data loader says
"timed out" as a gloo timeout does, and taking it for a collective made the job regroup on the same
failing step again and again. A collective error is:
- a `torch.distributed.DistError` (NCCL's `DistBackendError`, store and network errors);
- a `RuntimeError` whose innermost frame is torch.distributed's or DDP's own code (a collective, a
  ZeRO broadcast, DDP's buffer sync), not user code they called;
- a `RuntimeError` raised by the communication backend's C++ code, which gloo raises without a
  type of its own and which reaches Python from autograd's engine (DDP's gradient hooks), where no
  Python frame tells: its message begins with the source location of the gloo or c10d file that
  raised it (`[.../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error ...`).
The chain of causes is followed, so an error raised while handling one of these is one too.
"""

from __future__ import annotations

import re
from pathlib import PurePath

import torch.distributed as dist

__all__ = ["is_collective_error"]

CAUSE_DEPTH_MAX = 8
"""How far down `__cause__`/`__context__` the origin is looked for."""
_BACKEND_SOURCE = re.compile(r"^\[[^\]\n]*(?:/gloo/|/c10d/|ProcessGroup\w*\.cpp|/nccl)[^\]\n]*:\d+\]")
_COMMUNICATION_CODE = (("torch", "distributed"), ("torch", "nn", "parallel", "distributed.py"))


def is_collective_error(exc: BaseException) -> bool:
    """True if `exc` means a peer or the network broke, as opposed to a failure of the step itself."""
    seen: BaseException | None = exc
    for _ in range(CAUSE_DEPTH_MAX):
        if seen is None:
            return False
        if _is_dist_error(seen) or (
            isinstance(seen, RuntimeError) and (_raised_by_communication_code(seen) or _raised_by_backend(seen))
        ):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _is_dist_error(exc: BaseException) -> bool:
    dist_error = getattr(dist, "DistError", None)
    return dist_error is not None and isinstance(exc, dist_error)


def _raised_by_communication_code(exc: BaseException) -> bool:
    tb = exc.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    parts = PurePath(tb.tb_frame.f_code.co_filename).parts
    return any(_contains(parts, code) for code in _COMMUNICATION_CODE)


def _contains(parts: tuple[str, ...], run: tuple[str, ...]) -> bool:
    return any(parts[i : i + len(run)] == run for i in range(len(parts) - len(run) + 1))


def _raised_by_backend(exc: BaseException) -> bool:
    return bool(_BACKEND_SOURCE.match(str(exc)))
