"""Which cores a member's threads run on, when told: `DEADPOOL_TRAIN_CPUS` for the training thread
(and the threads it creates: gloo's, torch's), `DEADPOOL_BACKGROUND_CPUS` for the member's own
background threads (snapshot copy and stream, the control link).

A GPU host trains on its GPUs and has cores to spare for the snapshot path; a CPU-only machine can
emulate that by keeping training off the cores the snapshot threads and the store use
(`bench/overhead.py --free-core`). Unset, nothing is pinned.
"""

from __future__ import annotations

import os

__all__ = ["BACKGROUND_CPUS_ENV", "TRAIN_CPUS_ENV", "cpus_from_env", "parse_cpus", "pin_this_thread"]

TRAIN_CPUS_ENV = "DEADPOOL_TRAIN_CPUS"
BACKGROUND_CPUS_ENV = "DEADPOOL_BACKGROUND_CPUS"


def parse_cpus(text: str) -> set[int]:
    """'0', '0,2' or '1-3' (as taskset takes them) -> the set of cores."""
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    if not cpus or min(cpus) < 0:
        raise ValueError(f"no cores in {text!r}")
    return cpus


def cpus_from_env(name: str) -> set[int] | None:
    text = os.environ.get(name, "")
    return parse_cpus(text) if text else None


def pin_this_thread(cpus: set[int] | None) -> None:
    """Confine the calling thread (only it: Linux affinity is per thread) to `cpus`; None: leave it."""
    if cpus:
        os.sched_setaffinity(0, cpus)
