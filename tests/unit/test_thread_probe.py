"""The heartbeat's view of the training thread: inside torch.distributed code it waits on its peers,
unless torch.compile is compiling (then it traces that code, busy in its own right).

The frames are real frames of a blocked thread; their code is compiled under the file names of the
torch modules the probe looks for, since no real compile can be caught half-way on demand."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from deadpool.thread_probe import probe_thread

DISTRIBUTED = "/venv/site-packages/torch/distributed/distributed_c10d.py"
CONVERT_FRAME = "/venv/site-packages/torch/_dynamo/convert_frame.py"


def function_in(filename: str, name: str, body: str) -> Callable[..., None]:
    namespace: dict[str, object] = {}
    exec(compile(f"def {name}(inner, ready, release):\n    {body}\n", filename, "exec"), namespace)
    function = namespace[name]
    assert callable(function)
    return function


def blocked_in(*files: str) -> tuple[bool, str]:
    """Probe a thread blocked in the innermost of nested functions defined in `files` (outermost first)."""
    ready = threading.Event()
    release = threading.Lock()
    release.acquire()
    innermost = function_in(files[-1], "wait", "ready.set(); release.acquire(timeout=10)")  # blocks in C
    chain = innermost
    for filename in reversed(files[:-1]):
        chain = _wrap(function_in(filename, "call", "inner(None, ready, release)"), chain)
    thread = threading.Thread(target=chain, args=(None, ready, release))
    thread.start()
    try:
        assert ready.wait(10)
        return probe_thread(thread.ident)
    finally:
        release.release()
        thread.join()


def _wrap(outer: Callable[..., None], inner: Callable[..., None]) -> Callable[..., None]:
    return lambda _, ready, release: outer(inner, ready, release)


@pytest.mark.parametrize(
    ("files", "waiting"),
    [
        ((DISTRIBUTED,), True),  # a collective, blocked on a peer
        ((CONVERT_FRAME, DISTRIBUTED), False),  # Dynamo tracing a collective: compiling
        (("/home/me/train.py", DISTRIBUTED), True),
    ],
)
def test_waiting_on_peers_unless_compiling(files: tuple[str, ...], waiting: bool) -> None:
    assert blocked_in(*files)[0] is waiting
