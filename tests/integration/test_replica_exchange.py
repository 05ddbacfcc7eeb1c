"""Replicated state reassembled over a real gloo group from each rank's snapshot share; and the
chunked, staged broadcast the exchange uses on NCCL, over the same group."""

from __future__ import annotations

import multiprocessing

from deadpool_cli.nats_server import free_port

from . import replica_members

WORLD_SIZE = 3
GET_TIMEOUT_S = 60.0


def test_every_rank_rebuilds_the_whole_state_from_the_shares_bit_for_bit() -> None:
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    processes = [
        ctx.Process(target=replica_members.restore_from_partitions, args=(rank, WORLD_SIZE, port, results))
        for rank in range(WORLD_SIZE)
    ]
    for p in processes:
        p.start()
    try:
        reports = sorted(results.get(timeout=GET_TIMEOUT_S) for _ in processes)
    finally:
        for p in processes:
            p.join(10)
            if p.is_alive():
                p.kill()
    assert [rank for rank, *_ in reports] == list(range(WORLD_SIZE))
    assert all(same for _, same, _, _ in reports)
    shares, whole = sum(r[2] for r in reports), reports[0][3]
    assert shares < 1.1 * whole  # the W snapshots together hold the state about once, not W times
