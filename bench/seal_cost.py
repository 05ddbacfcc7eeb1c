"""What signing a snapshot's seal costs: one HMAC-SHA256 of its fields (job, generation, rank, member,
step, sizes, one checksum per chunk, the layout), made once per upload per store and checked once per
restore. It grows with the number of chunks and the layout's size, not with the snapshot's bytes.

    .venv/bin/python bench/seal_cost.py [--repeats 50]

Prints a row per size and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from deadpool_protocol.dataplane import CHUNK_BYTES_DEFAULT, chunk_count, seal_key, seal_signature

SIZES = ((1.5, 64), (1.5, 5 * 1024), (16.0, 64), (16.0, 5 * 1024))
"""(snapshot GB, layout KB): a 1.5 GB rank of a GPT-2-sized model, and 16 GB, each with a small layout
and one of 5 MB (a model of about 10^5 tensors)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    key = seal_key(os.urandom(32), "job")
    rows = []
    for gigabytes, layout_kb in SIZES:
        total = int(gigabytes * 2**30)
        checksums = [int.from_bytes(os.urandom(8), "little") for _ in range(chunk_count(total, CHUNK_BYTES_DEFAULT))]
        layout = os.urandom(layout_kb * 1024)
        started = time.perf_counter()
        for _ in range(args.repeats):
            seal_signature(key, "job", 3, 7, "member-7", 1000, total, CHUNK_BYTES_DEFAULT, checksums, layout)
        ms = (time.perf_counter() - started) / args.repeats * 1e3
        rows.append({"snapshot_gb": gigabytes, "layout_kb": layout_kb, "chunks": len(checksums), "ms": round(ms, 3)})
        print(f"{gigabytes:5.1f} GB, {len(checksums):5d} chunks, {layout_kb:5d} KB layout: {ms:7.3f} ms per signature")
    print(json.dumps({"repeats": args.repeats, "signatures": rows}))


if __name__ == "__main__":
    main()
