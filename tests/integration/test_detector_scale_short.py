"""The detector-alone benchmark's short version: `bench/detector_scale.py` as a real command.

A real detector and nats-server, 256 members' beat batches made beforehand and replayed at their rate
by two processes: every member beats throughout, so the detector must declare nobody, and the replay
must have sent every batch it made. No timing goal is asserted here: the benchmark's is at 16,384
members (docs/performance.md §5).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
MEMBERS = 256
TIMEOUT_S = 120.0


@pytest.mark.timeout(180)
def test_a_replay_of_hundreds_of_members_beats_is_watched_without_a_verdict() -> None:
    command = [sys.executable, "detector_scale.py", "--members", str(MEMBERS), "--seconds", "3", "--warm-s", "2"]
    run = subprocess.run(command, cwd=BENCH, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    assert lines, f"exit code {run.returncode}\n{run.stdout[-4000:]}\n{run.stderr[-4000:]}"
    result = json.loads(lines[-1])
    context = json.dumps({k: v for k, v in result.items() if k != "sizes"}, indent=1)
    assert result["members"] == MEMBERS, context
    assert result["verdicts"] == 0, context
    assert result["replay_sent_share"] == 1.0, context  # every batch made went out
    # Real beats, a step every 2 s: a member's beat goes whole when its step moves, and the refresh
    # (`HEARTBEAT_REFRESH_S`, 2 s) adds next to nothing; a beat whole every period would be 4.
    assert 0.45 <= result["whole_beats_per_member_s"] <= 0.6, context
    assert result["detector_cpu_pct"] > 0, context
