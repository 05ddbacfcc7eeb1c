"""Getting survivors out of a broken gloo collective, with real processes and a real SIGKILL.

gloo offers no abort that releases a collective blocked on a peer that is alive but gone quiet, and
destroying a group does not close its sockets while anything references it. `GenerationGroup.abort()`
shuts the group's connections down; these tests show it releases a blocked rank whether the abort runs
in the blocked process's own control thread or in the peer it waits on.
"""

from __future__ import annotations

from typing import Any

from deadpool_cli.nats_server import free_port

from . import gloo_members
from .conftest import stop_processes

PG_TIMEOUT_S = 60.0
GET_TIMEOUT_S = 90.0


def test_a_blocked_rank_is_released_by_its_own_control_thread(ctx: Any) -> None:
    abort_myself, done = ctx.Event(), ctx.Event()
    port = free_port()
    results = ctx.Queue()
    peer = ctx.Process(target=gloo_members.silent_peer, args=(0, 2, port, results, done), daemon=True)
    blocked = ctx.Process(target=gloo_members.blocked_receiver, args=(1, 2, port, results, abort_myself), daemon=True)
    peer.start()
    blocked.start()
    try:
        seen = {results.get(timeout=GET_TIMEOUT_S)[0] for _ in range(2)}
        assert seen == {"joined", "waiting"}
        abort_myself.set()
        kind, rank, elapsed, error = results.get(timeout=GET_TIMEOUT_S)
        assert (kind, rank) == ("released", 1), error
        assert elapsed < PG_TIMEOUT_S / 2  # out through the abort, not the timeout
    finally:
        done.set()
        stop_processes([peer, blocked])


def test_a_survivor_that_aborts_releases_the_ranks_waiting_on_it(ctx: Any) -> None:
    done, never = ctx.Event(), ctx.Event()
    port = free_port()
    results = ctx.Queue()
    processes = [
        ctx.Process(target=gloo_members.aborting_survivor, args=(0, 3, port, results, done), daemon=True),
        ctx.Process(target=gloo_members.blocked_receiver, args=(1, 3, port, results, never), daemon=True),
        ctx.Process(target=gloo_members.dying_rank, args=(2, 3, port, results, done), daemon=True),
    ]
    for p in processes:
        p.start()
    try:
        events = [results.get(timeout=GET_TIMEOUT_S) for _ in range(3)]
        by_kind = {kind: (rank, elapsed, error) for kind, rank, elapsed, error in events}
        assert set(by_kind) == {"waiting", "aborted", "released"}
        rank, elapsed, error = by_kind["released"]
        assert rank == 1 and elapsed < PG_TIMEOUT_S / 2, error
        assert "closed" in error.lower() or "reset" in error.lower()
    finally:
        done.set()
        stop_processes(processes)
