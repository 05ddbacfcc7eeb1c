"""Each failure class, injected into a real job, is detected, fenced and swapped, bit-identically.

`deadpool demo --fault F` trains the tiny GPT on 4 ranks + 1 warm spare, injects F into rank 2 mid-step
and compares the final weights with an uninterrupted run. Thresholds: heartbeat timeout 2 s, hang
floor 3 s (the demo's defaults: 0.1 s heartbeat period < 2 s < 3 s < 20 s collective timeout).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

DEMO_TIMEOUT_S = 240.0


def run_demo(tmp_path: Path, fault: str) -> dict:  # type: ignore[type-arg]
    report_path = tmp_path / "report.json"
    command = [sys.executable, "-m", "deadpool_cli", "demo", "--model-size", "tiny", "--steps", "24"]
    command += ["--kill-step", "8", "--kill-rank", "2", "--fault", fault, "--report", str(report_path)]
    command += ["--run-dir", str(tmp_path / "run")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=DEMO_TIMEOUT_S, check=False)
    assert report_path.exists(), result.stdout + result.stderr
    report: dict = json.loads(report_path.read_text())  # type: ignore[type-arg]
    assert result.returncode == 0, result.stdout + result.stderr
    return report


@pytest.mark.parametrize(
    ("fault", "reason", "detect_max_s"),
    [
        ("hang", "hang", 3.0 + 2.0),  # the training thread stuck in Python, heartbeats going on
        ("stop", "heartbeat", 2.0 + 2.0),  # SIGSTOP: the whole process frozen
        ("exception", "error", 2.0),  # raised inside the step: reported by the member itself
    ],
)
def test_a_failure_class_is_detected_fenced_and_swapped_bit_identically(
    tmp_path: Path, fault: str, reason: str, detect_max_s: float
) -> None:
    report = run_demo(tmp_path, fault)
    context = json.dumps(report, indent=1)
    assert report["recovered"] is True and report["bit_identical"] is True, context
    (incident,) = report["incidents"]
    assert incident["rank"] == 2 and incident["reason"] == reason, context
    assert incident["replacement"] != incident["member"], context
    assert incident["lost_steps"] <= 1, context
    assert incident["detect_s"] < detect_max_s, context
    if reason == "hang":
        evidence = incident["evidence"]
        assert float(evidence["hang_threshold_s"]) >= 3.0, context
        assert float(evidence["no_step_s"]) >= float(evidence["hang_threshold_s"]), context  # never sooner
    assert incident["phases"]["fence"] > 0, context  # the member was still alive: killed before the swap
