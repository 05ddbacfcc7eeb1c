"""Small measuring helpers the benchmarks share (imported as a sibling module: run them from bench/)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cpu_seconds", "percentile"]


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank `q`th percentile of `values` (NaN for none)."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
