"""Process bodies for the abort tests (module-level so `multiprocessing` can spawn them)."""

from __future__ import annotations

import os
import signal
import time
from typing import Any


def join(rank: int, world_size: int, port: int) -> Any:
    import torch.distributed as dist

    from deadpool.process_group import GenerationGroup

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    store = dist.TCPStore("127.0.0.1", port, None, rank == 0, wait_for_workers=False)
    group = GenerationGroup()
    group.create(dist.PrefixStore("g1/", store), rank, world_size, "gloo", 60.0, 1, {port})
    dist.barrier()
    return group, store


def blocked_receiver(rank: int, world_size: int, port: int, results: Any, abort_myself: Any) -> None:
    """Receives from rank 0, which never sends; reports how it got out. With `abort_myself` set by the
    test, another thread of this process aborts the group (as the control thread does on a rebuild)."""
    import threading

    import torch
    import torch.distributed as dist

    group, _store = join(rank, world_size, port)

    def aborter() -> None:
        abort_myself.wait()
        group.abort()

    threading.Thread(target=aborter, daemon=True).start()
    results.put(("waiting", rank, 0.0, ""))
    started = time.monotonic()
    try:
        dist.recv(torch.zeros(10), src=0)
        results.put(("received", rank, time.monotonic() - started, ""))
    except RuntimeError as exc:
        from deadpool.failure_origin import is_collective_error

        kind = "released" if is_collective_error(exc) else "released, but not taken for a collective error"
        results.put((kind, rank, time.monotonic() - started, str(exc)))


def silent_peer(rank: int, world_size: int, port: int, results: Any, done: Any) -> None:
    """Joins, then neither sends nor dies (a peer stuck elsewhere) until the test is over."""
    _group, _store = join(rank, world_size, port)
    results.put(("joined", rank, 0.0, ""))
    done.wait()


def aborting_survivor(rank: int, world_size: int, port: int, results: Any, done: Any) -> None:
    """Waits on the rank that dies, then aborts its group while still holding a reference to it (as a
    failed collective's traceback does), which must release peers waiting on this rank."""
    import torch
    import torch.distributed as dist

    group, _store = join(rank, world_size, port)
    try:
        dist.recv(torch.zeros(10), src=2)
    except RuntimeError:
        held = dist.group.WORLD  # noqa: F841 - the reference that keeps gloo's sockets open
        group.abort()
        results.put(("aborted", rank, 0.0, ""))
        done.wait()


def dying_rank(rank: int, world_size: int, port: int, results: Any, done: Any) -> None:
    _group, _store = join(rank, world_size, port)
    os.kill(os.getpid(), signal.SIGKILL)
