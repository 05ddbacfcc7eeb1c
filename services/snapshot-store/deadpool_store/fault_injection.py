"""Test and benchmark faults for a store, armed only by `DEADPOOL_FAULT_INJECTION=1`: flip bytes inside
the store's own copies of a rank's snapshots, so the restore path's verification is shown on a real
store (the checksums the seal recorded no longer match the bytes it serves). With `"forge": true` the
store also rewrites the chunk's checksum to match, as a hostile store (or a holder of the stores' keys)
would: then only the member's seal signature tells the copy was changed."""

from __future__ import annotations

import json
import os
from typing import Any

from deadpool_protocol.dataplane import chunk_checksum
from deadpool_store.memory import SnapshotMemory

__all__ = ["ENV_FAULT_INJECTION", "armed", "corrupt_request"]

ENV_FAULT_INJECTION = "DEADPOOL_FAULT_INJECTION"


def armed() -> bool:
    return os.environ.get(ENV_FAULT_INJECTION) == "1"


def corrupt_request(memory: SnapshotMemory, body: bytes) -> dict[str, Any]:
    """`{"job": J, "rank": R}`: flip one byte in the middle of every sealed snapshot of (J, R), or only
    of step S with `"step": S`; with `"forge": true`, and its chunk's checksum rewritten to match."""
    try:
        request = json.loads(body)
        job, rank, step = str(request["job"]), int(request["rank"]), int(request.get("step", -1))
        forge = bool(request.get("forge", False))
    except (ValueError, KeyError, TypeError) as exc:
        return {"corrupted": [], "error": f"want {{'job': ..., 'rank': ...}}: {exc}"}
    steps = []
    for snap in memory.sealed_of(job, rank):
        if snap.total_bytes and step in (-1, snap.step):
            middle = snap.total_bytes // 2
            snap.data[middle] = snap.data[middle] ^ 0xFF
            if forge:
                index = middle // snap.chunk_bytes
                start = index * snap.chunk_bytes
                end = min(start + snap.chunk_bytes, snap.total_bytes)
                snap.checksums[index] = chunk_checksum(memoryview(snap.data)[start:end])
            steps.append(snap.step)
    return {"corrupted": sorted(steps), "error": ""}
