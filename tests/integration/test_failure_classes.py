"""Each failure class, injected into a real job, is detected, fenced and swapped (or, with every rank
alive, regrouped), bit-identically.

`deadpool demo --fault F` trains the tiny GPT on 4 ranks + 1 warm spare, injects F into rank 2 mid-step
and compares the final weights with an uninterrupted run. Thresholds: heartbeat timeout 2 s, hang
floor 3 s (the demo's defaults: 0.1 s heartbeat period < 2 s < 3 s < 20 s collective timeout).
Every class trains the same job, so the uninterrupted reference is trained once, by the `reset` run,
and the others compare with it (`--reference-from`).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.demo_runs import DemoRun

TRAINING = ["--model-size", "tiny", "--steps", "24", "--kill-step", "8", "--kill-rank", "2"]


@pytest.fixture(scope="module")
def reset_run(tmp_path_factory: pytest.TempPathFactory) -> DemoRun:
    """Rank 2's group connections reset mid-step, with the reference run the other classes reuse."""
    return DemoRun(tmp_path_factory.mktemp("reset"), [*TRAINING, "--fault", "reset"])


@pytest.mark.parametrize(
    ("fault", "reason", "detect_max_s"),
    [
        ("hang", "hang", 3.0 + 2.0),  # the training thread stuck in Python, heartbeats going on
        ("stop", "heartbeat", 2.0 + 2.0),  # SIGSTOP: the whole process frozen
        ("exception", "error", 2.0),  # raised inside the step: reported by the member itself
    ],
)
def test_a_failure_class_is_detected_fenced_and_swapped_bit_identically(
    tmp_path: Path, reset_run: DemoRun, fault: str, reason: str, detect_max_s: float
) -> None:
    run = DemoRun(tmp_path, [*TRAINING, "--fault", fault, "--reference-from", str(reset_run.run_dir)])
    report, context = run.report, run.context()
    assert run.result.returncode == 0, context
    assert report["recovered"] is True and report["bit_identical"] is True, context
    assert report["tensors_compared"] > 0 and report["reference_from"], context
    (incident,) = report["incidents"]
    assert incident["rank"] == 2 and incident["reason"] == reason, context
    assert incident["replacement"] != incident["member"], context
    assert incident["lost_steps"] <= 1, context
    # Every step is snapshotted: the job goes back at most to the step before the one the fault hit
    # (the fault's step comes from the last heartbeat before it, so it may be one behind).
    assert report["runs"]["swap"]["kill"]["step"] - 2 <= incident["restore_step"], context
    assert incident["detect_s"] < detect_max_s, context
    if reason == "hang":
        evidence = incident["evidence"]
        assert float(evidence["hang_threshold_s"]) >= 3.0, context
        assert float(evidence["no_step_s"]) >= float(evidence["hang_threshold_s"]), context  # never sooner
    assert incident["phases"]["fence"] > 0, context  # the member was still alive: killed before the swap


def test_a_group_broken_with_every_rank_alive_is_regrouped_bit_identically(reset_run: DemoRun) -> None:
    """Rank 2's process-group connections are reset mid-step (as by the network): every rank's
    collective fails, nobody dies. After the heartbeat timeout (2 s, so a silent death would have
    been declared first) the same members form a new generation; no spare is used, nobody fenced."""
    run = reset_run
    report, context = run.report, run.context()
    assert run.result.returncode == 0, context
    assert report["recovered"] is True and report["bit_identical"] is True, context
    (incident,) = report["incidents"]
    assert incident["reason"] == "group" and incident["replacement"] == incident["member"], context
    assert incident["phases"]["fence"] == 0, context
    assert 2.0 <= incident["detect_s"] < 2.0 + 2.0, context
    assert incident["lost_steps"] <= 1, context
    assert report["runs"]["swap"]["kill"]["step"] - 2 <= incident["restore_step"], context
