"""A rank's first upload to a store, with and without the swapper's reservation beforehand.

    .venv/bin/python bench/store_reservation.py [--gigabytes 1.0]

One store process (embedded nats-server). Rank 0 uploads its first snapshot there with nothing
reserved: the store allocates the buffer as the upload arrives and the upload pays for the page
faults (its next steps' buffers are faulted in after it, as the store does for a rank it has not seen).
Then the swapper's `Reserve` for rank 1 (a size of its own, so that no buffer of rank 0's fits it) is
published, the store faults in its buffers, and rank 1's first upload lands in one of them. Each upload
is timed to the store's seal reply. The last line is one JSON object: the two uploads' seconds and GB/s,
and the seconds the store spent faulting in the reserved buffers (its log), which the reservation moves
out of the upload.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import nats
from store_throughput import start_store

from deadpool.store_client import StoreConnection, UploadKey
from deadpool_cli.nats_server import NatsServer
from deadpool_protocol import Reserve, encode
from deadpool_protocol.dataplane import CHUNK_BYTES_DEFAULT
from deadpool_protocol.subjects import store_reserve

JOB = "bench"
FAULT_WAIT_S = 300.0
"""The most the bench waits for the store to fault buffers in (seconds per GB on a cold VM)."""


def faulted(log: Path, nbytes: int) -> list[float]:
    """The seconds each pool buffer of `nbytes` took to fault in, from the store's log (JSON lines)."""
    took = []
    for line in log.read_text(errors="replace").splitlines():
        if '"pool buffer faulted in"' not in line:
            continue
        entry = json.loads(line)
        if entry.get("nbytes") == nbytes:
            took.append(float(entry["took_s"]))
    return took


async def wait_faulted(log: Path, nbytes: int, count: int) -> list[float]:
    deadline = time.monotonic() + FAULT_WAIT_S
    while len(found := faulted(log, nbytes)) < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{len(found)} of {count} buffers of {nbytes} bytes faulted in; see {log}")
        await asyncio.sleep(0.1)
    return found


def upload_s(address: object, rank: int, data: memoryview) -> float:
    conn = StoreConnection(address, timeout_s=300)  # type: ignore[arg-type]
    try:
        started = time.perf_counter()
        conn.upload(UploadKey(JOB, 1, rank, f"m{rank}", 1), data, CHUNK_BYTES_DEFAULT, b"meta", lambda: False)
        return time.perf_counter() - started
    finally:
        conn.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gigabytes", type=float, default=1.0, help="each rank's snapshot (default 1 GB)")
    args = parser.parse_args()
    first = int(args.gigabytes * 1e9)
    second = first - 4096  # another size: none of rank 0's buffers fits it
    data = memoryview(os.urandom(1 << 20) * (first // (1 << 20) + 1))[:first]
    workdir = Path(tempfile.mkdtemp(prefix="deadpool-reservation-"))
    nats_server = NatsServer(workdir / "nats")
    url = nats_server.start()

    async def run() -> dict[str, float]:
        nc = await nats.connect(url)
        store, address = await start_store(nc, url, workdir, capacity=8 * first)
        log = workdir / "store.log"
        try:
            cold = await asyncio.to_thread(upload_s, address, 0, data)
            await wait_faulted(log, first, 2)  # rank 0's next buffers, before anything else is timed
            reservation = Reserve(JOB, 1, address.store, [1], [second])
            await nc.publish(store_reserve(address.store), encode(reservation))
            await nc.flush()
            reserved_fault = await wait_faulted(log, second, 3)
            reserved = await asyncio.to_thread(upload_s, address, 1, data[:second])
            return {"cold": cold, "reserved": reserved, "reserved_fault_in": sum(reserved_fault)}
        finally:
            await nc.close()
            store.terminate()
            store.wait(timeout=30)

    try:
        times = asyncio.run(run())
    finally:
        nats_server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    result = {
        "snapshot_bytes": first,
        "first_upload_cold_s": round(times["cold"], 3),
        "first_upload_cold_gbps": round(first / times["cold"] / 1e9, 3),
        "first_upload_reserved_s": round(times["reserved"], 3),
        "first_upload_reserved_gbps": round(second / times["reserved"] / 1e9, 3),
        "reserved_fault_in_s": round(times["reserved_fault_in"], 3),
        "cpus": os.cpu_count(),
    }
    print(
        f"first upload to a store, {first / 1e9:.2f} GB: nothing reserved {result['first_upload_cold_s']} s "
        f"({result['first_upload_cold_gbps']} GB/s); reserved beforehand {result['first_upload_reserved_s']} s "
        f"({result['first_upload_reserved_gbps']} GB/s; the store faulted the reservation's 3 buffers in "
        f"{result['reserved_fault_in_s']} s beforehand)"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
