"""The control-plane scale benchmark's short version: `bench/control_plane_scale.py` as a real command.

The real detector and swapper against 256 simulated members (4 worker processes, hosts of 8, real
beats compacted by the launcher's own code, simulated stores reporting every step). Three members go
silent one after the other: each must be declared and rebuilt, nobody else declared, steps committed
on the way, and the bench's own counts (the beats it sent, the largest message) must make sense. No
timing goal is asserted here: those are the benchmark's, at 16,384 members (docs/performance.md §5).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from deadpool_protocol.message_parts import MESSAGE_PART_BYTES_MAX

BENCH = Path(__file__).resolve().parents[2] / "bench"
MEMBERS = 256
FAILURES = 3
TIMEOUT_S = 240.0


@pytest.mark.timeout(300)
def test_silences_among_hundreds_of_simulated_members_are_each_rebuilt_and_nobody_else_declared() -> None:
    command = [sys.executable, "control_plane_scale.py", "--members", str(MEMBERS), "--failures", str(FAILURES)]
    run = subprocess.run(command, cwd=BENCH, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    assert lines, f"exit code {run.returncode}\n{run.stdout[-6000:]}\n{run.stderr[-4000:]}"
    result = json.loads(lines[-1])
    context = f"{run.stdout[-4000:]}\n{json.dumps({k: v for k, v in result.items() if k != 'sizes'}, indent=1)}"
    assert (result["members"], result["failures_injected"]) == (MEMBERS, FAILURES), context
    assert result["failures_detected"] == FAILURES, context
    assert result["rebuilds_seen"] == FAILURES, context
    assert result["rebuilds_probed"] == FAILURES, context  # the probe process heard each failure and its rebuild
    assert result["false_verdicts"] == 0, context
    assert result["commits"] >= 1, context
    # The workers' beat messages over their own report times, as a share of the nominal rate: about
    # 0.99 at this size (a rate lost, or counted twice, fails here).
    assert 0.5 < result["heartbeat_messages_of_nominal"] <= 1.05, context
    assert 0 < result["message_bytes_max"] <= MESSAGE_PART_BYTES_MAX + 1024, context  # a frame and its headers
