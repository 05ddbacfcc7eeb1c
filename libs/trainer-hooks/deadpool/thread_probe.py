"""Where the training thread is, seen from the heartbeat thread: waiting on peers, or in user code.

When a rank hangs, its peers hang too, blocked in the collective that waits for it. Step progress
alone cannot tell them apart; the training thread's Python stack can: the innermost frame of a rank
blocked on its peers is torch's distributed, autograd (DDP reduces gradients during backward) or DDP
code, calling into C++ that waits; the culprit's is somewhere else (a data loader, a stuck lock, an
endless loop). A blocked C++ call inside backward is counted as waiting too, so a rank stuck in a
kernel of its own is not identifiable this way (the detector then names no culprit). Sampled every heartbeat from
`sys._current_frames()`, which costs microseconds. A thread compiling (`COMPILING_MARKERS` anywhere on
its stack) is busy, not waiting.
"""

from __future__ import annotations

import os
import sys
from types import FrameType

__all__ = ["COMPILING_MARKERS", "WAITING_MARKERS", "probe_thread"]

WAITING_MARKERS = (
    f"{os.sep}torch{os.sep}distributed{os.sep}",
    f"{os.sep}torch{os.sep}autograd{os.sep}",
    f"{os.sep}torch{os.sep}nn{os.sep}parallel{os.sep}",
    f"{os.sep}deadpool{os.sep}noting_group.py",
)
"""Code a thread is in while it waits for its peers (collectives; backward, where DDP reduces)."""
COMPILING_MARKERS = (
    f"{os.sep}torch{os.sep}_dynamo{os.sep}convert_frame.py",
    f"{os.sep}torch{os.sep}_inductor{os.sep}compile_fx.py",
)
"""`torch.compile` compiling (Dynamo converting a frame, Inductor compiling a forward or a lazily
compiled backward): busy in the rank's own right, even where the innermost frame is torch's
distributed or autograd code being traced. Running compiled code is not compiling: a compiled
model waiting on a peer still waits."""
_LIBRARY_MARKERS = (f"{os.sep}site-packages{os.sep}", f"{os.sep}deadpool{os.sep}", f"{os.sep}lib{os.sep}python3")
FRAMES_EXAMINED_MAX = 64


def probe_thread(thread_id: int | None) -> tuple[bool, str]:
    """(waiting, where) for thread `thread_id`: whether its innermost frame is torch's distributed/
    autograd/DDP code, and its innermost frame in user code as 'file:line function' ('' if unknown)."""
    if thread_id is None:
        return False, ""
    frame: FrameType | None = sys._current_frames().get(thread_id)
    if frame is None:
        return False, ""
    waiting = any(marker in frame.f_code.co_filename for marker in WAITING_MARKERS)
    where = ""
    for _ in range(FRAMES_EXAMINED_MAX):
        if frame is None:
            break
        filename = frame.f_code.co_filename
        if waiting and any(marker in filename for marker in COMPILING_MARKERS):
            waiting = False  # compiling: tracing a collective is not waiting on peers
        if not where and not any(marker in filename for marker in _LIBRARY_MARKERS):
            where = f"{os.path.basename(filename)}:{frame.f_lineno} {frame.f_code.co_name}"
            if not waiting:
                break
        frame = frame.f_back
    return waiting, where
