"""Recovery figures of the end-to-end demo, over several runs.

    .venv/bin/python bench/demo_recovery.py --runs 3 [--model-size small] [--steps 40] [--kill-step 15]

Runs `deadpool demo` (4 ranks, 1 warm spare, SIGKILL of rank 2 mid-step, reference run, bit-identity
check) `--runs` times and prints, per run and as medians, the detection time, the downtime (kill to
every rank training again), each recovery phase, and the steps lost. The last line is one JSON object.
Runs must not overlap with other heavy work: the machine's 2 cores are shared by 5 trainers and 4 services.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

PHASES = ("exit", "detect", "decide", "fence", "abort", "notify", "restore", "rendezvous", "apply")
"""`exit`: SIGKILL -> process reaped (seen by the launcher); `detect` starts there. See docs/architecture.md."""


def run_once(args: argparse.Namespace, workdir: Path, index: int) -> dict[str, Any]:
    report_path = workdir / f"report-{index}.json"
    command = [
        sys.executable,
        "-m",
        "deadpool_cli",
        "demo",
        "--report",
        str(report_path),
        "--run-dir",
        str(workdir / f"run-{index}"),
        "--model-size",
        args.model_size,
        "--steps",
        str(args.steps),
        "--kill-step",
        str(args.kill_step),
    ]
    subprocess.run(command, check=False, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    report: dict[str, Any] = json.loads(report_path.read_text())
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--model-size", default="small")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--kill-step", type=int, default=15)
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="deadpool-bench-"))
    rows = []
    print(
        f"{'run':>3} {'ok':>3} {'bit-id':>6} {'kill->det':>9} {'downtime':>8} {'lost':>4}  "
        + " ".join(f"{p:>10}" for p in PHASES)
    )
    for i in range(args.runs):
        report = run_once(args, workdir, i)
        incident = report["incidents"][0] if report["incidents"] else None
        row = {
            "recovered": report["recovered"],
            "bit_identical": report["bit_identical"],
            "detect_s": incident["detect_s"] if incident else None,
            "downtime_s": incident["downtime_s"] if incident else None,
            "lost_steps": incident["lost_steps"] if incident else None,
            "phases": incident["phases"] if incident else {},
        }
        rows.append(row)
        phases = " ".join(f"{row['phases'].get(p, float('nan')) * 1000:>8.1f}ms" for p in PHASES)
        detect = f"{row['detect_s']:.3f}" if incident else "-"
        downtime = f"{row['downtime_s']:.3f}" if incident else "-"
        print(
            f"{i:>3} {'yes' if row['recovered'] else 'NO':>3} {'yes' if row['bit_identical'] else 'NO':>6} "
            f"{detect:>9} {downtime:>8} {row['lost_steps'] if incident else '-':>4}  {phases}"
        )

    done = [r for r in rows if r["downtime_s"] is not None]
    summary = {
        "runs": len(rows),
        "recovered": sum(r["recovered"] for r in rows),
        "bit_identical": sum(r["bit_identical"] for r in rows),
        "downtime_s": [r["downtime_s"] for r in done],
        "downtime_s_median": statistics.median(r["downtime_s"] for r in done) if done else None,
        "detect_s_median": statistics.median(r["detect_s"] for r in done) if done else None,
        "lost_steps_max": max((r["lost_steps"] for r in done), default=None),
        "phases_median_s": {p: statistics.median(r["phases"].get(p, 0.0) for r in done) for p in PHASES}
        if done
        else {},
        "model_size": args.model_size,
        "reports": str(workdir),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
