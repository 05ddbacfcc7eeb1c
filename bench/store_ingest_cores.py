"""A store's ingest with several uploads at once: does it use more than one core?

    cd bench && ../.venv/bin/python store_ingest_cores.py [--megabytes 512] [--senders 2] [--rounds 4]

One `deadpool store` process (embedded nats-server), and `--senders` member processes, each uploading
its own rank's snapshot of `--megabytes` through `StoreConnection.upload` (checksummed, sealed and
verified by the store), round after round, all at once. Two stores are measured one after the other,
as the same run: one with its default ingest threads (one per core it may run on) and one with
`--ingest-threads 0` (every byte received on its event loop, as before issue 25's point 2). Each
sender uploads six rounds first, untimed, so that the store's buffers are reused ones (training's
steady state), then `--rounds` timed ones after a common start.

Reported per store: the aggregate GB/s (every sender's bytes over the wall time from the common start
to the last seal), the store's CPU over that time in cores (its process's CPU seconds over the wall
seconds: a store on one event loop cannot pass 1.0), its CPU per MB; and the same with one sender. The
senders run on the same machine: on a 2-core machine they take part of the cores the store could use,
so the aggregate figure understates what a store does with cores of its own. The last line is one
JSON object, with `memcpy_scaling`: how many times one thread's memcpy rate `--senders` threads reach
together on this machine (where it is near 1, memory bandwidth, not cores, bounds the data path, and
no number of ingest threads can show a gain).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nats
from measures import cpu_seconds, memcpy_ms_per_mb, memcpy_scaling
from store_throughput import start_store

from deadpool.store_client import StoreConnection, UploadKey
from deadpool_cli.nats_server import NatsServer
from deadpool_protocol import StoreAddress
from deadpool_protocol.dataplane import CHUNK_BYTES_DEFAULT

JOB = "cores"
UNCOMMITTED_HELD = 5
"""Snapshots of one rank a store holds with no commit (`uncommitted_max` and the one being received)."""
WARM_UP_ROUNDS = UNCOMMITTED_HELD + 1
"""Uploads before the timed ones: from the sixth on, each lands in a buffer an older one freed (nothing
commits here, so the store frees the second oldest past `uncommitted_max`)."""
CAPACITY_PER_SENDER = UNCOMMITTED_HELD + 2
"""Snapshots' room per sender: those held, and the pool buffers the store faults in ahead."""


def sender_main(host: str, port: int, rank: int, nbytes: int, rounds: int) -> None:
    """One member: warm up, say so, wait for the go on stdin, upload `rounds` times, print the seconds."""
    data = memoryview(bytearray(os.urandom(1024 * 1024)) * (nbytes // (1024 * 1024)))
    conn = StoreConnection(StoreAddress("store", host, port), timeout_s=120)
    step = 0

    def upload() -> None:
        nonlocal step
        step += 1
        conn.upload(UploadKey(JOB, 1, rank, f"m{rank}", step), data, CHUNK_BYTES_DEFAULT, b"", lambda: False)

    for _ in range(WARM_UP_ROUNDS):
        upload()
    print("ready", flush=True)
    sys.stdin.readline()
    started = time.perf_counter()
    for _ in range(rounds):
        upload()
    print(json.dumps({"seconds": time.perf_counter() - started}), flush=True)
    conn.close()


async def measure(
    url: str, workdir: Path, threads: int | None, senders: int, nbytes: int, rounds: int
) -> dict[str, float]:
    """Start a store (`threads` ingest threads; None: its default), run `senders` at once, stop it."""
    nc = await nats.connect(url)
    extra = [] if threads is None else ["--ingest-threads", str(threads)]
    capacity = senders * CAPACITY_PER_SENDER * nbytes
    store, address = await start_store(nc, url, workdir, capacity, extra)
    command = [sys.executable, __file__, "--sender", address.host, str(address.port)]
    procs = [
        subprocess.Popen(
            [*command, str(rank), str(nbytes), str(rounds)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        for rank in range(senders)
    ]
    try:
        for proc in procs:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready", "a sender failed to warm up"
        cpu_before, started = cpu_seconds(store.pid), time.perf_counter()
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        for proc in procs:
            assert proc.stdout is not None
            json.loads(proc.stdout.readline())
        wall = time.perf_counter() - started
        cpu = cpu_seconds(store.pid) - cpu_before
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
        await nc.close()
        store.terminate()
        store.wait(timeout=30)
    total = senders * rounds * nbytes
    return {
        "gbps": round(total / wall / 1e9, 3),
        "store_cores": round(cpu / wall, 2),
        "store_cpu_ms_per_mb": round(1000 * cpu / (total / 1e6), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--megabytes", type=int, default=512, help="each sender's snapshot, MiB (default 512)")
    parser.add_argument("--senders", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--sender", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.sender:
        host, port, rank, nbytes, rounds = args.sender
        sender_main(host, int(port), int(rank), int(nbytes), int(rounds))
        return
    nbytes = args.megabytes * 1024 * 1024
    workdir = Path(tempfile.mkdtemp(prefix="deadpool-ingest-cores-"))
    nats_server = NatsServer(workdir / "nats")
    url = nats_server.start()
    results: dict[str, dict[str, float]] = {}
    try:
        for name, threads in (("threads", None), ("loop", 0)):
            for senders in (1, args.senders):
                key = f"{name}_{senders}"
                results[key] = asyncio.run(measure(url, workdir, threads, senders, nbytes, args.rounds))
                print(f"{key:<12} {results[key]}", flush=True)
    finally:
        nats_server.stop()
    many = args.senders
    summary = {
        "snapshot_bytes": nbytes,
        "senders": many,
        "rounds": args.rounds,
        "cpus": len(os.sched_getaffinity(0)),
        "memcpy_ms_per_mb": round(memcpy_ms_per_mb(), 3),
        "memcpy_scaling": round(memcpy_scaling(many), 2),
        **{f"{key}_{field}": value for key, result in results.items() for field, value in result.items()},
        "threads_over_loop": round(results[f"threads_{many}"]["gbps"] / results[f"loop_{many}"]["gbps"], 2),
        "threads_many_over_one": round(results[f"threads_{many}"]["gbps"] / results["threads_1"]["gbps"], 2),
    }
    print(
        f"{many} uploads at once: {summary['threads_over_loop']}x the loop-only store's GB/s; the threaded store "
        f"used {results[f'threads_{many}']['store_cores']} cores (the loop-only one "
        f"{results[f'loop_{many}']['store_cores']}); {summary['threads_many_over_one']}x its own GB/s with one sender; "
        f"{many} threads' memcpy together: {summary['memcpy_scaling']}x one thread's"
    )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
