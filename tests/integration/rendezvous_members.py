"""Process bodies for the superseded-rendezvous tests (module-level so `multiprocessing` can spawn them).

Each member runs the product's own pieces: `Rendezvous` (a client store per generation),
`GenerationGroup` (a creation that can be broken) and `GenerationWaits`, with a thread standing in
for the control thread that learns of a newer generation. Times are `time.monotonic()`, which every
process on the host shares.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from deadpool_protocol import Rebuild, StoreAddress

PG_TIMEOUT_S = 60.0


def command(generation: int, ranks: list[str], host: str, port: int) -> Rebuild:
    return Rebuild(
        job="j",
        generation=generation,
        world_size=len(ranks),
        ranks=ranks,
        spares=[],
        rendezvous_member=host,
        rendezvous_host="127.0.0.1",
        rendezvous_port=port,
        restore_step=-1,
        stores=[StoreAddress("s", "127.0.0.1", 1)],
        placement=[["s"] for _ in ranks],
        incident="",
        t_decided=time.time(),
    )


class Member:
    def __init__(self, name: str) -> None:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
        from deadpool.generation_waits import GenerationWaits
        from deadpool.process_group import GenerationGroup, Rendezvous

        self.name = name
        self.rendezvous = Rendezvous("127.0.0.1", PG_TIMEOUT_S)
        self.group = GenerationGroup()
        self.waits = GenerationWaits()

    def form(self, cmd: Rebuild) -> float:
        """One generation's CONNECT and FORM states, then a collective that proves the group works;
        returns the all-reduced value."""
        import torch
        import torch.distributed as dist

        g = cmd.generation
        store, sockets = self.rendezvous.store_for(cmd, self.name, self.waits, time.monotonic() + PG_TIMEOUT_S)
        try:
            self.group.create(store, cmd.rank_of(self.name), cmd.world_size, "gloo", PG_TIMEOUT_S, g, {1}, sockets)
        except RuntimeError:
            self.waits.check(g)  # raises SupersededError if that is why it broke
            raise
        value = torch.ones(1)
        dist.all_reduce(value)
        return float(value.item())

    def supersede_on(self, event: Any, generation: int) -> None:
        """What the control thread does when a newer rebuild arrives (in a thread, when `event` is set)."""

        def control() -> None:
            event.wait()
            self.waits.supersede(newest=generation)
            self.group.abort(below_generation=generation)

        threading.Thread(target=control, daemon=True).start()


def lone_host(port_out: Any, results: Any, newer: Any, again: Any) -> None:
    """Hosts generation 1 of a world of 2 whose other member never comes, is told of generation 2,
    then forms generation 2 with a fresh member (a process that never saw generation 1)."""
    from deadpool.errors import SupersededError

    me = Member("a")
    port_out.put(me.rendezvous.port)
    me.supersede_on(newer, 2)
    results.put(("forming", 1, time.monotonic(), ""))
    try:
        me.form(command(1, ["a", "ghost"], "a", me.rendezvous.port))
        results.put(("formed", 1, time.monotonic(), ""))
    except SupersededError as exc:
        results.put(("released", 1, time.monotonic(), repr(exc.__cause__)))
    again.wait()
    total = me.form(command(2, ["a", "b"], "a", me.rendezvous.port))
    results.put(("formed", 2, time.monotonic(), str(total)))


def fresh_member(host_port: int, results: Any) -> None:
    me = Member("b")
    total = me.form(command(2, ["a", "b"], "a", host_port))
    results.put(("formed-fresh", 2, time.monotonic(), str(total)))


def client_of_frozen_host(host_port: int, results: Any, newer: Any) -> None:
    """Joins generation 1, hosted by a member that is frozen (SIGSTOP), and is told of generation 2."""
    from deadpool.errors import SupersededError

    me = Member("b")
    me.supersede_on(newer, 2)
    results.put(("forming", 1, time.monotonic(), ""))
    try:
        me.form(command(1, ["a", "b"], "a", host_port))
        results.put(("formed", 1, time.monotonic(), ""))
    except SupersededError as exc:
        results.put(("released", 1, time.monotonic(), repr(exc.__cause__)))


def rendezvous_host(port_out: Any, hold: Any) -> None:
    """Binds its rendezvous socket, starts generation 1's store on it, and stays (to be frozen)."""
    import torch.distributed as dist

    me = Member("a")
    master = dist.TCPStore(
        "127.0.0.1",
        me.rendezvous.port,
        None,
        True,
        wait_for_workers=False,
        master_listen_fd=me.rendezvous._listener.detach(),
    )
    port_out.put(me.rendezvous.port)
    hold.wait()
    del master


def resetting_host(port_out: Any, hold: Any) -> None:
    """Accepts every connection and resets it at once, as a host dying while a client connects
    does: torch's client then sleeps a back-off before it tries again."""
    import socket
    import struct

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    listener.settimeout(0.05)
    port_out.put(listener.getsockname()[1])
    while not hold.is_set():
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close sends a reset
        conn.close()
    listener.close()
