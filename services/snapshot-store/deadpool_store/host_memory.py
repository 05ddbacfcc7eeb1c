"""The host's memory, as the kernel counts it (`/proc/meminfo`): what a store may still take.

A store's `--capacity-bytes` is what it may hold, not what the host has: two stores on one host, or a
store beside training processes, can be given more than the host holds together. A store that fills
its capacity then meets the kernel's OOM killer, which ends it (seen in `bench/scale.py` runs with
8 GiB stores on a 23 GB machine) and takes its copies with it. So a store asks the host too.
"""

from __future__ import annotations

__all__ = ["HOST_RESERVE_FRACTION", "HOST_RESERVE_MIN_BYTES", "available_bytes", "reserve_bytes"]

MEMINFO = "/proc/meminfo"
HOST_RESERVE_FRACTION = 0.05
"""The share of the host's memory a store leaves to everything else (training processes grow)."""
HOST_RESERVE_MIN_BYTES = 256 * 1024 * 1024


def _meminfo_bytes(field: str) -> int | None:
    try:
        with open(MEMINFO) as info:
            for line in info:
                name, _, rest = line.partition(":")
                if name == field:
                    return int(rest.split()[0]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def available_bytes() -> int | None:
    """The memory the host can still give without swapping (MemAvailable); None where unknown."""
    return _meminfo_bytes("MemAvailable")


def reserve_bytes() -> int:
    """What a store leaves free on this host: a share of its memory, and at least the minimum."""
    total = _meminfo_bytes("MemTotal") or 0
    return max(HOST_RESERVE_MIN_BYTES, int(total * HOST_RESERVE_FRACTION))
