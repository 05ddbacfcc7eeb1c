"""The chaos benchmark's short version: ten seeded faults from the whole catalogue, in one run.

`bench/chaos.py --faults 10` as a real command: a 3-node NATS cluster, two swappers, two detectors,
two stores, the example job with warm spares and respawns; rank kills (one, two at once, a second one
during the recovery, the promoted spare or the rendezvous host mid-takeover), SIGSTOP, and the loss of
the swapper leader, a detector or a NATS server. The job must recover from every fault, never wedge,
and end bit-identical to the same job run without faults. Downtime figures are the benchmark's to
print; the long version (50 faults) is `bench/chaos.py --faults 50`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
FAULTS = 10
SEED = 7
TIMEOUT_S = 1200.0


def test_ten_faults_from_the_catalogue_heal_without_a_wedge_and_end_bit_identical(tmp_path: Path) -> None:
    command = [sys.executable, "chaos.py", "--faults", str(FAULTS), "--seed", str(SEED), "--workdir", str(tmp_path)]
    run = subprocess.run(command, cwd=BENCH, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    assert lines, f"exit code {run.returncode}\n{run.stdout[-6000:]}\n{run.stderr[-4000:]}"
    result = json.loads(lines[-1])
    context = f"{run.stdout[-6000:]}\n{json.dumps(result, indent=1)[-3000:]}"
    assert result["faults"] == FAULTS, context
    assert result["recovered"] == FAULTS, context
    assert result["wedged"] == 0, context
    assert result["bit_identical"] is True and result["tensors_compared"] > 0, context
    assert result["lost_steps_max"] <= 1, context
