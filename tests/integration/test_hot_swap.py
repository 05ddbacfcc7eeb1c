"""The whole product, end to end: a rank SIGKILLed mid-step is replaced by a warm spare, training
finishes, and the final weights and optimizer shards equal an uninterrupted run's (torch.equal).

Runs `deadpool demo` as a real command: nats-server, detector, swapper and two stores as processes,
`deadpool launch` with 4 ranks and 1 spare (DDP + ZeroRedundancyOptimizer on gloo), a real SIGKILL.
The recovery's trace goes over OTLP/HTTP, configured by the standard `OTEL_*` variables, to a
receiver in the test, and forms one trace.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from tests.integration.demo_runs import DemoRun
from tests.integration.otlp_receiver import OtlpReceiver, ReceivedSpan

TRACE_WAIT_S = 10.0


def processes_carrying(marker: str) -> list[int]:
    """Live processes whose environment holds `marker` (every process the demo starts inherits it)."""
    found = []
    needle = marker.encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def recovery_traces(spans: list[ReceivedSpan]) -> dict[str, list[ReceivedSpan]]:
    """trace id -> its spans, for the traces that hold a `recovery` root."""
    roots = {s.trace_id for s in spans if s.name == "recovery" and not s.parent_span_id}
    return {t: [s for s in spans if s.trace_id == t] for t in roots}


def test_a_killed_rank_is_replaced_and_training_ends_bit_identical(tmp_path: Path) -> None:
    marker = f"DEADPOOL_TEST_MARK={uuid.uuid4().hex}"
    args = ["--model-size", "tiny", "--steps", "10", "--kill-step", "4", "--kill-rank", "2"]
    with OtlpReceiver() as receiver:
        env = {
            **os.environ,
            marker.split("=")[0]: marker.split("=")[1],
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
            "OTEL_SERVICE_NAME": "swapper-under-test",
            "OTEL_BSP_SCHEDULE_DELAY": "100",
        }
        run = DemoRun(tmp_path, args, env=env)
        report, context = run.report, run.context()
        receiver.wait_for(lambda spans: recovery_traces(spans), TRACE_WAIT_S)
        spans = list(receiver.spans)
    assert run.result.returncode == 0, context

    assert report["recovered"] is True, context
    assert report["bit_identical"] is True, context
    assert report["tensors_compared"] > 0, context
    (incident,) = report["incidents"]
    kill = report["runs"]["swap"]["kill"]
    assert incident["rank"] == kill["rank"] == 2, context
    assert incident["member"] == kill["member"], context
    assert incident["reason"] == "exit", context
    assert incident["replacement"] != incident["member"], context
    assert incident["lost_steps"] <= 1, context
    # kill["step"] comes from the last heartbeat before the kill (sent every 100 ms), so it is a lower
    # bound of the step the rank was computing: the restored step is at most two behind it.
    assert kill["step"] - 2 <= incident["restore_step"] < 10, context
    assert 0 < incident["detect_s"] < incident["downtime_s"], context
    assert set(incident["phases"]) >= {"exit", "detect", "decide", "abort", "restore", "rendezvous", "apply"}, context
    assert incident["first_step_known"] and incident["downtime_s"] >= incident["ready_s"], context  # to the step
    assert isinstance(report["time_lost_s"], float), context
    assert report["runs"]["swap"]["finished"] and report["runs"]["reference"]["finished"], context

    (trace,) = recovery_traces(spans).values()  # one trace for the one recovery, over OTLP/HTTP
    (root,) = [s for s in trace if s.name == "recovery"]
    children = [s for s in trace if s is not root]
    assert {s.name for s in children} >= {"detect", "decide", "abort", "restore", "rendezvous", "apply", "first_step"}
    assert all(s.parent_span_id == root.span_id for s in children)
    assert {s.attributes["incident"] for s in trace} == {root.attributes["incident"]} and root.attributes["incident"]
    assert root.attributes["rank"] == 2 and root.service == "swapper-under-test"

    assert processes_carrying(marker) == [], "the demo left processes behind"
