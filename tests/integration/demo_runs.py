"""Running `deadpool demo` from a test, so that a failure explains itself.

The demo gets a run timeout below the test's, so a run that never finishes is stopped by the demo,
which then reports each member's last heartbeat, instead of by the test's timeout, which reports
nothing. A failed assertion's message carries the report and the end of every log of the run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

RUN_TIMEOUT_S = 150.0
"""The demo's limit for each of its runs (the faulty one and the reference)."""
COMMAND_TIMEOUT_S = 2 * RUN_TIMEOUT_S + 120.0
LOG_TAIL_LINES = 25
_NOISE = ('"heartbeat', "reducer.cpp", "UserWarning", "_conversion_method_template")


def log_tails(run_dir: Path) -> str:
    """The last lines of each log of a demo run, without heartbeats and library warnings."""
    parts = []
    for log in sorted((run_dir / "logs").glob("*.log")):
        lines = [line for line in log.read_text(errors="replace").splitlines() if not any(n in line for n in _NOISE)]
        parts.append(f"--- {log.name} (last {LOG_TAIL_LINES} lines)\n" + "\n".join(lines[-LOG_TAIL_LINES:]))
    return "\n".join(parts)


class DemoRun:
    def __init__(self, tmp_path: Path, args: list[str], env: Mapping[str, str] | None = None) -> None:
        self.report_path = tmp_path / "report.json"
        self.run_dir = tmp_path / "run"
        command = [sys.executable, "-m", "deadpool_cli", "demo", *args, "--report", str(self.report_path)]
        command += ["--run-dir", str(self.run_dir), "--run-timeout-s", str(RUN_TIMEOUT_S)]
        self.result = subprocess.run(
            command, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False, env=env
        )
        self.report: dict[str, Any] = json.loads(self.report_path.read_text()) if self.report_path.exists() else {}

    def context(self) -> str:
        """Everything needed to understand a failed assertion about this run."""
        return "\n".join(
            [
                f"exit code {self.result.returncode}",
                self.result.stdout[-6000:],
                self.result.stderr[-6000:],
                json.dumps(self.report, indent=1)[-8000:],
                log_tails(self.run_dir),
            ]
        )
